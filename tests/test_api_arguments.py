"""The public Python API checks the arguments a user passes (issue 51): wrong types and values
raise poslens's own ArgumentError (a UserError, also a ValueError) in one line naming the
argument, never a torch error from deep inside a forward pass. The table walks every public
function that takes a device, an input, indices or a seed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import poslens
from poslens.cli import main
from poslens.errors import ArgumentError, CheckpointError, UserError
from poslens.interventions import (
    ablate,
    ape_permute,
    axis_map,
    component_hook,
    mean_activations,
    plane_mask,
    rotary_mask,
    rpi,
    seeded_permutation,
)
from poslens.models import ModelConfig, build_model
from tests.conftest import TINY, tiny

SITE = "blocks.0.hook_resid_pre"


def _enter(cm: Any) -> None:
    with cm:
        pass


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return poslens.save(tiny("rope_axial"), tmp_path_factory.mktemp("ck") / "ck")


def table(ck: Path) -> list[tuple[str, Callable[[], object], str]]:
    """(case, call, fragment of the message: the argument's name and what is wrong)."""
    rope, ape = tiny("rope_axial"), tiny("ape")
    x = torch.randn(2, 1, 16, 16)
    cfg = ModelConfig(**TINY)  # type: ignore[arg-type]
    cases = [
        # devices: strings torch cannot parse, kinds poslens does not run on, wrong types
        ("load tpu9", lambda: poslens.load(ck, device="tpu9"), "device 'tpu9' is not a device"),
        ("load xla", lambda: poslens.load(ck, device="xla"), "device 'xla': poslens runs on"),
        ("load device int", lambda: poslens.load(ck, device=5), "device must be a string"),
        ("load cuda:99", lambda: poslens.load(ck, device="cuda:99"), "device cuda:99"),
        ("load spec int", lambda: poslens.load(5), "spec must be a checkpoint folder"),
        ("load weights int", lambda: poslens.load(ck, weights=3), "weights must be a path"),
        # model inputs
        ("long input", lambda: rope.run_with_cache(x.long(), SITE),
         "images must be a floating-point tensor, got int64"),
        ("double input", lambda: rope.run_with_cache(x.double(), SITE),
         "images has dtype float64, the model's weights float32"),
        ("bool input", lambda: rope(x > 0), "images must be a floating-point tensor, got bool"),
        ("numpy input", lambda: rope(x.numpy()), "images must be a torch.Tensor, got ndarray"),
        ("list input", lambda: rope([1.0]), "images must be a torch.Tensor, got list"),
        ("3-d input", lambda: rope(x[0]), "expected images [B, 1, H, W]"),
        ("residual long", lambda: rope(torch.zeros(2, 17, 32, dtype=torch.long), start_at=1),
         "x must be a floating-point tensor"),
        ("images at start_at", lambda: rope(x, start_at=1), "start_at=1 needs a residual"),
        ("residual block str", lambda: rope.residual(x, "1"), "block must be an integer, got str"),
        ("residual block 0", lambda: rope.residual(x, 0), "block must be in 1..2, got 0"),
        # saving and loading
        ("save model", lambda: poslens.save("model", ck.parent / "s"), "model must be a poslens ViT"),
        ("save folder", lambda: poslens.save(rope, 5), "folder must be a path, got int"),
        ("save data", lambda: poslens.save(rope, ck.parent / "s", data={}), "data must be a DataConfig"),
        ("load_task spec", lambda: poslens.load_task(None), "spec must be a checkpoint folder"),
        # seeds
        ("build seed str", lambda: build_model(cfg, seed="x"), "seed must be an integer, got str"),
        ("build seed -1", lambda: build_model(cfg, seed=-1), "seed must be in 0.."),
        ("build seed float", lambda: build_model(cfg, seed=1.5), "seed must be an integer"),
        ("build cfg", lambda: build_model({"dim": 32}), "cfg must be a ModelConfig, got dict"),
        ("rpi seed str", lambda: _enter(rpi(rope, seed="x")), "seed must be an integer, got str"),
        ("rpi seed 2**70", lambda: _enter(rpi(rope, seed=2**70)), "seed must be in 0.."),
        ("rpi seed bool", lambda: _enter(rpi(rope, seed=True)), "seed must be an integer"),
        ("ape_permute seed", lambda: _enter(ape_permute(ape, seed=0.5)), "seed must be an integer"),
        ("permutation n", lambda: seeded_permutation(-1, 0), "n must be at least 0, got -1"),
        ("permutation seed", lambda: seeded_permutation(4, None), "seed must be an integer"),
        ("load_images seed", lambda: poslens.load_images(ck, "timm:x", rope, seed="a"),
         "seed must be an integer"),
        # block / head / plane indices and their types
        ("planes str", lambda: _enter(rotary_mask(rope, planes="abc")),
         "planes must be plane indices (a list of integers), got 'abc'"),
        ("blocks float", lambda: _enter(rotary_mask(rope, blocks=[0.5])),
         "blocks[0] must be an integer, got float 0.5"),
        ("blocks bool", lambda: _enter(rotary_mask(rope, blocks=[True])), "blocks[0] must be an integer"),
        ("blocks str", lambda: _enter(rotary_mask(rope, blocks="01")), "blocks must be block indices"),
        ("blocks 9", lambda: _enter(rotary_mask(rope, blocks=[9])), "blocks: block 9 out of range"),
        ("heads -1", lambda: _enter(rotary_mask(rope, heads=[-1])), "heads: head -1 out of range"),
        ("heads str item", lambda: _enter(rotary_mask(rope, heads=["a"])), "heads[0] must be an integer"),
        ("planes 99", lambda: plane_mask(rope, [99]), "planes: plane 99 out of range"),
        ("planes float tensor", lambda: plane_mask(rope, torch.tensor([0.5])),
         "planes[0] must be an integer"),
        ("planes None item", lambda: plane_mask(rope, [None]), "planes[0] must be an integer"),
        ("ablate blocks", lambda: _enter(ablate(rope, "attn", blocks=[1.0])), "blocks[0] must be an integer"),
        ("ablate heads", lambda: _enter(ablate(rope, "attn", heads=[9])), "heads: head 9 out of range"),
        ("component block", lambda: component_hook("attn", "x"), "block must be an integer"),
        ("mean batch 0", lambda: mean_activations(rope, x, [SITE], batch_size=0),
         "batch_size must be at least 1, got 0"),
        ("axis_map grid", lambda: axis_map(rope, grid=("a", 2)), "grid[0] must be an integer"),
        ("axis_map grid int", lambda: axis_map(rope, grid=4), "grid must be (rows, columns)"),
        ("axis_map threshold", lambda: axis_map(rope, threshold="x"), "threshold must be a number"),
    ]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append(
            ("load cuda", lambda: poslens.load(ck, device="cuda"), "device cuda: torch"),
        )
    return cases


def test_wrong_arguments_raise_one_line_errors_naming_them(ck: Path) -> None:
    failures = []
    for name, call, fragment in table(ck):
        try:
            call()
        except UserError as e:
            if fragment not in str(e) or "\n" in str(e):
                failures.append(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:
            failures.append(f"{name}: raw {type(e).__name__}: {str(e)[:200]}")
        else:
            failures.append(f"{name}: accepted")
    assert not failures, "\n".join(failures)


def test_right_arguments_still_work(ck: Path) -> None:
    """What the checks accept: numpy and tensor integers, a lone index, torch.device, autocast."""
    model = poslens.load(ck, device=torch.device("cpu"))
    assert poslens.load(ck, device="auto") is not None
    x = torch.randn(2, 1, 16, 16)
    with rotary_mask(model, planes=np.array([0, 1]), blocks=torch.tensor([0, 1]), heads=1) as m:
        assert m[:, 1, :2].all() and not m[:, 0].any()
    with rpi(model, seed=np.int64(3)) as perm, torch.no_grad():
        assert perm.shape == (16,) and model(x).shape == (2, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert model(x).shape == model(x.bfloat16()).shape == (2, 5)  # autocast casts these
        with pytest.raises(ArgumentError, match="images has dtype float64"):
            model(x.double())  # which autocast does not cast
    assert isinstance(ArgumentError("x"), ValueError)
    assert len(seeded_permutation(4, 2**64 - 1)) == 4  # torch's whole seed range


def test_integer_weights_are_refused_naming_the_tensor(
    ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose model.safetensors holds int32 tensors is refused by poslens.load and
    `poslens info` (it loaded as silently cast floats before)."""
    from poslens.io import load_tensors, read_metadata, save_tensors

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((ck / "config.json").read_bytes())
    state = load_tensors(ck / "model.safetensors")
    state["head.weight"] = state["head.weight"].to(torch.int32)
    save_tensors(bad / "model.safetensors", state, read_metadata(ck / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor head.weight is int32; weights must be float"):
        poslens.load(bad)
    assert main(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head.weight is int32" in err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_weights_of_any_precision_load(ck: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    from poslens.io import load_tensors, read_metadata, save_tensors

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_bytes((ck / "config.json").read_bytes())
    state = {k: v.to(dtype) for k, v in load_tensors(ck / "model.safetensors").items()}
    save_tensors(other / "model.safetensors", state, read_metadata(ck / "model.safetensors"))
    assert poslens.load(other).head.weight.dtype == torch.float32


def test_integer_weights_in_a_resume_state_are_refused(tmp_path: Path) -> None:
    from poslens.checkpoint import read_resume_state, write_checkpoint
    from poslens.training.config import preset

    weights = dict(tiny("rope_axial").state_dict())
    weights["head.bias"] = weights["head.bias"].to(torch.int64)
    write_checkpoint(tmp_path, preset("rope_axial"), 2, [], weights, {})
    with pytest.raises(CheckpointError, match="tensor head.bias is int64"):
        read_resume_state(tmp_path)
