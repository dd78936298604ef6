"""Ensemble design: S seeds through torch.func (stack_module_state + functional_call + vmap over
the ViT) vs poslens's StackedViT (grouped ops with a leading member dimension) vs S sequential
models, one training step each (forward, backward, per-model clipping, AdamW), same run.

The measurement behind poslens.models.ensemble: on a 2-core AMD EPYC (AVX512-BF16), 1 thread,
S = 5, CPU clock, APE and RoPE-Axial at width 64, 6 blocks, an 8 x 8 grid (the default study's size
when the ensemble was designed), vmap ran at 0.92-0.94x (fp32)
and 0.78-0.84x (bf16) the sequential models' images/s, StackedViT at 1.11-1.15x and 1.09-1.24x.

    python benchmarks/ensemble_vmap.py [--seeds 5] [--precisions fp32,bf16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state

import poslens.models.vit as vit
from poslens.allocator import keep_freed_memory
from poslens.models import ModelConfig, build_model
from poslens.models.ensemble import StackedViT
from poslens.precision import autocast
from poslens.training.config import RunConfig, TrainConfig
from poslens.training.ensemble import clip_grad_norms, train_step
from poslens.training.train import make_optimizer
from train_throughput import Step, measure


class ExplicitAttention:
    """torch.nn.functional, but attention written out: under vmap the ViT cannot see that
    autograd records (BatchedTensor hides requires_grad) and would take the fused kernel, whose
    CPU backward is slow and has no batching rule; training uses the explicit path."""

    def __getattr__(self, name: str) -> object:
        return getattr(F, name)

    @staticmethod
    def scaled_dot_product_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1) @ v


def candidates(cfg: ModelConfig, seeds: int, precision: str) -> dict[str, Step]:
    x = torch.randn(64, cfg.in_chans, cfg.image_size, cfg.image_size)
    y = torch.randint(0, cfg.num_classes, (64,))
    models = [build_model(cfg, seed=s).train() for s in range(seeds)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]

    def sequential() -> None:
        for m, opt in zip(models, opts, strict=True):
            with autocast(x.device, precision):
                loss = F.cross_entropy(m(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()

    params, buffers = stack_module_state(models)  # type: ignore[arg-type]
    template = copy.deepcopy(models[0]).to("meta")
    forward = torch.vmap(
        lambda p, b, images: functional_call(template, (p, b), (images,)), in_dims=(0, 0, None)
    )
    vopt = torch.optim.AdamW(list(params.values()), lr=1e-3)

    def vmapped() -> None:
        vit.F = ExplicitAttention()  # type: ignore[assignment]
        try:
            with autocast(x.device, precision):
                logits = forward(params, buffers, x)  # [S, B, num_classes]
            loss = torch.stack([F.cross_entropy(lg.float(), y) for lg in logits]).sum()
            vopt.zero_grad(set_to_none=True)
            loss.backward()
            clip_grad_norms(list(params.values()), 1.0)
            vopt.step()
        finally:
            vit.F = F

    stacked = StackedViT(models)
    sopt = make_optimizer(stacked.named_stacked(), RunConfig(train=TrainConfig()), member_dims=1)

    def grouped() -> None:
        train_step(stacked, sopt, x, y, 1e-3, precision, 1.0)

    return {"sequential": sequential, "vmap": vmapped, "StackedViT": grouped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dim", type=int, default=64, help="width (default 64, as measured above)")
    args = p.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.seeds} seeds, CPU clock")
    print("| model | precision | sequential img/s | vmap | StackedViT |")
    print("|---|---|---|---|---|")
    for posenc in ("ape", "rope_axial"):
        for prec in args.precisions.split(","):
            cfg = ModelConfig(posenc=posenc, dim=args.dim)
            times, _ = measure(candidates(cfg, args.seeds, prec), args.rounds, 1, time.process_time)
            rate = {k: args.seeds * 64 / sorted(v)[len(v) // 2] for k, v in times.items()}
            seq = rate["sequential"]
            print(f"| {posenc} | {prec} | {seq:.0f} | {rate['vmap'] / seq:.2f}x | "
                  f"{rate['StackedViT'] / seq:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
