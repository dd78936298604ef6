"""The original study's claims, each with a verdict from this study's own numbers.

Every verdict rests on evidence that does not hold by construction (see shared NOTES.md), with
its control beside it: e.g. removing the row planes of an axial RoPE model sends the row probe to
chance by construction, so that claim rests on the column probe surviving and on random planes
of the same count costing less. One seed is never enough: with fewer than two seeds a claim
is "inconclusive" whatever its numbers say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from poslens.study.config import StudyConfig

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"
APE_LIKE = ("ape", "sincos")
ROPE_LIKE = ("rope_axial", "rope_mixed", "rope_axial_ape", "rope_mixed_ape")
MIN_SEEDS = 2

Models = dict[str, dict[str, Any]]

TASK_CAVEAT = (
    "The default task's label depends on where the objects are, so a drop is expected; the "
    "non-trivial part is that nothing else in the model stands in for the encoding (the floor "
    "falls to the content-only level) and how much a partial removal costs."
)
PRETRAINED_CAVEAT = (
    "Pretrained weights: each model is one set of weights, so its seeds are analysis seeds (image "
    "subset, RPI permutation, probe split, random draws) and the SE measures analysis noise, not "
    "variation between trainings."
)


class View:
    """Read one model's headline numbers: per seed or as mean/SE over seeds."""

    def __init__(self, model: str, entry: dict[str, Any]) -> None:
        self.model, self.agg, self.runs = model, entry["aggregate"], entry["runs"]

    def has(self, exp: str, key: str) -> bool:
        return exp in self.agg and key in self.agg[exp] and self.agg[exp][key]["n"] > 0

    def mean(self, exp: str, key: str) -> float:
        """Mean over seeds; NaN when missing or undefined (e.g. a retention with no gap)."""
        m = self.agg.get(exp, {}).get(key, {}).get("mean")
        return float(m) if m is not None else float("nan")

    def se(self, exp: str, key: str) -> float:
        se = self.agg.get(exp, {}).get(key, {}).get("se")
        return float(se) if se is not None else float("nan")

    def values(self, exp: str, key: str) -> list[float]:
        vals = self.agg.get(exp, {}).get(key, {}).get("values", [])
        return [float(v) for v in vals if v is not None]

    def all_at_least(self, exp: str, key: str, threshold: float) -> bool:
        """True when every seed has the number and it is >= threshold."""
        vals = self.agg.get(exp, {}).get(key, {}).get("values", [])
        return bool(vals) and all(v is not None and v >= threshold for v in vals)

    def seeds(self, exp: str) -> int:
        return sum(1 for r in self.runs if exp in r["experiments"])

    def fmt(self, exp: str, key: str, pct: bool = False, count: bool = False) -> str:
        """'mean ± SE' (or the single value) of one headline number; counts without decimals."""
        scale, unit = (100, "%") if pct else (1, "")
        m, se = scale * self.mean(exp, key), scale * self.se(exp, key)
        if m != m:
            return "n/a"
        if count:
            return f"{m:g} ± {se:.1f}" if se == se else f"{m:g}"
        digits = 1 if pct else 2
        if se == se:  # not NaN
            return f"{m:.{digits}f} ± {se:.{digits}f}{unit}"
        return f"{m:.{digits}f}{unit}"


def _claim(
    cid: str,
    title: str,
    verdict: str,
    summary: str,
    evidence: list[str],
    controls: list[str],
    caveats: list[str],
    models: list[str],
    seeds: int,
) -> dict[str, Any]:
    if models and seeds < MIN_SEEDS:  # one seed is never enough
        caveats = [*caveats, f"only {seeds} seed(s): a verdict needs at least {MIN_SEEDS}"]
        verdict = INCONCLUSIVE
    if verdict == INCONCLUSIVE and 0 < seeds < MIN_SEEDS:
        summary = (
            f"No verdict from {seeds} seed (at least {MIN_SEEDS} are needed); so far: "
            + summary[:1].lower()
            + summary[1:]
        )
    return {
        "id": cid,
        "title": title,
        "verdict": verdict,
        "summary": summary,
        "evidence": evidence,
        "controls": controls,
        "caveats": caveats,
        "models": models,
        "seeds": seeds,
    }


