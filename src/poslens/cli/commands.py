"""The commands behind `poslens train | info | analyze | sae train | study | export | report`: each turns
parsed arguments into calls of the Python API and returns an exit code."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poslens.errors import UserError

if TYPE_CHECKING:
    from poslens.api import CheckpointStatus
    from poslens.study.slurm import SlurmOptions
    from poslens.training.config import RunConfig


def _rank_zero() -> bool:
    """Whether this process prints and writes: rank 0 under torchrun (read from the environment,
    so no process group is joined just to ask), the only process otherwise."""
    import os

    return int(os.environ.get("RANK", "0")) == 0


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


def study_seeds(seeds: str | None, start: int | None) -> dict[str, int]:
    """`--seeds N` / `--seeds A-B` and `--seed-start S` -> the StudyConfig fields they set."""
    from poslens._config import short_repr

    out: dict[str, int] = {} if start is None else {"seed_start": start}
    if seeds is None:
        return out
    first, dash, last = seeds.strip().partition("-")
    try:
        a, b = int(first), int(last) if dash else None
    except ValueError:
        raise UserError(f"--seeds takes a count N or a range A-B, got {short_repr(seeds)}") from None
    if b is None:
        return {**out, "seeds": a}
    if start is not None and start != a:
        raise UserError(f"--seeds {seeds} starts at {a}, but --seed-start says {start}")
    if b < a:
        raise UserError(f"--seeds {seeds}: the range's end is below its start")
    return {"seed_start": a, "seeds": b - a + 1}


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
    with locked(out, "train") if _rank_zero() else contextlib.nullcontext():
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
    if not _rank_zero():  # under torchrun rank 0 reports; train() has saved and synchronised
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


def cmd_info(args: argparse.Namespace) -> int:
    import poslens

    spec = args.model or args.checkpoint
    if spec is None or (args.model and args.checkpoint):
        raise UserError(
            "poslens info takes a checkpoint folder, --model timm:NAME --weights PATH or "
            "--model hf:DIR"
        )
    model = poslens.load(spec, weights=args.weights, allow_unfinished=args.allow_unfinished)
    cfg = model.cfg
    print(
        f"{spec}: ViT posenc={cfg.posenc} depth={cfg.depth} dim={cfg.dim} heads={cfg.heads} "
        f"grid={cfg.grid}x{cfg.grid} prefix={cfg.num_prefix} params={model.num_params():,}"
    )
    status = _unfinished(args.checkpoint, args.weights) if args.checkpoint else None
    if status is not None:
        print(f"warning: {status.describe()}, loaded with --allow-unfinished")
    if args.hooks:
        print("\n".join(model.hook_names()))
    return 0


def _unfinished(checkpoint: str, weights: str | None = None) -> CheckpointStatus | None:
    """The checkpoint's status when it is an unfinished training run (else None)."""
    from poslens.api import checkpoint_status

    path = Path(weights) if weights is not None else Path(checkpoint)
    if path.is_dir():
        path = path / "model.safetensors"
    status = checkpoint_status(path.parent, path)
    return None if status.finished else status


def _experiment_names(text: str) -> list[str]:
    """`--experiments a,b`: names in order, each at most once (a repeat is refused, not rerun)."""
    from poslens import experiments

    if text == "all":
        return list(experiments.EXPERIMENTS)
    names = [n.strip() for n in text.split(",")]
    for i, n in enumerate(names):
        experiments.get(n)  # an unknown name is refused first, naming the known ones
        if n in names[:i]:
            raise UserError(f"--experiments lists {n!r} twice")
    return names


def _overrides(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, str]]:
    """`--set experiment.field=value` items grouped by experiment (which must be selected)."""
    from poslens._config import experiment_sets

    sets = experiment_sets(items, "--set")
    for exp, fields in sets.items():
        if exp not in names:
            item = next(f"{exp}.{k}={v}" for k, v in fields.items())
            raise UserError(f"--set {item!r}: experiment {exp!r} is not selected")
    return sets


