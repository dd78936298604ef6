"""Hostile but realistic inputs (issue 21): lying or unfinished checkpoints, non-finite configs,
sizes no machine holds, unusable devices and outputs, hostile files, repeated experiments.

Every case in the table must end in exit code 2 with exactly one line on stderr starting
`poslens: error:`, no traceback, and must leave the whole test folder as it found it (no file
created, changed or removed). Failed writes (a full disk), Ctrl-C, byte determinism and the
--allow-unfinished record are tested after the table.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import poslens.io
from poslens.cli import main
from poslens.report.__main__ import main as report_main
from poslens.training.progress import TrainProgress
from tests.report.synthetic import make_valid_study

SETS = [
    "model.dim=16", "model.depth=1", "model.heads=2", "train.steps=4", "train.batch_size=8",
    "train.ckpt_every=2", "train.eval_every=2", "train.eval_images=16", "data.n_val=16",
    "data.n_test=16", "data.image_size=16", "data.object_scale=0.32", 'train.precision="fp32"',
]  # fmt: skip
TRAIN = [a for s in SETS for a in ("--set", s)] + ["--no-progress"]
QUICK = ["--no-progress", "--images", "20", "--probe-images", "10"]


def _train(out: Path, preset: str = "rope_axial", *extra: str) -> Path:
    assert main(["train", "--preset", preset, "--out", str(out), *TRAIN, *extra]) == 0
    return out


def _interrupt_at(step: int) -> Callable[..., None]:
    """A TrainProgress.update that presses Ctrl-C when training reaches `step`."""
    real = TrainProgress.update

    def update(self: TrainProgress, done: int, loss: float, images_per_s: float) -> None:
        if done == step:
            raise KeyboardInterrupt
        real(self, done, loss, images_per_s)

    return update


def _edit_config(folder: Path, **model: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model"].update(model)
    (folder / "config.json").write_text(json.dumps(cfg))


def _sparse(path: Path, size: int, head: bytes = b"") -> str:
    """A file of `size` bytes that takes no disk space (a hole after `head`)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A finished tiny rope_axial run, one interrupted by Ctrl-C at step 3 (weights of step 2),
    and copies whose config.json lies about the weights."""
    root = tmp_path_factory.mktemp("ckpts")
    done = _train(root / "done")
    _train(root / "ape", "ape")
    mp = pytest.MonkeyPatch()
    mp.setattr(TrainProgress, "update", _interrupt_at(3))
    try:
        assert (
            main(["train", "--preset", "rope_axial", "--out", str(root / "ctrlc"), *TRAIN]) == 130
        )
    finally:
        mp.undo()
    out = {"done": done, "ctrlc": root / "ctrlc", "ape": root / "ape"}
    lies = {
        "posenc": "none",
        "rope_layout": "half",
        "rope_theta": 100.0,
        "rope_coords": "centered",
        "norm_eps": 1e-5,
        "pool": "mean",
        "ape_init_std": 0.02,
    }
    for field, value in lies.items():
        shutil.copytree(done, root / f"lie_{field}")
        _edit_config(root / f"lie_{field}", **{field: value})
        out[f"lie_{field}"] = root / f"lie_{field}"
    for field, value in {"seed": 5, "background": "flat"}.items():  # other val/test images
        shutil.copytree(done, root / f"lie_data_{field}")
        cfg = json.loads((done / "config.json").read_text())
        cfg["data"][field] = value
        (root / f"lie_data_{field}" / "config.json").write_text(json.dumps(cfg))
        out[f"lie_data_{field}"] = root / f"lie_data_{field}"
    for name, text in {"inf": "Infinity", "nan": "NaN"}.items():
        shutil.copytree(done, root / f"nonfinite_{name}")
        cfg = (done / "config.json").read_text()
        field = "rope_theta" if name == "inf" else "norm_eps"
        cfg = cfg.replace(f'"{field}": ', f'"{field}": {text}, "_x": ', 1)
        (root / f"nonfinite_{name}" / "config.json").write_text(cfg)
        out[f"nonfinite_{name}"] = root / f"nonfinite_{name}"
    return out


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]
    fragment: str
    runner: Callable[[list[str]], int] = main


def _busy(folder: Path, command: str) -> Path:
    """A folder whose lock file names `command` as its holder (this process, pid-wise)."""
    folder.mkdir()
    (folder / poslens.io.LOCK).write_text(f"{os.getpid()} {command}\n")
    return folder


def _holding(folder: Path) -> Callable[[list[str]], int]:
    """A runner that calls main while folder's lock is held: an flock on another open file of
    it, refused exactly as another process's would be (and the lock file is left unchanged)."""
    import fcntl

    def run(argv: list[str]) -> int:
        fd = os.open(folder / poslens.io.LOCK, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return main(argv)
        finally:
            os.close(fd)

    return run


def _without_timm(argv: list[str]) -> int:
    """main as on a machine without timm installed."""
    saved = sys.modules.get("timm")
    sys.modules["timm"] = None  # type: ignore[assignment]  # `import timm` raises ImportError
    try:
        return main(argv)
    finally:
        if saved is None:
            del sys.modules["timm"]
        else:
            sys.modules["timm"] = saved


def cases(tmp: Path, ck: dict[str, Path]) -> list[Case]:
    """The table: (name, argv, fragment of the one-line message)."""
    out = str(tmp / "out")
    done, ctrlc = str(ck["done"]), str(ck["ctrlc"])
    a_file = tmp / "a_file"
    a_file.write_text("not a folder")
    train = ["train", "--preset", "rope_axial", "--out", out, *TRAIN]
    files = tmp / "files"
    files.mkdir()

    def write(name: str, text: str) -> str:
        (files / name).write_text(text)
        return str(files / name)

    deep_json = files / "deep_json"
    deep_json.mkdir()
    (deep_json / "config.json").write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    shallow_deep = files / "deep100"
    shallow_deep.mkdir()
    (shallow_deep / "config.json").write_text('{"model": ' + "[" * 100 + "]" * 100 + "}")
    huge = files / "huge"
    huge.mkdir()
    _sparse(huge / "config.json", 254 << 20, b'{"model": {')
    digits = files / "digits"
    digits.mkdir()
    (digits / "config.json").write_text('{"model": {"dim": ' + "9" * 5000 + "}}")
    big_header = files / "big_header"
    shutil.copytree(ck["done"], big_header)
    two_gb = (2_000_000_000).to_bytes(8, "little") + b'{"__metadata__":'
    _sparse(big_header / "model.safetensors", 2_100_000_000, two_gb)
    resume = files / "resume"  # the same run, its resume state replaced by a 2 GB header
    shutil.copytree(ck["done"], resume)
    (resume / "metrics.json").unlink()
    _sparse(resume / "train_state.safetensors", 2_100_000_000, two_gb)

    report_dirs = {}
    for name, text in {
        "empty": "{}",
        "nan": '{"schema": "poslens.study/2", "config": {"seeds": NaN}}',
        "deep": "[" * 100_000 + "]" * 100_000,
        "list": "[1, 2]",
    }.items():
        (files / f"report_{name}").mkdir()
        (files / f"report_{name}" / "results.json").write_text(text)
        report_dirs[name] = str(files / f"report_{name}")
    valid = make_valid_study(files / "report_schema")
    valid["config"]["seeds"] = "two"
    (files / "report_schema" / "results.json").write_text(json.dumps(valid))
    report_dirs["schema"] = str(files / "report_schema")
    (files / "report_huge").mkdir()
    _sparse(files / "report_huge" / "results.json", 100 << 20, b"{")

    sae = ["sae", "train", done, "--out", out, "--no-progress"]
    analyze = ["analyze", done, "--out", out, *QUICK]
    study = ["study", "--preset", "quick", "--no-progress", "--out", out]
    # sizes the tiny checkpoints' 16 test images hold, so that only the check under test refuses
    fits = ["--out", out, "--no-progress", "--images", "16", "--probe-images", "10"]
    an16 = ["analyze", done, *fits]
    # weights that are not a regular file: a link to /dev/zero, a FIFO, a folder
    odd = {}
    for kind in ("devzero", "fifo", "folder"):
        odd[kind] = files / f"weights_{kind}"
        shutil.copytree(ck["done"], odd[kind])
        (odd[kind] / "model.safetensors").unlink()
    (odd["devzero"] / "model.safetensors").symlink_to("/dev/zero")
    os.mkfifo(odd["fifo"] / "model.safetensors")
    (odd["folder"] / "model.safetensors").mkdir()
    loop = tmp / "loop"  # --out on a link to itself, and a link to nowhere
    loop.symlink_to(loop)
    dangling = tmp / "dangling"
    dangling.symlink_to(tmp / "nowhere")
    (tmp / "empty").mkdir()
    busy_train, busy_study = _busy(tmp / "busy_train", "train"), _busy(tmp / "busy_study", "study")
    ape = str(ck["ape"])
    images = files / "images"
    (images / "a").mkdir(parents=True)
    slurm = ["study", "--preset", "quick", "--out", out, "--no-progress", "--executor", "slurm"]
    return [
        # checkpoints tied to their config: what shapes cannot show
        *(
            Case(f"lie {f}", ["info", str(ck[f"lie_{f}"])], f"model.{f} is")
            for f in ("posenc", "rope_layout", "rope_theta", "rope_coords", "norm_eps", "pool")
        ),
        Case("lie ape_init_std", ["info", str(ck["lie_ape_init_std"])], "model.ape_init_std"),
        Case("analyze lie", ["analyze", str(ck["lie_posenc"]), "--out", out, *QUICK], "model.posenc is 'none' but"),
        Case("sae lie", ["sae", "train", str(ck["lie_rope_layout"]), "--out", out], "model.rope_layout is 'half'"),
        Case("analyze data lie", ["analyze", str(ck["lie_data_seed"]), "--out", out, *QUICK], "data.seed is 5 but the weights were trained with 0"),
        Case("sae data lie", ["sae", "train", str(ck["lie_data_background"]), "--out", out], "data.background is 'flat'"),
        # unfinished runs (Ctrl-C at step 3)
        Case("info unfinished", ["info", ctrlc], "unfinished training run (weights at step 2 of 4"),
        Case("analyze unfinished", ["analyze", ctrlc, "--out", out, *QUICK], "--allow-unfinished"),
        Case("sae unfinished", ["sae", "train", ctrlc, "--out", out], "unfinished training run"),
        # every float finite
        Case("config.json Infinity", ["info", str(ck["nonfinite_inf"])], "model.rope_theta is inf"),
        Case("config.json NaN", ["analyze", str(ck["nonfinite_nan"]), "--out", out], "model.norm_eps is nan"),
        Case("lr inf", [*train, "--set", "train.lr=inf"], "train.lr must be a finite number"),
        Case("lr nan", [*train, "--set", "train.lr=nan"], "train.lr must be a finite number"),
        Case("theta inf", [*train, "--set", "model.rope_theta=inf"], "model.rope_theta must be a finite"),
        Case("eps nan", [*train, "--set", "model.norm_eps=nan"], "model.norm_eps must be a finite"),
        Case("ape std inf", [*train, "--set", "model.ape_init_std=inf"], "model.ape_init_std must be a finite"),
        Case("toml inf", ["train", "--config", write("inf.toml", "[train]\nlr = inf\n"), "--out", out], "train.lr is inf"),
        Case("exp float inf", [*analyze, "--experiments", "heads", "--set", "heads.min_explained=inf"], "heads.min_explained must be a finite"),
        Case("lr 1e30 diverges", [*train, "--set", "train.lr=1e30", "--set", "train.ckpt_every=100"], "training diverged at step"),
        # sizes no machine holds, and counts that never end
        Case("batch 1e8", [*train, "--set", "train.batch_size=100000000"], "train.batch_size=100,000,000"),
        Case("n_test 1e9", [*train, "--set", "data.n_test=1000000000"], "data.n_test=1,000,000,000"),
        Case("image 65536", [*train, "--set", "data.image_size=65536"], "data.image_size=65,536"),
        Case("dim 1e6", [*train, "--set", "model.dim=1000000"], "model.dim=1,000,000"),
        Case("depth 1e8", [*train, "--set", "model.depth=100000000"], "model.depth=100,000,000"),
        Case("registers 1e8", [*train, "--set", "model.num_registers=100000000"], "100,000,017 tokens"),
        Case("steps 1e20", [*train, "--set", "train.steps=100000000000000000000"], "train.steps must be below 2**63"),
        Case("steps 1e8", [*train, "--set", "train.steps=100000000"], "train.steps must be at most 10,000,000"),
        Case("seed 2**70", [*train, "--set", f"train.seed={2**70}"], "train.seed must be below 2**63"),
        Case("threads 1e5", [*train, "--set", "train.threads=100000"], "train.threads must be at most 1024"),
        Case("sae expansion 1e8", [*sae, "--expansion", "100000000"], "expansion 100,000,000"),
        Case("sae images 1e9", [*sae, "--images", "1000000000"], "--images 1,000,000,000"),
        Case("sae epochs 1e8", [*sae, "--epochs", "100000000"], "sae.epochs must be at most"),
        Case("sae epochs x tokens", [*sae, "--epochs", "9000000"], "the SAE's steps"),
        Case("analyze images 1e9", ["analyze", done, "--out", out, "--images", "1000000000"], "--images 1,000,000,000"),
        Case("analyze batch 1e8", [*analyze, "--batch-size", "100000000"], "--batch-size 100,000,000"),
        Case("analyze probes 1e8", ["analyze", done, "--out", out, "--images", "100000000", "--probe-images", "100000000"], "needs about"),
        # study jobs and threads
        Case("jobs -1", ["study", "--preset", "quick", "--jobs", "-1", "--out", out], "argument --jobs"),
        Case("threads -2", ["study", "--preset", "quick", "--threads", "-2", "--out", out], "argument --threads"),
        Case("jobs 1e5", ["study", "--preset", "quick", "--jobs", "100000", "--out", out], "argument --jobs"),
        Case("threads x", ["study", "--preset", "quick", "--threads", "x", "--out", out], "must be an integer"),
        # study on SLURM: options without the executor, resources that cannot work, no sbatch here
        Case("slurm option, local", ["study", "--preset", "quick", "--out", out, "--slurm-partition", "gpu"], "add --executor slurm"),
        Case("slurm cuda, no gpus", [*slurm, "--device", "cuda"], "--slurm-gpus-per-task 1"),
        Case("slurm gpus, cpu", [*slurm, "--slurm-gpus-per-task", "1"], "with --device cuda"),
        Case("slurm time 0", [*slurm, "--slurm-time", "0"], "--slurm-time must be at least 1, got 0"),
        Case("slurm option no =", [*slurm, "--slurm-option", "account"], "expected KEY=VALUE"),
        Case("slurm mem -1", [*slurm, "--slurm-mem-gb", "-1"], "--slurm-mem-gb must be positive"),
        # where SLURM could run it, it would: only without sbatch (submitit missing says so too)
        *([Case("slurm no sbatch", slurm, "--executor slurm")] if _no_slurm() else []),
        # outputs that cannot be written
        Case("train out file", ["train", "--out", str(a_file), *TRAIN], "is a file, not a folder"),
        Case("train out under file", ["train", "--out", str(a_file / "sub"), *TRAIN], "is a file, not a folder"),
        Case("analyze out file", ["analyze", done, "--out", str(a_file), *QUICK], "is a file, not a folder"),
        Case("sae out file", ["sae", "train", done, "--out", str(a_file)], "is a file, not a folder"),
        Case("study out file", ["study", "--preset", "quick", "--out", str(a_file)], "is a file, not a folder"),
        Case("train out /proc", ["train", "--out", "/proc/poslens-out", *TRAIN], "is not writable"),
        # devices
        Case("train tpu", [*train, "--device", "tpu"], "--device 'tpu'"),
        Case("train meta", [*train, "--device", "meta"], "not meta"),
        Case("analyze cuda:7", [*analyze, "--device", "cuda:7"], "--device cuda:7"),
        Case("sae xla", [*sae, "--device", "xla"], "not xla"),
        Case("study tpu", ["study", "--preset", "quick", "--out", out, "--device", "tpu"], "--device 'tpu'"),
        Case("device empty", [*train, "--device", ""], "--device ''"),
        # hostile files
        Case("deep config.json", ["info", str(deep_json)], "nested more than 64 levels"),
        Case("depth-100 config.json", ["info", str(shallow_deep)], "nested more than 64 levels"),
        Case("254 MB config.json", ["info", str(huge)], "more than the 1,048,576"),
        Case("5000-digit int", ["info", str(digits)], "is not valid JSON (a number has more than 4,300 digits; poslens integers are below 2**63)"),
        Case("deep TOML", ["train", "--config", write("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000), "--out", out], "nested more than 64"),
        Case("2 MB TOML", ["train", "--config", _sparse(files / "big.toml", 2 << 20, b"#"), "--out", out], "more than the 1,048,576"),
        Case("deep --set", [*train, "--set", "model.dim=" + "[" * 5000 + "]" * 5000], "--set model.dim is nested"),
        Case("weights 2 GB header", ["info", str(big_header)], "declares a 2,000,000,000-byte safetensors header"),
        Case("resume 2 GB header", ["train", "--preset", "rope_axial", "--out", str(resume), *TRAIN, "--resume"], "declares a 2,000,000,000-byte"),
        # SAE sites that are not token activations, repeated experiments
        Case("sae hook_pattern", [*sae, "--site", "blocks.0.attn.hook_pattern"], "not the token activations"),
        Case("sae hook_rotary", [*sae, "--site", "blocks.0.attn.hook_rotary"], "not the token activations"),
        Case("sae hook_q", [*sae, "--site", "blocks.0.attn.hook_q"], "not the token activations"),
        Case("sae hook_embed", [*sae, "--site", "hook_embed"], "not the token activations"),
        Case("experiments twice", [*analyze, "--experiments", "axis_map,axis_map"], "lists 'axis_map' twice"),
        Case("experiments twice spaced", [*analyze, "--experiments", "axis_map, heads,axis_map"], "twice"),
        # python -m poslens.report
        Case("report {}", [report_dirs["empty"]], "lacks the required key", report_main),
        Case("report NaN config", [report_dirs["nan"]], "config.seeds is nan", report_main),
        Case("report deep", [report_dirs["deep"]], "nested more than 64", report_main),
        Case("report list", [report_dirs["list"]], "must be object, got array", report_main),
        Case("report schema", [report_dirs["schema"]], "config.seeds must be integer", report_main),
        Case("report 100 MB", [str(files / "report_huge")], "more than the 67,108,864", report_main),
        Case("report on a file", [str(a_file)], "is not a folder", report_main),
        Case("report two args", ["a", "b"], "unrecognized arguments", report_main),
        # issue 30: empty --out (Path('') is the current folder; the test runs in tmp)
        Case("train out ''", ["train", "--out", "", *TRAIN], "--out is empty"),
        Case("analyze out ''", ["analyze", done, "--out", "", "--images", "16", "--probe-images", "10"], "--out is empty"),
        Case("sae out ''", ["sae", "train", done, "--out", ""], "--out is empty"),
        Case("study out ''", ["study", "--preset", "quick", "--out", ""], "--out is empty"),
        Case("train out '  '", ["train", "--out", "  ", *TRAIN], "--out is empty"),
        # unbounded counts: the bound (poslens.limits.COUNTS) refuses them before any work
        Case("study seeds 1e9", [*study, "--seeds", "1000000000"], "study.seeds 1,000,000,000 is more than the 1,000 seeds"),
        Case("train 1001 seeds", [*train, "--seeds", ",".join(map(str, range(1001)))], "--seeds lists 1,001 seeds, more than the 1,000"),
        Case("probe images 1e9", [*an16, "--probe-images", "1000000000"], "--probe-images 1,000,000,000 is more than the 100,000,000 images"),
        Case("probe images 5", [*an16, "--probe-images", "5"], "--probe-images must be at least 10"),
        Case("draws 1e6", [*an16, "--experiments", "position_removal", "--set", "position_removal.draws=1000000"], "analysis.draws 1,000,000 is more than the 1,000 draws"),
        Case("planes 1e6", [*an16, "--experiments", "position_removal", "--set", "position_removal.n_planes=2,1000000"], "analysis.n_planes 1,000,000 is more than the 65,536"),
        Case("doses 1e8", [*an16, "--experiments", "sae_causal", "--set", "sae_causal.doses=4,100000000"], "analysis.doses 100,000,000 is more than the 1,000,000"),
        Case("sae_causal images 5", [*an16, "--experiments", "sae_causal", "--set", "sae_causal.train_images=5"], "analysis.train_images must be at least 10"),
        # given but empty: refused, never replaced by the preset's
        Case("study models ''", [*study, "--models", ""], "study.models must name at least one encoding"),
        Case("study models ','", [*study, "--models", ","], "study.models must name at least one encoding"),
        Case("pretrained models ''", [*study, "--pretrained", "timm:vit_tiny_patch16_224=hub", "--data", str(images), "--models", ""], "--pretrained replaces them"),
        # counts the model does not have, experiments it cannot run
        Case("n_planes 999", [*an16, "--experiments", "position_removal", "--set", "position_removal.n_planes=2,999"], "position_removal.n_planes 999 is more than this model's 4 rotary planes per head"),
        Case("n_planes on ape", ["analyze", ape, *fits, "--experiments", "position_removal", "--set", "position_removal.n_planes=2"], "posenc=ape has none"),
        Case("axis_map on ape", ["analyze", ape, *fits, "--experiments", "axis_map"], "none applies to this model (axis_map: posenc=ape has no rotary planes)"),
        # a refused --pretrained creates no --out (and no .lock in it)
        Case("pretrained without timm", [*study, "--pretrained", "timm:vit_tiny_patch16_224=hub", "--data", str(images)], "need the timm package", _without_timm),
        # one train or study per --out, whichever holds it
        Case("train on a busy --out", ["train", "--out", str(busy_train), *TRAIN], f"--out {busy_train} is in use by another poslens train (pid {os.getpid()})", _holding(busy_train)),
        Case("train while a study runs", ["train", "--out", str(busy_study), *TRAIN], "in use by another poslens study", _holding(busy_study)),
        Case("study while a train runs", ["study", "--preset", "quick", "--out", str(busy_train)], "in use by another poslens train", _holding(busy_train)),
        # messages that name the real problem
        Case("info on a file", ["info", str(a_file)], f"{a_file} is a file, not a checkpoint folder"),
        Case("weights -> /dev/zero", ["info", str(odd["devzero"])], "model.safetensors is a device (through a symbolic link), not a regular file"),
        Case("weights FIFO", ["info", str(odd["fifo"])], "model.safetensors is a FIFO (named pipe), not a regular file"),
        Case("weights folder", ["analyze", str(odd["folder"]), "--out", out], "model.safetensors is a folder, not a file"),
        Case("train out link loop", ["train", "--out", str(loop), *TRAIN], f"{loop} is a symbolic link loop"),
        Case("study out under loop", ["study", "--preset", "quick", "--out", str(loop / "sub")], "is a symbolic link loop"),
        Case("train out dangling link", ["train", "--out", str(dangling), *TRAIN], "is a broken symbolic link"),
        Case("resume empty folder", ["train", "--out", str(tmp / "empty"), *TRAIN, "--resume"], "holds no training run to continue"),
        Case("resume no folder", [*train, "--resume"], "holds no training run to continue"),
        Case("resume empty seeds", [*train, "--seeds", "0,1", "--resume"], "seed{0,1} holds no training run"),
    ]  # fmt: skip


def _no_slurm() -> bool:
    return shutil.which("sbatch") is None and "POSLENS_SUBMITIT_CLUSTER" not in os.environ


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with, for files, its size and modification time (a folder's own
    time changes when the output check writes and removes its probe file there)."""
    return {
        str(p): (0, 0) if p.is_dir() else (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def _run(case: Case) -> int:
    try:
        return case.runner(case.argv)
    except SystemExit as e:  # argparse usage errors exit through SystemExit
        return int(e.code or 0)


# Cases in the table: 87 before issue 30 (86 where sbatch exists), 120 after it.
TABLE_SIZE = 120


def test_hostile_inputs_are_one_line_exit_2_and_change_nothing(
    tmp_path: Path,
    ckpts: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = cases(tmp_path, ckpts)
    assert len(table) == TABLE_SIZE - (not _no_slurm())
    assert len({c.name for c in table}) == len(table)
    monkeypatch.chdir(tmp_path)  # what `--out ''` would write lands in the folder watched below
    if torch.cuda.is_available():
        table = [c for c in table if "cuda" not in c.name]
    capsys.readouterr()
    before = {root: _tree(root) for root in (tmp_path, ckpts["done"].parent)}
    failures = []
    for case in table:
        code = _run(case)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        ok = (
            code == 2
            and len(lines) == 1
            and lines[0].startswith("poslens: error:")
            and case.fragment in lines[0]
            and "Traceback" not in err
        )
        if not ok:
            failures.append(f"{case.name}: exit {code}, stderr {err[:400]!r}")
        for root, tree in before.items():
            if _tree(root) != tree:
                failures.append(f"{case.name}: the folder {root} changed")
                before[root] = _tree(root)
    assert not failures, "\n".join(failures)


def test_read_only_folder_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; the /proc case covers unwritable --out")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["train", "--out", str(ro / "out"), *TRAIN]) == 2
    finally:
        ro.chmod(0o700)
    err = capsys.readouterr().err
    assert err.startswith("poslens: error: --out") and "not writable" in err
    assert list(ro.iterdir()) == []


def test_real_entry_points_print_help_and_one_line_errors(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "poslens.report", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "usage: poslens report" in r.stdout
    assert not (Path("--help")).exists()
    r = subprocess.run(
        [sys.executable, "-m", "poslens", "train", "--out", str(tmp_path / "o"), "--set",
         "train.lr=inf", "--no-progress"], capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "train.lr must be a finite number" in r.stderr


# --- failed writes: a full disk mid-run ---------------------------------------------------------


def _full_disk_at(mp: pytest.MonkeyPatch, nth: int) -> list[Path]:
    """Make the nth atomic write (1-based) and every later one fail with ENOSPC; returns the
    paths that were written before."""
    written: list[Path] = []
    real = poslens.io._replace

    def replace(tmp: Path, path: Path) -> None:
        if len(written) + 1 >= nth:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(tmp, path)
        written.append(path)

    mp.setattr(poslens.io, "_replace", replace)
    return written


def _one_line_error(capsys: pytest.CaptureFixture[str], *fragments: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("poslens: error:") and err.count("\n") == 1, err
    assert all(f in err for f in fragments) and "Traceback" not in err, err


def _no_temp_files(root: Path) -> None:
    assert not [p for p in root.rglob(".*.tmp")], "a temporary file was left behind"


@pytest.mark.parametrize("nth", [1, 3, 4, 5, 7])
def test_full_disk_while_training_never_marks_the_run_finished(
    tmp_path: Path, nth: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writes: config, weights, state at step 2, then at step 4, then metrics.json (7th)."""
    _full_disk_at(monkeypatch, nth)
    out = tmp_path / "run"
    assert main(["train", "--preset", "rope_axial", "--out", str(out), *TRAIN]) == 2
    _one_line_error(capsys, "No space left on device")
    monkeypatch.undo()
    assert not (out / "metrics.json").exists()
    _no_temp_files(tmp_path)
    if (out / "model.safetensors").exists():  # a checkpoint, but not a finished one
        assert main(["info", str(out)]) == 2
        _one_line_error(capsys, "unfinished training run")
    if (out / "train_state.safetensors").exists():  # and --resume completes it
        assert main(["train", "--preset", "rope_axial", "--out", str(out), *TRAIN, "--resume"]) == 0
        assert main(["info", str(out)]) == 0


@pytest.mark.parametrize("nth", [1, 2, 4])
def test_full_disk_while_analysing_leaves_no_partial_set(
    tmp_path: Path,
    ckpts: dict[str, Path],
    nth: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """axis_map writes its JSON, CSV and figure; then analysis.json. A failure inside the set
    leaves no file of it (neither new nor from the earlier run), and never an analysis.json."""
    out = tmp_path / "an"
    argv = ["analyze", str(ckpts["done"]), "--out", str(out), "--experiments", "axis_map", *QUICK]
    assert main(argv) == 0
    capsys.readouterr()
    complete = sorted(p.name for p in out.iterdir())
    assert "analysis.json" in complete and len(complete) >= 4
    written = _full_disk_at(monkeypatch, nth)
    assert main(argv) == 2
    if nth < len(complete):  # the message says the folder holds no results now
        _one_line_error(capsys, "No space left on device", f"no results are left in {out}")
    else:
        _one_line_error(capsys, "No space left on device", "analysis.json")
    assert not (out / "analysis.json").exists()
    left = sorted(p.name for p in out.iterdir())
    if nth < len(complete):  # the set failed: none of it (old or new) is left
        assert left == [], (left, written)
    else:  # the set is whole; only the index failed, and it is absent
        assert left == [n for n in complete if n != "analysis.json"]
    _no_temp_files(tmp_path)


def test_full_disk_on_a_first_analysis_leaves_no_empty_out(
    tmp_path: Path,
    ckpts: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A full disk at the first write of a fresh --out: the folder analyze made is removed again
    (an empty --out looked like a finished run with no results), and the message says so; one
    finished experiment before the failure is kept and named."""
    out = tmp_path / "fresh"
    argv = ["analyze", str(ckpts["done"]), "--out", str(out), "--experiments", "axis_map",
            "--no-progress", "--images", "16", "--probe-images", "10"]  # fmt: skip
    _full_disk_at(monkeypatch, 1)
    assert main(argv) == 2
    _one_line_error(capsys, "No space left on device", f"--out {out} removed again")
    assert not out.exists()
    monkeypatch.undo()
    _full_disk_at(monkeypatch, 4)  # axis_map's 3 files, then depth_profile's first
    argv[argv.index("axis_map")] = "axis_map,depth_profile"
    assert main(argv) == 2
    _one_line_error(capsys, "No space left on device", "3 file(s) of the experiments finished")
    assert sorted(p.name for p in out.iterdir()) == [
        "axis_map.json", "axis_map.png", "axis_map_planes.csv"
    ]  # fmt: skip


def test_a_rerun_study_sweeps_the_temp_files_a_kill_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 between an atomic write's mkstemp and its rename leaves `.NAME.XXXXXXXX.tmp`
    (mode 0600); the rerun removes them under its lock before any work, and nothing else."""
    import poslens.study.run as study_run
    from poslens.study import preset, run_study

    out = tmp_path / "study"
    leftovers = [
        out / "runs/rope_axial/seed0/.depth_profile.svg.k2j4h5g6.tmp",
        out / "figures/.depth_profile.png.a1b2c3d4.tmp",
        out / "checkpoints/rope_axial_s0_0123456789ab/.model.safetensors.zz9_x8y7.tmp",
        out / ".results.json.qwertyui.tmp",
    ]
    kept = [
        out / "runs/notes.tmp",  # not a temporary file of poslens's
        out / "runs/.a.tmp",
        out / "runs/rope_axial/seed0/depth_profile.json",
        out / "mine/.x.abcdefgh.tmp",  # not a folder the study writes
    ]
    for p in leftovers + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("half a file")
        p.chmod(0o600)
    seen: list[list[Path]] = []

    def fake_run(plan: object, executor: object, progress: bool) -> dict[str, object]:
        seen.append([p for p in leftovers + kept if p.exists()])
        return {}

    monkeypatch.setattr(study_run, "_run", fake_run)
    assert run_study(preset("quick"), out, progress=False) == {}
    assert seen == [kept]  # swept before the work began
    assert not (out / ".lock").exists()  # the lock file goes with the run


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
def test_full_disk_while_saving_an_sae_leaves_nothing(
    tmp_path: Path,
    ckpts: dict[str, Path],
    nth: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The SAE's weights, cfg.json, figure and report are one set: all or nothing."""
    _full_disk_at(monkeypatch, nth)
    out = tmp_path / "sae"
    argv = ["sae", "train", str(ckpts["done"]), "--out", str(out), "--images", "20",
            "--epochs", "1", "--k", "4", "--site", "blocks.0.ln1.hook_normalized",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    _one_line_error(capsys, "No space left on device")
    assert not out.exists() or list(out.iterdir()) == []


def test_full_disk_in_a_study_leaves_no_stage_marker_and_the_rerun_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import poslens.study
    from poslens.study import StudyConfig

    tiny = StudyConfig(
        preset="quick", models=("rope_axial",), seeds=1, experiments=("axis_map",),
        train_set=tuple(s for s in SETS if not s.startswith("train.precision")),
        n_images=20, probe_images=10, batch_size=20,
    )  # fmt: skip
    monkeypatch.setattr(poslens.study, "preset", lambda *_a, **_k: tiny)
    out = tmp_path / "study"
    argv = ["study", "--out", str(out), "--jobs", "1", "--no-progress"]
    written = _full_disk_at(monkeypatch, 9)  # train writes 7 files, then axis_map's set starts
    assert main(argv) == 2
    _one_line_error(capsys, "No space left on device")
    assert any(p.name == "metrics.json" for p in written)
    assert not list(out.rglob("*.stage.json")) and not (out / "results.json").exists()
    monkeypatch.setattr(poslens.io, "_replace", os.replace)
    assert main(argv) == 0
    assert (out / "runs" / "rope_axial" / "seed0" / "axis_map.stage.json").is_file()
    assert (out / "report.md").is_file()


# --- what the flags and records say -------------------------------------------------------------


def test_allow_unfinished_is_recorded(
    tmp_path: Path, ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    ctrlc = str(ckpts["ctrlc"])
    assert main(["info", ctrlc, "--allow-unfinished"]) == 0
    assert "unfinished training run (weights at step 2 of 4" in capsys.readouterr().out
    out = tmp_path / "an"
    argv = ["analyze", ctrlc, "--out", str(out), "--experiments", "axis_map", *QUICK]
    assert main([*argv, "--allow-unfinished"]) == 0
    record = json.loads((out / "analysis.json").read_text())
    assert record["unfinished"] == {"finished": False, "step": 2, "steps": 4}
    assert main(["analyze", str(ckpts["done"]), "--out", str(out), "--experiments", "axis_map",
                 *QUICK]) == 0  # fmt: skip
    assert "unfinished" not in json.loads((out / "analysis.json").read_text())


def test_ctrl_c_message_fits_the_command(
    tmp_path: Path,
    ckpts: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(TrainProgress, "update", _interrupt_at(1))
    assert main(["train", "--preset", "ape", "--out", str(tmp_path / "t"), *TRAIN]) == 130
    assert "rerun with --resume" in capsys.readouterr().err

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    import dataclasses

    import poslens.study
    from poslens.experiments import REGISTRY

    # experiments are looked up in the registry: its entry is what analyze runs
    monkeypatch.setitem(
        REGISTRY, "axis_map", dataclasses.replace(REGISTRY["axis_map"], run=interrupted)
    )
    argv = ["analyze", str(ckpts["done"]), "--out", str(tmp_path / "a"), "--experiments",
            "axis_map", *QUICK]  # fmt: skip
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume" not in err and "rerun" in err
    monkeypatch.setattr(poslens.study, "run_study", interrupted)
    assert main(["study", "--preset", "quick", "--out", str(tmp_path / "s")]) == 130
    err = capsys.readouterr().err
    assert "--resume" not in err and "rerun the same command" in err


def test_resume_state_of_another_model_is_refused(
    tmp_path: Path, ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Shapes match (same sizes, other rotary layout): only the fingerprint tells them apart."""
    other = _train(tmp_path / "half", "rope_axial", "--set", 'model.rope_layout="half"')
    run = tmp_path / "run"
    shutil.copytree(ckpts["done"], run)
    (run / "metrics.json").unlink()
    shutil.copy(other / "train_state.safetensors", run / "train_state.safetensors")
    capsys.readouterr()
    assert main(["train", "--preset", "rope_axial", "--out", str(run), *TRAIN, "--resume"]) == 2
    _one_line_error(capsys, "belongs to another model: model.rope_layout is 'interleaved'")


def test_weights_saved_before_fingerprints_still_load(tmp_path: Path) -> None:
    """Old checkpoints (the study reuses them by config hash) carry no fingerprint: unknown, not
    an error; their training state comes from the step metadata and metrics.json as before."""
    import poslens
    from poslens.io import save_tensors, write_json
    from poslens.models import ModelConfig, build_model

    cfg = ModelConfig(image_size=16, dim=16, depth=1, heads=2)
    model = build_model(cfg, seed=0)
    write_json(tmp_path / "config.json", {"model": cfg.to_dict(), "train": {"steps": 4}})
    save_tensors(tmp_path / "model.safetensors", model.state_dict(), {"step": "4"})
    write_json(tmp_path / "metrics.json", {"steps": 4})
    loaded = poslens.load(tmp_path)
    assert torch.equal(loaded.head.weight, model.head.weight)
    assert poslens.api.checkpoint_status(tmp_path).finished
    (tmp_path / "metrics.json").unlink()
    with pytest.raises(poslens.errors.CheckpointError, match="unfinished"):
        poslens.load(tmp_path)
    assert poslens.load(tmp_path, allow_unfinished=True) is not None
    # without a stored data config, the [data] section must still agree with the model's shape
    from poslens.data import DataConfig

    data = DataConfig(image_size=16, object_scale=0.32)
    write_json(tmp_path / "config.json", {"model": cfg.to_dict(), "data": data.__dict__})
    assert poslens.load_task(tmp_path).num_classes == cfg.num_classes
    data = DataConfig(image_size=32)
    write_json(tmp_path / "config.json", {"model": cfg.to_dict(), "data": data.__dict__})
    with pytest.raises(poslens.errors.CheckpointError, match="image_size 32, but model.image_size"):
        poslens.load_task(tmp_path)


def test_two_processes_save_identical_bytes(tmp_path: Path) -> None:
    """safetensors writes its metadata from a hash map seeded per process; poslens sorts it."""
    script = (
        "import sys, torch; from pathlib import Path\n"
        "from poslens.io import save_tensors\n"
        "from poslens.models import ModelConfig, build_model\n"
        "cfg = ModelConfig(image_size=16, dim=16, depth=1, heads=2)\n"
        "meta = {'step': '4', 'poslens': '0.1.0', 'history': '[]', **cfg.weights_metadata()}\n"
        "save_tensors(Path(sys.argv[1]), build_model(cfg, seed=0).state_dict(), meta)\n"
    )
    digests = set()
    for i in range(3):
        path = tmp_path / f"w{i}.safetensors"
        subprocess.run([sys.executable, "-c", script, str(path)], check=True)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1


def test_a_second_train_on_the_same_out_is_refused_while_the_first_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two `poslens train --out X` started moments apart: the second is refused in one line
    naming the first's pid (it used to train too, both exiting 0, the folder holding whichever
    wrote last)."""
    from tests.training.cli_args import tiny_train_args

    out = tmp_path / "run"
    argv = ["train", *tiny_train_args(steps=100_000, eval_every=100_000), "--out", str(out)]
    first = subprocess.Popen(
        [sys.executable, "-m", "poslens", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "train_state.safetensors").exists():  # its first checkpoint
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline, "the first run wrote no checkpoint"
            time.sleep(0.01)
        assert main(argv) == 2
        _one_line_error(capsys, f"--out {out} is in use by another poslens train (pid {first.pid})")
    finally:
        first.kill()
        first.wait()
    # the flock died with its holder: the next train is refused for the run there, not the lock
    assert main(argv) == 2
    _one_line_error(capsys, "already holds a run; pass --resume")