def _missing(cid: str, title: str, why: str) -> dict[str, Any]:
    return _claim(cid, title, INCONCLUSIVE, why, [], [], [why], [], 0)


def _views(models: Models, kinds: tuple[str, ...], exp: str) -> list[View]:
    return [
        View(m, e) for m, e in models.items() if e["posenc"] in kinds and e["aggregate"].get(exp)
    ]


def ape_features(models: Models) -> dict[str, Any]:
    cid, title = (
        "ape_explicit_features",
        "APE: position lives in explicit row/column features that are causal",
    )
    views = _views(models, APE_LIKE, "sae_causal")
    if not views:
        return _missing(cid, title, "no APE model with the sae_causal experiment in this study")
    v = views[0]
    sites = [k[: -len(".probe_causal")] for k in v.agg["sae_causal"] if k.endswith(".probe_causal")]
    e = "sae_causal"

    def drop(site: str, key: str) -> float:
        k = f"{site}.{key}.probe_drop_site"
        return v.mean(e, k) if v.has(e, k) else float("-inf")

    best = max(sites, key=lambda s: drop(s, "zero_all+error"))
    evidence, controls, caveats = [], [], []
    for site in sites:
        n = v.fmt(e, f"{site}.n_positional", count=True)
        kinds = ", ".join(
            f"{k} {v.fmt(e, f'{site}.latents_{k}', count=True)}" for k in ("row", "col", "cell", "mixed")
            if v.has(e, f"{site}.latents_{k}")
        )  # fmt: skip
        line = f"{site}: {n} positional latents ({kinds})"
        if v.has(e, f"{site}.zero_all+error.probe_drop_site"):
            line += (
                f"; zeroing all of them (+error, nothing else moves) takes the exact probe "
                f"{v.fmt(e, f'{site}.zero_all+error.probe_drop_site', pct=True)} of the way to chance, "
                f"accuracy change {v.fmt(e, f'{site}.zero_all+error.d_accuracy', pct=True)}"
            )
            controls.append(
                f"{site}: matched random latents (same count, firing rate and mass) take it "
                f"{v.fmt(e, f'{site}.matched_all.probe_drop_site', pct=True)} of the way, accuracy "
                f"change {v.fmt(e, f'{site}.matched_all.d_accuracy', pct=True)}; the reconstruction "
                f"alone changes accuracy by {v.fmt(e, f'{site}.recon.d_accuracy', pct=True)}"
            )
        evidence.append(line)
    seeds = v.seeds(e)
    causal = v.all_at_least(e, f"{best}.probe_causal", 1)
    task = v.all_at_least(e, f"{best}.task_causal", 1)
    rowcol = all(
        v.has(e, f"{best}.latents_{k}") and v.mean(e, f"{best}.latents_{k}") >= 1
        for k in ("row", "col")
    )
    cells = v.has(e, f"{best}.latents_cell") and v.mean(e, f"{best}.latents_cell") >= 1
    if causal and rowcol:
        verdict = SUPPORTED
        summary = f"At {best}, row and column latents exist and zeroing the positional set drives the probe toward chance while matched random latents do much less, in every seed."
    elif causal and cells:
        verdict = NOT_SUPPORTED
        summary = f"Position is explicit and causal for the probes at {best}, but factored into cell (single-position) latents, not row/column ones."
    else:
        verdict = NOT_SUPPORTED
        summary = f"At the best site ({best}) zeroing the positional latents does not take the probe at least half-way to chance in every seed while matched random latents do less than half as much."
    summary += (
        " Zeroing them also costs task margin beyond 2 SE and beyond the matched control."
        if task
        else " Zeroing them does not clearly cost task margin beyond the matched control (decodability is not use)."
    )
    caveats.append(
        "APE probes decode position at ~100% even in a random-init model: the verdict rests on the causal test against matched latents, not on probe accuracy."
    )
    return _claim(
        cid,
        title,
        verdict,
        summary,
        evidence,
        controls,
        caveats,
        [v.model],
        seeds,
    )