def cmd_analyze(args: argparse.Namespace) -> int:
    import poslens
    from poslens import distributed, experiments
    from poslens.errors import OutputError
    from poslens.experiments.analyze import analyze
    from poslens.experiments.registry import configs as experiment_configs
    from poslens.io import jsonable, write_json
    from poslens.limits import check_analysis, check_count, check_output_dir
    from poslens.precision import autocast

    check_count("--images", args.images, "images")
    check_count("--probe-images", args.probe_images, "images")
    names = _experiment_names(args.experiments)
    common = {
        "n_images": args.images,
        "probe_images": min(args.probe_images, args.images),
        "batch_size": args.batch_size,
        "seed": args.seed,
        "probe_block": args.probe_block,
        "precision": args.precision,
    }
    # every name, field and value checked (UserError) before any work
    sets = _overrides(args.set, names)
    configs = list(experiment_configs(names, common, sets).values())
    try:
        device = str(distributed.device_for(args.device))  # cuda:LOCAL_RANK under torchrun
    except RuntimeError:
        device = args.device  # not a torch device: load() says so
    if args.model is not None:
        if args.checkpoint is not None:
            raise UserError("poslens analyze takes a checkpoint folder or --model, not both")
        if args.data is None:
            raise UserError(f"--model {args.model} needs --data DIR, a folder of class subfolders")
        model = poslens.load(args.model, weights=args.weights, device=device)
        data = poslens.load_images(args.data, args.model, model, seed=args.seed)
        source = {"model": args.model, "weights": str(args.weights), "data": str(args.data)}
    else:
        if args.checkpoint is None:
            raise UserError(
                "poslens analyze needs a checkpoint folder or --model timm:NAME or hf:DIR"
            )
        if args.data is not None or args.weights is not None:
            raise UserError(
                "--data and --weights go with --model timm:NAME or hf:DIR, not a checkpoint"
            )
        model = poslens.load(args.checkpoint, device=device, allow_unfinished=args.allow_unfinished)
        data = poslens.load_task(args.checkpoint)
        source = {"checkpoint": str(args.checkpoint)}
        status = _unfinished(args.checkpoint)
        if status is not None:  # loaded with --allow-unfinished: the results say so
            source["unfinished"] = status.to_dict()  # type: ignore[assignment]
    autocast(model, args.precision)  # UserError now if torch cannot run this precision here
    reasons = [experiments.get(n).applies(model) for n in names]
    if all(r is not None for r in reasons):  # nothing would run: an error, not a run of skips
        why = "; ".join(f"{n}: {r}" for n, r in zip(names, reasons, strict=True))
        raise UserError(f"--experiments {args.experiments}: none applies to this model ({why})")
    if "n_planes" in sets.get("position_removal", {}):
        from poslens.experiments.position_removal import check_planes

        check_planes(model, configs[names.index("position_removal")].n_planes)
    check_output_dir(args.out)  # the text: Path('') would be the current folder
    out = Path(args.out)
    created = not out.exists()
    check_analysis(
        model.cfg, args.images, common["probe_images"], args.batch_size, device,
        getattr(data, "cfg", None),
    )  # fmt: skip
    # Under torchrun every rank evaluates its share of the images; rank 0 prints and writes.
    main = distributed.is_main()
    if main:  # the index is written last; a stale one must not outlive a failure
        (out / "analysis.json").unlink(missing_ok=True)
    report = print if main else lambda *_a, **_k: None

    def done(name: str, record: dict[str, object]) -> None:
        if "skipped" in record:
            report(f"{name:<18} skipped: {record['skipped']}")
        else:
            files = ", ".join(f.name for f in record["files"])  # type: ignore[attr-defined]
            report(f"{name:<18} {record['seconds']:6.0f}s  {files}")

    try:
        records = analyze(
            model, data, names, configs, out, progress=main and not args.no_progress, on_done=done
        )
    except OutputError as e:  # a full disk: say what is left in --out
        raise OutputError(f"{e}; {_left_in(out, created)}") from None
    summary: dict[str, object] = {
        **source,
        "posenc": model.cfg.posenc,
        "version": poslens.__version__,
        "analysis": common,
        "experiments": {
            name: r if "skipped" in r else {
                "seconds": r["seconds"], "files": [f.name for f in r["files"]], "config": r["config"]
            }
            for name, r in records.items()
        },
    }  # fmt: skip
    if main:
        world = distributed.world()[1]
        if world > 1:
            summary["processes"] = world
        write_json(out / "analysis.json", jsonable(summary))
    distributed.barrier()
    report(f"results in {out}")
    return 0


def _left_in(out: Path, created: bool) -> str:
    """What a failed analysis left in `out`, for its error message; the folder it created for
    nothing is removed."""
    left = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if left:
        return (
            f"{len(left)} file(s) of the experiments finished before it are kept in {out}, "
            "without analysis.json; rerun to complete it"
        )
    if created and out.is_dir():
        out.rmdir()
        return f"no results were written (--out {out} removed again)"
    return f"no results are left in {out} (the failed experiment's files were removed)"


