"""A refused command leaves nothing behind (issue 71): every subcommand run with a bad value in each
argument that names a path or a number exits 2 with one `poslens: error:` line naming the problem,
and leaves the file system as it found it (every path, with each file's size and modification
time: no --out created, no input touched).

The table gives each subcommand a valid invocation and, per argument, bad values; a case is that
invocation with one argument replaced. A test walks the parser so that a subcommand or a path or
number argument added later without bad values here fails.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from poslens.cli import build_parser, main
from poslens.io import save_tensors, write_json
from tests.conftest import TINY
from tests.report.synthetic import make_valid_study

SMALL = ["--set", "model.dim=16", "--set", "model.depth=1", "--set", "train.steps=4"]


@dataclass(frozen=True)
class Command:
    """A valid invocation (`<name>` a positional, `{name}` a path of the inputs) and bad values
    per argument: (value, fragment of the one-line message)."""

    base: tuple[str, ...]
    bad: dict[str, list[tuple[str, str]]]
    needs: str = ""  # an optional package the inputs need (the Hugging Face folder: transformers)
    # options whose bad value is added after the valid ones (any other option is replaced): a
    # second --pretrained is refused after the first was converted, and must leave nothing
    append: frozenset[str] = frozenset({"--set", "--sae"})


POSITIONALS = {"<checkpoint>": "{ck}", "<dir>": "{study_a}", "<runs>": "{study_b}",
               "<blocks>": "{study_b}"}  # fmt: skip
MISSING_CHECKPOINT = [("{nowhere}", "checkpoint not found"),
                      ("{a_file}", "is a file, not a checkpoint folder"),
                      ("{empty}", "config.json")]  # fmt: skip
OUT_DIR = [("{a_file}", "is a file, not a folder"), ("{a_file}/sub", "is a file, not a folder"),
           ("", "--out is empty")]  # fmt: skip
IMAGES = [("{nowhere}", "does not exist"), ("{a_file}", "is not a directory"),
          ("{empty}", "no class subfolders"), ("{images_one}", "needs at least 2 images"),
          ("{images_many}", "8 class folders cannot be matched to the model's 5 classes")]  # fmt: skip
HF_MODEL = [("hf:{nowhere}", "{nowhere}"), ("hf:{a_file}", "{a_file}"), ("hf:{empty}", "{empty}"),
            ("hf:", "needs a folder"), ("hf:{hf_bert}", "'bert'")]  # fmt: skip
WEIGHTS = [("{nowhere}.safetensors", "{nowhere}.safetensors not found"),
           ("{a_file}", "is not a valid safetensors file")]  # fmt: skip


def _number(flag: str, *values: str) -> list[tuple[str, str]]:
    """Bad values of a number whose message names its argument."""
    return [(v, flag) for v in values]


TABLE: dict[str, Command] = {
    "train": Command(("train", "--out", "{out}", "--no-progress", *SMALL), {
        "--out": OUT_DIR,
        "--config": [("{nowhere}.toml", "{nowhere}.toml"), ("{empty}", "{empty}"),
                     ("{bad_toml}", "bad.toml")],
        "--seeds": [("-1,2", "--seeds needs distinct non-negative integers, got '-1,2'"),
                    ("-1", "--seeds needs distinct non-negative"), ("1,1", "--seeds needs"),
                    ("x", "--seeds takes comma-separated integers"),
                    ("", "--seeds takes comma-separated integers")],
        "--set": [("train.steps=-1", "train.steps"), ("train.seed=-1", "train.seed"),
                  ("data.image_size=-16", "data.image_size"), ("model.dim=-1e5", "model.dim")],
    }),
    "analyze": Command(("analyze", "<checkpoint>", "--out", "{out}", "--no-progress", "--images",
                        "16", "--probe-images", "10"), {
        "<checkpoint>": MISSING_CHECKPOINT,
        "--out": OUT_DIR,
        "--images": [("-5", "--images must be at least 10"), *_number("--images", "-1e5", "x")],
        "--probe-images": [("-5", "--probe-images must be at least 10"),
                           *_number("--probe-images", "-1,2")],
        "--batch-size": _number("--batch-size", "-1", "-1,2", "x"),
        "--seed": _number("--seed", "-1", "-1e3", "x"),
        "--probe-block": _number("--probe-block", "-5", "x"),
        "--sae": [("{nowhere}", "{nowhere}"), ("{a_file}", "a_file"), ("{empty}", "empty")],
        "--set": [("position_removal.draws=-1", "draws")],
    }),
    "analyze --model": Command(("analyze", "--model", "hf:{hf}", "--data", "{images}", "--out",
                                "{out}", "--no-progress", "--images", "10", "--probe-images", "10"),
        {"--model": HF_MODEL, "--weights": WEIGHTS, "--data": IMAGES, "--out": OUT_DIR},
        needs="transformers"),
    "sae train": Command(("sae", "train", "<checkpoint>", "--out", "{out}", "--no-progress",
                          "--images", "16"), {
        "<checkpoint>": MISSING_CHECKPOINT,
        "--out": OUT_DIR,
        "--k": _number("--k", "-1", "0", "x"),
        "--expansion": _number("--expansion", "-1", "-1,2"),
        "--epochs": _number("--epochs", "-1", "-1e5"),
        "--images": [("-1", "--images must be at least 10"), *_number("--images", "x")],
    }),
    "study": Command(("study", "--preset", "quick", "--out", "{out}", "--no-progress", "--jobs",
                      "1"), {
        "--out": OUT_DIR,
        "--seeds": [("-1", "--seeds: study.seeds must be a positive integer, got -1"),
                    ("0", "--seeds: study.seeds"), ("-1,2", "--seeds takes a count N"),
                    ("-3-5", "--seeds takes a count N"), ("x", "--seeds takes a count N"),
                    ("1000000000", "--seeds: study.seeds 1,000,000,000 is more than")],
        "--seed-start": _number("--seed-start", "-1", "x"),
        "--model-seeds": [("ape=-1", "--model-seeds: study.model_seeds"),
                          ("ape=x", "--model-seeds: study.model_seeds")],
        "--gate-retries": [*_number("--gate-retries", "-1"),
                           ("99", "--gate-retries: study.gate_retries")],
        "--rebuild-finetune": [("x", "--rebuild-finetune"),
                               ("5", "--rebuild-finetune goes with --pretrained")],
        "--finetune-lr": _number("--finetune-lr", "-1", "0", "x"),
        "--finetune-batch": _number("--finetune-batch", "-1", "0"),
        "--jobs": _number("--jobs", "-1", "-1e5", "100000"),
        "--threads": _number("--threads", "-2", "x"),
        "--data": [("{nowhere}", "data.task")],
        "--pretrained": [("hf:{nowhere}", "--data")],  # a pretrained study needs --data
    }),
    "study --executor slurm": Command(("study", "--preset", "quick", "--out", "{out}",
                                       "--no-progress", "--executor", "slurm"), {
        "--slurm-time": [("-1", "--slurm-time must be at least 1"),
                         ("0", "--slurm-time must be at least 1"), ("x", "--slurm-time")],
        "--slurm-gpus-per-task": [("-1", "--slurm-gpus-per-task must be at least 0")],
        "--slurm-cpus-per-task": [("0", "--slurm-cpus-per-task must be at least 1"),
                                  ("-1e5", "--slurm-cpus-per-task")],
        "--slurm-mem-gb": [("-1", "--slurm-mem-gb must be positive"), ("x", "--slurm-mem-gb")],
    }),
    "study --pretrained": Command(("study", "--preset", "quick", "--pretrained", "hf:{hf}",
                                   "--data", "{images}", "--seeds", "1", "--out", "{out}",
                                   "--no-progress", "--jobs", "1"), {
        "--pretrained": HF_MODEL,
        "--data": [*IMAGES,
                   ("task:{nowhere}", "is not a poslens checkpoint folder"),
                   ("task:{a_file}", "is not a poslens checkpoint folder"),
                   ("task:{task_nodata}", "task_nodata/config.json has no [data] section"),
                   ("task:{task_big}", "data.image_size must be int, got str 'big'"),
                   ("task:{task_wide}", "the task's images are 1x32x32, the model takes 3x16x16")],
        "--out": OUT_DIR,
        "--seeds": [("-1", "--seeds: study.seeds"), ("-1,2", "--seeds takes a count N")],
        "--finetune-lr": _number("--finetune-lr", "-1"),
    }, needs="transformers", append=frozenset({"--pretrained"})),
    "info": Command(("info", "<checkpoint>"), {"<checkpoint>": MISSING_CHECKPOINT}),
    "info --model": Command(("info", "--model", "hf:{hf}"),
                            {"--model": HF_MODEL, "--weights": WEIGHTS}, needs="transformers"),
    "export": Command(("export", "<checkpoint>", "--out", "{out}.safetensors"), {
        "<checkpoint>": MISSING_CHECKPOINT,
        "--out": [("", "--out is empty"), ("{empty}", "is a folder, not a file"),
                  ("{a_file}/x.safetensors", "is a file, not a folder")],
    }),
    "report": Command(("report", "<dir>"), {
        "<dir>": [("{nowhere}", "is not a folder"), ("{a_file}", "is not a folder"),
                  ("{empty}", "results.json"), ("{bad_results}", "results.json")],
    }),
    "compare": Command(("compare", "{study_a}", "<runs>"), {
        "<runs>": [("{nowhere}", "is not a folder"), ("{a_file}", "is not a folder"),
                   ("{empty}", "results.json")],
        "--out": [("{a_file}", "is a file, not a folder"), ("", "--out is empty")],
        "--md": [("{empty}", "--md"), ("{a_file}/x.md", "--md"), ("", "--md is empty")],
        "--html": [("{empty}", "--html"), ("{a_file}/x.html", "--html"), ("", "--html is empty")],
    }),
    "merge": Command(("merge", "{study_a}", "<blocks>", "--out", "{out}"), {
        "<blocks>": [("{nowhere}", "holds no results.json"), ("{a_file}", "results.json"),
                     ("{empty}", "holds no results.json")],
        "--out": [*OUT_DIR, ("{study_a}", "is one of the blocks")],
        "--jobs": _number("--jobs", "-1"),
        "--threads": _number("--threads", "-2", "-1,2"),
    }),
}  # fmt: skip


def _argv(cmd: Command, argument: str, value: str) -> list[str]:
    """The command's valid invocation with `argument` set to `value`."""
    tokens = list(cmd.base)
    if argument.startswith("-"):
        if argument in tokens and argument not in cmd.append:
            i = tokens.index(argument)
            del tokens[i : i + 2]
        tokens += [argument, value]
    else:
        tokens[tokens.index(argument)] = value
    return [POSITIONALS.get(t, t) for t in tokens]


