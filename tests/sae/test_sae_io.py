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
        d.update({"architecture": "jumprelu"} if case == "architecture" else {"d_in": 33})
        cfg.write_text(json.dumps(d))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no weights", "file not found"),
        ("no cfg", "SAE config not found"),
        ("truncated weights", "truncated|corrupt|could not be read"),
        ("pickle", "pickle"),
        ("bad json", "not valid JSON"),
        ("architecture", "architecture must be 'topk'"),
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
