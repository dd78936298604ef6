"""`poslens analyze` under torchrun (gloo, 2 processes on the CPU) equals the single-process run:
every experiment's image loop is sharded across the ranks and reduced, and only rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from poslens.data import DataConfig
from poslens.io import save_tensors, write_json
from tests.conftest import free_port, json_numbers, tiny

# Sums over images are float64, added in another order across ranks; per-image results and probe
# features are gathered in image order, so what differs is rounding only (measured: <= 3e-16).
TOLERANCE = 1e-9
DATA = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=30)
# 24 images in batches of 10: three batches, two on rank 0 and one on rank 1 (the last one short).
ANALYZE = ["--images", "24", "--probe-images", "16", "--batch-size", "10", "--no-progress"]
ANALYZE += ["--experiments", "depth_profile,components,prefix_attention,heads"]
CHEAP = ["heads.cumulative=1", "heads.draws=1", "heads.axis_windows=false", "heads.units=head"]
CHEAP += ["components.single_blocks=false", "components.modes=mean", "prefix_attention.draws=1"]
ANALYZE += [a for s in CHEAP for a in ("--set", s)]


def test_two_process_analyze_equals_one_process(tmp_path: Path) -> None:
    m = tiny("rope_axial", num_classes=16)  # a CLS token: prefix_attention applies
    ckpt = tmp_path / "ckpt"
    write_json(ckpt / "config.json", {"model": m.cfg.to_dict(), "data": DATA.__dict__})
    save_tensors(ckpt / "model.safetensors", m.state_dict())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    analyze = ["-m", "poslens", "analyze", str(ckpt), *ANALYZE, "--out"]
    one = subprocess.run([sys.executable, *analyze, str(tmp_path / "one")],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         *analyze, str(tmp_path / "two")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    # rank 0 alone reports: one line per experiment, not one per process
    firsts = [line.split()[0] for line in two.stdout.splitlines()]
    assert firsts == [line.split()[0] for line in one.stdout.splitlines()], two.stdout
    assert firsts == ["depth_profile", "components", "prefix_attention", "heads", "results"]
    assert json.loads((tmp_path / "two" / "analysis.json").read_text())["processes"] == 2
    for name in ("depth_profile", "components", "prefix_attention", "heads"):
        a = json.loads((tmp_path / "one" / f"{name}.json").read_text())
        b = json.loads((tmp_path / "two" / f"{name}.json").read_text())
        pairs = json_numbers(a, b)
        assert len(pairs) > 50, name
        bad = [(p, x, y) for p, x, y in pairs if abs(x - y) > TOLERANCE * max(1.0, abs(x))]
        assert not bad, (name, bad[:5])
