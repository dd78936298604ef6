"""The argument parser of `poslens`: one subcommand per command, each in its own module."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from poslens.cli.analyze import cmd_analyze
from poslens.cli.compare import add_parser as add_compare
from poslens.cli.export import cmd_export
from poslens.cli.info import cmd_info
from poslens.cli.merge import add_parser as add_merge
from poslens.cli.report import cmd_report
from poslens.cli.sae import cmd_sae_train
from poslens.cli.study import cmd_study
from poslens.cli.train import cmd_train
from poslens.models import hooks


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"poslens: error: {message} (see {self.prog} --help)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """An unknown option is named before anything else argparse would say (a missing
        subcommand or required option hid it: `poslens --frob`)."""
        argv = _joined_values(self, list(sys.argv[1:] if args is None else args))
        unknown = _unknown_option(self, argv)
        if unknown is not None:
            self.error(f"unrecognized arguments: {unknown}")
        return super().parse_args(argv, namespace)


def _unknown_option(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first token of argv that looks like an option and that no parser on its subcommand
    path knows (abbreviations included, as argparse takes them); None if there is none."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    for i, token in enumerate(argv):
        if token == "--":
            return None
        if sub is not None and token in sub.choices:
            return _unknown_option(sub.choices[token], argv[i + 1 :])
        if not token.startswith("-") or token == "-":
            continue
        found = parser._parse_optional(token)  # None: a positional (e.g. a negative number)
        found = found[0] if isinstance(found, list) and len(found) == 1 else found
        if isinstance(found, tuple) and found[0] is None:
            return token.partition("=")[0]
    return None


# A token that starts like a negative number ("-1,2", "-1e5", "-3-5", "-.5"): argparse takes
# only plain ones ("-1", "-1.5") as values, the rest as options; no poslens option looks like it.
NEGATIVE = re.compile(r"-\.?\d")


def _joined_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with each value that starts like a negative number joined to the option before it
    (`--seeds -1,2` -> `--seeds=-1,2`), so that the option's own check names it rather than
    argparse calling "-1,2" an unrecognized argument."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        if sub is not None and token in sub.choices:
            return [*out, token, *_joined_values(sub.choices[token], argv[i + 1 :])]
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if token.startswith("--") and "=" not in token and NEGATIVE.match(following):
            found = parser._parse_optional(token)
            found = found[0] if isinstance(found, list) and len(found) == 1 else found
            action = found[0] if isinstance(found, tuple) else None
            if action is not None and action.nargs is None:  # an option taking one value
                out.append(f"{token}={following}")
                i += 2
                continue
        out.append(token)
        i += 1
    return out


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


def _at_least(low: int, what: str) -> Callable[[str], int]:
    """argparse type of a count or seed: an integer of at least `low`, else "must be WHAT, got V"
    (argparse puts the argument's name in front)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def _positive_number(text: str) -> float:
    """argparse type of a rate: a number above 0 (a finite bound is the config's to check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


NON_NEGATIVE = _at_least(0, "a non-negative integer")
POSITIVE = _at_least(1, "a positive integer")


def build_parser(prog: str = "poslens") -> argparse.ArgumentParser:
    from poslens._config import ANALYSIS_PRECISIONS
    from poslens.training.config import PRESETS

    p = _Parser(prog=prog, description="How ViTs represent patch position, under APE and RoPE.")
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
    a.add_argument(
        "--model",
        help="timm:NAME (a pretrained timm ViT) or hf:DIR (a Hugging Face ViT / DeiT folder), "
        "converted to poslens",
    )
    a.add_argument(
        "--weights",
        help="with --model timm:NAME: a .safetensors file, or 'hub' (timm's download); with "
        "hf:DIR: a .safetensors file instead of DIR/model.safetensors",
    )
    a.add_argument(
        "--data",
        help="with --model: image folder, one subfolder per class (class index, ImageNet synset "
        "id, hf:DIR's id2label name, or all classes in order), preprocessed as the checkpoint's timm "
        "config or HF image processor says",
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
    a.add_argument(
        "--batch-size", type=NON_NEGATIVE, default=0,
        help="images per forward pass (default 0: chosen from the model and the device's memory)",
    )  # fmt: skip
    a.add_argument(
        "--seed", type=NON_NEGATIVE, default=0, help="RPI permutation, probe split, random draws"
    )
    a.add_argument(
        "--probe-block",
        type=_at_least(-1, "-1 (automatic) or a site index 0, 1, ..."),
        default=-1,
        help="site for single-site probes (-1: automatic)",
    )
    a.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="EXP.FIELD=VALUE",
        help="override an experiment's config field, e.g. "
        "sae_causal.sites=blocks.0.hook_resid_pre,blocks.2.hook_resid_pre (repeatable)",
    )
    a.add_argument(
        "--sae",
        action="append",
        default=[],
        metavar="DIR",
        help="sae_causal: use this SAE at the hook its cfg.json names instead of training one "
        "(a poslens SAE folder, or a SAELens TopK, standard (ReLU) or JumpReLU one; repeatable, "
        "one per hook); the sites default to the SAEs' hooks",
    )
    a.add_argument("--device", default="cpu", help=DEVICE_HELP)
    a.add_argument(
        "--precision",
        choices=ANALYSIS_PRECISIONS,
        default="fp32",
        help="forward passes in float32 (default), under torch.autocast in bfloat16 / float16, or "
        "auto (bf16 where the device runs it natively, else fp32); statistics are always "
        "computed in float32 or float64",
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
    st.add_argument("--site", default=hooks.normalized(1), help="hook name")
    st.add_argument("--out", required=True, help="folder for the SAE, its report and figure")
    st.add_argument("--k", type=POSITIVE, default=16, help="active latents per token")
    st.add_argument("--expansion", type=POSITIVE, default=4, help="d_sae / d_in")
    st.add_argument("--epochs", type=POSITIVE, default=5)
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
    sy.add_argument(
        "--preset",
        choices=("quick", "default", "confirm", "paper", "ladder"),
        default="default",
        help="quick (smoke test), default (the calibrated study), confirm (the default's design "
        "at the pre-registered seed count on the fresh block: docs/preregistration.md; run it in "
        "blocks of --seeds A-B and `poslens merge` them), paper (sized for a GPU), or "
        "ladder: the study along a scale ladder of grid, width, depth and task (docs/ladder.md; "
        "an hour or more on 2 cores)",
    )
    sy.add_argument(
        "--rungs",
        help="with --preset ladder: comma-separated rungs to run (default all: "
        "g6,g10,g14,g14_w64,d8,d12,g6_quadrant)",
    )
    sy.add_argument("--models", help="comma-separated encodings (default: the preset's)")
    sy.add_argument(
        "--seeds",
        help="seeds per model, N (seeds 0..N-1, or from --seed-start) or a range A-B such as 5-9 "
        "(default: the preset's count)",
    )
    sy.add_argument(
        "--model-seeds",
        metavar="MODEL=N[,MODEL=N]",
        help="these study models (and their in-situ controls) run N seeds from the first seed "
        "instead of --seeds, e.g. rope_axial=8: the seeds a level's power asks for on one model",
    )
    sy.add_argument(
        "--seed-start",
        type=NON_NEGATIVE,
        help="the first seed (default 0): --seed-start 5 --seeds 5 replicates a study on seeds 5-9",
    )
    sy.add_argument(
        "--pretrained",
        action="append",
        metavar="timm:NAME=WEIGHTS|hf:DIR",
        help="study a pretrained timm model instead of training (repeat for several); WEIGHTS "
        "is a .safetensors file or hub; or hf:DIR, a Hugging Face ViT / DeiT folder; seeds "
        "become analysis seeds",
    )
    sy.add_argument(
        "--data",
        help="task: relation, animals (default relation); with --pretrained: an image folder "
        "(class subfolders), a datasets directory (DIR or DIR::SPLIT), or task:CHECKPOINT (a "
        "poslens checkpoint's own task, for a model exported with `poslens export`)",
    )
    sy.add_argument(
        "--precision",
        choices=ANALYSIS_PRECISIONS,
        default=None,
        help="the experiments' forward passes: fp32, bf16 / fp16 under torch.autocast, or auto "
        "(bf16 where the device runs it natively, else fp32); default fp32, and auto with "
        "--pretrained",
    )
    sy.add_argument(
        "--train-precision",
        choices=("fp32", "bf16", "auto"),
        default=None,
        help="training precision of the study's models: fp32 (the presets'), bf16 autocast, or "
        "auto (bf16 where the CPU/GPU runs it natively, else fp32); on a CPU with AVX512-BF16 / "
        "AMX bf16 trains the default study's width-32 models only about 4%% faster, and is another "
        'seed draw, not a copy of the fp32 study (docs/study.md, "Training in bf16")',
    )
    sy.add_argument(
        "--no-in-situ",
        action="store_true",
        help="leave out the in-situ controls (the studied models' weights edited to plant or "
        "remove each mechanism); a pretrained study then has no controls",
    )
    sy.add_argument(
        "--gate-retries",
        type=NON_NEGATIVE,
        metavar="N",
        help="the accuracy gate: retrain a seed whose training never reached train.stop_acc from "
        "reserve seeds (seed + 1000, + 2000, ...) up to N times, reported as such; 0: off "
        "(default: 2 for default and paper, 0 for quick and --pretrained)",
    )
    sy.add_argument(
        "--rebuild-finetune",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --pretrained: calibrate the rebuild claim on the studied RoPE weights "
        "fine-tuned STEPS steps on --data's images, rotations withheld in held-out windows "
        "(positive) or in late blocks only (negative); default 0: no fine-tune, the claim "
        "is then calibrated on trained toy models only",
    )
    sy.add_argument(
        "--finetune-lr",
        type=_positive_number,
        default=1e-4,
        help="the fine-tunes' peak learning rate (1e-4)",
    )
    sy.add_argument(
        "--finetune-batch", type=POSITIVE, default=32, help="the fine-tunes' batch size (32)"
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
    i.add_argument(
        "--model",
        help="timm:NAME (a pretrained timm ViT) or hf:DIR (a Hugging Face ViT / DeiT folder), "
        "converted to poslens",
    )
    i.add_argument(
        "--weights",
        help="weights: a .safetensors file, or 'hub' (timm's download) for timm:NAME; for "
        "hf:DIR, instead of DIR/model.safetensors",
    )
    i.add_argument("--hooks", action="store_true", help="list every hook point name")
    i.add_argument(
        "--allow-unfinished", action="store_true", help="describe an unfinished training run too"
    )
    i.set_defaults(fn=cmd_info)

    x = sub.add_parser(
        "export",
        help="write a poslens checkpoint as timm weights, to study it as a pretrained model",
    )
    x.add_argument("checkpoint", help="poslens checkpoint folder")
    x.add_argument(
        "--timm",
        metavar="NAME",
        help="the timm architecture (default: vit_tiny_patch16_224 for APE, "
        "vit_small_patch16_rope_224 for RoPE-Axial); its shapes come from the checkpoint",
    )
    x.add_argument("--out", required=True, help="the .safetensors file to write")
    x.set_defaults(fn=cmd_export)

    r = sub.add_parser(
        "report", help="rebuild a study's report.html and report.md from its results.json"
    )
    r.add_argument("dir", metavar="DIR", help="a `poslens study` output folder")
    r.set_defaults(fn=cmd_report)

    add_compare(sub)
    add_merge(sub, _count)
    return p