CASES = [
    pytest.param(name, argument, value, fragment, id=f"{name} {argument} {value!r}")
    for name, cmd in TABLE.items()
    for argument, values in cmd.bad.items()
    for value, fragment in values
]


def _checkpoint(folder: Path, image_size: int = 16) -> Path:
    """A tiny poslens checkpoint (relation task, one channel) with its [data] section."""
    from poslens.data import DataConfig
    from poslens.models import ModelConfig, build_model

    cfg = ModelConfig(**{**TINY, "num_classes": 16, "image_size": image_size})  # type: ignore[arg-type]
    data = DataConfig(image_size=image_size, object_scale=0.32, n_val=30, n_test=40)
    write_json(folder / "config.json", {"model": cfg.to_dict(), "data": data.__dict__})
    save_tensors(folder / "model.safetensors", build_model(cfg).state_dict())
    return folder


def _images(root: Path, classes: int, per_class: int) -> Path:
    rng = np.random.default_rng(0)
    for k in range(classes):
        (root / str(k)).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / str(k) / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every input a case reads, valid or broken, in one folder (watched by every case)."""
    root = tmp_path_factory.mktemp("inputs")
    paths = {"ck": _checkpoint(root / "ck"), "a_file": root / "a_file", "empty": root / "empty",
             "nowhere": root / "nowhere"}  # fmt: skip
    paths["a_file"].write_text("not a folder")
    paths["empty"].mkdir()
    paths["task_wide"] = _checkpoint(root / "task_wide", image_size=32)
    for name, edit in (("task_big", {"image_size": "big"}), ("task_nodata", None)):
        paths[name] = _checkpoint(root / name)
        raw = json.loads((paths[name] / "config.json").read_text())
        raw.pop("data") if edit is None else raw["data"].update(edit)
        (paths[name] / "config.json").write_text(json.dumps(raw))
    paths["images"] = _images(root / "images", 5, 2)
    paths["images_one"] = _images(root / "images_one", 1, 1)
    paths["images_many"] = _images(root / "images_many", 8, 1)
    paths["hf_bert"] = root / "hf_bert"  # a Hugging Face folder of a model poslens cannot read
    paths["hf_bert"].mkdir()
    (paths["hf_bert"] / "config.json").write_text('{"model_type": "bert"}')
    save_tensors(paths["hf_bert"] / "model.safetensors", {"w": torch.zeros(1)})
    paths["bad_toml"] = root / "bad.toml"
    paths["bad_toml"].write_text("[train\nsteps = -1\n")
    for name in ("study_a", "study_b"):
        (root / name).mkdir()
        results = make_valid_study(root / name)
        (root / name / "results.json").write_text(json.dumps(results))
    paths |= {"study_a": root / "study_a", "study_b": root / "study_b"}
    (root / "bad_results").mkdir()
    (root / "bad_results" / "results.json").write_text('{"schema": 1}')
    paths["bad_results"] = root / "bad_results"
    return paths


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Hugging Face ViT folder taking 3x16x16 images, 5 classes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=5,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("hf") / "vit"
    transformers.ViTForImageClassification(cfg).eval().save_pretrained(root)
    return root


def _tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every path under the roots with, for files, its size and modification time (a folder's
    own time changes when the output check writes and removes its probe file there)."""
    return {
        str(p): (0, 0) if p.is_dir() else (p.lstat().st_size, p.lstat().st_mtime_ns)
        for root in roots
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(("name", "argument", "value", "fragment"), CASES)
def test_a_refused_command_leaves_nothing_behind(
    name: str,
    argument: str,
    value: str,
    fragment: str,
    inputs: dict[str, Path],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cmd = TABLE[name]
    paths = {k: str(v) for k, v in inputs.items()} | {"out": str(tmp_path / "o")}
    roots = [tmp_path, inputs["ck"].parent]
    if cmd.needs == "transformers":
        paths["hf"] = str(request.getfixturevalue("hf"))
        roots.append(Path(paths["hf"]).parent)
    argv = [t.format(**paths) for t in _argv(cmd, argument, value)]
    monkeypatch.chdir(tmp_path)  # what an empty path would write lands in the watched folder
    capsys.readouterr()
    before = _tree(*roots)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (argv, err)
    assert len(lines) == 1 and lines[0].startswith("poslens: error:"), err
    assert fragment.format(**paths) in lines[0], (fragment, lines[0])
    assert _tree(*roots) == before, f"{argv} changed the file system"


# what the table must cover: each argument naming a path or a number (a typed argument is a
# number; these names hold paths or numbers in text)
PATHS_OR_NUMBERS = {"out", "checkpoint", "config", "data", "weights", "model", "pretrained", "sae",
                    "dir", "runs", "blocks", "md", "html", "seeds", "model_seeds", "set"}  # fmt: skip


def _subcommands(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = list(_subcommands(sub, f"{prefix}{name} "))
                yield from inner or [(f"{prefix}{name}", sub)]


def test_the_table_covers_every_subcommand_and_argument() -> None:
    """Every subcommand of the parser is in the table, and each of its arguments that names a
    path or a number has bad values there (under any variant of the subcommand)."""
    covered: dict[str, set[str]] = {}
    for name, cmd in TABLE.items():  # "study --pretrained" is a variant of study
        subcommand = name.split(" -")[0]
        covered.setdefault(subcommand, set()).update(a.strip("<>") for a in cmd.bad)
    missing = []
    for name, parser in _subcommands(build_parser()):
        assert name in covered, f"subcommand {name!r} has no bad values in TABLE"
        for action in parser._actions:
            wanted = (action.type is not None and action.nargs != 0) or (
                action.dest in PATHS_OR_NUMBERS
            )
            names = [action.dest, *action.option_strings]
            if wanted and not covered[name] & set(names):
                missing.append(f"{name} {action.option_strings or action.dest}")
    assert not missing, f"arguments without bad values: {missing}"
