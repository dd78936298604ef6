"""Heads: which attention heads carry position, which rebuild it after a withheld window, and
along which axis each head works.

Intervention. Rotary models: a head's rotations are masked (every plane of that head becomes the
identity, exact). Models without rotations (APE, sincos): the head's output is zero-ablated
(its `hook_z`, so only the shared output bias is left); zero, not mean, because the per-position
mean of a head's output is itself positional. A *unit* is "head" (head index h in every block
concerned, the wording of METHODS.md) or "block_head" (head h of one block b).

Carrying: each unit masked alone (head units in every block, block_head units in their own block;
block_head units at or after the probe site cannot reach it and are skipped). Retention of
RPI-SSDC and of the row and column probes at the probe site (between intact and floor; the RPI
pass stops at the probe site, so carrying reports no RPI-SSDC after it);
carrying damage = 1 - the mean of those three retentions; units ranked by it; the top-k units
masked together against k random units (`draws` seeded draws per k). carrying=false leaves
carrying and the top-k out (no rule reads them; a note says so).

Rebuilding (rotary models with at least two blocks): window = rotations withheld in blocks 0..k
(k = window_k, default depth // 2 - 1); "later" = blocks k+1..end. Each unit is masked in the
later blocks only, after the window and in the intact model (its comparison):
    drop_window(u) = margin(window) - margin(window + u)      per image, correct-class margin
    drop_intact(u) = margin(intact) - margin(u)               per image, same head, no window
    excess(u) = drop_window - drop_intact: the rebuilding score, mean with paired SE
    ratio(u) = mean drop_window / mean drop_intact, delta-method SE
with accuracy, RPI-SSDC at the output and probes at the output against the window alone beside
it (accuracy saturates near 100%, see NOTES.md: the margins decide). Redundancy control: the
later blocks' rotations all masked, in the intact model (C_intact = margin(intact) - margin(later
off)) and after the window (C_window = margin(window) - margin(window + later off)):
compensation = C_window - C_intact with paired SE and the block-level ratio C_window / C_intact.
Held out (the verdict's test of the top rebuilder, `result.held_out`): the unit with the
largest margin excess on a seeded half of the images; on the other half, its excess in margin
and accuracy against the null of a unit drawn at random (the mean over all units of its kind),
and top minus null, paired per image.
Axis x head: the same with row-only and column-only windows (planes from the axis map); a unit's
axis preference = excess after the row window - excess after the column window.

Attention statistics (every model, intact; `poslens.metrics.attention`): E|d_row| and E|d_col|
under each head's attention, the shares eta2_row / eta2_col of its logits explained by the row
and column offsets, and the axis-specialization score spec in [-1, 1] (+1 row-only, -1
column-only). Consistency: Pearson and Spearman correlation across units between rebuilding
excess (and carrying damage) and |spec|, and between axis preference and signed spec.

Statistics. Paired SEs are over the evaluation images of one model (one training seed: seeds
are separate runs, and head h of one seed is not head h of another). Ratio SEs use the delta
method (`poslens.metrics.stats.ratio_se`), not a bootstrap, which includes the covariance of the
numerator and denominator per image.

Modules: config (settings, applies, the window), units (heads and windows as masks), run (the
phases), result (the result, its verdict and the headline), plots (the figure).
"""

from poslens.experiments.heads.config import Config, applies
from poslens.experiments.heads.phases import run
from poslens.experiments.heads.plots import plot
from poslens.experiments.heads.result import NAME, Heads, headline
from poslens.experiments.output import Experiment

EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    applies,
    headline,
    plot,
    cost=20,
    shares_reference=True,
    reads_baseline=True,
)

__all__ = ["EXPERIMENT", "Config", "Heads", "applies", "headline", "plot", "run"]
