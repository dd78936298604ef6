"""Position probes: poslens' batched L-BFGS `fit_position_probes` vs scikit-learn, same features.

For every block and target (exact cell, row, column): poslens fits all blocks, targets and its
three L2 strengths in one call (whitened features, max_iter=25). scikit-learn fits one
LogisticRegression (lbfgs, multinomial) per block, target and C in (0.1, 1, 10) on features
standardised on the training images (StandardScaler), picks C on validation accuracy and reports
test accuracy. Both use the same 60/20/20 image split (`split_images(n, seed)`) and labels
(`position_labels`). Times cover fitting, selection and scoring, not feature extraction. Both run
single-process with --threads threads (torch.set_num_threads; threadpoolctl for sklearn's BLAS
and OpenMP pools).

Features: patch tokens after each block's ln1 and after ln_final of each --checkpoint, on the
first --images test images of the checkpoint's own task. With no checkpoint: synthetic features with a
planted position code at strengths from near-chance to perfectly decodable.

    PYTHONPATH=src python benchmarks/probes.py --checkpoint /tmp/final/a/ape \\
        [--checkpoint ...] [--images 300] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from poslens.metrics.probes import TARGETS, fit_position_probes, position_labels, split_images

C_GRID = (0.1, 1.0, 10.0)
SYNTH_STRENGTHS = (0.02, 0.05, 0.1, 0.2, 0.5)  # one synthetic "block" per planted strength


def checkpoint_features(path: str, n_images: int) -> tuple[torch.Tensor, list[str], int]:
    """Patch tokens [L, N, T, D] at every block's ln1 and at ln_final; block labels; grid side."""
    import poslens

    model = poslens.load(path).eval()
    x, _ = poslens.load_task(path).split("test")  # the checkpoint's own task and image size
    depth, p = model.cfg.depth, model.cfg.num_prefix
    names = [f"blocks.{b}.ln1.hook_normalized" for b in range(depth)] + ["ln_final.hook_normalized"]
    with torch.no_grad():
        _, cache = model.run_with_cache(x[:n_images], names)
    feats = torch.stack([cache[n][:, p:].float() for n in names])
    return feats, [f"ln1 {b}" for b in range(depth)] + ["final"], model.cfg.grid


def synthetic_features(n_images: int, g: int = 8, d: int = 128, seed: int = 0) -> torch.Tensor:
    """[L, N, g*g, d]: s * (row code + column code + cell code) + unit noise, per strength s."""
    gen = torch.Generator().manual_seed(seed)
    lab = position_labels(g, g)
    code = sum(torch.randn(k, d, generator=gen)[lab[:, t]] for t, k in enumerate((g * g, g, g)))
    code = code / 3**0.5  # unit power per dimension
    noise = torch.randn(len(SYNTH_STRENGTHS), n_images, g * g, d, generator=gen)
    return torch.tensor(SYNTH_STRENGTHS)[:, None, None, None] * code + noise


def sklearn_probes(feats: torch.Tensor, g: int, seed: int, max_iter: int) -> tuple[np.ndarray, int]:
    """Test accuracy [L, 3] at the C chosen on validation; number of fits that hit max_iter."""
    L, n, _, D = feats.shape
    tr, va, te = split_images(n, seed)
    lab = position_labels(g, g).numpy()
    acc, unconverged = np.zeros((L, len(TARGETS))), 0
    for b in range(L):
        x = feats[b].numpy()
        scaler = StandardScaler().fit(x[tr].reshape(-1, D))
        xs = {
            k: scaler.transform(x[i].reshape(-1, D))
            for k, i in (("tr", tr), ("va", va), ("te", te))
        }
        for t in range(len(TARGETS)):
            y = {k: np.tile(lab[:, t], len(i)) for k, i in (("tr", tr), ("va", va), ("te", te))}
            best = (-1.0, 0.0)  # (val acc, test acc)
            for c in C_GRID:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ConvergenceWarning)
                    clf = LogisticRegression(C=c, max_iter=max_iter).fit(xs["tr"], y["tr"])
                unconverged += int(clf.n_iter_.max() >= max_iter)
                val = clf.score(xs["va"], y["va"])
                if val > best[0]:
                    best = (val, clf.score(xs["te"], y["te"]))
            acc[b, t] = best[1]
    return acc, unconverged


def compare(
    name: str, feats: torch.Tensor, blocks: list[str], g: int, args: argparse.Namespace
) -> dict:
    t = time.perf_counter()
    ours = fit_position_probes(feats, g, g, seed=args.seed).test_acc
    t_ours = time.perf_counter() - t
    t = time.perf_counter()
    theirs, unconverged = sklearn_probes(feats, g, args.seed, args.max_iter)
    t_theirs = time.perf_counter() - t
    return {
        "model": name,
        "shape": list(feats.shape),
        "blocks": blocks,
        "poslens_acc": ours.tolist(),
        "sklearn_acc": theirs.tolist(),
        "poslens_s": t_ours,
        "sklearn_s": t_theirs,
        "speedup": t_theirs / t_ours,
        "max_abs_diff_points": float(np.abs(ours - theirs).max() * 100),
        "sklearn_unconverged_fits": unconverged,
        "sklearn_fits": len(blocks) * len(TARGETS) * len(C_GRID),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", action="append", default=[], help="repeatable")
    p.add_argument("--images", type=int, default=300, help="test images used (split 60/20/20)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-iter", type=int, default=1000, help="sklearn lbfgs iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    with threadpool_limits(args.threads):
        if not args.checkpoint:
            blocks = [f"s={s}" for s in SYNTH_STRENGTHS]
            runs.append(compare("synthetic", synthetic_features(args.images), blocks, 8, args))
        for path in args.checkpoint:
            feats, blocks, g = checkpoint_features(path, args.images)
            runs.append(compare(path, feats, blocks, g, args))
            r = runs[-1]
            print(
                f"{path}: poslens {r['poslens_s']:.1f} s, sklearn {r['sklearn_s']:.1f} s",
                file=sys.stderr,
            )
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.images} images, seed {args.seed}"
    )
    print("test accuracy %, poslens / sklearn:")
    print("| model | block | exact | row | col |\n|---|---|---|---|---|")
    for r in runs:
        for b, block in enumerate(r["blocks"]):
            cells = [
                f"{100 * r['poslens_acc'][b][t]:.1f} / {100 * r['sklearn_acc'][b][t]:.1f}"
                for t in range(len(TARGETS))
            ]
            print(f"| {r['model']} | {block} | " + " | ".join(cells) + " |")
    print(
        "\n| model | features [L,N,T,D] | poslens s | sklearn s | speedup | max |Δacc| (points) "
        "| sklearn fits at max_iter |\n|---|---|---|---|---|---|---|"
    )
    for r in runs:
        print(
            f"| {r['model']} | {r['shape']} | {r['poslens_s']:.1f} | {r['sklearn_s']:.1f} | "
            f"{r['speedup']:.1f}x | {r['max_abs_diff_points']:.2f} | "
            f"{r['sklearn_unconverged_fits']}/{r['sklearn_fits']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