def _retention_per_seed(v: View, e: str, cond: str, probe: str) -> list[float]:
    """(cond - floor) / (intact - floor) of one probe, per seed (NaN where undefined)."""
    c, f, i = (
        v.agg[e].get(f"{k}.{probe}", {}).get("values", []) for k in (cond, "floor", "intact")
    )
    out = []
    for a, b, t in zip(c, f, i, strict=False):
        ok = None not in (a, b, t) and abs(t - b) > 1e-12
        out.append((a - b) / (t - b) if ok else float("nan"))
    return out


def rope_split(models: Models) -> dict[str, Any]:
    """Non-trivial part: the *other* axis survives removing one axis's planes (the removed axis
    going to chance is by construction), and survives better than under random planes of the
    same count, which cut into both axes."""
    cid, title = "rope_planes_split", "RoPE: rotary planes split into row and column parts"
    views = _views(models, ROPE_LIKE, "position_removal")
    if not views:
        return _missing(cid, title, "no RoPE model with position_removal in this study")
    evidence, controls, caveats, oks, seeds = [], [], [], [], []
    e = "position_removal"
    for v in views:
        if not v.has(e, "axis_row.accuracy"):
            continue
        n = (
            round(v.mean("axis_map", "row_planes_per_head"))
            if v.has("axis_map", "row_planes_per_head")
            else 0
        )
        rnd = f"random_{n}"
        evidence.append(
            f"{v.model}: without the row planes the column probe keeps "
            f"{v.fmt(e, 'axis_row.retention_probe_col', pct=True)} of its intact-minus-floor "
            f"accuracy (the row probe {v.fmt(e, 'axis_row.retention_probe_row', pct=True)}: near 0 by "
            f"construction); without the column planes the row probe keeps "
            f"{v.fmt(e, 'axis_col.retention_probe_row', pct=True)}"
        )
        kept = [
            min(a, b)
            for a, b in zip(
                _retention_per_seed(v, e, "axis_row", "probe_col"),
                _retention_per_seed(v, e, "axis_col", "probe_row"),
                strict=True,
            )
        ]
        ok = bool(kept) and all(k >= 0.5 for k in kept)
        if n and v.has(e, f"{rnd}.accuracy"):
            rand = [
                max(a, b)
                for a, b in zip(
                    _retention_per_seed(v, e, rnd, "probe_col"),
                    _retention_per_seed(v, e, rnd, "probe_row"),
                    strict=True,
                )
            ]
            ok = (
                ok
                and len(rand) == len(kept)
                and all(k > r for k, r in zip(kept, rand, strict=True))
            )
            controls.append(
                f"{v.model}: {n} random planes per head (the count of one axis; mean of the draws) "
                f"leave the column probe {100 * np.nanmean(_retention_per_seed(v, e, rnd, 'probe_col')):.1f}% "
                f"and the row probe {100 * np.nanmean(_retention_per_seed(v, e, rnd, 'probe_row')):.1f}% "
                "of their intact-minus-floor accuracy"
            )
            axis_acc = (v.mean(e, "axis_row.accuracy") + v.mean(e, "axis_col.accuracy")) / 2
            rnd_acc, rnd_se = (
                v.mean(e, f"{rnd}.accuracy"),
                max(v.values(e, f"{rnd}.accuracy_se") or [0.0]),
            )
            controls.append(
                f"{v.model}: accuracy without the row planes {v.fmt(e, 'axis_row.accuracy', pct=True)}, "
                f"without the column planes {v.fmt(e, 'axis_col.accuracy', pct=True)}, without {n} "
                f"random planes per head {v.fmt(e, f'{rnd}.accuracy', pct=True)} (intact "
                f"{v.fmt(e, 'intact.accuracy', pct=True)}, floor {v.fmt(e, 'floor.accuracy', pct=True)})"
            )
            if not axis_acc < rnd_acc - 2 * rnd_se:
                caveats.append(
                    f"{v.model}: losing one axis costs no more accuracy than losing as many random "
                    "planes, which remove part of both axes: the task needs both."
                )
        else:
            caveats.append(f"{v.model}: no random-plane control of the same count was run")
            ok = False
        if v.has("axis_map", "fraction_axis_aligned"):
            evidence.append(
                f"{v.model}: {v.fmt('axis_map', 'fraction_axis_aligned', pct=True)} of planes follow "
                "one axis (axis map measured from the rotation tables)"
            )
        oks.append(ok)
        seeds.append(v.seeds(e))
    if not oks:
        return _missing(cid, title, "no axis conditions were run (model without an axis split)")
    if any(models[v.model]["posenc"] == "rope_axial" for v in views):
        caveats.append(
            "In axial RoPE the plane split is built into the encoding; what is measured is that "
            "the model uses the two parts separably."
        )
    verdict = SUPPORTED if all(oks) else NOT_SUPPORTED
    summary = (
        "Removing one axis's planes leaves the other axis decodable (at least half of its "
        "intact-minus-floor probe accuracy in every seed), and better than random planes of the "
        "same count leave either axis."
        if all(oks)
        else "Removing one axis's planes does not leave the other axis clearly decodable, or no "
        "better than random planes of the same count do."
    )
    return _claim(cid, title, verdict, summary, evidence,
                  controls, caveats, [v.model for v in views], min(seeds))  # fmt: skip


