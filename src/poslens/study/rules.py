"""The claims' decision rules, two per claim (METHODS.md, "Claims: the original's observation,
then the sharper test"): the original's observation, measured the way the original measured it,
then the sharper test of what that observation does not show yet. Each rule has one primary
effect per training seed, computed from the experiments' headline numbers, a threshold it must
exceed, the study models it judges, and controls: models (or nulls built inside a model) in which
its mechanism is present (positive) or absent (negative) by design. Controls go through exactly
the same pipeline; a verdict counts only when the rule detected every positive control and
rejected every measured negative one (METHODS.md, "Calibration").

Keys are built with the experiment modules' own key builders (never typed or parsed here), and a
contract test runs every experiment a rule reads and checks that each key the rule asks for is in
the real headline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from poslens.experiments import axis_map, position_removal, windows
from poslens.experiments.heads import result as heads
from poslens.experiments.output import retention_number
from poslens.experiments.sae_causal import result as sae
from poslens.interventions import in_situ
from poslens.models.config import posenc_family
from poslens.study.original import REBUILD_COMPENSATION

Values = list[float]  # one number per seed (NaN where a seed lacks it)

ORIGINAL, SHARPER = "original", "sharper"
LEVELS = {ORIGINAL: "the original's observation", SHARPER: "the sharper test"}


class View:
    """One model's headline numbers per seed, read through (experiment, key)."""

    def __init__(self, model: str, entry: dict[str, Any]) -> None:
        self.model, self.posenc = model, entry["posenc"]
        self.agg, self.runs = entry["aggregate"], entry["runs"]
        self.scale: dict[str, Any] = entry.get("scale") or {}
        self.missing: set[tuple[str, str]] = set()  # keys asked for of an experiment that ran

    @property
    def family(self) -> str:
        return posenc_family(self.posenc)

    def values(self, exp: str, key: str) -> Values:
        """Per-seed values in seed order (NaN where missing); [] when the experiment did not run."""
        if exp not in self.agg:
            return []
        n = sum(1 for r in self.runs if exp in r["experiments"])
        if key not in self.agg[exp]:
            self.missing.add((exp, key))
        vals = self.agg[exp].get(key, {}).get("values", [math.nan] * n)
        return [math.nan if v is None else float(v) for v in vals]

    def seeds(self, exp: str) -> int:
        return sum(1 for r in self.runs if exp in r["experiments"])


@dataclass(frozen=True)
class Effect:
    """A rule's effect in each seed of one model: a number where it was measured, NaN where it
    was not, with the reason (`missing`: seed -> why). `empty`: the missing seeds where there was
    nothing to measure (no row/column latents, a closed gate, no variance), as opposed to a
    measurement that was not made. `gate`: set when a gate decided that the seeds it closed have
    nothing to test (an outcome, not an effect of 0)."""

    values: tuple[float, ...]
    missing: dict[int, str]
    gate: str | None = None
    empty: frozenset[int] = frozenset()

    @property
    def measured(self) -> int:
        return sum(math.isfinite(x) for x in self.values)

    def reasons(self) -> str:
        """'seeds 1, 3: no row or column latents; seed 4: ...' (one phrase per reason)."""
        by: dict[str, list[int]] = {}
        for seed, why in sorted(self.missing.items()):
            by.setdefault(why, []).append(seed)
        return "; ".join(
            f"seed{'s' * (len(ss) > 1)} {', '.join(map(str, ss))}: {why}" for why, ss in by.items()
        )


def effect(
    values: Values, why: Callable[[int], str], empty: Callable[[int], bool] = lambda s: False
) -> Effect:
    """An Effect from per-seed values; `why(seed)` names the reason of each NaN, `empty(seed)`
    says whether there was nothing to measure there."""
    nan = [s for s, x in enumerate(values) if not math.isfinite(x)]
    return Effect(tuple(values), {s: why(s) for s in nan}, None,
                  frozenset(s for s in nan if empty(s)))  # fmt: skip


def _column(v: View, exp: str, key: str, n: int) -> Values:
    """Per-seed values of one key, NaN where a seed lacks it (n seeds ran the experiment)."""
    return v.values(exp, key) or [math.nan] * n


def _minus(a: Values, b: Values) -> Values:
    return [x - y for x, y in zip(a, b, strict=True)]


Notes = list[tuple[str, Values]]  # (what, per-seed values): secondary numbers beside an effect


# ------------------------------------------------------------------------------ APE

E_SAE = "sae_causal"
SITE = "early"  # the SAE's site role the claims read (the block where the APE probe peaks)


