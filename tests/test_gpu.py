"""poslens on a device: the ViT and its ensemble, hooks and interventions, SAE training and
splicing, probes, an experiment, the study placing its work on the device, and bf16 autocast,
each checked against the same work on the CPU.

Every test here carries the `gpu` marker (`pytest -m gpu`) and runs on POSLENS_TEST_DEVICE
(default `cuda`); without CUDA they skip. `POSLENS_TEST_DEVICE=cpu` runs them on the CPU, as
`benchmarks/gpu_check.py --dry-run` does, so their own code is checked where no GPU is.
Tolerances against the CPU are loose (1e-3 and up): a GPU may run float32 convolutions in TF32
and sums in another order; the tests catch work on the wrong device or a wrong result, not
rounding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from poslens.models import build_model
from poslens.models.ensemble import StackedViT
from tests.conftest import tiny

pytestmark = pytest.mark.gpu

ENCODINGS = ("ape", "rope_axial", "rope_mixed", "sincos", "relpos")
CLOSE = dict(atol=2e-3, rtol=2e-3)  # device against CPU, fp32


@pytest.fixture(scope="module")
def device() -> str:
    """The device under test: POSLENS_TEST_DEVICE (default cuda); skips where it is missing."""
    name = os.environ.get("POSLENS_TEST_DEVICE", "cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (POSLENS_TEST_DEVICE=cpu runs these tests on the CPU)")
    return name


def on(t: torch.Tensor, device: str) -> bool:
    return t.device.type == torch.device(device).type


def images(n: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("posenc", ENCODINGS)
def test_vit_forward_and_backward_match_the_cpu(posenc: str, device: str) -> None:
    cpu = tiny(posenc)
    dev = tiny(posenc).to(device)
    x = images()
    out = dev(x.to(device))
    assert on(out, device)
    torch.testing.assert_close(out.cpu(), cpu(x).detach(), **CLOSE)
    out.logsumexp(-1).sum().backward()
    grads = [p.grad for p in dev.parameters() if p.requires_grad]
    assert all(g is not None and on(g, device) and bool(g.isfinite().all()) for g in grads)


def test_ensemble_members_equal_their_models_and_a_train_step_runs(device: str) -> None:
    from poslens.training.config import RunConfig, TrainConfig
    from poslens.training.ensemble import train_step
    from poslens.training.train import make_optimizer

    cfg = tiny("rope_axial").cfg
    vits = [build_model(cfg, seed=s).eval() for s in range(3)]
    stack = StackedViT(vits).to(device)
    x = images()
    with torch.no_grad():
        logits = stack(x.to(device))  # [S, B, classes]
        for s, vit in enumerate(vits):
            torch.testing.assert_close(logits[s].cpu(), vit(x), **CLOSE)
    opt = make_optimizer(stack.named_stacked(), RunConfig(train=TrainConfig()), member_dims=1)
    y = torch.arange(len(x)) % cfg.num_classes
    losses = train_step(stack, opt, x.to(device), y.to(device), 1e-3, "fp32", 1.0)
    assert losses.shape == (3,) and on(losses, device) and bool(losses.isfinite().all())
    assert all(on(p, device) for _, p in stack.named_stacked())


def test_hooks_cache_on_the_device_and_are_removed(device: str) -> None:
    from poslens.models import hooks

    cpu, dev = tiny("rope_axial"), tiny("rope_axial").to(device)
    names = [hooks.resid_pre(1), hooks.attn(1, "pattern"), hooks.normalized(1)]
    x = images()
    with torch.no_grad():
        _, want = cpu.run_with_cache(x, names)
        logits, got = dev.run_with_cache(x.to(device), names)
        for n in names:
            assert on(got[n], device)
            torch.testing.assert_close(got[n].cpu(), want[n], **CLOSE)
        with dev.hooks([(hooks.resid_pre(1), lambda t, _n: torch.zeros_like(t))]):
            zeroed = dev(x.to(device))
        torch.testing.assert_close(dev(x.to(device)), logits)  # the hook is gone
    assert not torch.allclose(zeroed, logits)


def test_interventions_move_the_device_output_as_they_move_the_cpus(device: str) -> None:
    from poslens.interventions import ablate, ape_zero, axis_map, rotary_mask, rpi

    x = images()
    for posenc, make in [
        ("rope_axial", lambda m: rotary_mask(m, planes=axis_map(m).row, blocks=[0])),
        ("rope_axial", lambda m: rpi(m, seed=3)),
        ("ape", lambda m: ape_zero(m)),
        ("ape", lambda m: ablate(m, "attn", blocks=[1], heads=[0])),
    ]:
        cpu, dev = tiny(posenc), tiny(posenc).to(device)
        with torch.no_grad():
            clean = dev(x.to(device))
            with make(cpu):
                want = cpu(x)
            with make(dev):
                got = dev(x.to(device))
            torch.testing.assert_close(got.cpu(), want, **CLOSE)
            assert not torch.allclose(got, clean), posenc
            torch.testing.assert_close(dev(x.to(device)), clean)  # restored on leaving


def test_sae_trains_on_the_device_and_splices_exactly(device: str) -> None:
    from poslens.sae import ActivationStore, SAEConfig, splice, train_sae

    site = "blocks.1.ln1.hook_normalized"
    model = tiny("ape").to(device)
    imgs = images(40, seed=2).to(device)
    store = ActivationStore.from_model(model, imgs, site)
    sae, history = train_sae(store, SAEConfig(site=site, k=4, batch=128, steps=30, lr=3e-3),
                             device=device)  # fmt: skip
    assert all(on(p, device) for p in sae.parameters())
    assert history and np.isfinite(history[-1]["fvu"])
    with torch.no_grad():
        clean = model(imgs[:6])
        with splice(model, sae, with_error=True):  # no edit: x + D(z) - D(z)
            same = model(imgs[:6])
        with splice(model, sae, edit=lambda z: torch.zeros_like(z), with_error=True):
            edited = model(imgs[:6])
    torch.testing.assert_close(same, clean, atol=1e-5, rtol=0)
    assert on(edited, device) and not torch.allclose(edited, clean)


def test_probes_decode_position_on_the_device(device: str) -> None:
    from poslens.metrics.probes import fit_position_probes

    g = torch.Generator().manual_seed(0)
    onehot = torch.eye(16)[None, None].repeat(1, 30, 1, 1) + 0.05 * torch.randn(1, 30, 16, 16,
                                                                               generator=g)  # fmt: skip
    noise = torch.randn(1, 30, 16, 16, generator=g)
    res = fit_position_probes(torch.cat([onehot, noise]).to(device), 4, 4, max_iter=100)
    np.testing.assert_allclose(res.test_acc[0], 1.0)
    assert res.test_acc[1, 0] < 0.2


def test_an_experiment_on_the_device_reads_as_on_the_cpu(device: str, tmp_path: Path) -> None:
    from poslens.data import DataConfig, build_task
    from poslens.experiments import registry
    from poslens.experiments.analyze import analyze

    task = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=20, n_test=40))
    cfg = registry.get("depth_profile").Config(n_images=40, probe_images=40, batch_size=20)
    got = {}
    for where in ("cpu", device):
        model = tiny("rope_axial", num_classes=task.num_classes).to(where)
        rec = analyze(model, task, ["depth_profile"], [cfg], tmp_path / where, formats=())
        got[where] = rec["depth_profile"]["headline"]
    assert got["cpu"].keys() == got[device].keys()
    for k, v in got["cpu"].items():
        if v is not None:  # SSDC, probe accuracies, accuracy: near ties may flip a probe's call
            assert got[device][k] == pytest.approx(v, abs=0.1), k


def test_the_study_trains_and_analyses_on_the_device(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import poslens.training.ensemble as ens
    from poslens.study import StudyConfig, run_study
    from poslens.study.stages import Source

    trained: list[str] = []
    loaded: list[str] = []
    train_ensemble, load = ens.train_ensemble, Source.load

    def train_on(*a: Any, **k: Any) -> Any:
        trained.append(str(k.get("device")))
        return train_ensemble(*a, **k)

    def load_on(self: Source, where: str) -> Any:
        model, data = load(self, where)
        loaded.append(next(model.parameters()).device.type)
        return model, data

    monkeypatch.setattr(ens, "train_ensemble", train_on)
    monkeypatch.setattr(Source, "load", load_on)
    cfg = StudyConfig(
        preset="quick", models=("rope_axial",), seeds=1, in_situ=False,
        experiments=("depth_profile", "axis_map"),
        train_set=("model.dim=16", "model.depth=2", "model.heads=2", "train.steps=4",
                   "train.batch_size=16", "train.eval_every=2", "train.eval_images=20",
                   "data.n_val=40", "data.n_test=40", "data.image_size=16",
                   "data.object_scale=0.32"),
        n_images=30, probe_images=30, batch_size=30,
    )  # fmt: skip
    res = run_study(cfg, tmp_path / "study", progress=False, device=device, jobs=1)
    assert trained == [device]
    assert loaded and set(loaded) == {torch.device(device).type}
    assert res["config"]["device"] == device
    run = res["models"]["rope_axial"]["runs"][0]
    assert set(run["experiments"]) == {"depth_profile", "axis_map"}


@pytest.mark.parametrize("posenc", ["ape", "rope_axial"])
def test_bf16_autocast_stays_close_to_fp32(posenc: str, device: str) -> None:
    from poslens.precision import autocast

    model = tiny(posenc).to(device)
    x = images().to(device)
    with torch.no_grad():
        full = model(x)
        with autocast(model, "bf16"):
            half = model(x)
            _, cache = model.run_with_cache(x, ["blocks.1.hook_resid_pre"])
    assert cache["blocks.1.hook_resid_pre"].dtype in (torch.bfloat16, torch.float32)
    assert on(half, device) and bool(half.isfinite().all())
    torch.testing.assert_close(half.float(), full, atol=5e-2, rtol=5e-2)