def rope_rebuilds(models: Models) -> dict[str, Any]:
    cid, title = "rope_rebuilds", "RoPE: later blocks rebuild withheld position"
    views = _views(models, ROPE_LIKE, "windows")
    if not views:
        return _missing(cid, title, "no RoPE model with the windows experiment in this study")
    evidence, controls, caveats, oks, seeds = [], [], [], [], []
    ordinary: list[str] = []
    e = "windows"
    for v in views:
        ks = sorted(
            int(k.split("_")[1].split(".")[0])
            for k in v.agg[e]
            if k.startswith("prefix_") and k.endswith(".accuracy")
        )
        depth = 1 + max(
            int(k.split("_")[1].split(".")[0])
            for k in v.agg[e]
            if k.startswith("suffix_") and k.endswith(".accuracy")
        )
        target = depth // 2 - 1
        k = max([x for x in ks if x <= target] or ks[:1])
        w, sfx = f"prefix_{k}", f"suffix_{k + 1}"
        evidence.append(
            f"{v.model}: rotations withheld in blocks 0..{k}: right after the window RPI-SSDC is at the floor "
            f"(retention {v.fmt(e, f'{w}.retention_ssdc_after_window', pct=True)}, exact by construction); at the output it is back to "
            f"{v.fmt(e, f'{w}.retention_ssdc_out', pct=True)} of intact-minus-floor, accuracy {v.fmt(e, f'{w}.accuracy', pct=True)} "
            f"(intact {v.fmt(e, 'intact.accuracy', pct=True)}, floor {v.fmt(e, 'floor.accuracy', pct=True)})"
        )
        after = v.mean(e, f"{w}.ssdc_rpi_out") - v.mean(e, "floor.ssdc_rpi_out")
        if v.has(e, f"{sfx}.ssdc_rpi_out"):
            anyway = v.mean(e, "intact.ssdc_rpi_out") - v.mean(e, f"{sfx}.ssdc_rpi_out")
            controls.append(
                f"{v.model}: blocks {k + 1}..{depth - 1} add {after:.2f} RPI-SSDC at the output "
                f"after the window, vs {anyway:.2f} when nothing was withheld before them (their "
                "rotations removed instead: what they contribute anyway)"
            )
            if not after > anyway:
                ordinary.append(f"{after:.2f} vs {anyway:.2f}")
                caveats.append(
                    f"{v.model}: after the window the later blocks add no more structure than they "
                    "add anyway: rebuilding is their ordinary contribution, not compensation."
                )
        ok = v.all_at_least(e, f"{w}.retention_ssdc_out", 0.5) and v.all_at_least(
            e, f"{w}.retention_accuracy", 0.5
        )
        oks.append(ok)
        seeds.append(v.seeds(e))
    verdict = SUPPORTED if all(oks) else NOT_SUPPORTED
    summary = (
        "After rotations are withheld in the first half of the blocks, the later blocks bring RPI-SSDC and accuracy back above half of the intact-minus-floor gap in every seed."
        if all(oks)
        else "Withheld position does not come back to half of the intact-minus-floor gap in every seed."
    )
    if ordinary:
        summary += (
            " The later blocks add no more than they add when nothing is withheld (RPI-SSDC at the "
            f"output {', '.join(ordinary)}): their ordinary contribution, not compensation."
        )
    return _claim(
        cid,
        title,
        verdict,
        summary,
        evidence,
        controls,
        caveats,
        [v.model for v in views],
        min(seeds),
    )


