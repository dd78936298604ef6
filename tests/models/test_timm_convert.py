"""timm -> poslens conversion: logits and per-block residuals match timm on random weights saved
to a local safetensors file (offline), the naver axial axis map, and one-line errors on bad input."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import poslens
from poslens.errors import CheckpointError, UserError
from poslens.interventions.rotary import axis_map, rotary_mask
from poslens.models.timm_convert import import_timm, load_timm

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # CI (POSLENS_FULL=1) installs the [timm] extra: a missing timm must fail, not skip
else:
    timm = pytest.importorskip("timm")

# small variants: 2 blocks at 64 px (4x4 grid) keep each case well under a second
SMALL = dict(depth=2, img_size=64, num_classes=7)
FAMILIES = [
    ("vit_small_patch16_224", "ape"),
    ("deit3_small_patch16_224", "ape"),
    ("vit_small_patch16_rope_224", "rope_axial"),
    ("vit_small_patch16_rope_mixed_224", "rope_mixed"),
    ("vit_small_patch16_rope_ape_224", "rope_axial_ape"),
    ("vit_small_patch16_rope_mixed_ape_224", "rope_mixed_ape"),
    ("vit_small_patch16_dinov3", "rope_axial"),
    ("vit_small_patch16_dinov3_qkvb", "rope_axial"),
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def random_timm(name: str, **kw: object) -> torch.nn.Module:
    """A timm model with random weights of a useful size (LayerScale, positions and biases far from
    their near-zero init, so that every converted tensor matters)."""
    torch.manual_seed(0)
    tm = timm.create_model(name, pretrained=False, **kw).eval()
    with torch.no_grad():
        for n, p in tm.named_parameters():
            if n.endswith("freqs"):
                continue
            scale = 0.5 if ("gamma" in n or "pos_embed" in n or "token" in n) else 0.05
            p.add_(torch.randn_like(p) * scale)
    return tm


def save(tm: torch.nn.Module, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(path))
    return path


@pytest.mark.parametrize(("name", "posenc"), FAMILIES)
def test_logits_and_residuals_match_timm(name: str, posenc: str, tmp_path: Path) -> None:
    tm = random_timm(name, **SMALL)
    model = load_timm(name, save(tm, tmp_path / "model.safetensors"), **SMALL)
    assert model.cfg.posenc == posenc and not model.training
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    names = [f"blocks.{i}.hook_resid_pre" for i in range(2)] + ["blocks.1.hook_resid_post"]
    with torch.no_grad():
        logits, cache = model.run_with_cache(x, names)
        theirs = tm(x)
        feats = tm.forward_intermediates(
            x, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True
        )
        embedded = tm._pos_embed(tm.patch_embed(x))
    assert theirs.abs().max() > 0.1  # a comparison of real numbers, not of zeros
    torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=0)
    emb = embedded[0] if isinstance(embedded, tuple) else embedded
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], emb, atol=1e-4, rtol=0)
    outs = [torch.cat([prefix, patches], dim=1) for patches, prefix in feats]
    torch.testing.assert_close(cache["blocks.1.hook_resid_pre"], outs[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(cache["blocks.1.hook_resid_post"], outs[1], atol=1e-4, rtol=0)


def test_poslens_load_full_size_vit(tmp_path: Path) -> None:
    """poslens.load('timm:NAME', weights=PATH) on an unmodified ViT-Ti/16 at 224 px."""
    tm = random_timm("vit_tiny_patch16_224")
    model = poslens.load("timm:vit_tiny_patch16_224", weights=save(tm, tmp_path / "w.safetensors"))
    assert (model.cfg.image_size, model.cfg.patch_size, model.cfg.depth) == (224, 16, 12)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tm(x), atol=1e-4, rtol=0)


def test_naver_axial_axis_map_and_masks(tmp_path: Path) -> None:
    """16 row and 16 column planes per 64-dim head; masking a plane changes the output."""
    name = "vit_small_patch16_rope_224"
    tm = random_timm(name, **SMALL)
    model = load_timm(name, save(tm, tmp_path / "w.safetensors"), **SMALL)
    assert model.cfg.head_dim == 64 and model.cfg.rope_theta == 100.0
    amap = axis_map(model)
    assert amap.col == tuple(range(16)) and amap.row == tuple(range(16, 32))
    assert amap.counts() == {"row": 2 * 6 * 16, "col": 2 * 6 * 16, "mixed": 0, "none": 0}
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        base = model(x)
        with rotary_mask(model, planes=amap.row):
            masked = model(x)
    assert not torch.allclose(base, masked)


def test_dinov3_layout_registers_and_other_resolution(tmp_path: Path) -> None:
    """DINOv3: half layout, centred coordinates, 4 registers + CLS as prefix, mean pooling; the
    column-first plane order after the q/k channel permutation; parity on a grid it was not built for."""
    name = "vit_small_patch16_dinov3"
    tm = random_timm(name, **SMALL)
    model = load_timm(name, save(tm, tmp_path / "w.safetensors"), **SMALL)
    cfg = model.cfg
    assert (cfg.rope_layout, cfg.rope_coords, cfg.num_prefix, cfg.pool) == (
        "half",
        "centered",
        5,
        "mean",
    )
    amap = axis_map(model)
    assert amap.col == tuple(range(16)) and amap.row == tuple(range(16, 32))
    x = torch.randn(2, 3, 96, 80)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tm(x), atol=1e-4, rtol=0)


def test_mixed_freqs_are_timm_parameters(tmp_path: Path) -> None:
    name = "vit_small_patch16_rope_mixed_224"
    tm = random_timm(name, **SMALL)
    model = load_timm(name, save(tm, tmp_path / "w.safetensors"), **SMALL)
    torch.testing.assert_close(model.rotary.freqs, tm.rope.freqs.permute(1, 2, 3, 0))


# ---- bad input: one-line UserError / CheckpointError -------------------------------------------


def one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_unknown_timm_name() -> None:
    with pytest.raises(UserError) as e:
        poslens.load("timm:vit_no_such_model", weights="x.safetensors")
    assert "unknown timm model" in one_line(e)


def test_spec_needs_weights_and_name() -> None:
    with pytest.raises(UserError) as e:
        poslens.load("timm:vit_small_patch16_224")
    assert "needs weights" in one_line(e)
    with pytest.raises(UserError):
        poslens.load("timm:", weights="x.safetensors")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as e:
        load_timm("vit_small_patch16_224", tmp_path / "none.safetensors", **SMALL)
    assert "not found" in one_line(e)


def test_pickle_refused(tmp_path: Path) -> None:
    tm = random_timm("vit_small_patch16_224", **SMALL)
    torch.save(tm.state_dict(), tmp_path / "w.pth")
    with pytest.raises(CheckpointError) as e:
        load_timm("vit_small_patch16_224", tmp_path / "w.pth", **SMALL)
    assert "never unpickles" in one_line(e)


def test_weights_of_another_model(tmp_path: Path) -> None:
    deit = save(random_timm("deit3_small_patch16_224", **SMALL), tmp_path / "deit.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_timm("vit_small_patch16_224", deit, **SMALL)
    assert "does not fit timm:vit_small_patch16_224" in one_line(e)
    rope = save(random_timm("vit_small_patch16_rope_224", **SMALL), tmp_path / "rope.safetensors")
    with pytest.raises(CheckpointError):
        load_timm("vit_small_patch16_224", rope, **SMALL)


def test_shape_mismatch(tmp_path: Path) -> None:
    path = save(random_timm("vit_small_patch16_224", **SMALL), tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_timm("vit_small_patch16_224", path, **{**SMALL, "img_size": 32})
    assert "pos_embed" in one_line(e) and "shape" in one_line(e)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    """A ViT with timm's PRR pooling (parameter-free attention over every token) cannot be
    reproduced exactly: refused in one line naming the feature, not approximated."""
    name = "vit_tiny_patch16_224"
    kw = dict(depth=1, img_size=32, global_pool="prr")
    path = save(random_timm(name, **kw), tmp_path / "w.safetensors")
    with pytest.raises(UserError) as e:
        load_timm(name, path, **kw)
    assert "not supported: attention pooling AttentionPoolPrr" in one_line(e)


def test_missing_timm_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(UserError) as e:
        import_timm()
    assert "poslens[timm]" in one_line(e)


def test_cli_info_on_timm_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from poslens.cli import main

    name = "vit_tiny_patch16_224"
    path = save(random_timm(name), tmp_path / "w.safetensors")
    assert main(["info", "--model", f"timm:{name}", "--weights", str(path)]) == 0
    assert "posenc=ape depth=12 dim=192 heads=3 grid=14x14" in capsys.readouterr().out
    assert main(["info", "--model", f"timm:{name}", "--weights", str(tmp_path / "no")]) == 2
    assert main(["info"]) == 2
