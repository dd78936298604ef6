"""Where a pretrained experiment's time goes: forward passes, caching, probe fits and the rest,
against timm's own forward of the same images on the same device, in the same run.

A timm model with random weights (pretrained=False, no download) is saved to a temporary file and
studied through the user's route (poslens.load("timm:NAME", weights=...), an image folder of
random RGB images); each experiment runs once under cProfile, and the profile is split by
function: poslens' model forward (ViT.forward and run_with_cache, cumulative), of which the
hook points' own work (hooks.py), the probe fits (metrics.probes.fit_probes) and everything else
(statistics, interventions, SAE training, plots). Peak resident memory of the process is
reported after each experiment. The timm forward is the same images, batched as the experiment
batches them, no_grad.

With --preset quick the experiments take the study's own configs (what `poslens study --preset
quick --pretrained ...` runs for analysis seed 0: its sizes, settings and precision, "auto"), and
share one intact reference as the experiments of one study run do; else their defaults
(--images, --probe-images, fp32) and each its own reference.
The forward column counts ViT.forward calls and the images they read.

    python benchmarks/pretrained_experiment.py [--model vit_tiny_patch16_224]
        [--experiments depth_profile,position_removal,heads] [--images 100] [--probe-images N]
        [--preset quick] [--batch 0] [--threads 1]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

import poslens
from poslens.experiments.analyze import analyze
from poslens.experiments.readout import ReferenceCache
from poslens.experiments.registry import configs
from poslens.limits import auto_batch_size
from poslens.models.vit import ViT
from poslens.precision import autocast, resolve_precision
from poslens.study.config import preset
from poslens.study.plan import experiment_configs


def image_folder(root: Path, n: int, classes: int = 5) -> Path:
    """n random 256 x 256 RGB images in `classes` class folders named by class index."""
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / str(i % classes)
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return root


def cumulative(stats: pstats.Stats, pred) -> float:  # type: ignore[no-untyped-def]
    """The largest cumulative time of the functions matching pred(file, name): the outermost
    call of a recursive or nested family."""
    best = 0.0
    for (file, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if pred(file, name):
            best = max(best, ct)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit_tiny_patch16_224")
    ap.add_argument("--experiments", default="depth_profile,position_removal,heads")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--probe-images", type=int, default=0, help="default: --images")
    ap.add_argument("--preset", default="", help="a study preset's analysis settings (quick)")
    ap.add_argument("--batch", type=int, default=0, help="0: chosen per model (the default)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import timm

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        torch.manual_seed(0)
        tm = timm.create_model(args.model, pretrained=False).eval()
        weights = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(weights))
        folder = image_folder(tmp_path / "images", 2 * args.images)
        spec = f"timm:{args.model}"
        model = poslens.load(spec, weights=weights)
        data = poslens.load_images(folder, spec, model)
        x, _ = data.split("test")
        x = x[: args.images]
        batch = args.batch or auto_batch_size(model.cfg)
        study = preset(args.preset, pretrained=(f"{spec}={weights}",), images=str(folder)) \
            if args.preset else None  # fmt: skip
        precision = resolve_precision(study.precision if study is not None else "fp32", x.device)
        with torch.no_grad(), autocast(model, precision):  # timm in the experiments' precision
            t = time.perf_counter()
            for i in range(0, len(x), batch):
                tm(x[i : i + batch])
            timm_s = time.perf_counter() - t
        print(f"{args.model}, {args.images} images at {model.cfg.image_size} px, batch {batch}, "
              f"{args.threads} thread(s), torch {torch.__version__}; timm forward of the images "
              f"({precision}): {timm_s:.2f} s")  # fmt: skip
        names = args.experiments.split(",")
        common = {"n_images": args.images, "probe_images": args.probe_images or args.images,
                  "batch_size": args.batch}  # fmt: skip
        if study is not None:  # the study's own configs of a pretrained run (seed 0), precision too
            cfgs = experiment_configs(study, seed=0)
            print(f"preset {args.preset}: n_images {study.n_images}, probe_images "
                  f"{study.probe_images}, precision {study.precision}")  # fmt: skip
        else:
            cfgs = configs(names, common, {})
        references: ReferenceCache = {}  # shared by the experiments, as in one study run
        print("| experiment | total s | model forward s (passes, images) | of it hook callbacks s "
              "| probe fits s | rest s | forward / one timm pass | peak RSS GB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        seen: list[int] = []
        forward = ViT.forward

        def counted(self: ViT, x: torch.Tensor, *a: object, **k: object) -> object:
            seen.append(len(x))
            return forward(self, x, *a, **k)

        ViT.forward = counted  # type: ignore[method-assign]
        for name in names:
            seen.clear()
            prof = cProfile.Profile()
            t = time.perf_counter()
            prof.enable()
            analyze(model, data, [name], [cfgs[name]], tmp_path / name, formats=(),
                    references=references)  # fmt: skip
            prof.disable()
            total = time.perf_counter() - t
            st = pstats.Stats(prof)
            fwd = cumulative(st, lambda f, n: f.endswith("models/vit.py") and n == "forward")
            fwd = max(
                fwd,
                cumulative(
                    st, lambda f, n: f.endswith("pretrained_experiment.py") and n == "counted"
                ),
            )
            hooks = cumulative(st, lambda f, n: f.endswith("models/hooks.py") and n == "hook")
            probes = cumulative(
                st, lambda f, n: f.endswith("metrics/probes.py") and n == "fit_probes"
            )
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            print(f"| {name} | {total:.1f} | {fwd:.1f} ({len(seen)}, {sum(seen):,}) | {hooks:.1f} | {probes:.1f} | "
                  f"{total - fwd - probes:.1f} | {fwd / timm_s:.1f}x | {rss:.1f} |")  # fmt: skip
            sys.stdout.flush()


if __name__ == "__main__":
    main()
