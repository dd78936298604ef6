"""Forward time of a converted timm ViT in poslens against timm's own forward, same weights, same
inputs, same run: plain, with every hook cached (run_with_cache), and under a rotary mask.

The timm model gets random weights (pretrained=False, no download); they are saved to a temporary
safetensors file and loaded with poslens.load("timm:NAME", weights=...), the user's path. Each
repeat times every variant once in turn (so drift hits all alike); medians are reported.

    python benchmarks/pretrained_forward.py [--models vit_base_patch16_224,...] [--batch 8]
        [--threads 1] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

import poslens
from poslens.interventions import rotary_mask


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(name: str, batch: int, repeats: int, warmup: int) -> dict[str, object]:
    import timm

    torch.manual_seed(0)
    tm = timm.create_model(name, pretrained=False).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(path))
        model = poslens.load(f"timm:{name}", weights=path)
    size = model.cfg.image_size
    x = torch.randn(batch, 3, size, size)
    every_hook = model.hook_names()

    def full_cache() -> object:
        return model.run_with_cache(x, every_hook)

    def masked() -> object:
        with rotary_mask(model):  # all planes of every block and head: position removed
            return model(x)

    variants: dict[str, Callable[[], object]] = {
        "timm": lambda: tm(x),
        "poslens": lambda: model(x),
        "full_cache": full_cache,
    }
    if model.rotary is not None:
        variants["rotary_mask"] = masked
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        diff = (model(x) - tm(x)).abs().max().item()
        for _ in range(warmup):
            for fn in variants.values():
                fn()
        for _ in range(repeats):
            for k, fn in variants.items():
                times[k].append(timed(fn))
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "posenc": model.cfg.posenc,
        "batch": batch,
        "hooks_cached": len(every_hook),
        "max_logit_diff": diff,
        "seconds": {k: round(v, 4) for k, v in median.items()},
        "ratio_to_timm": {
            k: round(v / median["timm"], 3) for k, v in median.items() if k != "timm"
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="vit_base_patch16_224,vit_base_patch16_rope_224")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}")
    for name in args.models.split(","):
        print(json.dumps(bench(name.strip(), args.batch, args.repeats, args.warmup)))


if __name__ == "__main__":
    main()
