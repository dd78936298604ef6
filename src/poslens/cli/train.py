"""`poslens train`: one model per preset or config, or an ensemble of seeds."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from poslens.cli.common import rank_zero
from poslens.errors import UserError

if TYPE_CHECKING:
    from poslens.training.config import RunConfig


def _run_configs(args: argparse.Namespace) -> list[tuple[str, RunConfig]]:
    from poslens.training.config import apply_overrides, load_config, preset

    if args.config and args.preset:
        raise UserError("give either --preset or --config, not both")
    if args.config:
        runs = [(Path(args.config).stem, load_config(args.config))]
    else:
        runs = [(name, preset(name)) for name in (args.preset or ["rope_axial"])]
    return [(name, apply_overrides(cfg, args.set or [])) for name, cfg in runs]


def _seeds(text: str) -> list[int]:
    """--seeds "0,1,2" -> [0, 1, 2]: distinct non-negative integers, at most COUNTS["seeds"]."""
    from poslens._config import short_repr
    from poslens.limits import COUNTS

    bound = COUNTS["seeds"]
    if text.count(",") >= bound.high:  # before parsing: a hostile list can be huge
        raise UserError(
            f"--seeds lists {text.count(',') + 1:,} seeds, more than the {bound.high:,} poslens "
            f"allows ({bound.why})"
        )
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds takes comma-separated integers, got {short_repr(text)}") from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UserError(f"--seeds needs distinct non-negative integers, got {short_repr(text)}")
    return seeds


def _check_resume(target: Path, seeds: list[int] | None) -> None:
    """--resume needs a run to continue: refused when `target` (each seed folder, for an
    ensemble) holds no trace of training, which would silently train from scratch."""
    from poslens.checkpoint import CONFIG, METRICS, STATE, WEIGHTS

    folders = [target] if seeds is None else [target / f"seed{k}" for k in seeds]
    if not any((f / n).exists() for f in folders for n in (CONFIG, WEIGHTS, STATE, METRICS)):
        where = target if seeds is None else f"{target}/seed{{{','.join(map(str, seeds))}}}"
        raise UserError(
            f"--resume: {where} holds no training run to continue (no train_state.safetensors); "
            "drop --resume to start one"
        )


def cmd_train(args: argparse.Namespace) -> int:
    import contextlib
    import dataclasses

    from poslens.io import locked
    from poslens.limits import check_output_dir
    from poslens.training.ensemble import train_ensemble
    from poslens.training.train import train

    runs = _run_configs(args)
    seeds = None if args.seeds is None else _seeds(args.seeds)
    if args.compile and seeds is None:
        raise UserError("--compile applies to ensembles: give --seeds too")
    check_output_dir(args.out)  # the text: Path('') would be the current folder
    out = Path(args.out)
    targets = [(name, cfg, out / name if len(runs) > 1 else out) for name, cfg in runs]
    if args.resume:
        for _, _, target in targets:
            _check_resume(target, seeds)
    results = []
    # one train (or study) per --out at a time; under torchrun rank 0 holds it for all ranks
    with locked(out, "train") if rank_zero() else contextlib.nullcontext():
        for name, cfg, target in targets:
            if seeds is None:
                m = train(
                    cfg, target, resume=args.resume, progress=not args.no_progress,
                    device=args.device,
                )  # fmt: skip
                results.append((name, m, target))
                continue
            cfgs = [
                dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=k))
                for k in seeds
            ]
            outs = [target / f"seed{k}" for k in seeds]
            ms = train_ensemble(
                cfgs, outs, args.resume, not args.no_progress, args.device, compile=args.compile
            )
            prefix = f"{name}/" if len(runs) > 1 else ""
            results += [(f"{prefix}seed{k}", m, o) for k, m, o in zip(seeds, ms, outs, strict=True)]
    if not rank_zero():  # under torchrun rank 0 reports; train() has saved and synchronised
        return 0
    if len(results) > 1:
        from poslens.io import atomic_write
        from poslens.training.plots import learning_curves

        fig = learning_curves({name: m for name, m, _ in results})
        atomic_write(out / "learning_curves.png", lambda p: fig.savefig(p, format="png", dpi=120))
    print(
        f"{'model':<16}{'train':>8}{'val':>8}{'test':>8}{'chance':>8}{'steps→90%':>11}{'time':>8}  checkpoint"
    )
    for name, m, target in results:
        s90 = m["steps_to_90"] if m["steps_to_90"] is not None else "-"
        print(
            f"{name:<16}{m['train']['acc']:>8.1%}{m['val']['acc']:>8.1%}{m['test']['acc']:>8.1%}"
            f"{m['chance']:>8.1%}{s90!s:>11}{m['train_seconds']:>7.0f}s  {target}"
        )
    return 0
