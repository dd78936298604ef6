"""Command line: parses arguments, calls the Python API, maps user errors to exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from poslens.errors import UserError, WorkerLost

if TYPE_CHECKING:
    from poslens.api import CheckpointStatus
    from poslens.study.slurm import SlurmOptions
    from poslens.training.config import RunConfig


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"poslens: error: {message} (see {self.prog} --help)\n")


DEVICE_HELP = "torch device: cpu (default), cuda, cuda:N, or auto (cuda if available, else cpu)"


def _count(text: str) -> int:
    """argparse type of --jobs / --threads: 0 (automatic) up to MAX_THREADS."""
    from poslens._config import MAX_THREADS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be 0 (automatic) to {MAX_THREADS}, got {value}")
    return value


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; any other name unchanged."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
    """--seeds "0,1,2" -> [0, 1, 2]: distinct non-negative integers."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds takes comma-separated integers, got {text!r}") from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UserError(f"--seeds needs distinct non-negative integers, got {text!r}")
    return seeds


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from poslens.limits import check_output_dir
    from poslens.training.ensemble import train_ensemble
    from poslens.training.train import train

    runs = _run_configs(args)
    seeds = None if args.seeds is None else _seeds(args.seeds)
    if args.compile and seeds is None:
        raise UserError("--compile applies to ensembles: give --seeds too")
    out = Path(args.out)
    check_output_dir(out)
    results = []
    for name, cfg in runs:
        target = out / name if len(runs) > 1 else out
        if seeds is None:
            m = train(
                cfg, target, resume=args.resume, progress=not args.no_progress, device=args.device
            )
            results.append((name, m, target))
            continue
        cfgs = [
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=k)) for k in seeds
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
            "poslens info takes a checkpoint folder or --model timm:NAME --weights PATH"
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
        if n in names[:i]:
            raise UserError(f"--experiments lists {n!r} twice")
    return names


