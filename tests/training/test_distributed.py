"""torchrun on the CPU (gloo, 2 processes): training equals the single-process run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from poslens.io import load_tensors

ARGS = [
    "--preset", "rope_axial", "--set", "model.dim=16", "--set", "model.depth=2",
    "--set", "model.heads=2", "--set", "train.steps=8", "--set", "train.batch_size=16",
    "--set", "train.ckpt_every=4", "--set", "train.eval_every=4", "--set", "train.eval_images=16",
    "--set", "data.n_val=32", "--set", "data.n_test=32", "--set", "data.image_size=16",
    "--set", "data.object_scale=0.32", "--set", "train.threads=1", "--set", 'train.precision="fp32"',
    "--no-progress",
]  # fmt: skip
TOLERANCE = 1e-5  # gradients are summed in another order across processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_process_training_equals_one_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "poslens", "train", *ARGS, "--out", str(tmp_path / "one")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
         "-m", "poslens", "train", *ARGS, "--out", str(tmp_path / "two")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_tensors(tmp_path / "one" / "model.safetensors")
    b = load_tensors(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < TOLERANCE, worst
    print(f"max |two-process - one-process| weight difference: {worst:.2e}")
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m2["processes"] == 2 and "processes" not in m1
    assert abs(m1["test"]["acc"] - m2["test"]["acc"]) < 1e-9
    assert [h["step"] for h in m1["history"]] == [h["step"] for h in m2["history"]]