def heads_rebuild(models: Models) -> dict[str, Any]:
    cid, title = "heads_rebuild", "RoPE: axis-specialized heads rebuild position"
    views = [v for v in _views(models, ROPE_LIKE, "heads") if v.has("heads", "heads_total")]
    if not views:
        return _missing(cid, title, "no RoPE model with the heads experiment in this study")
    e, rb = "heads", "rebuilding/head"
    evidence, controls, caveats, seeds = [], [], [], []
    spec_ok, rebuild_ok, link_ok = [], [], []
    for v in views:
        evidence.append(
            f"{v.model}: {v.fmt(e, 'specialized_heads', count=True)} of "
            f"{v.fmt(e, 'heads_total', count=True)} block-heads are axis-specialized (|spec| >= 0.5: "
            f"{v.fmt(e, 'row_heads', count=True)} row, {v.fmt(e, 'col_heads', count=True)} column; "
            f"largest |spec| {v.fmt(e, 'max_abs_specialization')})"
        )
        spec_ok.append(v.all_at_least(e, "specialized_heads", 1))
        if not v.has(e, f"{rb}.held_out.excess"):
            caveats.append(f"{v.model}: rebuilding was not measured")
            rebuild_ok.append(False)
            seeds.append(v.seeds(e))
            continue
        evidence.append(
            f"{v.model}: the top rebuilder head (chosen on half the images) costs "
            f"{v.fmt(e, f'{rb}.held_out.excess')} more correct-class margin after the window than "
            f"in the intact model, on the other half; {v.fmt(e, f'{rb}.rebuilders.n', count=True)} "
            f"of {v.fmt(e, f'{rb}.tests', count=True)} heads clear 2 SE "
            f"(~{v.fmt(e, f'{rb}.expected_false_positives')} expected by chance)"
        )
        ex = v.values(e, f"{rb}.held_out.excess")
        se = v.values(e, f"{rb}.held_out.se")
        rebuild_ok.append(
            len(ex) == len(se) == v.seeds(e) and all(a > 2 * b for a, b in zip(ex, se, strict=True))
        )
        key = "consistency/rebuild_vs_abs_spec/head.pearson"
        if v.has(e, key):
            evidence.append(
                f"{v.model}: correlation across heads between rebuilding excess and |spec|: "
                f"{v.fmt(e, key)}"
            )
            link_ok.append(v.mean(e, key) > 0)
        else:
            link_ok.append(False)
        controls.append(
            f"{v.model}: the same head masked in the intact model (the excess is over that); the "
            f"later blocks' rotations all masked contribute {v.fmt(e, 'block_control.later_after_window')} "
            f"margin after the window vs {v.fmt(e, 'block_control.later_intact')} in the intact model "
            f"(compensation {v.fmt(e, 'block_control.compensation')})"
        )
        seeds.append(v.seeds(e))
    caveats.append(
        "Scored on the correct-class margin: accuracy sits near 100% and makes ordinary heads look "
        "like rebuilders (NOTES.md)."
    )
    if not all(spec_ok):
        verdict, summary = NOT_SUPPORTED, "Not every seed has axis-specialized heads."
    elif not all(rebuild_ok):
        verdict = NOT_SUPPORTED
        summary = (
            "Axis-specialized heads exist, but no head's margin cost after the window exceeds its "
            "cost in the intact model by 2 SE on held-out images in every seed: no rebuilder heads "
            "at this scale."
        )
    elif not all(link_ok):
        verdict = NOT_SUPPORTED
        summary = "Rebuilder heads exist, but rebuilding does not go with axis specialization."
    else:
        verdict = SUPPORTED
        summary = (
            "Axis-specialized heads exist, a held-out rebuilder head clears 2 SE in every seed, "
            "and rebuilding correlates with specialization."
        )
    return _claim(cid, title, verdict, summary, evidence,
                  controls, caveats, [v.model for v in views], min(seeds))  # fmt: skip


