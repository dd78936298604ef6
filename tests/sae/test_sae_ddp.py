"""torchrun on the CPU (gloo, 2 processes): SAE activation extraction, training and the
`poslens sae train` pipeline equal the single-process run.

One script runs all three, once as a plain process and once under torchrun; every rank writes
what it ended with, so the test also sees that the ranks agree with each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poslens.io import load_tensors
from tests.conftest import free_port, json_numbers
from tests.sae.conftest import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # weights and metrics: the ranks' slices are summed in another float order
CONFIGS = {  # batch 173 leaves short last batches; 1039 tokens = 6 x 173 + 1: one rank's is empty
    "aux": {"k": 4, "batch": 173, "steps": 30, "dead_tokens": 300, "log_every": 8},
    "whiten": {
        "k": 4,
        "batch": 173,
        "steps": 14,
        "dead_tokens": 80,
        "whiten": True,
        "log_every": 7,
    },
}

SCRIPT = """
import json, sys
from pathlib import Path
import torch
import poslens
from poslens import distributed
from poslens.cli import main
from poslens.io import save_tensors
from poslens.sae import ActivationStore, SAEConfig, train_sae
from tests.sae.conftest import planted

torch.set_num_threads(1)
ckpt, out, configs = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
site = "blocks.1.ln1.hook_normalized"
rank = distributed.world()[0]
out.mkdir(parents=True, exist_ok=True)
model, task = poslens.load(ckpt), poslens.load_task(ckpt)
images = task.split("val")[0][:11]  # 6 batches of 2: 3 rounds on 2 ranks, the last one short
mem = ActivationStore.from_model(model, images, site, batch_images=2)
disk = ActivationStore.from_model(  # with the CLS token, into a .npy file written by rank 0
    model, images, site, include_prefix=True, path=out / "acts.npy", batch_images=3
)
save_tensors(out / f"store_{rank}.safetensors", {
    "acts": mem.rows(slice(None)), "pos": mem.pos_N, "image": mem.image_N,
    "disk": disk.rows(slice(None)), "disk_pos": disk.pos_N,
})
x = planted(1039)[0]
for name, kw in configs.items():
    sae, history = train_sae(x, SAEConfig(site="synthetic", **kw))
    save_tensors(out / f"sae_{name}_{rank}.safetensors", sae.state_dict())
    (out / f"history_{name}_{rank}.json").write_text(json.dumps(history))
argv = ["sae", "train", str(ckpt), "--site", site, "--out", str(out / "cli"), "--images", "30",
        "--epochs", "3", "--k", "4", "--no-progress"]
assert main(argv) == 0
(out / f"world_{rank}.json").write_text(json.dumps(distributed.world()))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(one-process output, two-process output) of SCRIPT."""
    tmp = tmp_path_factory.mktemp("sae_ddp")
    ckpt = tiny_checkpoint(tmp / "ckpt")
    script = tmp / "sae_ddp.py"
    script.write_text(SCRIPT)
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    args = [str(script), str(ckpt)]
    configs = json.dumps(CONFIGS)
    one = subprocess.run([sys.executable, *args, str(tmp / "one"), configs],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args,
         str(tmp / "two"), configs],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[
        -6000:
    ]  # the ranks' own messages come before the launcher's
    assert json.loads((tmp / "one" / "world_0.json").read_text()) == [0, 1]
    assert json.loads((tmp / "two" / "world_1.json").read_text()) == [1, 2]
    return tmp / "one", tmp / "two"


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _assert_close_json(a: object, b: object, least: int) -> float:
    pairs = json_numbers(a, b)
    assert len(pairs) >= least
    bad = [(p, x, y) for p, x, y in pairs if abs(x - y) > TOLERANCE * max(1.0, abs(x))]
    assert not bad, bad[:5]
    return max(abs(x - y) / max(1.0, abs(x)) for _, x, y in pairs)


def test_sharded_activation_store_equals_the_single_process_store(runs: tuple[Path, Path]) -> None:
    one, two = runs
    ref = load_tensors(one / "store_0.safetensors")
    assert ref["acts"].shape == (11 * 16, 32) and ref["disk"].shape == (11 * 17, 32)
    for rank in (0, 1):  # every rank holds the whole store, bit for bit (the same batches ran)
        got = load_tensors(two / f"store_{rank}.safetensors")
        assert ref.keys() == got.keys()
        assert all(torch.equal(ref[k], got[k]) for k in ref), rank


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_data_parallel_sae_training_equals_one_process(runs: tuple[Path, Path], name: str) -> None:
    one, two = runs
    ref = load_tensors(one / f"sae_{name}_0.safetensors")
    r0, r1 = (load_tensors(two / f"sae_{name}_{r}.safetensors") for r in (0, 1))
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # the ranks took identical steps
    assert torch.equal(ref["tokens_since_fired"], r0["tokens_since_fired"])  # same dead latents
    worst = _worst(ref, r0)
    assert worst < TOLERANCE, worst
    h1 = json.loads((one / f"history_{name}_0.json").read_text())
    h2 = json.loads((two / f"history_{name}_0.json").read_text())
    worst_h = _assert_close_json(h1, h2, least=len(h1) * 8)
    assert all(h["dead"] > 0 and h["aux"] > 0 for h in h1)  # AuxK's reductions were exercised
    print(f"{name}: max |2 - 1 process| weight {worst:.1e}, history (relative) {worst_h:.1e}")


def test_sae_train_cli_under_torchrun_equals_one_process(runs: tuple[Path, Path]) -> None:
    one, two = runs
    worst = _worst(
        load_tensors(one / "cli" / "sae_weights.safetensors"),
        load_tensors(two / "cli" / "sae_weights.safetensors"),
    )
    assert worst < TOLERANCE, worst
    r1 = json.loads((one / "cli" / "sae_report.json").read_text())
    r2 = json.loads((two / "cli" / "sae_report.json").read_text())
    assert r2.pop("processes") == 2 and "processes" not in r1
    assert r1["train_tokens"] == 30 * 16
    worst_r = _assert_close_json(r1, r2, least=20)
    print(f"cli: max |2 - 1 process| weight {worst:.1e}, report (relative) {worst_r:.1e}")
    assert (two / "cli" / "positional_latents.png").is_file()
