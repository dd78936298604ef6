"""run(): the heads experiment as phases, each a function returning what the next one reads:
reference, attention statistics, carrying, cumulative top-k, rebuilding readouts and scores."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from poslens import distributed
from poslens.data import Task
from poslens.experiments.conditions import planes_off
from poslens.experiments.config import Passes, resolved
from poslens.experiments.heads.config import CARRYING_OFF, Config, window_last
from poslens.experiments.heads.result import Heads, Rebuild, WindowControl
from poslens.experiments.heads.units import (
    Unit,
    head_mask,
    heads_off,
    intervention_of,
    units_of,
    window_mask,
)
from poslens.experiments.readout import (
    ConditionResult,
    FixedProbes,
    Prefix,
    Readout,
    Reference,
    ReferenceCache,
    eval_images,
    measure,
    prefix,
    reference,
    site_labels,
    summarise,
)
from poslens.interventions import axis_map
from poslens.metrics import paired_diff
from poslens.metrics.attention import attention_stats
from poslens.metrics.stats import ratio_diff_se, ratio_se
from poslens.models.vit import ViT
from poslens.progress import progress_bar

Advance = Callable[[], None]  # moves the progress bar on by one step


@dataclass(frozen=True)
class Plan:
    """What rebuilding measures on this model (nothing where `last` is None)."""

    last: int | None  # last withheld block k of the window
    windows: list[str]  # "all", then "row" and "col" when the axis map finds both
    later: list[int]  # blocks k+1..end, where units are masked
    notes: list[str]  # why a part is not measured


@dataclass(frozen=True)
class Draw:
    """One cumulative condition: the top k units of a kind, or random draw `draw` of k."""

    kind: str
    k: int
    draw: int | None  # None: the top k


def plan_rebuilding(model: ViT, cfg: Config) -> Plan:
    """The window, the axis windows and the later blocks, with notes on what is left out."""
    last = window_last(model, cfg)
    notes: list[str] = []
    if not model.cfg.uses_rope:
        notes.append(f"posenc={model.cfg.posenc} has no rotations to withhold: no rebuilding test")
    elif last is None:
        notes.append("a single block leaves nothing after a window: no rebuilding test")
    if last is None:
        return Plan(None, [], [], notes)
    windows = ["all"]
    if cfg.axis_windows:
        amap = axis_map(model)
        if amap.row_mask.any() and amap.col_mask.any():
            windows += ["row", "col"]
        else:
            notes.append("the axis map finds no row and column planes: no axis windows")
    return Plan(last, windows, list(range(last + 1, model.cfg.depth)), notes)


def top_k_draws(cfg: Config, units: list[Unit]) -> list[Draw]:
    """Per unit kind and k below its unit count: the top k, then `cfg.draws` random draws."""
    out = []
    for kind in cfg.units:
        n = sum(u.kind == kind for u in units)
        for k in sorted(set(cfg.cumulative)):
            if k < n:
                out += [Draw(kind, k, None)] + [Draw(kind, k, d) for d in range(cfg.draws)]
    return out


def rebuilding_masks(model: ViT, plan: Plan, units: list[Unit]) -> dict[str, torch.Tensor]:
    """[depth, H, P] planes off per rebuilding readout, in the order they are measured: the
    later blocks, each window alone and with the later blocks, each unit alone and per window."""
    if plan.last is None:
        return {}
    later = head_mask(model, [(b, h) for b in plan.later for h in range(model.cfg.heads)])
    window = {w: window_mask(model, w, plan.last) for w in plan.windows}
    masks = {"later": later}
    for w in plan.windows:
        masks[f"window:{w}"] = window[w]
        masks[f"window:{w}+later"] = window[w] | later
    for u in units:
        unit = head_mask(model, u.pairs(plan.later))
        masks[f"unit:{u.name}"] = unit
        for w in plan.windows:
            masks[f"window:{w}+{u.name}"] = window[w] | unit
    return masks


def carrying_damage(c: ConditionResult) -> float:
    """1 - mean retention of RPI-SSDC, row probe and column probe at the probe site."""
    vals = [c.retention.get(k, math.nan) for k in ("ssdc_probe_site", "probe_row", "probe_col")]
    vals = [v for v in vals if math.isfinite(v)]
    return 1 - float(np.mean(vals)) if vals else math.nan


def score_carrying(
    model: ViT,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: Config,
    ref: Reference,
    at_site: Readout | None,
    units: list[Unit],
    advance: Advance,
) -> tuple[list[ConditionResult], dict[Unit, Readout]]:
    """Each unit masked alone (head units in every block), against `at_site` (the baseline
    probed at the probe site only); block_head units at or after the probe site cannot reach it
    and are skipped. Meta: kind, unit, block, head, damage, rank. Also the readouts, by unit.
    The damage reads RPI-SSDC at the probe site, so the RPI pass stops there (later sites NaN),
    except for a block_head unit that rebuilding reads again with its SSDC (carried_readouts)."""
    carrying, readouts = [], {}
    for unit in units:
        assert at_site is not None, "carrying reads the baseline at the probe site"
        if unit.block is None or unit.block < ref.probe_site:
            cond = heads_off(model, unit.pairs(range(model.cfg.depth)))
            through = None if unit.block is not None and cfg.rebuild_ssdc else ref.probe_site
            r = readouts[unit] = measure(model, x, y, cfg, cond, [ref.probe_site], fixed=ref.fixed,
                                         rpi_through=through)  # fmt: skip
            meta = {"kind": unit.kind, "unit": unit.name, "block": unit.block, "head": unit.head}
            c = summarise(f"carry:{unit.name}", r, at_site, ref.floor, ref.probe_site, meta)
            carrying.append(replace(c, meta=c.meta | {"damage": carrying_damage(c)}))
        advance()
    return ranked(carrying), readouts


def ranked(carrying: list[ConditionResult]) -> list[ConditionResult]:
    """The same list with meta "rank": 1 = most damage within each unit kind (NaN damage last)."""
    order = sorted(
        range(len(carrying)),
        key=lambda i: (
            carrying[i].meta["kind"],
            -carrying[i].meta["damage"] if math.isfinite(carrying[i].meta["damage"]) else math.inf,
        ),
    )
    out = list(carrying)
    seen: dict[str, int] = {}
    for i in order:
        kind = carrying[i].meta["kind"]
        seen[kind] = seen.get(kind, 0) + 1
        out[i] = replace(carrying[i], meta=carrying[i].meta | {"rank": seen[kind]})
    return out


def score_cumulative(
    model: ViT,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: Config,
    ref: Reference,
    at_site: Readout | None,
    carrying: list[ConditionResult],
    draws: list[Draw],
    advance: Advance,
) -> list[ConditionResult]:
    """The top-k carriers masked together, and k random ones (seeded per kind, k and draw).
    Meta: kind, k, selection, draw, units, damage. One unit (k = 1) is its carrying condition,
    measured the same way: that result is reused, not measured again."""
    out = []
    for d in draws:
        assert at_site is not None, "the top-k read the baseline at the probe site"
        ranked_units = sorted(
            (c for c in carrying if c.meta["kind"] == d.kind), key=lambda c: c.meta["rank"]
        )
        if d.k < len(ranked_units):
            if d.draw is None:
                chosen, selection = ranked_units[: d.k], "top"
            else:
                seed = cfg.seed * 1000 + 101 * d.k + d.draw + (7 if d.kind == "head" else 0)
                picks = np.random.default_rng(seed).choice(len(ranked_units), d.k, replace=False)
                chosen, selection = [ranked_units[i] for i in sorted(picks)], "random"
            meta = {"kind": d.kind, "k": d.k, "selection": selection, "draw": d.draw}
            meta["units"] = [c.meta["unit"] for c in chosen]
            name = f"{selection}_{d.k}:{d.kind}" + ("" if d.draw is None else f"/{d.draw}")
            if d.k == 1:
                c = replace(chosen[0], name=name, meta=meta)
            else:
                pairs = [
                    p
                    for c in chosen
                    for p in Unit(c.meta["head"], c.meta["block"]).pairs(range(model.cfg.depth))
                ]
                r = measure(model, x, y, cfg, heads_off(model, pairs), [ref.probe_site],
                            fixed=ref.fixed, rpi_through=ref.probe_site)  # fmt: skip
                c = summarise(name, r, at_site, ref.floor, ref.probe_site, meta)
            out.append(replace(c, meta=c.meta | {"damage": carrying_damage(c)}))
        advance()
    return out


def measure_rebuilding(
    model: ViT,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: Config,
    masks: dict[str, torch.Tensor],
    advance: Advance,
    fixed: FixedProbes | None = None,
    known: dict[bytes, Readout] | None = None,
    first: int = 0,
) -> dict[str, Readout]:
    """One readout per mask, probed at the output when cfg.rebuild_probes. A mask measured
    before is not measured again: one in `known` (readouts measured the same way, by
    mask_key), or one met earlier in `masks` (with one later block, head h is that block's
    b<block>h<h>). Where a readout is one clean pass (no SSDC, no probes), the masks that agree
    on blocks 0..first-1 (the window, or none of it) share those blocks' pass (readout.prefix),
    which gives the same numbers: about half the forward passes with the window at mid-depth."""
    sites = [model.cfg.depth] if cfg.rebuild_probes else []
    rpi_pass = cfg.rebuild_ssdc or bool(sites)
    seen = dict(known or {})
    prefixes: dict[bytes, Prefix] = {}
    out = {}
    for key, mask in masks.items():
        k = mask_key(mask)
        if k not in seen:
            resume = None
            if first > 0 and not rpi_pass:
                head = mask.clone()
                head[first:] = False  # the mask on blocks 0..first-1 alone
                if mask_key(head) not in prefixes:
                    prefixes[mask_key(head)] = prefix(model, x, cfg, planes_off(head), first)
                resume = prefixes[mask_key(head)]
            seen[k] = measure(model, x, y, cfg, planes_off(mask), probe_sites=sites, fixed=fixed,
                              passes=Passes(rpi=rpi_pass), resume=resume)  # fmt: skip
        out[key] = seen[k]
        advance()
    return out


def mask_key(mask: torch.Tensor) -> bytes:
    """A [depth, H, P] plane mask as a dictionary key."""
    return mask.numpy().tobytes()


def carried_readouts(
    model: ViT, cfg: Config, probe_site: int, carried: dict[Unit, Readout]
) -> dict[bytes, Readout]:
    """The carrying readouts that are also rebuilding readouts, by mask_key: a block-head unit
    masked alone in the intact model ("unit:b<b>h<h>"), where rebuilding probes the same sites
    (none, or the output when the probe site is the output). Without probes they are dropped:
    margins and accuracy do not depend on them, nor does SSDC (up to float rounding where
    analysis.ssdc_images < probe_images batches the RPI pass differently)."""
    if not model.cfg.uses_rope or (cfg.rebuild_probes and probe_site != model.cfg.depth):
        return {}
    out = {}
    for unit, r in carried.items():
        if unit.block is not None:
            if not cfg.rebuild_probes:
                r = replace(
                    r, probes=None, probe_sites=(), probes_rpi=None, fixed=None, fixed_rpi=None,
                    fitted=None,
                )  # fmt: skip
            if not (cfg.rebuild_ssdc or cfg.rebuild_probes):  # as the rebuilding readouts
                r = replace(r, ssdc_rpi=np.full_like(r.ssdc_rpi, np.nan),
                            ssdc_rpi_norm=np.full_like(r.ssdc_rpi_norm, np.nan))  # fmt: skip
            out[mask_key(head_mask(model, unit.pairs(range(model.cfg.depth))))] = r
    return out


def _probe(r: Readout, site: int) -> np.ndarray | None:
    return r.probe_at(site) if r.probes is not None and site in r.probe_sites else None


def score_rebuilding(
    readouts: dict[str, Readout], plan: Plan, units: list[Unit], out_site: int
) -> tuple[list[WindowControl], list[Rebuild]]:
    """Per window, the later blocks' redundancy control; per window and unit, the margin drop
    after the window against the same unit in the intact model (`readouts` has "intact")."""
    if plan.last is None:
        return [], []
    m = {k: r.margin for k, r in readouts.items()}  # [images] correct-class margins
    acc = {k: r.correct.astype(float) for k, r in readouts.items()}
    c_int = m["intact"] - m["later"]
    controls, rebuilding = [], []
    for w in plan.windows:
        wr = readouts[f"window:{w}"]
        c_win = m[f"window:{w}"] - m[f"window:{w}+later"]
        ratio, rse = ratio_se(c_win, c_int)
        controls.append(
            WindowControl(
                window=w,
                withheld=list(range(plan.last + 1)),
                later=plan.later,
                accuracy=wr.accuracy,
                margin=float(wr.margin.mean()),
                d_accuracy=paired_diff(acc[f"window:{w}"], acc["intact"]),
                d_margin=paired_diff(m[f"window:{w}"], m["intact"]),
                ssdc_out=float(wr.ssdc_rpi[-1]),
                probe_out=_probe(wr, out_site),
                later_after_window=paired_diff(c_win, np.zeros_like(c_win)),
                later_intact=paired_diff(c_int, np.zeros_like(c_int)),
                compensation=paired_diff(c_win, c_int),
                ratio=ratio,
                ratio_se=rse,
            )
        )
        for u in units:
            key_w, key_u = f"window:{w}+{u.name}", f"unit:{u.name}"
            dw = m[f"window:{w}"] - m[key_w]
            di = m["intact"] - m[key_u]
            r, r_se = ratio_se(dw, di)
            rd, rd_se = ratio_diff_se(dw, di, c_win, c_int)
            rebuilding.append(
                Rebuild(
                    unit=u.name,
                    kind=u.kind,
                    block=u.block,
                    head=u.head,
                    window=w,
                    drop_window=paired_diff(m[f"window:{w}"], m[key_w]),
                    drop_intact=paired_diff(m["intact"], m[key_u]),
                    excess=paired_diff(dw, di),
                    ratio=r,
                    ratio_se=r_se,
                    ratio_minus_blocks=rd,
                    ratio_minus_blocks_se=rd_se,
                    d_accuracy_window=paired_diff(acc[key_w], acc[f"window:{w}"]),
                    d_accuracy_intact=paired_diff(acc[key_u], acc["intact"]),
                    ssdc_out=float(readouts[key_w].ssdc_rpi[-1]),
                    ssdc_out_intact=float(readouts[key_u].ssdc_rpi[-1]),
                    probe_out=_probe(readouts[key_w], out_site),
                    probe_out_intact=_probe(readouts[key_u], out_site),
                )
            )
    return controls, rebuilding


def readout_summary(r: Readout, probe_site: int) -> dict[str, Any]:
    """Accuracy, mean margin, RPI-SSDC per site and the probes at the probe site and output."""
    out: dict[str, Any] = {"accuracy": r.accuracy, "margin": float(r.margin.mean())}
    out["ssdc_rpi"] = r.ssdc_rpi
    for site in (probe_site, len(r.ssdc_rpi) - 1):
        if r.probes is not None and site in r.probe_sites:
            out[f"probe@{site}"] = r.probe_at(site)
    return out


@contextmanager
def progress_steps(total: int, enabled: bool) -> Iterator[Advance]:
    """`advance` of a progress bar over `total` steps (a no-op when disabled, and off rank 0)."""
    if not enabled or not distributed.is_main():
        yield lambda: None
        return
    with progress_bar("{task.completed}/{task.total}") as bar:
        task = bar.add_task("heads", total=total)
        yield lambda: bar.advance(task)


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    references: ReferenceCache | None = None,
) -> Heads:
    """Carrying, cumulative top-k, rebuilding (rotary models) and attention statistics of every
    head of `model`, against its intact baseline and floor."""
    cfg = resolved(cfg or Config(), model)
    x, y = eval_images(data, cfg)
    depth = model.cfg.depth
    plan = plan_rebuilding(model, cfg)
    carry_units = [u for kind in cfg.units for u in units_of(model, kind, range(depth))]
    notes = list(plan.notes)
    if not cfg.carrying:
        carry_units = []
        notes.append(CARRYING_OFF)
    draws = top_k_draws(cfg, carry_units)
    rebuild_units = [u for kind in cfg.units for u in units_of(model, kind, plan.later)]
    masks = rebuilding_masks(model, plan, rebuild_units)

    with progress_steps(2 + len(carry_units) + len(draws) + len(masks), progress) as advance:
        ref = reference(model, x, y, cfg, extra_sites=[depth], cache=references)
        at_site = None
        if carry_units:
            # Probes are fitted jointly over the sites of one readout, so accuracy at a site
            # moves slightly with the other sites fitted beside it: carrying compares like with
            # like (its RPI pass, as theirs, stops at the probe site).
            at_site = measure(model, x, y, cfg, probe_sites=[ref.probe_site], fixed=ref.fixed,
                              rpi_through=ref.probe_site)  # fmt: skip
        advance()
        attention = attention_stats(
            model, x, cfg.batch_size, cfg.min_explained, precision=cfg.precision
        )
        advance()
        carrying, carried = score_carrying(model, x, y, cfg, ref, at_site, carry_units, advance)
        cumulative = score_cumulative(model, x, y, cfg, ref, at_site, carrying, draws, advance)
        known = carried_readouts(model, cfg, ref.probe_site, carried)
        first = 0 if plan.last is None else plan.last + 1
        readouts = measure_rebuilding(model, x, y, cfg, masks, advance, ref.fixed, known, first)
        readouts |= {"intact": ref.base}

    windows, rebuilding = score_rebuilding(readouts, plan, rebuild_units, out_site=depth)
    per_image = readouts if plan.last is not None else {}  # what verdict() reads, not saved
    return Heads(
        posenc=model.cfg.posenc,
        sites=site_labels(model),
        probe_site=ref.probe_site,
        n_images=len(x),
        probe_images=cfg.probe_images,
        intervention=intervention_of(model),
        baseline=readout_summary(ref.base, ref.probe_site),
        floor=readout_summary(ref.floor, ref.probe_site),
        attention=attention,
        carrying=carrying,
        cumulative=cumulative,
        window_k=plan.last,
        windows=windows,
        rebuilding=rebuilding,
        notes=notes,
        margins={k: r.margin for k, r in per_image.items()},
        correct={k: r.correct.astype(float) for k, r in per_image.items()},
        seed=cfg.seed,
    )
