"""poslens -> timm export: timm itself loads the file (with the arguments written beside it) and
computes poslens' logits; poslens' timm route reads it back to the same tensors; models timm
cannot express are one-line errors, through the API and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import poslens
from poslens.cli import main
from poslens.errors import UserError
from poslens.models import ModelConfig, build_model
from poslens.models.timm_export import export_timm, kwargs_file

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # CI installs the [timm] extra: a missing timm must fail, not skip
else:
    timm = pytest.importorskip("timm")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def trained_like(posenc: str, **kw: object) -> poslens.ViT:
    """A small model whose every tensor is far from its init (biases, table, tokens), so that a
    tensor left out or misplaced by the export changes the logits."""
    cfg = ModelConfig(image_size=24, patch_size=4, in_chans=1, dim=32, depth=2, heads=4,
                      num_classes=6, posenc=posenc, **kw)  # type: ignore[arg-type]  # fmt: skip
    m = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return m


@pytest.mark.parametrize(
    ("posenc", "pool"), [("ape", "cls"), ("ape", "mean"), ("rope_axial", "cls")]
)
def test_timm_loads_the_export_and_computes_poslens_logits(
    posenc: str, pool: str, tmp_path: Path
) -> None:
    m = trained_like(posenc, pool=pool)
    weights, side = export_timm(m, tmp_path / "m.safetensors")
    assert side == kwargs_file(weights) and side.name == "m.timm.json"
    doc = json.loads(side.read_text())
    tm = timm.create_model(doc["timm"], pretrained=True,
                           pretrained_cfg_overlay=doc["pretrained_cfg_overlay"], **doc["kwargs"]).eval()  # fmt: skip
    x = torch.randn(3, 1, 24, 24, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(tm(x), m(x), atol=1e-4, rtol=1e-4)
    # the pretrained route reads it back (shapes from the file beside it) to the same tensors
    back = poslens.load(f"timm:{doc['timm']}", weights=weights)
    assert back.cfg.posenc == posenc and back.cfg.pool == pool
    for k, v in m.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)


def test_what_timm_cannot_express_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="export to timm supports"):
        export_timm(trained_like("rope_mixed"), tmp_path / "m.safetensors")
    with pytest.raises(UserError, match="oblique"):
        export_timm(trained_like("rope_axial", rope_variant="oblique"), tmp_path / "m.safetensors")
    with pytest.raises(UserError, match=r"\.safetensors file"):
        export_timm(trained_like("ape"), tmp_path / "m.pt")
    with pytest.raises(UserError, match="is a eva model"):  # an APE model into a RoPE architecture
        export_timm(trained_like("ape"), tmp_path / "m.safetensors", "vit_small_patch16_rope_224")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_cli_export_writes_both_files_and_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = poslens.save(trained_like("ape"), tmp_path / "ckpt")
    out = tmp_path / "exp" / "ape.safetensors"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "--pretrained timm:vit_tiny_patch16_224=" in printed
    assert f"--data task:{Path(ckpt).resolve()}" in printed
    assert kwargs_file(out).is_file()
    assert main(["export", str(ckpt), "--timm", "vit_small_patch16_rope_224", "--out",
                 str(tmp_path / "r.safetensors")]) != 0  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "eva" in err
