"""The training loop: AdamW, warmup + cosine, bf16 autocast, atomic safetensors checkpoints, resume.

Each batch is a pure function of (data seed, step), and the optimiser state is checkpointed, so a
run resumed from step s continues exactly as the uninterrupted run would have. The checkpoint
folder (its files, and the rule that metrics.json is written last) is poslens.checkpoint's; every
run, single or ensembled, ends through `finish_run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from poslens import distributed
from poslens.checkpoint import has_resume_state, mark_finished, read_resume_state, write_checkpoint
from poslens.data import Task, build_task
from poslens.errors import CheckpointError, ConfigError, UserError
from poslens.models.vit import ViT, build_model
from poslens.precision import autocast, resolve_precision
from poslens.training.config import (
    STOP_EVALS,
    WINDOW_AXES,
    RunConfig,
    TrainConfig,
    held_out_windows,
)
from poslens.training.progress import TrainProgress


class TrainingDiverged(UserError):
    """The loss (or a weight) stopped being finite: the run is stopped, never marked finished."""


def step_seed(cfg: RunConfig, step: int, stream: int = 0) -> int:
    """A torch seed drawn from (data seed, step) alone, so every seed of one config (and a resumed
    run) sees the same schedule; `stream` 0 the rotary schedule (its seed since the first
    release), 1 the patch permutation, 2 the planes a window withholds (train.rotary_axes)."""
    return (1_000_003 * cfg.data.seed + step + stream * 2**62) % 2**64


def withheld_blocks(cfg: RunConfig, step: int) -> range:
    """The blocks whose rotations train.rotary_dropout withholds at this step (withheld_window
    under train.rotary_windows, drawn from the step's seed)."""
    p = cfg.train.rotary_dropout
    if p <= 0:
        return range(0)
    return withheld_window(cfg.train.rotary_windows, p, cfg.model.depth, step_seed(cfg, step))


def withheld_window(windows: str, p: float, depth: int, seed: int) -> range:
    """One step's withheld blocks, drawn from `seed`: "halves" the first half of the blocks with
    probability p, the second half with probability p; "held_out" a random prefix window with
    probability p, a random suffix window with probability p, each uniform over
    held_out_windows; "late" the second half with probability p. Otherwise (and never two
    windows at once) none."""
    g = torch.Generator().manual_seed(seed)
    u = float(torch.rand((), generator=g))
    if windows == "late":
        return range(depth // 2, depth) if u < p else range(0)
    if windows == "halves":
        if u < p:
            return range(depth // 2)
        return range(depth // 2, depth) if u < 2 * p else range(0)
    if u >= 2 * p:
        return range(0)
    prefixes, suffixes = held_out_windows(depth)
    choices = prefixes if u < p and prefixes else suffixes  # depth 2 has no prefix to train on
    return choices[int(torch.randint(len(choices), (), generator=g))]


def withheld_axis(cfg: RunConfig, step: int) -> str:
    """The planes this step's window withholds: "all", or under train.rotary_axes "each" one of
    WINDOW_AXES drawn uniformly from (data seed, step) on its own stream, so the windows
    themselves are those of rotary_axes "all"."""
    if cfg.train.rotary_axes == "all":
        return "all"
    g = torch.Generator().manual_seed(step_seed(cfg, step, stream=2))
    return WINDOW_AXES[int(torch.randint(len(WINDOW_AXES), (), generator=g))]


def axis_planes(model: ViT) -> dict[str, torch.Tensor]:
    """The planes that follow the row and the column, as [depth, H, P] masks (from the axis map
    of the rotation tables), for train.rotary_axes "each"; a ConfigError where a block that
    rotates has no plane of one axis (an oblique variant)."""
    from poslens.interventions import axis_map

    amap = axis_map(model)
    masks = {a: torch.as_tensor(amap.axis == a) for a in ("row", "col")}
    turning = torch.as_tensor(amap.axis != "none").flatten(1).any(1)  # [depth]
    for a, m in masks.items():
        if not bool(m.flatten(1).any(1)[turning].all()):
            raise ConfigError(
                f"train.rotary_axes='each' needs {a} planes in every block that rotates; this "
                f"model (rope_variant={model.cfg.rope_variant!r}) has blocks without"
            )
    return masks


def withheld_planes(
    cfg: RunConfig, step: int, planes: dict[str, torch.Tensor] | None
) -> torch.Tensor | None:
    """The plane mask [depth, H, P] this step's window withholds, from the model's `planes`
    (axis_planes) as withheld_axis draws; None: every plane."""
    axis = withheld_axis(cfg, step)
    if axis == "all":
        return None
    if planes is None:
        raise ValueError("train.rotary_axes='each' needs the model's axis_planes")
    return planes[axis]


def withheld_rotations(
    model: ViT, cfg: RunConfig, step: int, planes: dict[str, torch.Tensor] | None = None
) -> contextlib.AbstractContextManager[Any]:
    """Rotations off in the blocks train.rotary_dropout withholds at this step, in the planes
    withheld_planes says."""
    blocks = withheld_blocks(cfg, step)
    if not blocks:
        return contextlib.nullcontext()
    from poslens.interventions import rotary_mask

    return rotary_mask(model, withheld_planes(cfg, step, planes), blocks=blocks)


def permuted_patches(cfg: RunConfig, step: int, images: torch.Tensor) -> torch.Tensor:
    """The batch images [B, C, H, W] of this step, their patches permuted under
    train.permute_patches by seeded_permutation, one per step drawn from (data seed, step) (else
    unchanged). Patch i of the result is patch perm[i] (row-major) of the input: the patch
    embedding reads each patch alone, so this is rpi's permutation of the patch embeddings,
    before any position is added, and the same for train() and the ensemble."""
    if not cfg.train.permute_patches:
        return images
    from poslens.interventions import seeded_permutation

    B, C, H, W = images.shape
    p = cfg.model.patch_size
    gh, gw = H // p, W // p
    perm = seeded_permutation(gh * gw, step_seed(cfg, step, stream=1))
    patches = images.reshape(B, C, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).flatten(1, 2)
    patches = patches[:, perm]  # [B, N, C, p, p], N row-major
    return patches.unflatten(1, (gh, gw)).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def lr_at(step: int, total: int, base: float, warmup_frac: float) -> float:
    """Linear warmup over the first warmup_frac of steps, then cosine decay to zero."""
    warm = max(1, round(total * warmup_frac))
    if step < warm:
        return base * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def make_optimizer(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], cfg: RunConfig, member_dims: int = 0
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms, tokens or embeddings).

    An ensemble's stacked parameters carry `member_dims` leading member dimensions, not counted.
    """
    decay, no_decay = [], []
    for name, p in named_parameters:
        if not p.requires_grad:  # a planted, frozen position code
            continue
        is_matrix = p.ndim - member_dims >= 2 and name.endswith("weight")
        (decay if is_matrix else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.999))


@torch.no_grad()
def evaluate(
    model: ViT,
    images: torch.Tensor,
    labels: torch.Tensor,
    precision: str = "fp32",
    batch_size: int = 500,
) -> dict[str, float]:
    """Accuracy and mean cross-entropy over a fixed set."""
    was_training = model.training
    model.eval()
    try:
        device = model.head.weight.device
        return score(lambda x: model(x)[None], 1, device, images, labels, precision, batch_size)[0]
    finally:
        model.train(was_training)


@torch.no_grad()
def score(
    forward: Callable[[torch.Tensor], torch.Tensor],
    models: int,
    device: torch.device,
    images: torch.Tensor,
    labels: torch.Tensor,
    precision: str,
    batch_size: int = 500,
) -> list[dict[str, float]]:
    """Accuracy and mean cross-entropy of M models over a fixed set, where `forward` maps images
    [B, C, H, W] to the models' logits [M, B, num_classes]."""
    correct, loss = [0] * models, [0.0] * models
    for s in range(0, len(images), batch_size):
        x, y = images[s : s + batch_size].to(device), labels[s : s + batch_size].to(device)
        with autocast(device, precision):
            logits = forward(x).float()  # [M, B, num_classes]
        for m, lg in enumerate(logits):
            correct[m] += int((lg.argmax(-1) == y).sum())
            loss[m] += float(F.cross_entropy(lg, y, reduction="sum"))
    n = max(1, len(images))
    return [{"acc": c / n, "loss": sum_ / n} for c, sum_ in zip(correct, loss, strict=True)]


def model_config_for(cfg: RunConfig, task: Task) -> RunConfig:
    """Take image size, channels and classes from the task so model and data always agree."""
    model = dataclasses.replace(
        cfg.model, image_size=task.image_size, in_chans=task.in_chans, num_classes=task.num_classes
    )
    return dataclasses.replace(cfg, model=model)


def save_checkpoint(
    out: Path, model: ViT, opt: torch.optim.Optimizer, cfg: RunConfig, step: int, history: list
) -> None:
    """Config, weights and resume state of `model` and its optimiser (see write_checkpoint)."""
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {
        names[id(p)]: opt.state.get(p, {}) for group in opt.param_groups for p in group["params"]
    }
    write_checkpoint(out, cfg, step, history, model.state_dict(), moments)


def load_resume_state(out: Path, model: ViT, opt: torch.optim.Optimizer) -> tuple[int, list]:
    """Restore weights and optimiser moments from the resume state; returns (step, history)."""
    step, history, weights, moments = read_resume_state(out, model.cfg)
    try:
        model.load_state_dict(weights)
    except RuntimeError:
        raise CheckpointError(f"the resume state in {out} does not fit this model") from None
    params = dict(model.named_parameters())
    for pname, param_state in moments.items():
        if pname not in params:
            raise CheckpointError(f"optimiser state in {out} names unknown parameter {pname}")
        opt.state[params[pname]].update(param_state)
    return step, history


def last_train_batches(
    task: Task, cfg: RunConfig, n: int, end: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batches of the last training steps before `end` (default: all steps), at least n
    images (each step's batch is reproducible): the set the "train" accuracy is measured on."""
    total, bs = cfg.train.steps if end is None else end, cfg.train.batch_size
    last = [
        task.train_batch(s, bs)
        for s in range(total - 1, max(-1, total - 1 - math.ceil(n / bs)), -1)
    ]
    return torch.cat([b[0] for b in last]), torch.cat([b[1] for b in last])


def history_entry(step: int, ev: dict[str, float], train_loss: float) -> dict[str, Any]:
    """One periodic evaluation in metrics.json's history."""
    return {"step": step, "val_acc": ev["acc"], "val_loss": ev["loss"], "train_loss": train_loss}


def run_metrics(
    cfg: RunConfig,
    task: Task,
    scores: dict[str, dict[str, float]],
    history: list,
    precision: str,
    num_params: int,
    trained_images: int,
    wall: float,
    start: int,
) -> dict[str, Any]:
    """metrics.json of a finished run; `scores` holds its train, val and test evaluation."""
    return {
        "posenc": cfg.model.posenc,
        "task": cfg.data.task,
        "steps": cfg.train.steps,
        **scores,
        "chance": 1.0 / task.num_classes,
        "steps_to_90": next((h["step"] for h in history if h["val_acc"] >= 0.9), None),
        "history": history,
        "precision": precision,
        "num_params": num_params,
        "train_images_per_s": trained_images / wall if wall > 0 and trained_images else None,
        "train_seconds": wall,
        "resumed_from": start,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def final_scores(
    forward: Callable[[torch.Tensor], torch.Tensor],
    models: int,
    device: torch.device,
    task: Task,
    cfg: RunConfig,
    end: int,
    precision: str,
) -> list[dict[str, dict[str, float]]]:
    """Each of M models' accuracy and loss on its last training batches before step `end`, on the
    validation set and on the test set (`forward`: images -> logits [M, B, classes], see score)."""
    test_x, test_y = task.split("test")
    train_x, train_y = last_train_batches(task, cfg, len(test_y), end)
    sets = {"train": (train_x, train_y), "val": task.split("val"), "test": (test_x, test_y)}
    scores = {name: score(forward, models, device, *xy, precision) for name, xy in sets.items()}
    return [{name: scores[name][m] for name in sets} for m in range(models)]


def finish_run(
    out: Path,
    metrics: dict[str, Any],
    *,
    lr: float,
    finite: bool,
    save: Callable[[], None],
    write: bool = True,
    who: str = "",
) -> dict[str, Any]:
    """End one run, single or a member of an ensemble, with its `metrics` (run_metrics and what
    the caller adds): refuse non-finite weights, then `save()` (the final checkpoint) and write
    metrics.json last, so the folder is finished only once everything before it is on disk.
    `write` False (torchrun ranks other than 0): nothing is written. Returns the metrics."""
    if not finite:
        raise TrainingDiverged(
            f"training ended with non-finite weights{who} (train.lr={lr:g}); "
            f"nothing in {out} was marked finished"
        )
    if write:
        save()
        mark_finished(out, metrics)  # last: the run is finished (poslens.checkpoint)
    return metrics


def train(
    cfg: RunConfig,
    out: str | Path,
    resume: bool = False,
    progress: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train one model, checkpointing into `out`; returns (and writes) the final metrics.

    Under torchrun each rank takes an equal slice of every step's batch and DistributedDataParallel
    averages the gradients, so the update equals one process's on the whole batch; rank 0 alone
    evaluates and writes checkpoints and metrics.
    """
    out = Path(out)
    from poslens.limits import check_device, check_output_dir, check_training

    check_device(device)  # each a one-line UserError before any work
    check_output_dir(out)
    check_training(cfg, device)
    dev = distributed.device_for(device)
    rank, world = distributed.init(dev)
    if cfg.train.batch_size % world:
        raise ConfigError(
            f"train.batch_size ({cfg.train.batch_size}) must be divisible by the {world} processes"
        )
    main_rank = rank == 0
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    task = build_task(cfg.data)
    cfg = model_config_for(cfg, task)
    precision = resolve_precision(cfg.train.precision, dev)
    model = build_model(cfg.model, seed=cfg.train.seed).to(dev)
    planes = axis_planes(model) if cfg.train.rotary_axes != "all" else None
    opt = make_optimizer(model.named_parameters(), cfg)
    net: torch.nn.Module = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    val_x, val_y = task.split("val")
    val_x, val_y = val_x[: cfg.train.eval_images], val_y[: cfg.train.eval_images]

    start, history = 0, []
    if has_resume_state(out, cfg, resume):
        start, history = load_resume_state(out, model, opt)

    total, bs = cfg.train.steps, cfg.train.batch_size
    stopped_at = stop_step(history, cfg.train)  # a resumed run that had already stopped
    model.train()
    t0, trained_images = time.perf_counter(), 0
    bar = TrainProgress(total, start, enabled=progress and main_rank, label=cfg.model.posenc)
    shard = slice(rank * bs // world, (rank + 1) * bs // world)  # this rank's part of each batch
    with bar:
        for step in range(start, total if stopped_at is None else start):
            x, y = task.train_batch(step, bs)
            x = permuted_patches(cfg, step, x)
            x, y = x[shard].to(dev), y[shard].to(dev)
            lr = lr_at(step, total, cfg.train.lr, cfg.train.warmup_frac)
            for g in opt.param_groups:
                g["lr"] = lr
            with autocast(dev, precision), withheld_rotations(model, cfg, step, planes):
                logits = net(x)
            loss = F.cross_entropy(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.train.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            trained_images += bs
            done = step + 1
            rate = trained_images / (time.perf_counter() - t0)
            loss_value = loss.item()
            check_finite(loss_value, done, cfg, world)
            bar.update(done, loss=loss_value, images_per_s=rate)
            if main_rank and (done % cfg.train.eval_every == 0 or done == total):
                ev = evaluate(model, val_x, val_y, precision)
                history.append(history_entry(done, ev, loss_value))
                bar.log_eval(done, ev["acc"])
            if cfg.train.stop_acc and (done % cfg.train.eval_every == 0 or done == total):
                stopped_at = _agreed_stop(stop_step(history, cfg.train), done, world)
                if stopped_at is not None:
                    break
            if main_rank and done % cfg.train.ckpt_every == 0 and done != total:
                save_checkpoint(out, model, opt, cfg, done, history)
    wall = time.perf_counter() - t0
    end = total if stopped_at is None else stopped_at  # the step the weights were trained to

    model.eval()
    extra: dict[str, Any] = {}
    if cfg.train.stop_acc:
        extra["stopped_at"] = stopped_at  # None: the target was not reached, all steps ran
    if world > 1:
        extra["processes"] = world
    scores = final_scores(lambda x: model(x)[None], 1, dev, task, cfg, end, precision)[0]
    metrics = run_metrics(
        cfg, task, scores, history, precision, model.num_params(), trained_images, wall, start
    )
    metrics = finish_run(
        out, metrics | extra, lr=cfg.train.lr,
        finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        save=lambda: save_checkpoint(out, model, opt, cfg, end, history), write=main_rank,
    )  # fmt: skip
    distributed.barrier()
    return metrics


def stop_step(history: list[dict[str, Any]], train: TrainConfig) -> int | None:
    """The step of the first evaluation at or after train.min_steps that closes STOP_EVALS
    consecutive evaluations with val_acc >= train.stop_acc (early stopping); None if none does
    or stop_acc is 0."""
    if not train.stop_acc:
        return None
    run = 0
    for h in history:
        run = run + 1 if h["val_acc"] >= train.stop_acc else 0
        if run >= STOP_EVALS and h["step"] >= train.min_steps:
            return int(h["step"])
    return None


def _agreed_stop(stop: int | None, step: int, world: int) -> int | None:
    """Rank 0 alone evaluates: under torchrun every rank stops at the step rank 0 decided."""
    if world > 1:
        flag = distributed.all_reduce_sum(torch.tensor([float(stop is not None)]))
        return step if flag.item() > 0 else None
    return stop


def check_finite(loss: float, step: int, cfg: RunConfig, world: int, who: str = "") -> None:
    """Stop a run whose loss is NaN or infinite (all ranks together under torchrun, so none
    waits for the others): a diverged run must fail, not save NaN weights as finished."""
    bad = not math.isfinite(loss)
    if world > 1:
        flag = distributed.all_reduce_sum(torch.tensor([float(bad)]))
        bad = bool(flag.item() > 0)
    if bad:
        raise TrainingDiverged(
            f"training diverged at step {step}{who}: the loss is {loss} (train.lr={cfg.train.lr:g}; "
            "try a lower train.lr); the run was stopped and not marked finished"
        )