def _sae(v: View, group: str, number: str) -> Values:
    return _column(v, E_SAE, sae.key(SITE, group, number), v.seeds(E_SAE))


def _latents(v: View) -> Values:
    n = v.seeds(E_SAE)
    rows, cols = (_column(v, E_SAE, sae.latents_key(SITE, k), n) for k in ("row", "col"))
    return [r + c for r, c in zip(rows, cols, strict=True)]


def _beyond_matched(v: View, number: str, sign: float = 1.0) -> Effect:
    """sign * (row + column latents zeroed minus as many matched random latents), per seed;
    not measured where the SAE found no row or column latent (nothing row/column to remove)."""
    edit, ctrl = _sae(v, sae.ROWCOL_ZEROED, number), _sae(v, sae.MATCHED_ROWCOL, number)
    found = _latents(v)

    def why(s: int) -> str:
        if found[s] == 0:
            return "the SAE found no row or column latents"
        if not math.isfinite(edit[s]):
            return "the row/column edit was not measured"
        return "the matched random latents were not measured"

    return effect([sign * d for d in _minus(edit, ctrl)], why, lambda s: found[s] == 0)


def ape_site_effect(v: View) -> Effect:
    """The original's: how much further toward chance the exact probe at the SAE's own site
    (fitted on intact activations) falls when the row and column latents are zeroed (+error)
    than when as many matched random latents are."""
    return _beyond_matched(v, sae.fixed_drop("site"))


def ape_site_notes(v: View) -> Notes:
    """The axis split the original also measured, and the resampling controls."""
    out: Notes = []
    for group, axis, other in ((sae.ROW_ZEROED, "row", "col"), (sae.COL_ZEROED, "col", "row")):
        own = _sae(v, group, sae.fixed_drop("site", axis))
        kept = _sae(v, group, sae.fixed_drop("site", other))
        out.append((f"{axis} latents zeroed: {axis} probe drop at the site minus {other} probe "
                    "drop (an axis split is > 0)", _minus(own, kept)))  # fmt: skip
    site = sae.fixed_drop("site")
    out.append(("same position, other image resampled: exact probe drop at the site (should "
                "be ~0)", _sae(v, sae.RESAMPLE_SAME_POSITION, site)))  # fmt: skip
    out.append(("other position, same image resampled: exact probe drop at the site (should "
                "break position)", _sae(v, sae.RESAMPLE_OTHER_POSITION, site)))  # fmt: skip
    return out


def ape_downstream_effect(v: View) -> Effect:
    """The sharper: accuracy points the model loses when the row and column latents are zeroed
    (+error), beyond what as many matched random latents cost (what the model downstream uses,
    not what a probe can still decode)."""
    return _beyond_matched(v, "d_accuracy", -1.0)


def ape_downstream_notes(v: View) -> Notes:
    """Margin and the output probe beside accuracy, the SAE's own cost, and the table edit."""
    pr, e, n = position_removal, "position_removal", v.seeds("position_removal")
    out: Notes = [
        ("correct-class margin lost beyond matched random latents",
         list(_beyond_matched(v, "d_margin", -1.0).values)),
        ("exact probe at the output: drop toward chance beyond matched random latents",
         list(_beyond_matched(v, sae.fixed_drop("out")).values)),
        ("SAE k (chosen by the reconstruction criterion)", _column(v, E_SAE, sae.k_key(SITE), v.seeds(E_SAE))),
        ("accuracy lost when the SAE reconstruction alone is spliced in",
         [-x for x in _sae(v, sae.RECONSTRUCTION, "d_accuracy")]),
    ]  # fmt: skip
    if n:
        for cond, what in ((pr.INTACT, "intact"), (pr.TABLE_ROWCOL, "the table's row + column "
                           "part alone"), (pr.TABLE_CELL, "its cell residual alone"),
                           (pr.FLOOR, "no position")):  # fmt: skip
            out.append(
                (f"table edit: accuracy with {what}", _column(v, e, pr.key(cond, "accuracy"), n))
            )
    return out


# ------------------------------------------------------------------------------ split

ALIGNED = 0.5  # a split needs at least half of the planes to follow one axis (axis map)


