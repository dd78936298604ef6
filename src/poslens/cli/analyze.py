"""`poslens analyze`: run experiments on one model and write their results."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from poslens.cli.common import unfinished
from poslens.errors import UserError


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
    from poslens.experiments.analyze import analyze, why_not
    from poslens.experiments.registry import configs as experiment_configs
    from poslens.experiments.sae_causal import given
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
    saes = given.read_saes(args.sae)  # --sae folders: sae_causal's sites unless set
    sets = given.with_sites(saes, names, sets)
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
        status = unfinished(args.checkpoint)
        if status is not None:  # loaded with --allow-unfinished: the results say so
            source["unfinished"] = status.to_dict()  # type: ignore[assignment]
    saes = given.fit_model(saes, model, data)
    if saes:
        source["sae"] = list(args.sae)  # type: ignore[assignment]
    autocast(model, args.precision)  # UserError here if torch cannot run this precision here
    reasons = [why_not(experiments.get(n), model, data) for n in names]
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
            model, data, names, configs, out, progress=main and not args.no_progress, on_done=done,
            run_kwargs={"sae_causal": {"saes": saes}} if saes else None,
        )  # fmt: skip
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