def _overrides(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, str]]:
    """`--set experiment.field=value` items grouped by experiment (which must be selected)."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        exp, dot, field = key.partition(".")
        if not eq or not dot or not field:
            raise UserError(f"--set expects EXPERIMENT.FIELD=VALUE, got {item!r}")
        if exp not in names:
            raise UserError(f"--set {item!r}: experiment {exp!r} is not selected")
        out.setdefault(exp, {})[field] = value
    return out


def cmd_analyze(args: argparse.Namespace) -> int:
    import poslens
    from poslens import distributed, experiments
    from poslens._config import override
    from poslens.experiments.analyze import analyze
    from poslens.io import jsonable, write_json
    from poslens.limits import check_analysis, check_output_dir
    from poslens.precision import autocast

    names = _experiment_names(args.experiments)
    modules = [experiments.get(n) for n in names]  # validates every name before any work
    common = {
        "n_images": args.images,
        "probe_images": min(args.probe_images, args.images),
        "batch_size": args.batch_size,
        "seed": args.seed,
        "probe_block": args.probe_block,
        "precision": args.precision,
    }
    sets = _overrides(args.set, names)
    # ConfigError before any work, too
    configs = [
        m.Config(**{**common, **override(m.Config, n, sets.get(n, {}))})
        for n, m in zip(names, modules, strict=True)
    ]
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
            raise UserError("poslens analyze needs a checkpoint folder or --model timm:NAME")
        if args.data is not None or args.weights is not None:
            raise UserError("--data and --weights go with --model timm:NAME, not a checkpoint")
        model = poslens.load(args.checkpoint, device=device, allow_unfinished=args.allow_unfinished)
        data = poslens.load_task(args.checkpoint)
        source = {"checkpoint": str(args.checkpoint)}
        status = _unfinished(args.checkpoint)
        if status is not None:  # loaded with --allow-unfinished: the results say so
            source["unfinished"] = status.to_dict()  # type: ignore[assignment]
    autocast(model, args.precision)  # UserError now if torch cannot run this precision here
    out = Path(args.out)
    check_output_dir(out)
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

    records = analyze(
        model, data, names, configs, out, progress=main and not args.no_progress, on_done=done
    )
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


def cmd_sae_train(args: argparse.Namespace) -> int:
    import poslens
    from poslens.limits import check_output_dir, check_sae
    from poslens.sae import SAEConfig
    from poslens.sae.pipeline import train_on_checkpoint

    cfg = SAEConfig(
        site=args.site, expansion=args.expansion, k=args.k, epochs=args.epochs, whiten=args.whiten
    )
    if args.images < 10:
        raise UserError(f"--images must be at least 10, got {args.images}")
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

    changes: dict[str, object] = {"precision": args.precision}
    if args.pretrained:
        if args.models:
            raise UserError("--models names encodings to train; --pretrained replaces them")
        if not args.data:
            raise UserError("--pretrained needs --data DIR: an image folder or datasets directory")
        changes["pretrained"] = tuple(args.pretrained)
        changes["images"] = args.data
    elif args.data:
        changes["task"] = args.data
    if args.models:
        changes["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if args.seeds is not None:
        changes["seeds"] = args.seeds
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


def build_parser() -> argparse.ArgumentParser:
    from poslens._config import ANALYSIS_PRECISIONS
    from poslens.training.config import PRESETS

    p = _Parser(
        prog="poslens", description="How ViTs represent patch position, under APE and RoPE."
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a small ViT on a built-in task")
    t.add_argument(
        "--preset",
        action="append",
        choices=PRESETS,
        help="default config with this encoding (repeatable)",
    )
    t.add_argument("--config", help="TOML run config with [model], [data], [train] tables")
    t.add_argument(
        "--set", action="append", metavar="SECTION.FIELD=VALUE", help="override one config field"
    )
    t.add_argument(
        "--out", required=True, help="checkpoint folder (one subfolder per preset if several)"
    )
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    t.add_argument(
        "--seeds",
        metavar="K,K,...",
        help="train these train.seed values as one ensemble (faster than one by one), each into "
        "OUT/seedK; the models equal separate runs up to float rounding",
    )
    t.add_argument(
        "--compile",
        action="store_true",
        help="with --seeds: torch.compile the ensemble's training step (needs a C++ compiler; "
        "the first compile of a config takes tens of seconds, later runs reuse its cache)",
    )
    t.add_argument("--device", default="cpu", help=DEVICE_HELP)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    a = sub.add_parser("analyze", help="run position experiments on a checkpoint")
    a.add_argument("checkpoint", nargs="?", help="poslens checkpoint folder")
    a.add_argument("--model", help="timm:NAME, a pretrained timm ViT converted to poslens")
    a.add_argument(
        "--weights", help="with --model: a .safetensors file, or 'hub' (timm's download)"
    )
    a.add_argument(
        "--data",
        help="with --model: image folder, one subfolder per class (class index, ImageNet synset "
        "id, or all classes in order), preprocessed as the checkpoint's timm config says",
    )
    a.add_argument(
        "--experiments",
        default="all",
        help="comma-separated: depth_profile,position_removal,axis_map,windows,components,"
        "resolution,prefix_attention,heads,sae_causal (default: all that apply)",
    )
    a.add_argument("--out", required=True, help="folder for JSON, CSV and figures")
    a.add_argument("--images", type=int, default=500, help="evaluation images (default 500)")
    a.add_argument("--probe-images", type=int, default=200, help="images for probes (default 200)")
    a.add_argument("--batch-size", type=int, default=250)
    a.add_argument("--seed", type=int, default=0, help="RPI permutation, probe split, random draws")
    a.add_argument(
        "--probe-block", type=int, default=-1, help="site for single-site probes (-1: automatic)"
    )
    a.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="EXP.FIELD=VALUE",
        help="override an experiment's config field, e.g. "
        "sae_causal.sites=blocks.0.hook_resid_pre,blocks.2.hook_resid_pre (repeatable)",
    )
    a.add_argument("--device", default="cpu", help=DEVICE_HELP)
    a.add_argument(
        "--precision",
        choices=ANALYSIS_PRECISIONS,
        default="fp32",
        help="forward passes in float32 (default) or under torch.autocast in bfloat16 / float16; "
        "statistics are always computed in float32 or float64",
    )
    a.add_argument("--no-progress", action="store_true", help="no progress bars")
    a.add_argument(
        "--allow-unfinished",
        action="store_true",
        help="use a checkpoint whose training did not finish (recorded in the results)",
    )
    a.set_defaults(fn=cmd_analyze)

    sae = sub.add_parser("sae", help="sparse autoencoders on a checkpoint's activations")
    sae_sub = sae.add_subparsers(dest="sae_command", required=True, parser_class=_Parser)
    st = sae_sub.add_parser(
        "train", help="train a TopK SAE at one hook and find positional latents"
    )
    st.add_argument("checkpoint", help="poslens checkpoint folder")
    st.add_argument("--site", default="blocks.1.ln1.hook_normalized", help="hook name")
    st.add_argument("--out", required=True, help="folder for the SAE, its report and figure")
    st.add_argument("--k", type=int, default=16, help="active latents per token")
    st.add_argument("--expansion", type=int, default=4, help="d_sae / d_in")
    st.add_argument("--epochs", type=int, default=5)
    st.add_argument("--whiten", action="store_true", help="train on exactly whitened activations")
    st.add_argument("--images", type=int, default=1000, help="training images (default 1000)")
    st.add_argument("--device", default="cpu", help=DEVICE_HELP)
    st.add_argument("--no-progress", action="store_true", help="no progress bar")
    st.add_argument(
        "--allow-unfinished",
        action="store_true",
        help="use a checkpoint whose training did not finish (recorded in the results)",
    )
    st.set_defaults(fn=cmd_sae_train)

    sy = sub.add_parser(
        "study",
        help="train, analyse and report: the whole study in one command",
        description="Train each model and seed (reusing finished checkpoints), or load "
        "pretrained timm models, run every experiment, aggregate seeds, and write results.json, "
        "CSV, figures, report.html and report.md. Rerun the same command to continue an "
        "interrupted study.",
    )
    sy.add_argument("--preset", choices=("quick", "default", "paper"), default="default")
    sy.add_argument("--models", help="comma-separated encodings (default: the preset's)")
    sy.add_argument("--seeds", type=int, help="seeds per model (default: the preset's)")
    sy.add_argument(
        "--pretrained",
        action="append",
        metavar="timm:NAME=WEIGHTS",
        help="study a pretrained timm model instead of training (repeat for several); WEIGHTS "
        "is a .safetensors file or hub; seeds become analysis seeds",
    )
    sy.add_argument(
        "--data",
        help="task: relation, animals (default relation); with --pretrained: an image folder "
        "(class subfolders) or a datasets directory (DIR or DIR::SPLIT)",
    )
    sy.add_argument(
        "--precision",
        choices=ANALYSIS_PRECISIONS,
        default="fp32",
        help="the experiments' forward passes (bf16/fp16 under torch.autocast)",
    )
    sy.add_argument("--out", required=True, help="output folder (reused to continue)")
    sy.add_argument("--device", default="cpu", help=DEVICE_HELP)
    sy.add_argument(
        "--jobs",
        type=_count,
        default=0,
        help="model/seed runs in parallel processes (default 0: one per core on the CPU)",
    )
    sy.add_argument(
        "--threads", type=_count, default=0, help="torch threads per job (0: cores / jobs)"
    )
    sy.add_argument("--no-progress", action="store_true", help="no progress display")
    sy.add_argument(
        "--executor",
        choices=("local", "slurm"),
        default="local",
        help="local (default): processes on this machine (--jobs); slurm: each model/seed run "
        "as a SLURM job through submitit (pip install 'poslens[slurm]'; --jobs: jobs at a time, "
        "default all), results written to the shared --out; see docs/study.md",
    )
    sl = sy.add_argument_group("SLURM jobs (with --executor slurm)")
    sl.add_argument("--slurm-partition", metavar="P", help="partition (default: the cluster's)")
    sl.add_argument(
        "--slurm-time",
        dest="slurm_time_min",
        type=int,
        metavar="MIN",
        help="time limit of each job in minutes (default 720); a job that reaches it, or is "
        "preempted, is requeued and continues",
    )
    sl.add_argument("--slurm-gpus-per-task", type=int, metavar="N", help="GPUs per job (0)")
    sl.add_argument(
        "--slurm-cpus-per-task", type=int, metavar="N", help="CPUs per job, its torch threads (4)"
    )
    sl.add_argument("--slurm-mem-gb", type=float, metavar="GB", help="memory per job")
    sl.add_argument(
        "--slurm-option",
        dest="slurm_options",
        action="append",
        metavar="KEY=VALUE",
        help="any other sbatch option, e.g. account=abc, qos=high, constraint=a100 (repeatable)",
    )
    sy.set_defaults(fn=cmd_study)

    i = sub.add_parser("info", help="describe a checkpoint")
    i.add_argument("checkpoint", nargs="?", help="poslens checkpoint folder")
    i.add_argument("--model", help="timm:NAME, a pretrained timm ViT converted to poslens")
    i.add_argument(
        "--weights", help="weights: a .safetensors file, or 'hub' (timm's download) for timm:NAME"
    )
    i.add_argument("--hooks", action="store_true", help="list every hook point name")
    i.add_argument(
        "--allow-unfinished", action="store_true", help="describe an unfinished training run too"
    )
    i.set_defaults(fn=cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from poslens.allocator import keep_freed_memory

    keep_freed_memory()  # this process is ours: reuse big freed CPU blocks (poslens/allocator.py)
    try:
        if getattr(args, "device", None) is not None:
            from poslens.limits import check_device

            here = getattr(args, "executor", "local") == "local"  # slurm: checked on the nodes
            if here:
                args.device = resolve_device(args.device)
            check_device(args.device, here=here)
        return int(args.fn(args))
    except UserError as e:
        print(f"poslens: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except WorkerLost as e:  # not the input's fault: exit 1, with what is kept
        print(f"poslens: error: {' '.join(str(e).split())}; {INTERRUPTED.get(args.command, '')}",
              file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        print(f"poslens: interrupted ({INTERRUPTED.get(args.command, '')})", file=sys.stderr)
        return 130


# What an interrupted command leaves, and how to continue: only train takes --resume.
INTERRUPTED = {
    "train": "checkpoints written so far are kept; rerun with --resume to continue",
    "study": "finished stages are kept; rerun the same command to continue",
    "analyze": "experiments saved so far are kept, without analysis.json; rerun to redo them",
    "sae": "nothing was saved; rerun the command",
    "info": "nothing was written",
}


if __name__ == "__main__":
    sys.exit(main())