def position_matters(models: Models) -> dict[str, Any]:
    cid, title = "position_matters", "Position matters for accuracy"
    views = [
        View(m, e)
        for m, e in models.items()
        if e["posenc"] != "none" and e["aggregate"].get("position_removal")
    ]
    views = [v for v in views if v.has("position_removal", "intact.accuracy")]  # classifiers
    if not views:
        return _missing(
            cid, title, "no model with position, a classifier and position_removal in this study"
        )
    evidence, controls, caveats, oks, seeds = [], [], [], [], []
    e = "position_removal"
    for v in views:
        drops = v.values(e, "floor.d_margin")
        ses = v.values(e, "floor.d_margin_se")
        evidence.append(
            f"{v.model}: the same weights with every positional signal removed: accuracy "
            f"{v.fmt(e, 'intact.accuracy', pct=True)} -> {v.fmt(e, 'floor.accuracy', pct=True)}, "
            f"margin change {v.fmt(e, 'floor.d_margin')}"
        )
        if v.has("axis_map", "row_planes_per_head"):
            n = round(v.mean("axis_map", "row_planes_per_head"))
            if v.has(e, f"random_{n}.accuracy"):
                controls.append(
                    f"{v.model}: removing {n} random planes per head (half of them) instead: accuracy {v.fmt(e, f'random_{n}.accuracy', pct=True)}"
                )
        oks.append(
            len(drops) == len(ses) == v.seeds(e)
            and all(d < -2 * s for d, s in zip(drops, ses, strict=True))
            and v.mean(e, "floor.accuracy") < v.mean(e, "intact.accuracy") - 0.1
        )
        seeds.append(v.seeds(e))
    if "none" in models and models["none"]["aggregate"].get("position_removal"):
        nv = View("none", models["none"])
        controls.append(
            f"none (trained without position): accuracy {nv.fmt(e, 'intact.accuracy', pct=True)}, the content-only level"
        )
    caveats.append(TASK_CAVEAT)
    verdict = SUPPORTED if all(oks) else NOT_SUPPORTED
    summary = (
        "Removing the positional signal from the trained weights costs accuracy and margin far beyond 2 paired SE in every model and seed."
        if all(oks)
        else "Removing position does not cost a clear amount of accuracy in every model and seed."
    )
    return _claim(
        cid,
        title,
        verdict,
        summary,
        evidence,
        controls,
        caveats,
        [v.model for v in views],
        min(seeds),
    )


CLAIMS: tuple[Callable[[Models], dict[str, Any]], ...] = (
    ape_features,
    rope_split,
    rope_rebuilds,
    heads_rebuild,
    position_matters,
)


def evaluate_claims(models: Models, cfg: StudyConfig | None = None) -> list[dict[str, Any]]:
    """Every claim with its verdict, summary, evidence, controls and caveats."""
    claims = [claim(models) for claim in CLAIMS]
    if cfg is not None and cfg.pretrained:
        for c in claims:
            c["caveats"] = [x for x in c["caveats"] if x != TASK_CAVEAT] + [PRETRAINED_CAVEAT]
    return claims


__all__ = ["CLAIMS", "INCONCLUSIVE", "NOT_SUPPORTED", "SUPPORTED", "evaluate_claims"]
