"""Windows: withhold rotations in some blocks and watch whether later blocks rebuild position.

Conditions (RoPE only): every plane off in blocks 0..k (prefix_k) and in k..end (suffix_k), a
middle window, row-only and column-only prefix windows, and as their control the same number of
random planes per head in the same blocks (several draws). Per condition: RPI-SSDC and probes at
every site, final retention, and for windows that end before the last block the onset of
recovery and the blocks needed to get half of it back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens.data import Task
from poslens.errors import ConfigError
from poslens.experiments.conditions import Condition, planes_off, random_mask
from poslens.experiments.config import ExperimentConfig, resolved
from poslens.experiments.keys import keyed
from poslens.experiments.output import (
    Experiment,
    Header,
    Headline,
    condition_numbers,
    counts_in,
)
from poslens.experiments.readout import (
    ConditionResult,
    Readout,
    ReferenceCache,
    eval_images,
    measure,
    reference,
    site_labels,
    summarise,
)
from poslens.interventions import axis_map
from poslens.metrics import PairedDiff, paired_diff
from poslens.metrics.probes import TARGETS
from poslens.models.vit import ViT
from poslens.progress import track

NAME = "windows"  # the experiment: its registry name and every headline Key's

CURVE_KINDS = ("prefix", "suffix", "middle")  # windows with probe curves
ONSET_FRACTION = (
    0.1  # recovery "starts" when RPI-SSDC rises this share of the peak span above the floor
)


@dataclass(frozen=True)
class Config(ExperimentConfig):
    prefix_ks: tuple[int, ...] = ()  # last withheld block of the prefix windows; () = every block
    axis_windows: bool = True  # also row-only / column-only prefix windows and their random control
    # probes at every site for the all-plane windows (else only at the probe site); the axis and
    # random-plane windows are always probed at the probe site only
    probe_curves: bool = True
    # every suffix window k..end and the middle window (the later blocks' own curve); False: only
    # the suffix k+1..end of each prefix window k, which its compensation reads (the quick preset)
    every_suffix: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(not isinstance(k, int) or k < 0 for k in self.prefix_ks):
            raise ConfigError(f"analysis.prefix_ks must be block indices, got {self.prefix_ks!r}")


def applies(model: ViT) -> str | None:
    return (
        None if model.cfg.uses_rope else f"posenc={model.cfg.posenc} has no rotations to withhold"
    )


@dataclass(frozen=True)
class Window:
    """One withheld window: which blocks and planes, its readout, and how position came back."""

    kind: str  # prefix | suffix | middle | row_prefix | col_prefix | random_prefix
    blocks: list[int]
    result: ConditionResult
    probes: np.ndarray | None  # [sites, 3] test accuracy when probe curves are on
    onset: int | None  # first site after the window where RPI-SSDC rises above the floor
    blocks_to_half: int | None  # sites after the window until half the intact structure is back


def recovery(
    ssdc: np.ndarray, base: np.ndarray, floor: np.ndarray, last: int
) -> tuple[int | None, int | None]:
    """(onset site, blocks to half recovery) after a window whose last withheld block is `last`.

    Works on per-site RPI-SSDC: gain = condition - floor, span = intact - floor. Onset: the first
    site after the window with gain >= ONSET_FRACTION * max(span). Half recovery: the first such
    site with gain >= span / 2 where the span is itself at least that onset threshold; reported as
    the number of sites after the window's first free site.
    """
    gain, span = ssdc - floor, base - floor
    thresh = ONSET_FRACTION * max(float(span.max()), 1e-9)
    after = range(last + 1, len(ssdc))
    onset = next((s for s in after if gain[s] >= thresh), None)
    half = next((s for s in after if span[s] >= thresh and gain[s] >= span[s] / 2), None)
    return onset, None if half is None else half - (last + 1)


# ------------------------------------------------------------------------------ headline keys
# The names every reader of this experiment's headline uses (rules, figures): `key(condition,
# number)`, with the windows named by the functions below, as conditions() names them. REBUILD:
# the compensation of the window the rebuilding claim reads (rebuild_window), emitted directly.

INTACT, FLOOR, REBUILD = "intact", "floor", "rebuild"


def prefix_window(k: int) -> str:
    """Rotations withheld in blocks 0..k."""
    return f"prefix_{k}"


def suffix_window(k: int) -> str:
    """Rotations withheld in blocks k..end."""
    return f"suffix_{k}"


def compensation_of(k: int) -> str:
    """The redundancy control of prefix window k (what the later blocks add after it)."""
    return f"compensation_{k}"


key = keyed(NAME)  # key(window or INTACT / FLOOR / REBUILD, number) -> Key


def prefix_ks(keys: Iterable[str]) -> list[int]:
    """The k of every prefix window a headline holds, in order."""
    return counts_in(keys, prefix_window)


def rebuild_window(ks: Iterable[int], depth: int) -> int | None:
    """The window the rebuilding claim reads: the largest prefix window with a compensation that
    ends in the first half of the blocks (k <= depth // 2 - 1), else the smallest; None without
    one (or without later blocks)."""
    ks = sorted(ks)
    if not ks or depth < 2:
        return None
    fit = [k for k in ks if k <= depth // 2 - 1]
    return max(fit) if fit else ks[0]


def conditions(model: ViT, cfg: Config) -> list[tuple[str, str, list[int], Condition, int]]:
    """(name, kind, blocks, condition, draw) for every window of this model."""
    depth = model.cfg.depth
    ks = sorted(set(cfg.prefix_ks)) if cfg.prefix_ks else list(range(depth))
    if ks and ks[-1] >= depth:
        raise ConfigError(
            f"analysis.prefix_ks has block {ks[-1]}; this model has blocks 0..{depth - 1}"
        )
    out: list[tuple[str, str, list[int], Condition, int]] = []
    for k in ks:
        out.append(
            (
                prefix_window(k),
                "prefix",
                list(range(k + 1)),
                planes_off(_all(model), range(k + 1)),
                0,
            )
        )
    suffixes = range(1, depth) if cfg.every_suffix else sorted({k + 1 for k in ks} - {depth})
    for k in suffixes:
        out.append(
            (
                suffix_window(k),
                "suffix",
                list(range(k, depth)),
                planes_off(_all(model), range(k, depth)),
                0,
            )
        )
    mid = list(range(depth // 3, max(depth // 3 + 1, 2 * depth // 3)))
    if cfg.every_suffix:
        out.append((f"middle_{mid[0]}-{mid[-1]}", "middle", mid, planes_off(_all(model), mid), 0))
    if cfg.axis_windows:
        amap = axis_map(model)
        for axis in ("row", "col"):
            mask = torch.as_tensor(amap.axis == axis)
            if not mask.any():
                continue
            for k in ks:
                blocks = list(range(k + 1))
                out.append(
                    (f"{axis}_prefix_{k}", f"{axis}_prefix", blocks, planes_off(mask, blocks), 0)
                )
        n = int(torch.as_tensor(amap.axis == "row").sum(-1).max())  # planes per head of one axis
        if n:
            for k in ks:
                blocks = list(range(k + 1))
                for d in range(cfg.draws):
                    mask = random_mask(model, n, seed=cfg.seed * 1000 + 31 * k + d + 7)
                    out.append(
                        (
                            f"random_prefix_{k}/{d}",
                            "random_prefix",
                            blocks,
                            planes_off(mask, blocks),
                            d,
                        )
                    )
    return out


def _all(model: ViT) -> torch.Tensor:
    cfg = model.cfg
    return torch.ones(cfg.depth, cfg.heads, cfg.head_dim // 2, dtype=torch.bool)


@dataclass(frozen=True)
class Compensation:
    """Do the blocks after a prefix window add more when rotations were withheld before them than
    they add in the intact model? In correct-class margin, paired over the same images:
    (prefix_k - floor) - (intact - suffix_{k+1}). Zero when early and late rotations add up
    independently; positive when the later blocks compensate (NOTES.md, "redundancy vs
    compensation"). relative: the compensation as a share of intact - floor."""

    k: int  # last withheld block
    added_after_window: float  # mean margin: prefix_k - floor (later blocks rotate, early not)
    added_anyway: float  # mean margin: intact - suffix_{k+1} (later blocks' own contribution)
    compensation: PairedDiff
    span: float  # mean margin: intact - floor
    relative: float


def compensation(k: int, m: dict[str, np.ndarray]) -> Compensation:
    """The compensation test of the prefix window ending at block k, from per-image margins."""
    after = m[prefix_window(k)] - m[FLOOR]
    anyway = m[INTACT] - m[suffix_window(k + 1)]
    d = paired_diff(after - anyway, np.zeros_like(after))
    span = float((m[INTACT] - m[FLOOR]).mean())
    rel = d.mean / span if abs(span) > 1e-12 else float("nan")
    return Compensation(k, float(after.mean()), float(anyway.mean()), d, span, rel)


@dataclass(frozen=True)
class Windows(Header):
    name: ClassVar[str] = NAME
    baseline: dict[str, Any]  # accuracy, margin, ssdc_rpi [sites], probes [sites, 3]
    floor: dict[str, Any]
    windows: list[Window]
    compensation: list[Compensation]  # every prefix window whose suffix control was run

    def derived(self) -> dict[str, Any]:
        return {"onset_fraction": ONSET_FRACTION}

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        rows = []
        for w in self.windows:
            row = {"kind": w.kind, "blocks": f"{w.blocks[0]}-{w.blocks[-1]}"}
            row |= w.result.row(self.sites, self.probe_site)
            row |= {"onset_site": w.onset, "blocks_to_half": w.blocks_to_half}
            if w.probes is not None:
                row |= {f"probe_{t}@out": float(w.probes[-1, j]) for j, t in enumerate(TARGETS)}
            rows.append(row)
        return {"windows": rows}

    def by_kind(self, kind: str) -> list[Window]:
        return [w for w in self.windows if w.kind == kind]


def _curves(r: Readout) -> dict[str, Any]:
    out: dict[str, Any] = {
        "accuracy": r.accuracy,
        "margin": float(r.margin.mean()),
        "ssdc_rpi": r.ssdc_rpi,
    }
    if r.probes is not None:
        out["probes"] = r.probes.test_acc
        out["probe_sites"] = list(r.probe_sites)
    return out


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    references: ReferenceCache | None = None,
) -> Windows:
    """Every window of this RoPE model, against its baseline and floor."""
    cfg = resolved(cfg or Config(), model)
    x, y = eval_images(data, cfg)
    conds = conditions(model, cfg)
    all_sites = list(range(model.cfg.depth + 1))
    ref = None
    windows: list[Window] = []
    margins: dict[str, np.ndarray] = {}  # per-image margins, for the compensation test
    for item in track([None, *conds], "windows", progress):
        if item is None:
            ref = reference(model, x, y, cfg, cache=references)
            margins |= {INTACT: ref.base.margin, FLOOR: ref.floor.margin}
            continue
        assert ref is not None
        name, kind, blocks, cond, draw = item
        curves = cfg.probe_curves and kind in CURVE_KINDS
        sites = all_sites if curves else [ref.probe_site]
        r = measure(model, x, y, cfg, cond, probe_sites=sites, fixed=ref.fixed)
        margins[name] = r.margin
        meta = {"kind": kind, "first": blocks[0], "last": blocks[-1], "draw": draw}
        res = summarise(name, r, ref.base, ref.floor, ref.probe_site, meta)
        onset, half = recovery(r.ssdc_rpi, ref.base.ssdc_rpi, ref.floor.ssdc_rpi, blocks[-1])
        ends_early = blocks[-1] < model.cfg.depth - 1
        probes = r.probes.test_acc if curves and r.probes is not None else None
        windows.append(
            Window(
                kind,
                blocks,
                res,
                probes,
                onset if ends_early else None,
                half if ends_early else None,
            )
        )
    assert ref is not None
    ks = sorted(w.blocks[-1] for w in windows if w.kind == "prefix")
    comp = [compensation(k, margins) for k in ks if suffix_window(k + 1) in margins]
    return Windows(
        posenc=model.cfg.posenc,
        sites=site_labels(model),
        probe_site=ref.probe_site,
        baseline=_curves(ref.base),
        floor=_curves(ref.floor),
        windows=windows,
        compensation=comp,
        n_images=len(x),
        probe_images=cfg.probe_images,
    )


def plot(res: Windows) -> Figure:
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    x = np.arange(len(res.sites))
    prefix = res.by_kind("prefix")
    colours = [(0.1 + 0.8 * i / max(len(prefix) - 1, 1), 0.3, 0.8) for i in range(len(prefix))]
    for ax, key in ((ax1, "ssdc"), (ax2, "probe")):
        probes = res.baseline.get("probes")
        if key == "ssdc":
            ax.plot(x, res.baseline["ssdc_rpi"], "k-o", label="intact")
        elif probes is not None and len(probes) == len(x):
            ax.plot(x, 100 * probes[:, 1:].mean(1), "k-o", label="intact")
        floor = res.floor["ssdc_rpi"] if key == "ssdc" else None
        if floor is not None:
            ax.plot(x, floor, "k:", label="floor")
        for w, c in zip(prefix, colours, strict=True):
            y = (
                w.result.ssdc_rpi
                if key == "ssdc"
                else (None if w.probes is None else 100 * w.probes[:, 1:].mean(1))
            )
            if y is not None:
                ax.plot(x, y, "-", marker=".", color=c, label=f"blocks 0-{w.blocks[-1]} off")
        ax.set_xticks(x, res.sites)
        ax.grid(alpha=0.3)
    ax1.set(title="RPI-SSDC after prefix windows", xlabel="site", ylim=(-0.3, 1))
    ax2.set(title="row/col probe mean (%)", xlabel="site", ylim=(0, 100))
    ax1.legend(fontsize=6)
    for kind, style in (
        ("prefix", "o-"),
        ("row_prefix", "s-"),
        ("col_prefix", "^-"),
        ("random_prefix", "x--"),
    ):
        ws = res.by_kind(kind)
        if not ws:
            continue
        ks = sorted({w.blocks[-1] for w in ws})
        acc = [100 * np.mean([w.result.accuracy for w in ws if w.blocks[-1] == k]) for k in ks]
        ax3.plot(
            ks, acc, style, label=kind + (" (mean of draws)" if kind == "random_prefix" else "")
        )
    ax3.axhline(100 * res.baseline["accuracy"], color="black", lw=1, label="intact")
    ax3.axhline(100 * res.floor["accuracy"], color="black", ls=":", lw=1, label="floor")
    ax3.set(title="accuracy after withholding blocks 0..k", xlabel="k (last withheld block)")
    ax3.set(ylabel="accuracy (%)", ylim=(0, 101))
    ax3.grid(alpha=0.3)
    ax3.legend(fontsize=6)
    return fig


def headline(d: dict[str, Any]) -> Headline:
    """Intact and floor; per named window its condition numbers, the retention of RPI-SSDC right
    after a prefix window and the onset of recovery; the mean accuracy of each random window."""
    out: Headline = {}
    for name, r in ((INTACT, d["baseline"]), (FLOOR, d["floor"])):
        out[key(name, "accuracy")] = r["accuracy"]
        out[key(name, "margin")] = r["margin"]
        out[key(name, "ssdc_rpi_out")] = r["ssdc_rpi"][-1]
    random: dict[str, list[float]] = {}
    for w in d["windows"]:
        name = w["result"]["name"]
        if "/" in name:
            random.setdefault(name.split("/")[0], []).append(w["result"]["accuracy"])
            continue
        out |= condition_numbers(name, w["result"])
        last = w["blocks"][-1]
        if w["kind"].endswith("prefix") and last + 1 < len(d["sites"]):
            # retention right after the window (the floor there is exact by construction)
            ssdc, base, floor = (
                w["result"]["ssdc_rpi"][last + 1],
                d["baseline"]["ssdc_rpi"][last + 1],
                d["floor"]["ssdc_rpi"][last + 1],
            )
            measured = None not in (ssdc, base, floor)  # the floor's RPI-SSDC: rpi_probes
            span = base - floor if measured else 0.0
            out[f"{name}.retention_ssdc_after_window"] = (
                (ssdc - floor) / span if abs(span) > 1e-12 else None
            )
        out[f"{name}.onset"] = None if w["onset"] is None else float(w["onset"])
    for name, accs in random.items():
        out[f"{name}.accuracy"] = float(np.mean(accs))
    comp = {c["k"]: c for c in d.get("compensation", [])}
    for k, c in comp.items():
        out |= _compensation_numbers(compensation_of(k), c)
    k = rebuild_window(comp, len(d["sites"]) - 1)
    if k is not None:
        out[key(REBUILD, "window")] = float(k)
        out |= _compensation_numbers(REBUILD, comp[k])
    return out


def _compensation_numbers(name: str, c: dict[str, Any]) -> Headline:
    return {
        key(name, "margin"): c["compensation"]["mean"],
        key(name, "se"): c["compensation"]["se"],
        key(name, "relative"): c["relative"],
        key(name, "added_after_window"): c["added_after_window"],
        key(name, "added_anyway"): c["added_anyway"],
    }


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    applies,
    headline,
    plot,
    cost=12,
    shares_reference=True,
    reads_baseline=True,
)
