"""`poslens study`: the whole study (or the ladder of studies) in one command."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from poslens.errors import UserError

if TYPE_CHECKING:
    from poslens.study.config import StudyConfig
    from poslens.study.slurm import SlurmOptions


def study_seeds(seeds: str | None, start: int | None) -> dict[str, int]:
    """`--seeds N` / `--seeds A-B` and `--seed-start S` -> the StudyConfig fields they set."""
    from poslens._config import short_repr

    out: dict[str, int] = {} if start is None else {"seed_start": start}
    if seeds is None:
        return out
    try:  # a count, also one below 1 (StudyConfig refuses it, named_flag names --seeds)
        return {**out, "seeds": int(seeds)}
    except ValueError:
        pass
    first, dash, last = seeds.strip().partition("-")
    try:
        a, b = int(first), int(last) if dash else None
    except ValueError:
        raise UserError(
            f"--seeds takes a count N or a range A-B of seeds (0 <= A <= B), got {short_repr(seeds)}"
        ) from None
    if b is None:
        return {**out, "seeds": a}
    if start is not None and start != a:
        raise UserError(f"--seeds {seeds} starts at {a}, but --seed-start says {start}")
    if b < a:
        raise UserError(f"--seeds {seeds}: the range's end is below its start")
    return {"seed_start": a, "seeds": b - a + 1}


# The study fields set by one number-bearing option: (option, its attribute in the arguments).
FLAGS = {
    "study.seeds": ("--seeds", "seeds"),
    "ladder.seeds": ("--seeds", "seeds"),
    "study.seed_start": ("--seed-start", "seed_start"),
    "study.model_seeds": ("--model-seeds", "model_seeds"),
    "study.gate_retries": ("--gate-retries", "gate_retries"),
    "study.finetune_steps": ("--rebuild-finetune", "rebuild_finetune"),
    "study.finetune_lr": ("--finetune-lr", "finetune_lr"),
    "study.finetune_batch": ("--finetune-batch", "finetune_batch"),
}


def named_flag(message: str, args: argparse.Namespace) -> str:
    """A StudyConfig error about a field the user set with an option, with that option in front
    (`--model-seeds: study.model_seeds entries look like ...`)."""
    for field, (flag, attr) in FLAGS.items():
        given = getattr(args, attr, None) is not None
        if given and re.match(rf"{re.escape(field)}\b", message):
            return f"{flag}: {message}"
    return message


def with_train_precision(cfg: StudyConfig, precision: str) -> StudyConfig:
    """`cfg` training its models in `precision` (the last train.precision item wins)."""
    return replace(cfg, train_set=(*cfg.train_set, f'train.precision="{precision}"'))


def cmd_study(args: argparse.Namespace) -> int:
    from poslens.limits import check_output_dir
    from poslens.study import preset, run_study

    if args.preset == "ladder":
        return _ladder(args)
    if args.rungs is not None:
        raise UserError("--rungs goes with --preset ladder")
    changes: dict[str, object] = {} if args.precision is None else {"precision": args.precision}
    if args.no_in_situ:
        changes["in_situ"] = False
    if args.gate_retries is not None:
        changes["gate_retries"] = args.gate_retries
    if args.rebuild_finetune:
        if not args.pretrained:
            raise UserError(
                "--rebuild-finetune goes with --pretrained: a trained study calibrates the rebuild "
                "claim on models trained for it (rope_rebuild, rope_late)"
            )
        changes |= {"finetune_steps": args.rebuild_finetune, "finetune_lr": args.finetune_lr,
                    "finetune_batch": args.finetune_batch}  # fmt: skip
    if args.pretrained:
        if args.models is not None:
            raise UserError("--models names encodings to train; --pretrained replaces them")
        if not args.data:
            raise UserError("--pretrained needs --data DIR: an image folder or datasets directory")
        changes["pretrained"] = tuple(args.pretrained)
        changes["images"] = args.data
    elif args.data:
        changes["task"] = args.data
    if args.models is not None:  # given, even empty: `--models ''` is refused, not ignored
        changes["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
    changes.update(study_seeds(args.seeds, args.seed_start))
    if args.model_seeds is not None:
        changes["model_seeds"] = tuple(m.strip() for m in args.model_seeds.split(",") if m.strip())
    try:
        cfg = preset(args.preset, **changes)
    except UserError as e:  # the same kind of error, naming the option that set the field
        raise type(e)(named_flag(str(e), args)) from None
    if args.train_precision is not None:
        if args.pretrained:
            raise UserError("--train-precision goes with trained models; --pretrained trains none")
        cfg = with_train_precision(cfg, args.train_precision)
    check_output_dir(args.out)
    results = run_study(
        cfg,
        args.out,
        progress=not args.no_progress,
        device=args.device,
        threads=args.threads,
        jobs=args.jobs,
        slurm=_slurm_options(args),
    )
    from poslens.report.claims import verdict_label
    from poslens.study.result import claims_of

    print(f"{'claim':<48} {'level':<9} verdict (replication on fresh seed sets)")
    for c in claims_of(results):
        rep = (c.replication or {}).get("probability")
        same = "" if rep is None else f" ({rep:.0%})"
        print(f"{c.title[:47]:<48} {c.level:<9} {verdict_label(c)}{same}")
    total = results["timings"]["total_seconds"]
    print(f"results in {args.out} (report.html, report.md, results.json) after {total:.0f}s")
    return 0


def _ladder(args: argparse.Namespace) -> int:
    """`poslens study --preset ladder`: every rung's study, then the ladder's report."""
    from poslens.limits import check_output_dir
    from poslens.study.ladder import ladder_preset, run_ladder

    refused = [flag for flag, given in (("--pretrained", args.pretrained), ("--data", args.data),
               ("--rebuild-finetune", args.rebuild_finetune),
               ("--train-precision", args.train_precision),
               ("--model-seeds", args.model_seeds)) if given]  # fmt: skip
    if refused:
        raise UserError(
            f"{refused[0]} does not go with --preset ladder: the ladder trains its own models on "
            "the relation task"
        )
    changes: dict[str, object] = {} if args.precision is None else {"precision": args.precision}
    if args.gate_retries is not None:
        changes["gate_retries"] = args.gate_retries
    kw: dict[str, object] = {"in_situ": not args.no_in_situ, "changes": changes}
    if args.models is not None:
        kw["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
    seeds = study_seeds(args.seeds, args.seed_start)
    if seeds.get("seed_start"):
        raise UserError("--seed-start and --seeds A-B do not go with --preset ladder (its rungs run "
                        "seeds 0..N-1)")  # fmt: skip
    if "seeds" in seeds:
        kw["seeds"] = seeds["seeds"]
    try:
        cfg = ladder_preset(args.rungs, **kw)
    except UserError as e:
        raise type(e)(named_flag(str(e), args)) from None
    check_output_dir(args.out)
    results = run_ladder(
        cfg,
        args.out,
        progress=not args.no_progress,
        device=args.device,
        threads=args.threads,
        jobs=args.jobs,
        slurm=_slurm_options(args),
    )
    print(ladder_summary(results))
    total = results["timings"]["total_seconds"]
    print(f"results in {args.out} (report.html, report.md, results.json, ladder.csv; each rung in "
          f"rungs/) after {total:.0f}s")  # fmt: skip
    return 0


def ladder_summary(results: dict[str, Any]) -> str:
    """Each claim level's study-model effects per rung, one line per level (the terminal view of
    the report's table; verdicts need 5 seeds, so effects are what a 3-seed ladder shows)."""
    names = [r["name"] for r in results["rungs"]]
    lines = [
        f"{'claim level (mean effect per rung)':<40} " + " ".join(f"{n[:11]:>11}" for n in names)
    ]
    for cl in results["claims"]:
        label = f"{cl['claim'][:30]} ({cl['level']})"
        cells = []
        for n in names:
            means = [t["mean"] for t in cl["rungs"][n]["models"].values() if t["mean"] is not None]
            cells.append("/".join(f"{m:.2f}" for m in means) or "-")
        lines.append(f"{label[:39]:<40} " + " ".join(f"{x[:11]:>11}" for x in cells))
    return "\n".join(lines)


def _slurm_options(args: argparse.Namespace) -> SlurmOptions | None:
    """--executor slurm's job resources; the --slurm-* options are refused without it."""
    from poslens.study.slurm import SlurmOptions

    given = {k: v for k, v in vars(args).items() if k.startswith("slurm_") and v not in (None, [])}
    if args.executor != "slurm":
        if given:
            raise UserError("the --slurm-* options are for SLURM jobs: add --executor slurm")
        return None
    opts = SlurmOptions(
        **{
            k.removeprefix("slurm_"): tuple(v) if isinstance(v, list) else v
            for k, v in given.items()
        }
    )
    opts.check(args.device)
    return opts
