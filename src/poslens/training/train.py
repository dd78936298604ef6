"""The training loop: AdamW, warmup + cosine, bf16 autocast, atomic safetensors checkpoints, resume.

Each batch is a pure function of (data seed, step), and the optimiser state is checkpointed, so a
run resumed from step s continues exactly as the uninterrupted run would have.

A training folder is finished when, and only when, its metrics.json (FINISHED) exists: it is
written last, after the final config, weights and resume state, and never after a failed write
or a loss that stopped being finite. Readers (poslens.load, the study) rely on this rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from poslens import distributed
from poslens._version import __version__
from poslens.api import data_metadata
from poslens.data import Task, build_task
from poslens.errors import CheckpointError, ConfigError, UserError
from poslens.io import (
    MAX_CONFIG_BYTES,
    load_tensors,
    parse_json,
    read_json,
    read_metadata,
    save_tensors,
    write_json,
)
from poslens.models.config import config_mismatch
from poslens.models.vit import ViT, build_model
from poslens.precision import autocast, resolve_precision
from poslens.training.config import STOP_EVALS, RunConfig
from poslens.training.progress import TrainProgress

CONFIG, WEIGHTS, STATE, METRICS = (
    "config.json",
    "model.safetensors",
    "train_state.safetensors",
    "metrics.json",
)
FINISHED = METRICS  # the marker of a finished run: written last (see the module docstring)


class TrainingDiverged(UserError):
    """The loss (or a weight) stopped being finite: the run is stopped, never marked finished."""


def lr_at(step: int, total: int, base: float, warmup_frac: float) -> float:
    """Linear warmup over the first warmup_frac of steps, then cosine decay to zero."""
    warm = max(1, round(total * warmup_frac))
    if step < warm:
        return base * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def make_optimizer(model: ViT, cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms, tokens or embeddings)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # a planted, frozen position code
            continue
        is_matrix = p.ndim >= 2 and name.endswith("weight")
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
    device = model.head.weight.device
    correct, loss = 0, 0.0
    for s in range(0, len(images), batch_size):
        x, y = images[s : s + batch_size].to(device), labels[s : s + batch_size].to(device)
        with autocast(device, precision):
            logits = model(x).float()
        correct += int((logits.argmax(-1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
    model.train(was_training)
    n = max(1, len(images))
    return {"acc": correct / n, "loss": loss / n}


def model_config_for(cfg: RunConfig, task: Task) -> RunConfig:
    """Take image size, channels and classes from the task so model and data always agree."""
    model = dataclasses.replace(
        cfg.model, image_size=task.image_size, in_chans=task.in_chans, num_classes=task.num_classes
    )
    return dataclasses.replace(cfg, model=model)


def save_checkpoint(
    out: Path, model: ViT, opt: torch.optim.Optimizer, cfg: RunConfig, step: int, history: list
) -> None:
    """Config, weights (for loading) and the resume state, each file written atomically.

    The resume state holds weights and optimiser moments in one file, so a kill between two
    writes can never pair weights of one step with moments of another.
    """
    meta = {
        "step": str(step),
        "poslens": __version__,
        **cfg.model.weights_metadata(),
        **data_metadata(cfg.data),
    }
    weights = model.state_dict()
    write_json(out / CONFIG, {"poslens_version": __version__, **cfg.to_dict()})
    save_tensors(out / WEIGHTS, weights, meta)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model::{k}": v for k, v in weights.items()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                state[f"optim::{names[id(p)]}::{key}"] = torch.as_tensor(value)
    save_tensors(out / STATE, state, {**meta, "history": json.dumps(history)})


def load_resume_state(out: Path, model: ViT, opt: torch.optim.Optimizer) -> tuple[int, list]:
    """Restore weights and optimiser moments from the resume state; returns (step, history)."""
    meta = read_metadata(out / STATE)  # the header goes through the same guard as any weights
    why = config_mismatch(model.cfg, meta)
    if why is not None:
        raise CheckpointError(f"the resume state in {out} belongs to another model: {why}")
    flat = load_tensors(out / STATE)
    weights = {k.removeprefix("model::"): v for k, v in flat.items() if k.startswith("model::")}
    try:
        model.load_state_dict(weights)
    except RuntimeError:
        raise CheckpointError(f"the resume state in {out} does not fit this model") from None
    params = dict(model.named_parameters())
    for key, value in flat.items():
        if not key.startswith("optim::"):
            continue
        pname, _, skey = key.removeprefix("optim::").partition("::")
        if pname not in params:
            raise CheckpointError(f"optimiser state in {out} names unknown parameter {pname}")
        opt.state[params[pname]][skey] = value
    try:
        step = int(meta["step"])
    except (KeyError, ValueError):
        raise CheckpointError(f"the resume state in {out} records no valid step") from None
    history = parse_json(meta.get("history", "[]"), f"the training history in {out / STATE}")
    if not isinstance(history, list):
        raise CheckpointError(f"the training history in {out / STATE} is not a list")
    return step, history


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
    opt = make_optimizer(model, cfg)
    net: torch.nn.Module = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    val_x, val_y = task.split("val")
    val_x, val_y = val_x[: cfg.train.eval_images], val_y[: cfg.train.eval_images]

    start, history = 0, []
    if resume:  # a killed run may have left the temp file of an unfinished atomic write
        for name in (CONFIG, WEIGHTS, STATE, METRICS):
            for tmp in out.glob(f".{name}.*.tmp"):
                tmp.unlink(missing_ok=True)
    if resume and (out / STATE).is_file():
        saved = read_json(out / CONFIG, "checkpoint config", MAX_CONFIG_BYTES)
        if isinstance(saved, dict):
            saved.pop("poslens_version", None)
        if saved != cfg.to_dict():
            raise CheckpointError(f"--resume: the config in {out} differs from the requested one")
        start, history = load_resume_state(out, model, opt)
    elif (out / STATE).is_file() or (out / METRICS).is_file():
        raise CheckpointError(
            f"{out} already holds a run; pass --resume to continue it or pick another --out"
        )

    total, bs = cfg.train.steps, cfg.train.batch_size
    stopped_at = stop_step(history, cfg.train.stop_acc)  # a resumed run that had already stopped
    model.train()
    t0, trained_images = time.perf_counter(), 0
    bar = TrainProgress(total, start, enabled=progress and main_rank, label=cfg.model.posenc)
    shard = slice(rank * bs // world, (rank + 1) * bs // world)  # this rank's part of each batch
    with bar:
        for step in range(start, total if stopped_at is None else start):
            x, y = task.train_batch(step, bs)
            x, y = x[shard].to(dev), y[shard].to(dev)
            lr = lr_at(step, total, cfg.train.lr, cfg.train.warmup_frac)
            for g in opt.param_groups:
                g["lr"] = lr
            with autocast(dev, precision):
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
            _check_finite(loss_value, done, cfg, world)
            bar.update(done, loss=loss_value, images_per_s=rate)
            if main_rank and (done % cfg.train.eval_every == 0 or done == total):
                ev = evaluate(model, val_x, val_y, precision)
                history.append(
                    {
                        "step": done,
                        "val_acc": ev["acc"],
                        "val_loss": ev["loss"],
                        "train_loss": loss_value,
                    }
                )
                bar.log_eval(done, ev["acc"])
            if cfg.train.stop_acc and done % cfg.train.eval_every == 0:
                stopped_at = _agreed_stop(stop_step(history, cfg.train.stop_acc), done, world)
                if stopped_at is not None:
                    break
            if main_rank and done % cfg.train.ckpt_every == 0 and done != total:
                save_checkpoint(out, model, opt, cfg, done, history)
    wall = time.perf_counter() - t0
    end = total if stopped_at is None else stopped_at  # the step the weights were trained to

    model.eval()
    test_x, test_y = task.split("test")
    # training accuracy on the images of the last training steps (each step's batch is reproducible)
    last = [
        task.train_batch(s, bs)
        for s in range(end - 1, max(-1, end - 1 - math.ceil(len(test_y) / bs)), -1)
    ]
    train_x, train_y = torch.cat([b[0] for b in last]), torch.cat([b[1] for b in last])
    metrics = {
        "posenc": cfg.model.posenc,
        "task": cfg.data.task,
        "steps": total,
        "train": evaluate(model, train_x, train_y, precision),
        "val": evaluate(model, *task.split("val"), precision),
        "test": evaluate(model, test_x, test_y, precision),
        "chance": 1.0 / task.num_classes,
        "steps_to_90": next((h["step"] for h in history if h["val_acc"] >= 0.9), None),
        "history": history,
        "precision": precision,
        "num_params": model.num_params(),
        "train_images_per_s": trained_images / wall if wall > 0 and trained_images else None,
        "train_seconds": wall,
        "resumed_from": start,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    if cfg.train.stop_acc:
        metrics["stopped_at"] = stopped_at  # None: the target was not reached, all steps ran
    if world > 1:
        metrics["processes"] = world
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise TrainingDiverged(
            f"training ended with non-finite weights (train.lr={cfg.train.lr:g}); "
            f"nothing in {out} was marked finished"
        )
    if main_rank:
        save_checkpoint(out, model, opt, cfg, end, history)
        write_json(out / FINISHED, metrics)  # last: the run is finished (module docstring)
    distributed.barrier()
    return metrics


def stop_step(history: list[dict[str, Any]], stop_acc: float) -> int | None:
    """The step of the first evaluation that closes STOP_EVALS consecutive evaluations with
    val_acc >= stop_acc (early stopping, train.stop_acc); None if none does or stop_acc is 0."""
    if not stop_acc:
        return None
    run = 0
    for h in history:
        run = run + 1 if h["val_acc"] >= stop_acc else 0
        if run >= STOP_EVALS:
            return int(h["step"])
    return None


def _agreed_stop(stop: int | None, step: int, world: int) -> int | None:
    """Rank 0 alone evaluates: under torchrun every rank stops at the step rank 0 decided."""
    if world > 1:
        flag = distributed.all_reduce_sum(torch.tensor([float(stop is not None)]))
        return step if flag.item() > 0 else None
    return stop


def _check_finite(loss: float, step: int, cfg: RunConfig, world: int) -> None:
    """Stop a run whose loss is NaN or infinite (all ranks together under torchrun, so none
    waits for the others): a diverged run must fail, not save NaN weights as finished."""
    bad = not math.isfinite(loss)
    if world > 1:
        flag = distributed.all_reduce_sum(torch.tensor([float(bad)]))
        bad = bool(flag.item() > 0)
    if bad:
        raise TrainingDiverged(
            f"training diverged at step {step}: the loss is {loss} (train.lr={cfg.train.lr:g}; "
            "try a lower train.lr); the run was stopped and not marked finished"
        )