def rope_split_effect(v: View) -> Effect:
    """The fixed probe of the other axis kept after one axis's planes are removed (the smaller of
    the two retentions) minus the larger retention of either axis after as many random planes
    per head are removed. Where the axes come from the angle tensors, a seed where fewer than
    half the planes follow one axis is closed by the gate (nothing to split), never scored 0;
    where they come from the construction (oblique planes, split by their pre-rotation axes) the
    test is made."""
    e, pr = "position_removal", position_removal
    n = v.seeds(e)
    aligned = _column(v, "axis_map", axis_map.FRACTION_ALIGNED, n)
    per_head = _column(v, e, pr.AXIS_PLANES_PER_HEAD, n)  # one axis's planes per head
    pre = _column(v, e, pr.AXES_PRE_ROTATION, n)

    def kept(removed: str, other: str) -> Values:
        return _column(
            v, e, pr.key(pr.axis_condition(removed), retention_number("probe_fixed", other)), n
        )

    row_kept, col_kept = kept("row", "col"), kept("col", "row")
    out, missing, gated = [], {}, []
    for s in range(n):
        if not math.isfinite(aligned[s]):
            out.append(math.nan)
            missing[s] = "axis_map was not measured"
            continue
        if aligned[s] < ALIGNED and pre[s] != 1:
            out.append(math.nan)
            gated.append(s)
            missing[s] = (f"gate: {aligned[s]:.0%} of the planes follow one axis (a split needs "
                          f"{ALIGNED:.0%}): nothing to split")  # fmt: skip
            continue
        rnd = pr.random_condition(round(per_head[s]))
        rand = [_column(v, e, pr.key(rnd, retention_number("probe_fixed", t)), n)[s]
                for t in ("row", "col")]  # fmt: skip
        other = (
            min(row_kept[s], col_kept[s])
            if all(map(math.isfinite, (row_kept[s], col_kept[s])))
            else math.nan
        )
        worst = max(rand) if all(map(math.isfinite, rand)) else math.nan  # NaN-safe: either NaN
        out.append(other - worst)
        if not math.isfinite(out[-1]):
            missing[s] = _split_missing(v, rnd, rand, s)
    gate = f"the gate closed {len(gated)} of {n} seeds" if gated else None
    return Effect(tuple(out), missing, gate, frozenset(gated))


def _split_missing(v: View, rnd: str, rand: list[float], s: int) -> str:
    """Why seed s has no split effect: a condition that did not run, or one whose fixed-probe
    retention is undefined (the intact model's probes read the same as the floor's: a model with
    no decodable position, e.g. random weights)."""
    e, pr, n = "position_removal", position_removal, v.seeds("position_removal")
    if all(map(math.isfinite, rand)):
        name, conds = "the axis conditions", [pr.axis_condition("row"), pr.axis_condition("col")]
    else:
        name, conds = f"{rnd} (as many random planes per head as one axis has)", [rnd]
    ran = all(math.isfinite(_column(v, e, pr.key(c, "accuracy"), n)[s]) for c in conds)
    if not ran:
        return f"{name} {'were' if len(conds) > 1 else 'was'} not run"
    return (f"{name}: the fixed probes' retention is undefined (the intact model and the floor "
            "read the same: no position to retain)")  # fmt: skip


def rope_split_notes(v: View) -> Notes:
    """The own-axis loss (built in, a check rather than evidence) and the random planes."""
    e, pr, n = "position_removal", position_removal, v.seeds("position_removal")
    out: Notes = []
    for axis in ("row", "col"):
        own = _column(
            v, e, pr.key(pr.axis_condition(axis), retention_number("probe_fixed", axis)), n
        )
        out.append((f"check: {axis} probe retention after the {axis} planes are removed "
                    "(should be ~0)", own))  # fmt: skip
    return out


def rope_alignment_effect(v: View) -> Effect:
    """Descriptive: the share of planes that follow one axis after training minus the share at
    initialisation (learned frequencies that came to follow the axes, or not)."""
    n = v.seeds("axis_map")
    trained = _column(v, "axis_map", axis_map.FRACTION_ALIGNED, n)
    init = _column(v, "axis_map", axis_map.FRACTION_ALIGNED_INIT, n)
    return effect(_minus(trained, init), lambda s: "the initial frequencies are not known")


