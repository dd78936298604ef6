"""Train the seeds of one configuration as one ensemble: S models that share every kernel call.

Member s is the model that `train(cfgs[s], outs[s])` gives: the same initialisation (its own
train.seed), the same batches (they depend on data.seed and the step only), AdamW with its own
moments, warmup + cosine, its own gradient-norm clipping, the same periodic evaluations. Only the
float rounding of grouped kernels differs. Each member checkpoints into its own folder, in the
files and format of `train()`, so `poslens.load` and `train(..., resume=True)` read them.

A killed ensemble resumes from its members' checkpoints. If the kill fell between two members'
writes, the members that are behind first train alone up to the others, then all go on together.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from poslens import distributed
from poslens.checkpoint import (
    has_resume_state,
    is_finished,
    read_metrics,
    read_resume_state,
    write_checkpoint,
)
from poslens.data import Task, build_task
from poslens.errors import CheckpointError, ConfigError
from poslens.models.ensemble import StackedViT
from poslens.models.vit import build_model
from poslens.precision import autocast, resolve_precision
from poslens.training.config import RunConfig
from poslens.training.progress import TrainProgress
from poslens.training.train import (
    axis_planes,
    check_finite,
    final_scores,
    finish_run,
    history_entry,
    lr_at,
    make_optimizer,
    model_config_for,
    permuted_patches,
    run_metrics,
    score,
    stop_step,
    withheld_blocks,
    withheld_planes,
)


@dataclasses.dataclass
class _Member:
    """One seed's run: where it checkpoints, and what it has done so far."""

    cfg: RunConfig
    out: Path
    resumed_from: int = 0
    trained_images: int = 0
    seconds: float = 0.0


def train_ensemble(
    cfgs: Sequence[RunConfig],
    outs: Sequence[str | Path],
    resume: bool = False,
    progress: bool = False,
    device: str = "cpu",
    compile: bool = False,
) -> list[dict[str, Any]]:
    """Train one model per config as one ensemble; configs may differ in train.seed alone.

    Checkpoints go to outs[s] as `train()` writes them; returns (and writes) each member's
    metrics, which also record `"ensemble": S`. `compile`: torch.compile the training step's
    forward and backward (needs a C++ compiler; inductor's fused kernels change the float
    rounding). The first compile of a configuration takes tens of seconds, later ones reuse
    inductor's cache; it paid back within a few hundred steps (benchmarks/train_throughput.py).
    """
    if len(cfgs) != len(outs) or not cfgs:
        raise ConfigError(f"an ensemble needs one output folder per config, got {len(cfgs)} "
                          f"configs and {len(outs)} folders")  # fmt: skip
    paths = [Path(o) for o in outs]
    if len({p.resolve() for p in paths}) != len(paths):
        raise ConfigError("the members of an ensemble need distinct output folders")
    first = _without_seed(cfgs[0])
    for cfg in cfgs[1:]:
        if _without_seed(cfg) != first:
            raise ConfigError("the configs of an ensemble may differ in train.seed only")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("ensemble training runs in one process; under torchrun use `train`")
    from poslens.limits import check_device, check_output_dir, check_training

    dev = distributed.device_for(device)
    check_device(str(dev))
    for p in paths:
        check_output_dir(p)
    check_training(cfgs[0], device)
    if cfgs[0].train.threads:
        torch.set_num_threads(cfgs[0].train.threads)
    task = build_task(cfgs[0].data)
    everyone = [_Member(model_config_for(c, task), p) for c, p in zip(cfgs, paths, strict=True)]

    # a member that already finished (it stopped early, before a kill) keeps its files
    def finished() -> dict[int, dict[str, Any]]:
        return {i: read_metrics(m.out) for i, m in enumerate(everyone)
                if resume and is_finished(m.out)}  # fmt: skip

    done = finished()
    members = [m for i, m in enumerate(everyone) if i not in done]
    steps = [_step_of(m, resume) for m in members]
    for m, s in zip(members, steps, strict=True):
        m.resumed_from = s
    # members behind (a kill between two members' checkpoints) catch up with the others first
    while len(set(steps)) > 1:
        lo, hi = sorted(set(steps))[:2]
        behind = [m for m, s in zip(members, steps, strict=True) if s == lo]
        _run(behind, task, dev, lo, hi, progress, compile)
        done = finished()  # one may have stopped early while catching up
        members = [m for i, m in enumerate(everyone) if i not in done]
        steps = [_step_of(m, True) for m in members]
    if members:
        trained = iter(
            _run(members, task, dev, steps[0], members[0].cfg.train.steps, progress, compile)
        )
    return [done[i] if i in done else next(trained) for i in range(len(everyone))]


