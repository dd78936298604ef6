"""Prefix attention blocked: does the CLS token (or a register) mediate position?

In every block, patch queries are kept from reading prefix keys (CLS, registers): their attention
scores to those keys are set to -inf before the softmax. The prefix tokens' own queries still
attend everywhere, so CLS pooling keeps working; only the route prefix -> patches is cut. If
patches fetched position (or anything position-dependent) through the prefix, the probes and
RPI-SSDC fall under blocking. Blocking on top of the floor is the control: on a model with no
position left, any change blocking makes is not about position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens import distributed
from poslens.data import Task
from poslens.distributed import shard
from poslens.errors import UserError
from poslens.experiments.conditions import Condition, combine, floor_condition
from poslens.experiments.config import ExperimentConfig, resolved
from poslens.experiments.output import Experiment, Header, Headline, probe_rows, top_level_numbers
from poslens.experiments.readout import (
    ConditionResult,
    Readout,
    ReferenceCache,
    compare,
    eval_images,
    measure,
    reference,
    site_labels,
    summarise,
)
from poslens.interventions._checks import check_blocks
from poslens.metrics import PairedDiff
from poslens.metrics.probes import TARGETS, ProbeResult
from poslens.models import hooks
from poslens.models.vit import ViT
from poslens.precision import autocast
from poslens.progress import track

Config = ExperimentConfig


def applies(model: ViT) -> str | None:
    """None when the model has prefix tokens to block, else why not."""
    if model.cfg.num_prefix == 0:
        return "model has no prefix tokens (no CLS token, no registers)"
    return None


@contextlib.contextmanager
def block_prefix_attention(model: ViT, blocks: Iterable[int] | None = None) -> Iterator[None]:
    """Patch queries cannot attend to prefix keys in `blocks` (default all); prefix queries are
    untouched. Hooks `blocks.{b}.attn.hook_attn_scores` and always removes the hooks."""
    p = model.cfg.num_prefix
    if p == 0:
        raise UserError("model has no prefix tokens (no CLS token, no registers): nothing to block")

    def hook(scores: torch.Tensor, _name: str) -> torch.Tensor:
        out = scores.clone()  # [B, H, T, T]: queries x keys
        out[:, :, p:, :p] = -torch.inf
        return out

    names = [hooks.attn(b, "attn_scores") for b in check_blocks(model, blocks)]
    with model.hooks([(n, hook) for n in names]):
        yield


def blocked(model: ViT) -> contextlib.AbstractContextManager[None]:
    """Condition: patch-to-prefix attention blocked in every block."""
    return block_prefix_attention(model)


@torch.no_grad()
def prefix_mass(
    model: ViT, images: torch.Tensor, batch_size: int, precision: str = "fp32"
) -> np.ndarray:
    """[depth, H]: attention that patch queries give to prefix keys (summed over prefix keys,
    averaged over patch queries and images), in the intact model; sharded under torchrun."""
    p, depth = model.cfg.num_prefix, model.cfg.depth
    names = [hooks.attn(b, "pattern") for b in range(depth)]
    total = torch.zeros(depth, model.cfg.heads, dtype=torch.float64)
    dev = model.head.weight.device
    with autocast(model, precision):
        for start in shard(len(images), batch_size):
            _, cache = model.run_with_cache(images[start : start + batch_size].to(dev), names)
            for b, n in enumerate(names):
                mass = cache[n][:, :, p:, :p].float().sum(-1)  # [B, H, patches]
                total[b] += mass.double().mean(-1).sum(0).cpu()
    distributed.all_reduce_sum(total)
    return (total / len(images)).numpy()


@dataclass(frozen=True)
class PrefixAttention(Header):
    """Blocked vs intact, and blocked-on-floor vs floor (the control)."""

    name: ClassVar[str] = "prefix_attention"
    pool: str
    num_prefix: int
    baseline: dict[str, Any]
    floor: ConditionResult
    blocked: ConditionResult
    floor_blocked: ConditionResult  # against the intact model, like the others
    floor_blocked_vs_floor: dict[str, PairedDiff]  # the control: what blocking does at the floor
    probes: dict[str, ProbeResult]  # every site: "intact", "blocked", "floor_blocked"
    attention_to_prefix: np.ndarray  # [depth, H], intact model, patch queries

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | {"probes": {"sites": self.sites, **self.probes}}

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        rows = [c.row(self.sites, self.probe_site) for c in self.conditions()]
        control = self.floor_blocked_vs_floor
        rows[-1] |= {
            "d_accuracy_vs_floor": control["accuracy"].mean,
            "d_accuracy_vs_floor_se": control["accuracy"].se,
            "d_margin_vs_floor": control["margin"].mean,
            "d_margin_vs_floor_se": control["margin"].se,
        }
        probes = [
            row
            for name, p in self.probes.items()
            for row in probe_rows(self.sites, p, condition=name)
        ]
        attention = [
            {"block": b, "head": h, "attention_to_prefix": float(self.attention_to_prefix[b, h])}
            for b in range(self.attention_to_prefix.shape[0])
            for h in range(self.attention_to_prefix.shape[1])
        ]
        return {"conditions": rows, "probes": probes, "attention": attention}

    def conditions(self) -> list[ConditionResult]:
        """Floor, blocked, floor + blocked (table order)."""
        return [self.floor, self.blocked, self.floor_blocked]


def run(
    model: ViT,
    data: Task,
    cfg: ExperimentConfig | None = None,
    progress: bool = False,
    references: ReferenceCache | None = None,
) -> PrefixAttention:
    """Patch-to-prefix attention blocked in every block, against the intact model and the floor."""
    reason = applies(model)
    if reason is not None:
        raise UserError(f"prefix_attention does not apply: {reason}")
    cfg = resolved(cfg or Config(), model)
    x, y = eval_images(data, cfg)
    sites = list(range(model.cfg.depth + 1))
    conds: dict[str, Condition] = {
        "blocked": blocked,
        "floor_blocked": combine(floor_condition(model), blocked),
    }
    readouts: dict[str, Readout] = {}
    mass = np.zeros(0)
    ref = None
    for step in track(["reference", "attention", *conds], "prefix_attention", progress):
        if step == "reference":
            ref = reference(model, x, y, cfg, cache=references)
        elif step == "attention":
            mass = prefix_mass(model, x, cfg.batch_size, cfg.precision)
        else:
            readouts[step] = measure(model, x, y, cfg, conds[step], probe_sites=sites)
    assert ref is not None and ref.base.probes is not None
    site = ref.probe_site
    base = ref.base.summary()
    base["probe"] = ref.base.probe_at(site)
    results = {
        name: summarise(name, r, ref.base, ref.floor, site, {"kind": name})
        for name, r in readouts.items()
    }
    intact_probes = ref.base.probes
    if ref.base.probe_sites != tuple(sites):  # cfg.probe_block fixed: reference probed one site
        intact_probes = measure(model, x, y, cfg, probe_sites=sites).probes
        assert intact_probes is not None
    probes = {"intact": intact_probes}
    for name, r in readouts.items():
        assert r.probes is not None
        probes[name] = r.probes
    return PrefixAttention(
        posenc=model.cfg.posenc,
        pool=model.cfg.pool,
        num_prefix=model.cfg.num_prefix,
        sites=site_labels(model),
        probe_site=site,
        baseline=base,
        floor=summarise("floor", ref.floor, ref.base, ref.floor, site, {"kind": "floor"}),
        blocked=results["blocked"],
        floor_blocked=results["floor_blocked"],
        floor_blocked_vs_floor=compare(readouts["floor_blocked"], ref.floor),
        probes=probes,
        attention_to_prefix=mass,
        n_images=len(x),
        probe_images=cfg.probe_images,
    )


def plot(res: PrefixAttention) -> Figure:
    fig = Figure(figsize=(16, 3.8), layout="constrained")
    axes = fig.subplots(1, 4)
    x = np.arange(len(res.sites))
    acc = {"intact": res.baseline["accuracy"]} | {c.name: c.accuracy for c in res.conditions()}
    styles = {"intact": "-o", "blocked": "--s", "floor_blocked": ":^"}
    for j, (ax, t) in enumerate(zip(axes[:3], TARGETS, strict=True)):
        for name, p in res.probes.items():
            label = f"{name} (top-1 {100 * acc[name]:.1f}%)"
            ax.plot(x, 100 * p.test_acc[:, j], styles.get(name, "-"), label=label)
        if res.floor.probe is not None:
            ax.plot([res.probe_site], [100 * res.floor.probe[j]], "kx", label="floor")
        ax.axhline(100 * res.probes["intact"].chance[j], color="grey", ls="--", lw=0.8)
        ax.set(title=f"{t} probe ({res.posenc})", xlabel="site", ylabel="test accuracy (%)")
        ax.set(ylim=(0, 101))
    axes[0].legend(fontsize=7)
    ssdc = axes[3]
    ssdc.plot(x, res.baseline["ssdc_rpi"], "k-o", label="intact")
    for c in res.conditions():
        ssdc.plot(x, c.ssdc_rpi, styles.get(c.name, "-.x"), label=c.name)
    ssdc.axhline(0, color="black", lw=0.5)
    ssdc.set(title="RPI-SSDC", xlabel="site", ylim=(-0.5, 1))
    ssdc.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(x, res.sites)
        ax.grid(alpha=0.3)
    return fig


def headline(d: dict[str, Any]) -> Headline:
    """The top-level numbers (no claim reads this experiment)."""
    return top_level_numbers(d)


EXPERIMENT = Experiment(
    "prefix_attention",
    Config,
    run,
    applies,
    headline,
    plot,
    shares_reference=True,
    reads_baseline=True,
)