def rope_alignment_notes(v: View) -> Notes:
    n = v.seeds("axis_map")
    return [
        ("share of axis-aligned planes after training", _column(v, "axis_map", axis_map.FRACTION_ALIGNED, n)),
        ("share of axis-aligned planes at initialisation", _column(v, "axis_map", axis_map.FRACTION_ALIGNED_INIT, n)),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ rebuild


def _window_values(v: View, number: str, suffix: bool = False) -> tuple[Values, Values]:
    """Per seed, `number` of the rebuilding window (prefix 0..k, or with suffix=True the suffix
    window k+1..end after it), and k itself (NaN where no window was run)."""
    n = v.seeds("windows")
    ks = _column(v, "windows", windows.key(windows.REBUILD, "window"), n)
    out = []
    for s, k in enumerate(ks):
        if not math.isfinite(k):
            out.append(math.nan)
            continue
        name = windows.suffix_window(int(k) + 1) if suffix else windows.prefix_window(int(k))
        out.append(_column(v, "windows", windows.key(name, number), n)[s])
    return out, ks


def rebuild_retention_effect(v: View) -> Effect:
    """The original's: final RPI-SSDC retention after rotations are withheld in blocks 0..k (0:
    the all-position-removed floor, 1: intact)."""
    vals, ks = _window_values(v, "retention_ssdc_out")
    return effect(vals, lambda s: "no rebuilding window was run" if not math.isfinite(ks[s])
                  else "intact and floor RPI-SSDC equal: no retention to take",
                  lambda s: math.isfinite(ks[s]))  # fmt: skip


def rebuild_retention_notes(v: View) -> Notes:
    suffix, _ = _window_values(v, "retention_ssdc_out", suffix=True)
    probe, _ = _window_values(v, retention_number("probe_fixed", "exact"))
    acc, _ = _window_values(v, "retention_accuracy")
    return [
        ("what the later blocks add in the intact model: 1 - RPI-SSDC retention after the "
         "suffix window", [1 - x for x in suffix]),
        ("exact-probe retention at the output after the window", probe),
        ("accuracy retention after the window", acc),
    ]  # fmt: skip


def rebuild_effect(v: View) -> Effect:
    """The sharper: compensation in correct-class margin: what the blocks after the window add
    when rotations were withheld before them, minus what they add in the intact model, as a
    share of the intact-minus-floor margin ((prefix - floor) - (intact - suffix)) / (intact -
    floor), for the window the experiment reads for this claim (windows.rebuild_window)."""
    n = v.seeds("windows")
    vals = _column(v, "windows", windows.key(windows.REBUILD, "relative"), n)
    k = _column(v, "windows", windows.key(windows.REBUILD, "window"), n)
    return effect(vals, lambda s: "no compensation window was run" if not math.isfinite(k[s])
                  else "intact and floor margins equal: no share to take",
                  lambda s: math.isfinite(k[s]))  # fmt: skip


def rebuild_notes(v: View) -> Notes:
    """Compensation in RPI-SSDC units, comparable with the original's REBUILD_COMPENSATION."""
    prefix, _ = _window_values(v, "retention_ssdc_out")
    suffix, _ = _window_values(v, "retention_ssdc_out", suffix=True)
    return [("compensation in RPI-SSDC units: retention after the window minus what the later blocks "
             f"add anyway (original: +{REBUILD_COMPENSATION})", [p + q - 1 for p, q in zip(prefix, suffix, strict=True)])]  # fmt: skip


# ------------------------------------------------------------------------------ heads

UNITS = "block_head"


def _held_out(v: View, name: str) -> Values:
    return _column(v, "heads", heads.held_out_key(UNITS, name), v.seeds("heads"))


def heads_excess_effect(v: View) -> Effect:
    """The original's: accuracy the top rebuilder head (ranked on one half of the images)
    costs, on the other half, when masked after the withheld window, minus what it costs in the
    intact model."""
    return effect(_held_out(v, heads.EXCESS_ACCURACY), lambda s: "no rebuilding test was run")


def heads_null_effect(v: View) -> Effect:
    """A permutation null across heads: the same held-out excess for a head chosen at random
    instead of by rank. A window that makes every head costlier shows up here."""
    return effect(_held_out(v, heads.NULL_EXCESS_ACCURACY), lambda s: "no rebuilding test was run")


def heads_excess_notes(v: View) -> Notes:
    return [
        ("the same in correct-class margin", _held_out(v, heads.EXCESS)),
        ("a random head's held-out excess in margin (the null)", _held_out(v, heads.NULL_EXCESS)),
        ("top head minus the null, in margin", _held_out(v, heads.TOP_MINUS_NULL)),
    ]


def heads_effect(v: View) -> Effect:
    """The sharper (secondary): across the later blocks' heads (block-head units), the
    correlation of each head's scale-free axis-window preference (its share of what the later
    blocks rebuild after a row-only window minus after a column-only window) with its
    attention's axis specialization (+ row). Not measured where either does not vary."""
    n = v.seeds("heads")
    vals = _column(v, "heads", heads.consistency_key(heads.AXIS_PREFERENCE_RELATIVE, UNITS), n)
    return effect(vals, lambda s: "no variance across heads: the correlation is undefined",
                  lambda s: True)  # fmt: skip


def heads_permuted_effect(v: View) -> Effect:
    """The sharper level's null: the same correlation with the heads' specialisations permuted
    across heads (one seeded permutation per analysis seed). It is noise of the size the rule
    sees with this many heads, non-zero by design, but no head's preference follows its own
    axis."""
    n = v.seeds("heads")
    vals = _column(v, "heads", heads.consistency_key(heads.AXIS_PREFERENCE_PERMUTED, UNITS), n)
    return effect(vals, lambda s: "no variance across heads: the correlation is undefined",
                  lambda s: True)  # fmt: skip


# ------------------------------------------------------------------------------ position


def position_effect(v: View) -> Effect:
    """Accuracy points lost when every positional signal is removed from the trained weights."""
    e, pr = "position_removal", position_removal
    n = v.seeds(e)
    intact, floor = (_column(v, e, pr.key(c, "accuracy"), n) for c in (pr.INTACT, pr.FLOOR))
    return effect(_minus(intact, floor),
                  lambda s: "no accuracy (a backbone without a classifier head)")  # fmt: skip


# ------------------------------------------------------------------------------ the rules


EACH = "*"  # a Control's model: a null built inside each model the rule judges (`label` names it)


@dataclass(frozen=True)
class Control:
    """A calibration test: `model` with the mechanism present ("positive") or absent
    ("negative") by design. `effect`: a null built inside the model instead of the rule's own
    effect (e.g. a random head for the top head); `label` names it then. `design`: what the
    control plants or removes, in a phrase. `edit`: an in-situ control instead of a trained
    model: each judged model under that weight edit (interventions.in_situ), `model` empty.
    `model` EACH: the null `effect` read in each judged model itself ("rope_axial, random
    head"), trained or pretrained."""

    model: str
    role: str
    design: str
    effect: Callable[[View], Effect] | None = None
    label: str = ""
    edit: str = ""

    @property
    def name(self) -> str:
        return self.label or self.model

    @property
    def in_situ(self) -> bool:
        return bool(self.edit)


def in_situ_control(edit: str) -> Control:
    """The in-situ control `edit` (its role and design are the edit's own)."""
    e = in_situ.get(edit)
    return Control("", e.role, f"in situ: {e.plants}", edit=edit)


def _no_notes(v: View) -> Notes:
    return []


@dataclass(frozen=True)
class Rule:
    """One level of one claim: its primary effect per seed must exceed `threshold` (one-sided
    t-test over seeds); judged on `study` models, calibrated on `controls`. `reads`: the
    experiments its effect reads (the first is its primary one); `family`: the encodings it
    applies to (models.config.posenc_family, or "any" positional encoding), by which a
    pretrained model is judged. A `descriptive` rule reports its effect with an interval and no
    verdict (what it measures is decided by nothing the study controls)."""

    claim: str
    level: str  # ORIGINAL or SHARPER
    title: str  # the claim, as the original stated it
    statement: str  # what this level tests, in one line
    reads: tuple[str, ...]
    family: str
    effect: Callable[[View], Effect]
    effect_name: str
    threshold: float  # the smallest effect of interest, set before any run (never 0)
    threshold_source: str  # where the threshold comes from: the original's effect, a fraction
    study: tuple[str, ...]
    controls: tuple[Control, ...]
    would_change: str  # what result would have changed the verdict, in one sentence
    by_construction: str  # what holds by construction here, so it is not evidence
    notes: Callable[[View], Notes] = field(default=_no_notes)
    descriptive: bool = False
    # why no in-situ control can calibrate this level where one is missing (a pretrained study
    # then says so instead of a verdict), e.g. "no weight edit plants compensation"
    in_situ_gap: str = ""
    # where it reads position_removal: the condition kinds its effect and notes read
    # (position_removal.KINDS; () the intact model and floor alone). An in-situ control runs only
    # the kinds of the rules that judge it (study.plan.in_situ_runs): the rest would be paid for
    # and never read.
    removal: tuple[str, ...] = ()
    # whether its effect or notes read a position_removal condition's RPI numbers (RPI-SSDC, the
    # probes under RPI): an in-situ control's conditions run their RPI pass only then
    removal_rpi: bool = False
    # whether they read any of its probes or SSDC (False: accuracy and margins alone): where no
    # rule judging an in-situ control does, its position_removal runs unprobed (one clean pass
    # per condition, no probe site chosen)
    removal_probes: bool = True
    # whether its effect or notes read any number measured under RPI (RPI-SSDC, probes under
    # RPI) in any experiment: an in-situ control that only rules without are judged on is
    # measured without RPI probes (ExperimentConfig.rpi_probes)
    rpi: bool = False

    @property
    def id(self) -> str:
        return f"{self.claim}.{self.level}"

    @property
    def experiment(self) -> str:
        """The primary experiment: a model that did not run it has nothing to judge."""
        return self.reads[0]

    @property
    def models(self) -> tuple[str, ...]:
        """Every model this rule reads: study models, then trained control models."""
        trained = [c.model for c in self.controls if not c.in_situ and c.model != EACH]
        return tuple(dict.fromkeys([*self.study, *trained]))

    @property
    def edits(self) -> tuple[str, ...]:
        """The in-situ controls this rule runs on each model it judges."""
        return tuple(c.edit for c in self.controls if c.in_situ)

    def applies_to(self, family: str) -> bool:
        """Whether a model of this encoding family is judged by this rule."""
        return family != "none" and self.family in ("any", family)


def _ctl(model: str, role: str, design: str, **kw: Any) -> Control:
    return Control(model, role, design, **kw)


APE_TITLE = "APE: position lives in explicit row/column features that are causal"
SPLIT_TITLE = "RoPE: rotary planes split into row and column parts"
REBUILD_TITLE = "RoPE: later blocks rebuild withheld position"
HEADS_TITLE = "RoPE: axis-specialized heads rebuild position"
POSITION_TITLE = "Position matters for accuracy"

PLANTED_ROWCOL = "a planted, frozen row + column table: row and column features by design"
REBUILD_POSITIVE = ("heads of one axis each, trained with rotations withheld in random windows "
                    "that are never the one tested: compensation by design, not by rote")  # fmt: skip
LATE_NEGATIVE = ("later blocks rotate (a signal to measure) but were trained only with their own "
                 "rotations withheld, never an early window: nothing trained to compensate")  # fmt: skip

# the APE rules' in-situ controls: the studied table's own row + column part, or its cell residual
APE_IN_SITU = (in_situ_control("table_rowcol"), in_situ_control("table_cell"))
NO_EDIT_PLANTS_REBUILDING = (
    "no weight edit plants compensation: it is learned, so only models trained for it (the toy "
    "study's rope_rebuild and rope_late) or fine-tuned from the studied weights (poslens study "
    "--rebuild-finetune STEPS) can calibrate this level"
)
NO_EDIT_PLANTS_USE = (
    "no weight edit makes a model use position: in situ only the negative control (position "
    "shuffled across positions) is built, so sensitivity rests on trained models"
)

# the rebuilding rules' model controls (the heads rules read the same models)
REBUILD_CONTROLS = (
    Control("rope_rebuild", "positive", REBUILD_POSITIVE),
    Control("rope_late", "negative", LATE_NEGATIVE),
)
# a pretrained study's: the studied weights fine-tuned the same two ways (study.finetune_steps)
FINETUNE_CONTROLS = (in_situ_control("finetune_held_out"), in_situ_control("finetune_late"))

RULES = (
    Rule(
        "ape_explicit_features",
        ORIGINAL,
        APE_TITLE,
        "zeroing the SAE's row and column latents moves the exact probe at the SAE's site toward "
        "chance beyond matched random latents",
        (E_SAE,),
        "additive",
        ape_site_effect,
        "drop toward chance of the exact probe at the SAE's site (fitted on intact activations) "
        "when the row and column latents are zeroed, beyond matched random latents",
        0.10,
        "about a third of the original's 0.33 (the rule on its published numbers)",
        study=("ape",),
        controls=(
            _ctl("ape_rowcol", "positive", PLANTED_ROWCOL),
            _ctl("sincos", "positive", "a fixed 2-D sinusoidal table: row and column channels"),
            _ctl(
                "ape_cell",
                "negative",
                "a planted table of one direction per cell: positional "
                "features, none of them row or column",
            ),
            *APE_IN_SITU,
        ),
        would_change="Zeroing the row and column latents moving the site's probe less than a "
        "tenth of the way to chance beyond matched random latents.",
        by_construction="Zeroing position-carrying latents lowers a probe read at the same site "
        "whether or not the model uses them: decodability, not use (the sharper test reads use).",
        notes=ape_site_notes,
    ),
    Rule(
        "ape_explicit_features",
        SHARPER,
        APE_TITLE,
        "the model downstream loses accuracy when the row and column latents go, beyond matched "
        "random latents",
        (E_SAE, "position_removal"),
        "additive",
        ape_downstream_effect,
        "accuracy lost when the row and column latents are zeroed (+error), beyond matched random "
        "latents",
        0.05,
        "about two fifths of the original's 0.124 (top-1 61.5 with the latents zeroed against "
        "73.9 with matched random latents)",
        study=("ape",),
        controls=(
            _ctl("ape_rowcol", "positive", PLANTED_ROWCOL + ", which the model learned to use"),
            _ctl(
                "ape_shuffled",
                "negative",
                "the same planted row + column table, trained with "
                "its patches permuted at every step: row and column features present, unusable",
            ),
            *APE_IN_SITU,
        ),
        would_change="Zeroing the row and column latents costing less than 5 accuracy points "
        "beyond matched random latents.",
        by_construction="The +error splice moves only the edited latents, so the SAE's own "
        "reconstruction error is not part of the effect; its cost is reported beside it.",
        notes=ape_downstream_notes,
        removal=(position_removal.TABLE_KIND,),
    ),
    Rule(
        "rope_planes_split",
        ORIGINAL,
        SPLIT_TITLE,
        "on axial RoPE: removing one axis's planes keeps the other axis (fixed probes) beyond "
        "removing as many random planes per head",
        ("position_removal", "axis_map"),
        "rotary",
        rope_split_effect,
        "retention of the other axis's fixed probe after one axis's planes are removed, minus "
        "either axis's retention after as many random planes",
        0.10,
        "a tenth of the original's 0.94 (random planes' RPI-SSDC standing in for their probes)",
        study=("rope_axial",),
        controls=(
            _ctl(
                "rope_rebuild",
                "positive",
                "heads of one axis each: one axis's planes removed "
                "leaves the other axis's heads whole",
            ),
            _ctl(
                "rope_oblique",
                "negative",
                "planes along the diagonals, split by their "
                "pre-rotation axes: each half follows both axes, so removing it costs both",
            ),
            in_situ_control("heads_axis_split"),
            in_situ_control("freqs_oblique"),
        ),
        would_change="Removing one axis's planes hurting the other axis as much as random planes "
        "do.",
        by_construction="In axial RoPE each plane follows one axis by design, so the own-axis loss "
        "is built in (a check, not evidence); the other axis surviving is not.",
        notes=rope_split_notes,
        removal=(position_removal.AXIS_KIND, position_removal.RANDOM_AXIS_KIND),
    ),
    Rule(
        "rope_planes_split",
        SHARPER,
        SPLIT_TITLE,
        "learned-frequency RoPE: do the learned planes come to follow the axes (against their "
        "initialisation)? Descriptive",
        ("axis_map",),
        "rotary",
        rope_alignment_effect,
        "share of axis-aligned planes after training minus at initialisation",
        0.0,
        "descriptive: no threshold is tested",
        study=("rope_mixed",),
        controls=(),
        would_change="Descriptive: no verdict.",
        by_construction="The share at initialisation is set by the random init, so only its "
        "change with training describes the learned frequencies.",
        notes=rope_alignment_notes,
        descriptive=True,
    ),
    Rule(
        "rope_rebuilds",
        ORIGINAL,
        REBUILD_TITLE,
        "after rotations are withheld in the first blocks, the final RPI-SSDC returns to much "
        "(over half) of the intact model's",
        ("windows",),
        "rotary",
        rebuild_retention_effect,
        "final RPI-SSDC retention after the withheld window (0 floor, 1 intact)",
        0.5,
        "the claim's own wording (over half of the intact model's; the original measured 0.71)",
        study=("rope_axial",),
        controls=(*REBUILD_CONTROLS, *FINETUNE_CONTROLS),
        would_change="Final RPI-SSDC retention after the window at most one half.",
        by_construction="RPI-SSDC can return whenever later blocks still rotate: the return "
        "alone is not compensation (the sharper test subtracts the later blocks' ordinary part).",
        notes=rebuild_retention_notes,
        in_situ_gap=NO_EDIT_PLANTS_REBUILDING,
        rpi=True,
    ),
    Rule(
        "rope_rebuilds",
        SHARPER,
        REBUILD_TITLE,
        "the later blocks add more after the window than they add in the intact model "
        "(compensation beyond their ordinary contribution), in correct-class margin",
        ("windows",),
        "rotary",
        rebuild_effect,
        "compensation: what the later blocks add after the withheld window minus what they add in "
        "the intact model, as a share of intact-minus-floor margin",
        0.05,
        f"about a quarter of the original's +{REBUILD_COMPENSATION} compensation (in RPI-SSDC units; "
        "the original did not measure margin)",
        study=("rope_axial", "rope_mixed"),
        controls=(*REBUILD_CONTROLS, *FINETUNE_CONTROLS),
        would_change="The later blocks adding no more margin after the window than they add "
        "when nothing was withheld (their ordinary contribution, not compensation).",
        by_construction="Later blocks help even in the intact model, so only what they add "
        "beyond that is compensation.",
        notes=rebuild_notes,
        in_situ_gap=NO_EDIT_PLANTS_REBUILDING,
        rpi=True,
    ),
    Rule(
        "heads_rebuild",
        ORIGINAL,
        HEADS_TITLE,
        "the top rebuilder head (ranked on half the images) costs more accuracy after the "
        "window than the same head costs in the intact model (on the other half)",
        ("heads",),
        "rotary",
        heads_excess_effect,
        "held-out accuracy the top head costs after the window minus in the intact model",
        0.02,
        "about half the original's 0.038 (top-1 4.30 points lost after the window against 0.50 "
        "in the intact model)",
        study=("rope_axial",),
        controls=(
            *REBUILD_CONTROLS,
            *FINETUNE_CONTROLS,
            _ctl(
                EACH,
                "negative",
                "a head chosen at random instead of by rank: a "
                "window that makes every head costlier shows up here",
                effect=heads_null_effect,
                label="random head",
            ),
        ),
        would_change="The top head costing no more after the window than in the intact model, or "
        "a random head costing as much more.",
        by_construction="The head is ranked on other images than it is measured on, so picking "
        "the largest of many noisy excesses does not by itself make the effect positive.",
        notes=heads_excess_notes,
        in_situ_gap=NO_EDIT_PLANTS_REBUILDING,
    ),
    Rule(
        "heads_rebuild",
        SHARPER,
        HEADS_TITLE,
        "heads' rebuilding follows their axis: a head's preference for rebuilding after a "
        "row-only vs a column-only window correlates with its attention's axis specialization",
        ("heads",),
        "rotary",
        heads_effect,
        "correlation, over the later blocks' heads, of each head's scale-free preference for "
        "rebuilding after a row-only vs a column-only window with its axis specialization",
        0.2,
        "a correlation of 0.2 over the heads: between Cohen's small (0.1) and medium (0.3); the "
        "original did not test this level",
        study=("rope_axial",),
        controls=(
            *REBUILD_CONTROLS,
            _ctl(
                EACH,
                "negative",
                "the heads' specialisations permuted across heads: noise of the size this many "
                "heads give, with no head's preference following its own axis",
                effect=heads_permuted_effect,
                label="heads permuted",
            ),
        ),
        would_change="Heads' axis-window preferences unrelated to (or against) their attention's "
        "axis specialization.",
        by_construction="In the positive control each head's planes follow one axis by design, "
        "so its correlation is close to 1 by construction: it shows the instrument can see it.",
        in_situ_gap="no in-situ positive: axis-specialised heads can be planted by an edit "
        "(heads_axis_split), but the rebuilding they would have to show is learned",
    ),
    Rule(
        "position_matters",
        ORIGINAL,
        POSITION_TITLE,
        "removing every positional signal from the trained weights costs accuracy",
        ("position_removal",),
        "any",
        position_effect,
        "accuracy lost when every positional signal is removed from the same weights",
        0.10,
        "about a fifth of the original's 0.46 accuracy lost without position",
        study=("ape", "rope_axial", "rope_mixed"),
        controls=(
            _ctl("ape_rowcol", "positive", PLANTED_ROWCOL + ", which the model learned to use"),
            _ctl(
                "ape_shuffled",
                "negative",
                "position present (the planted table) but unusable: "
                "trained with its patches permuted at every step",
            ),
            in_situ_control("position_shuffled"),
        ),
        would_change="Removing position costing less than 10 accuracy points.",
        in_situ_gap=NO_EDIT_PLANTS_USE,
        removal_probes=False,
        by_construction="The task's label depends on where the objects are, so a drop is "
        "expected where the model learned to read position.",
    ),
)

CLAIMS = tuple(dict.fromkeys(r.claim for r in RULES))  # the claims, in order

__all__ = ["CLAIMS", "LEVELS", "ORIGINAL", "RULES", "SHARPER", "Control", "Effect", "Rule", "View"]
