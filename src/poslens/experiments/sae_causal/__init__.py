"""SAE causal test: do the positional latents carry the position the model uses?

At each configured site (by default the original study's kind of early site and the probe block,
both normalised residuals) an SAE, trained here unless given, is spliced into the model where
the model reads: for a normalised site its edit is mapped back through the norm into the
residual stream, so it reaches every later block. Its k is chosen by a stated criterion unless
set (analysis.k = 0: the smallest k of a doubling ladder whose reconstruction alone costs at
most RECON_MAX_COST accuracy; phases.fit_site_sae). Edits: the top 4, 8, ..., all positional
latents zeroed, each as the plain splice (the reconstruction with the edit) and "+error"
(x + D(z') - D(z): only the edited latents move); the row and column latents alone, the row
latents alone and the column latents alone (the axis split: zeroing the row latents should cost
the row probe and leave the column probe), and the cell latents alone. Controls, all spliced
"+error": uniform random latents, random latents matched on firing rate and activation mass
(several draws, for every edited set), mean ablation, and resampling the positional latents
from the same position in another image (should do nothing) or another position in the same
image (should break position). Each edit is read as accuracy and correct-class margin (paired
SE), RPI-SSDC at every site, and the exact/row/column probes at the SAE's site and the output:
the intact model's fixed probes (what the model's representation lost) and probes refitted on
the edit (what is left), clean and under RPI. The reconstruction alone measures the splicing
confound. For an additive position table, the share of its variance that is row + column
effects stands beside the kinds of latents found.
"""

from poslens.experiments.output import Experiment
from poslens.experiments.sae_causal.config import RECON_MAX_COST, Config, applies
from poslens.experiments.sae_causal.edits import matched_random, resample, set_to, spliced, zero
from poslens.experiments.sae_causal.phases import (
    fit_site_sae,
    position_table,
    reconstruction_cost,
    run,
    run_site,
)
from poslens.experiments.sae_causal.plots import plot
from poslens.experiments.sae_causal.result import (
    COL_ZEROED,
    FIXED_DROP_OUT,
    FIXED_DROP_OUT_COL,
    FIXED_DROP_OUT_ROW,
    FIXED_DROP_SITE,
    FIXED_DROP_SITE_COL,
    FIXED_DROP_SITE_ROW,
    GROUPS,
    K_COST,
    K_CRITERION_MET,
    K_TRIED,
    MATCHED_COL,
    MATCHED_ROW,
    MATCHED_ROWCOL,
    NAME,
    ROW_ZEROED,
    ROWCOL_EDITS,
    ROWCOL_OTHER_IMAGE,
    ROWCOL_OTHER_POSITION,
    ROWCOL_ZEROED,
    K,
    SAECausal,
    SiteResult,
    fixed_drop,
    headline,
    k_cost_at_key,
    k_key,
    key,
    latents_key,
)

EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    applies,
    headline,
    plot,
    cost=30,
    shares_reference=True,
    reads_baseline=True,
)

__all__ = [
    "COL_ZEROED",
    "EXPERIMENT",
    "FIXED_DROP_OUT",
    "FIXED_DROP_OUT_COL",
    "FIXED_DROP_OUT_ROW",
    "FIXED_DROP_SITE",
    "FIXED_DROP_SITE_COL",
    "FIXED_DROP_SITE_ROW",
    "GROUPS",
    "K_COST",
    "K_CRITERION_MET",
    "K_TRIED",
    "MATCHED_COL",
    "MATCHED_ROW",
    "MATCHED_ROWCOL",
    "RECON_MAX_COST",
    "ROWCOL_EDITS",
    "ROWCOL_OTHER_IMAGE",
    "ROWCOL_OTHER_POSITION",
    "ROWCOL_ZEROED",
    "ROW_ZEROED",
    "Config",
    "K",
    "SAECausal",
    "SiteResult",
    "applies",
    "fit_site_sae",
    "fixed_drop",
    "headline",
    "k_cost_at_key",
    "k_key",
    "key",
    "latents_key",
    "matched_random",
    "plot",
    "position_table",
    "reconstruction_cost",
    "resample",
    "run",
    "run_site",
    "set_to",
    "spliced",
    "zero",
]