def cmd_sae_train(args: argparse.Namespace) -> int:
    import poslens
    from poslens.limits import check_count, check_output_dir, check_sae
    from poslens.sae import SAEConfig
    from poslens.sae.pipeline import train_on_checkpoint

    cfg = SAEConfig(
        site=args.site, expansion=args.expansion, k=args.k, epochs=args.epochs, whiten=args.whiten
    )
    check_count("--images", args.images, "images")
    model = poslens.load(
        args.checkpoint, device=args.device, allow_unfinished=args.allow_unfinished
    )
    task = poslens.load_task(args.checkpoint)
    cfg.d_sae(model.cfg.dim)  # ConfigError now if k does not fit, before any work
    check_output_dir(args.out)
    check_sae(model.cfg, cfg, args.images, args.device, getattr(task, "cfg", None))
    status = _unfinished(args.checkpoint)
    main = _rank_zero()  # under torchrun only rank 0 reports
    r = train_on_checkpoint(
        model,
        task,
        cfg,
        Path(args.out),
        n_images=args.images,
        progress=main and not args.no_progress,
        record=None if status is None else {"unfinished_checkpoint": status.to_dict()},
    )
    if not main:
        return 0
    q, sp, pl = r["quality"], r["spliced"], r["positional_latents"]
    print(
        f"{cfg.site}: FVU {q['fvu']:.3f}  L0 {q['l0']:.1f}  dead {q['dead_fraction']:.1%}  "
        f"accuracy clean {sp['clean']['acc']:.1%} -> spliced {sp['spliced']['acc']:.1%}"
    )
    print(f"{pl['verdict']}\nsaved to {args.out}")
    return 0


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
    cfg = preset(args.preset, **changes)
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
    print(f"{'claim':<58} verdict")
    for c in results["claims"]:
        print(f"{c['title'][:57]:<58} {c['verdict']}")
    total = results["timings"]["total_seconds"]
    print(f"results in {args.out} (report.html, report.md, results.json) after {total:.0f}s")
    return 0


def _ladder(args: argparse.Namespace) -> int:
    """`poslens study --preset ladder`: every rung's study, then the ladder's report."""
    from poslens.limits import check_output_dir
    from poslens.study.ladder import ladder_preset, run_ladder

    refused = [flag for flag, given in (("--pretrained", args.pretrained), ("--data", args.data),
               ("--rebuild-finetune", args.rebuild_finetune)) if given]  # fmt: skip
    if refused:
        raise UserError(
            f"{refused[0]} does not go with --preset ladder: the ladder trains its own models on "
            "the relation task"
        )
    changes: dict[str, object] = {} if args.precision is None else {"precision": args.precision}
    kw: dict[str, object] = {"in_situ": not args.no_in_situ, "changes": changes}
    if args.models is not None:
        kw["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if args.seed_start is not None:
        raise UserError("--seed-start does not go with --preset ladder (its rungs run seeds 0..N-1)")
    if args.seeds is not None:
        kw["seeds"] = study_seeds(args.seeds, None)["seeds"]
    cfg = ladder_preset(args.rungs, **kw)
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
    lines = [f"{'claim level (mean effect per rung)':<40} " + " ".join(f"{n[:11]:>11}" for n in names)]
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


def cmd_export(args: argparse.Namespace) -> int:
    """Write a checkpoint as timm weights and the timm arguments beside them (timm_export),
    checked by converting them back; prints how to study and how to load them."""
    import poslens
    from poslens.models.timm_export import export_timm, timm_name_for

    model = poslens.load(args.checkpoint)
    name = args.timm or timm_name_for(model.cfg)
    weights, side = export_timm(model, args.out, name)
    print(weights)
    print(side)
    print(f"study it with: poslens study --pretrained timm:{name}={weights} "
          f"--data task:{Path(args.checkpoint).resolve()} --out DIR  (its own task; or an image folder)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render report.html and report.md of one study folder from its results.json, after
    checking it (size, depth, finite numbers, the schema)."""
    from poslens.io import read_json
    from poslens.report import write_report
    from poslens.report.schema import check_results

    out_dir = Path(args.dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is not a folder (give a poslens study output folder)")
    path = out_dir / "results.json"
    results = read_json(path, "results")  # size, depth and finite numbers bounded
    check_results(results, str(path))
    for p in write_report(out_dir, results):  # a study's or a ladder's report
        print(p)
    return 0
