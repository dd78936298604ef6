from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from poslens.errors import CheckpointError
from poslens.sae import SAEConfig, TopKSAE, Whitening, train_sae
from poslens.sae.io import load_sae, load_sae_config, save_sae
from tests.sae.conftest import planted


@pytest.fixture(scope="module")
def saes() -> list[tuple[TopKSAE, SAEConfig]]:
    x, _ = planted(1024)
    out = []
    for whiten in (False, True):
        cfg = SAEConfig(site="blocks.0.hook_resid_pre", k=4, batch=128, steps=5, whiten=whiten)
        out.append((train_sae(x, cfg)[0], cfg))
    return out


def state(sae: TopKSAE) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sae.state_dict().items() if k != "tokens_since_fired"}


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "whitened"])
def test_round_trip_is_bit_identical(saes: list, which: int, tmp_path: Path) -> None:
    sae, cfg = saes[which]
    save_sae(sae, tmp_path / "sae", cfg, metadata={"model_name": "tiny"})
    back = load_sae(tmp_path / "sae")
    a, b = state(sae), state(back)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(back.whitening, Whitening) == cfg.whiten
    assert (back.site, back.k, back.include_prefix) == (sae.site, 4, False)
    assert load_sae_config(tmp_path / "sae") == cfg
    meta = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert meta["architecture"] == "topk" and meta["metadata"]["model_name"] == "tiny"
    assert (meta["d_in"], meta["d_sae"], meta["hook_name"]) == (32, 128, cfg.site)
    x = torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(sae(x)[0], back(x)[0])


def corrupt(folder: Path, case: str) -> None:
    weights, cfg = folder / "sae_weights.safetensors", folder / "cfg.json"
    if case == "no weights":
        weights.unlink()
    elif case == "no cfg":
        cfg.unlink()
    elif case == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif case == "pickle":
        torch.save({"W_enc": torch.zeros(1)}, weights)
    elif case == "bad json":
        cfg.write_text("{not json")
    else:
        d = json.loads(cfg.read_text())
        d.update(
            {"architecture": "gated"} if case == "architecture"
            else {"architecture": "jumprelu"} if case == "jumprelu without threshold"
            else {"d_in": 33}
        )  # fmt: skip
        cfg.write_text(json.dumps(d))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no weights", "file not found"),
        ("no cfg", "SAE config not found"),
        ("truncated weights", "truncated|corrupt|could not be read"),
        ("pickle", "pickle"),
        ("bad json", "not valid JSON"),
        ("architecture", "SAE architecture 'gated' is not supported"),
        ("jumprelu without threshold", "has no tensor 'threshold'"),
        ("shape", r"W_enc has shape \(32, 128\), cfg.json says \(33, 128\)"),
    ],
)
def test_bad_folders_raise_one_line_checkpoint_errors(
    saes: list, case: str, message: str, tmp_path: Path
) -> None:
    save_sae(saes[0][0], tmp_path / "sae")
    corrupt(tmp_path / "sae", case)
    with pytest.raises(CheckpointError, match=message) as info:
        load_sae(tmp_path / "sae")
    assert "\n" not in str(info.value)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="SAE folder not found"):
        load_sae(tmp_path / "nope")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"k": 0}, "k must be a positive whole number, got 0"),
        ({"k": -4}, "k must be a positive whole number, got -4"),
        ({"k": 129}, r"k \(129\) must be at most d_sae \(128\)"),
        ({"d_in": 16.7}, "d_in must be a positive whole number, got 16.7"),
        ({"d_in": "32"}, "d_in must be a positive whole number, got '32'"),
        ({"d_sae": True}, "d_sae must be a positive whole number, got True"),
        ({"d_sae": None}, "d_sae must be a positive whole number"),
        ({"k": 2**70}, "k must be a positive whole number"),
        ({"dtype": "int32"}, "dtype must be one of float32"),
        ({"normalize_activations": "layer_norm"}, "normalize_activations must be one of"),
        ({"reshape_activations": "hook_z"}, "reshape_activations must be one of none"),
        ({"include_prefix": "yes"}, "include_prefix must be true or false"),
        ({"hook_name": 5}, "hook_name must be a hook name"),
        ({"metadata": [1]}, "metadata must be an object"),
        ({"poslens_config": {"k": "x"}}, "poslens_config: sae.k must be int"),
    ],
)
def test_invalid_cfg_json_is_refused_naming_file_and_field(
    saes: list, changes: dict, message: str, tmp_path: Path
) -> None:
    """Issue 51: every cfg.json field is checked on load (load_sae and load_sae_config), never
    truncated (16.7 -> 16) or passed on to torch."""
    save_sae(saes[0][0], tmp_path / "sae", saes[0][1])
    cfg = tmp_path / "sae" / "cfg.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | changes))
    for load in (load_sae, load_sae_config):
        with pytest.raises(CheckpointError, match=message) as info:
            load(tmp_path / "sae")
        assert str(cfg) in str(info.value) and "\n" not in str(info.value)


def test_integral_float_sizes_load(saes: list, tmp_path: Path) -> None:
    save_sae(saes[0][0], tmp_path / "sae")
    cfg = tmp_path / "sae" / "cfg.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"d_in": 32.0, "k": 4.0}))
    back = load_sae(tmp_path / "sae")
    assert (back.d_in, back.k) == (32, 4) and isinstance(back.k, int)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_weights_are_refused_naming_the_tensor(
    saes: list, dtype: torch.dtype, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    save_sae(saes[0][0], tmp_path / "sae")
    weights = tmp_path / "sae" / "sae_weights.safetensors"
    tensors = load_file(str(weights))
    tensors["b_dec"] = tensors["b_dec"].to(dtype)
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match="tensor b_dec is .*; weights must be floating"):
        load_sae(tmp_path / "sae")
