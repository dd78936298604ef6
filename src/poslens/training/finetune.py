"""A short fine-tune of a studied model with rotations withheld in some blocks: the rebuild
claim's controls built from the studied weights (METHODS.md, "Calibration"; issue 27).

No weight edit plants compensation: it is learned. Fine-tuning the studied model for a few
hundred steps with rotations withheld in random windows that never include the tested one
(`held_out`) teaches its later blocks to put position back, a positive control tested on a
window it was not trained on; withholding them in the late blocks only (`late`) trains the same
number of steps without ever asking the later blocks to compensate for early ones, a negative.
The images and labels are the study's own (the `val` half; the experiments read `test`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from poslens.errors import ConfigError
from poslens.models.vit import ViT
from poslens.training.train import lr_at, withheld_window

WINDOWS = ("held_out", "late")  # train.withheld_window's schedules the fine-tune controls use


@dataclass(frozen=True)
class FineTune:
    """How the studied model is fine-tuned: `steps` AdamW steps of `batch_size` images at peak
    `lr` (warmup over the first tenth, then cosine; weight decay 0.05 on matrices), rotations
    withheld at a step with probability `p` (either schedule), in a window drawn by `windows`;
    batches and windows seeded by `seed`."""

    windows: str
    steps: int
    lr: float = 1e-4
    batch_size: int = 32
    p: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.windows not in WINDOWS:
            raise ConfigError(f"finetune.windows must be one of {', '.join(WINDOWS)}, got "
                              f"{self.windows!r}")  # fmt: skip
        if self.steps < 1:
            raise ConfigError(f"finetune.steps must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise ConfigError(f"finetune.lr must be positive, got {self.lr}")
        if self.batch_size < 1:
            raise ConfigError(f"finetune.batch_size must be at least 1, got {self.batch_size}")
        if not 0 < self.p <= 1:
            raise ConfigError(f"finetune.p must be in (0, 1], got {self.p}")


@torch.enable_grad()  # also when called under no_grad (the study's load stage)
def finetune(
    model: ViT, images: torch.Tensor, labels: torch.Tensor, ft: FineTune
) -> dict[str, Any]:
    """Fine-tune `model` in place on images [N, C, H, W] with labels [N]; returns what was done
    (the config, the blocks withheld how often, the first and last losses, seconds)."""
    if model.rotary is None:
        raise ConfigError(f"a fine-tune control needs rotary position, not {model.cfg.posenc}")
    if len(images) < 1 or len(images) != len(labels):
        raise ConfigError(f"fine-tuning needs images with labels, got {len(images)} and "
                          f"{len(labels)}")  # fmt: skip
    from poslens.interventions import rotary_mask  # interventions import the models, not training

    dev = model.head.weight.device
    params = [p for p in model.parameters() if p.requires_grad]
    # weight decay on matrices only, as in training
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2
             and n.endswith("weight")]  # fmt: skip
    decayed = {id(p) for p in decay}
    rest = [p for p in params if id(p) not in decayed]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": rest, "weight_decay": 0.0}], lr=ft.lr)  # fmt: skip
    # withheld_window's p is per window kind: "held_out" draws a prefix or a suffix with p each
    per_kind = ft.p / 2 if ft.windows == "held_out" else ft.p
    g = torch.Generator().manual_seed(ft.seed)
    order = torch.randperm(len(images), generator=g)
    at, losses, withheld = 0, [], 0
    was_training = model.training
    model.train()
    t0 = time.perf_counter()
    try:
        for step in range(ft.steps):
            if at + ft.batch_size > len(order):  # a new epoch, reshuffled
                order, at = torch.randperm(len(images), generator=g), 0
            idx = order[at : at + ft.batch_size]
            at += ft.batch_size
            for group in opt.param_groups:
                group["lr"] = lr_at(step, ft.steps, ft.lr, 0.1)
            blocks = withheld_window(
                ft.windows, per_kind, model.cfg.depth, ft.seed * 100_003 + step
            )
            withheld += bool(blocks)
            with rotary_mask(model, blocks=blocks) if blocks else contextlib.nullcontext():
                loss = F.cross_entropy(model(images[idx].to(dev)), labels[idx].to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if not torch.isfinite(loss):
                raise ConfigError(
                    f"the fine-tune diverged at step {step + 1} (finetune.lr={ft.lr:g})"
                )
    finally:
        model.train(was_training)
    head = losses[: max(1, len(losses) // 10)]
    tail = losses[-max(1, len(losses) // 10) :]
    return asdict(ft) | {
        "images": len(images),
        "withheld_steps": withheld,
        "loss_first": sum(head) / len(head),  # mean over the first tenth of the steps
        "loss_last": sum(tail) / len(tail),  # and over the last tenth
        "seconds": round(time.perf_counter() - t0, 2),
    }


__all__ = ["WINDOWS", "FineTune", "finetune"]