def _without_seed(cfg: RunConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    d["train"].pop("seed")
    return d


def _step_of(m: _Member, resume: bool) -> int:
    """The step that member m's folder holds a resume state for (0: none)."""
    if not has_resume_state(m.out, m.cfg, resume):
        return 0
    return read_resume_state(m.out, m.cfg.model)[0]


def _run(
    members: list[_Member],
    task: Task,
    dev: torch.device,
    start: int,
    stop: int,
    progress: bool,
    compile: bool,
) -> list[dict[str, Any]]:
    """Train `members`, all at step `start`, as one stacked model up to `stop`, checkpointing as
    `train()` does; after the last step, evaluate them and write their metrics (returned). A
    member that stops early (train.stop_acc) is finished at once and leaves the stack, so the
    others train on without computing it."""
    cfg = members[0].cfg
    total, bs = cfg.train.steps, cfg.train.batch_size
    precision = resolve_precision(cfg.train.precision, dev)
    vits = [build_model(m.cfg.model, seed=m.cfg.train.seed) for m in members]
    # the row and column planes [depth, H, P] (fixed axial frequencies: the same in every member)
    planes = axis_planes(vits[0]) if cfg.train.rotary_axes != "all" else None
    model = StackedViT(vits).to(dev)
    del vits  # their weights now live in the stack
    opt = make_optimizer(model.named_stacked(), cfg, member_dims=1)
    histories: list[list] = [[] for _ in members]
    if start:
        histories = _load(members, model, opt, start)
    if compile:
        model.compile()  # the training steps' calls; evaluation calls model.forward, eager
    val_x, val_y = task.split("val")
    val_x, val_y = val_x[: cfg.train.eval_images], val_y[: cfg.train.eval_images]
    model.train()
    t0 = time.perf_counter()
    label = f"{cfg.model.posenc} x{len(members)}"
    everyone = list(members)
    finished: dict[int, dict[str, Any]] = {}  # id(member) -> metrics, once it stopped early
    with TrainProgress(total, start, enabled=progress, label=label) as bar:
        for step in range(start, stop):
            x, y = task.train_batch(step, bs)
            x = permuted_patches(cfg, step, x)
            lr = lr_at(step, total, cfg.train.lr, cfg.train.warmup_frac)
            withheld, off = withheld_blocks(cfg, step), withheld_planes(cfg, step, planes)
            losses = train_step(
                model, opt, x.to(dev), y.to(dev), lr, precision, cfg.train.grad_clip, withheld, off
            )
            done = step + 1
            loss_values = losses.tolist()
            for m, loss in zip(members, loss_values, strict=True):
                check_finite(loss, done, m.cfg, 1, f" (seed {m.cfg.train.seed})")
                m.trained_images += bs
            rate = len(members) * bs * (done - start) / (time.perf_counter() - t0)
            bar.update(done, loss=sum(loss_values) / len(members), images_per_s=rate)
            if done % cfg.train.eval_every == 0 or done == total:
                evals = _score(model, val_x, val_y, precision)
                for h, ev, loss in zip(histories, evals, loss_values, strict=True):
                    h.append(history_entry(done, ev, loss))
                bar.log_eval(done, sum(ev["acc"] for ev in evals) / len(evals))
                stopping = [
                    s for s, h in enumerate(histories)
                    if stop_step(h, cfg.train) is not None
                ]  # fmt: skip
                if stopping:  # early stopping: these members are done, as train() would be
                    elapsed = time.perf_counter() - t0
                    stopped = {"ensemble": len(members), "stopped_at": done}
                    for s, metrics in _finish(members, stopping, model, opt, task, histories,
                                              done, precision, elapsed, stopped).items():  # fmt: skip
                        finished[id(members[s])] = metrics
                    keep = [s for s in range(len(members)) if s not in stopping]
                    if not keep:
                        break
                    model, opt = _restack(model, opt, keep, [members[s] for s in keep], dev)
                    members = [members[s] for s in keep]
                    histories = [histories[s] for s in keep]
            if done != total and (done % cfg.train.ckpt_every == 0 or done == stop):
                _save(members, model, opt, done, histories)
    if len(finished) == len(everyone):
        return [finished[id(m)] for m in everyone]
    for m in members:
        m.seconds += time.perf_counter() - t0
    if stop != total:
        return []

    extra = {"ensemble": len(everyone)} | ({"stopped_at": None} if cfg.train.stop_acc else {})
    for s, metrics in _finish(members, list(range(len(members))), model, opt, task, histories,
                              total, precision, 0.0, extra).items():  # fmt: skip
        finished[id(members[s])] = metrics
    return [finished[id(m)] for m in everyone]


def _restack(
    model: StackedViT, opt: torch.optim.Optimizer, keep: list[int], members: list[_Member],
    dev: torch.device,
) -> tuple[StackedViT, torch.optim.Optimizer]:  # fmt: skip
    """The members in slots `keep` as a smaller stacked model and optimiser, with their weights
    and AdamW moments (the step count is shared), so that finished members cost nothing more.
    `members` are the kept ones, in slot order."""
    new = _members(model, keep, {s: m for s, m in zip(keep, members, strict=True)}, dev)
    new_opt = make_optimizer(new.named_stacked(), members[0].cfg, member_dims=1)
    idx = torch.as_tensor(keep, device=dev)
    for (_, old), (_, p) in zip(model.named_stacked(), new.named_stacked(), strict=True):
        if old in opt.state:
            new_opt.state[p] = {
                k: v.clone() if v.ndim == 0 else v.index_select(0, idx).clone()
                for k, v in opt.state[old].items()
            }
    return new, new_opt


def _members(
    model: StackedViT, slots: list[int], members: Mapping[int, _Member] | list[_Member],
    dev: torch.device,
) -> StackedViT:  # fmt: skip
    """The members in `slots` (`members[slot]`) as a stacked model of their own: weights copied,
    no optimiser."""
    sub = StackedViT([build_model(members[s].cfg.model, seed=members[s].cfg.train.seed)
                      for s in slots]).to(dev)  # fmt: skip
    sub.train(model.training)
    idx = torch.as_tensor(slots, device=dev)
    with torch.no_grad():
        for (name, old), (new_name, p) in zip(model.named_stacked(), sub.named_stacked(),
                                              strict=True):  # fmt: skip
            assert name == new_name
            p.copy_(old.index_select(0, idx))
    return sub


def _finish(
    members: list[_Member],
    slots: list[int],
    model: StackedViT,
    opt: torch.optim.Optimizer,
    task: Task,
    histories: list[list],
    step: int,
    precision: str,
    elapsed: float,
    extra: dict[str, Any],
) -> dict[int, dict[str, Any]]:
    """End the members in `slots` at `step` exactly as train() ends a run (finish_run): evaluated,
    checkpointed at that step and marked finished; the others train on. Returns their metrics
    by slot."""
    dev = next(model.parameters()).device
    # only the finishing members are scored: a stack of just them (each member's forward is its
    # own, whatever else is stacked with it)
    scored = model if len(slots) == model.size else _members(model, slots, members, dev)
    by_slot = dict(zip(slots, final_scores(
        scored.forward, len(slots), dev, task, members[0].cfg, step, precision), strict=True))  # fmt: skip
    out = {}
    for s in slots:
        m = members[s]
        m.seconds += elapsed
        metrics = run_metrics(
            m.cfg, task, by_slot[s], histories[s], precision, model.num_params(),
            m.trained_images, m.seconds, m.resumed_from,
        )  # fmt: skip
        out[s] = finish_run(
            m.out, metrics | extra, lr=m.cfg.train.lr,
            finite=all(bool(torch.isfinite(p[s]).all()) for _, p in model.named_stacked()),
            save=lambda s=s, m=m: _save([m], model, opt, step, [histories[s]], index=[s]),
            who=f" in seed {m.cfg.train.seed}",
        )  # fmt: skip
    return out


def train_step(
    model: StackedViT,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    precision: str,
    grad_clip: float,
    withheld: range = range(0),
    planes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One AdamW step of every member on the batch x [B, C, H, W], y [B]; their losses [S].
    withheld: the blocks whose rotations are off at this step (withheld_blocks); planes: which
    planes there [depth, H, P] (None: all)."""
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(x.device, precision):
        logits = model(x, withheld, planes)  # [S, B, num_classes]
    # each member's loss as train() computes it; their sum gives each its own gradient
    losses = torch.stack([F.cross_entropy(lg.float(), y) for lg in logits])  # [S]
    opt.zero_grad(set_to_none=True)
    losses.sum().backward()
    if grad_clip:
        clip_grad_norms([p for _, p in model.named_stacked()], grad_clip)
    opt.step()
    return losses.detach()


def clip_grad_norms(params: Sequence[torch.Tensor], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ for each member alone, on stacked parameters [S, ...]."""
    norms = [
        torch.linalg.vector_norm(p.grad.flatten(1), dim=1) for p in params if p.grad is not None
    ]
    total = torch.linalg.vector_norm(torch.stack(norms, dim=1), dim=1)  # [S]
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.view(-1, *[1] * (p.ndim - 1)))


@torch.no_grad()
def _score(
    model: StackedViT, images: torch.Tensor, labels: torch.Tensor, precision: str
) -> list[dict[str, float]]:
    """Each member's accuracy and mean cross-entropy, as `evaluate` gives it."""
    dev = next(model.parameters()).device
    return score(model.forward, model.size, dev, images, labels, precision)


def _load(
    members: list[_Member], model: StackedViT, opt: torch.optim.Optimizer, step: int
) -> list[list]:
    """Stack the members' resume states, all at `step`, into `model` and `opt`; returns each
    member's evaluation history."""
    states = [read_resume_state(m.out, m.cfg.model) for m in members]
    for m, (s, _, weights, moments) in zip(members, states, strict=True):
        if s != step or set(weights) != set(model.names) or not set(moments) <= set(weights):
            raise CheckpointError(f"the resume state in {m.out} does not fit this ensemble")
    with torch.no_grad():
        for name, p in model.named_stacked():
            stacked = torch.stack([weights[name] for _, _, weights, _ in states])
            if stacked.shape != p.shape:
                raise CheckpointError(f"the resume state of {name} does not fit this model")
            p.copy_(stacked)
            if name in states[0][3]:  # AdamW's step count is one number; the moments per member
                opt.state[p] = {
                    key: (
                        v if v.ndim == 0 else torch.stack([st[3][name][key] for st in states])
                    ).to(p.device)
                    for key, v in states[0][3][name].items()
                }
    return [history for _, history, _, _ in states]


def _save(
    members: list[_Member], model: StackedViT, opt: torch.optim.Optimizer, step: int,
    histories: list[list], index: list[int] | None = None,
) -> None:  # fmt: skip
    """Each member's checkpoint, exactly as `train()` writes it (`index`: the members' slots in
    the stacked model, default their order)."""
    slots = index if index is not None else list(range(len(members)))
    for s, m, history in zip(slots, members, histories, strict=True):
        moments = {
            name: {k: v if v.ndim == 0 else v[s] for k, v in opt.state[p].items()}
            for name, p in model.named_stacked()
            if p in opt.state
        }
        write_checkpoint(m.out, m.cfg, step, history, model.member_state(s), moments)


__all__ = ["clip_grad_norms", "train_ensemble", "train_step"]
