"""results.json's environment names what decides float rounding: the CPU and torch's kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from poslens.study.run import cpu


def test_cpu_records_the_instruction_set_torch_dispatches_to() -> None:
    info = cpu()
    assert info["kernels"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["extensions"]) <= {
        "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"
    }  # fmt: skip
    # a lowered kernel ISA (as on an older CPU, or forced) is what the record shows
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = "import json; from poslens.study.run import cpu; print(json.dumps(cpu()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lowered = json.loads(run.stdout)
    assert lowered["kernels"] == "DEFAULT"
    assert lowered["model"] == info["model"] and lowered["extensions"] == info["extensions"]
