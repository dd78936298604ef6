"""Rotary tables on rescaled, offset coordinates in row- or column-first order (timm's
RotaryEmbeddingCat with ref_feat_shape: EVA-02, Perception Encoder, timm's SBB RoPE ViTs): parity
with timm on random weights saved to a file, the axis map and plane masks on the permuted planes
(against timm with the same planes removed from its own table), another grid, config checks and
the refusals left."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from poslens.errors import ConfigError, UserError
from poslens.interventions.rotary import axis_map, num_planes, rotary_mask
from poslens.models import ModelConfig, build_model, hooks
from poslens.models.timm_convert import convert, load_timm
from poslens.models.timm_export import to_timm
from tests.conftest import TINY
from tests.models.test_timm_convert import random_timm, save

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # CI (POSLENS_FULL=1) installs the [timm] extra: a missing timm must fail, not skip
else:
    timm = pytest.importorskip("timm")

ATOL = 1e-5  # logits of size 0.5-4, fp32
RESID_ATOL = 1e-4  # block residuals of size 5-20 (measured up to 2.4e-5)
SMALL = dict(depth=2, num_classes=7)
# (timm name, image size of a 4 x 4 grid, the config fields the conversion must find)
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("eva02_tiny_patch14_224", 56, dict(rope_coords="rescaled", rope_ref_grid=16, rope_offset=0.0,
                                        mlp="swiglu", posenc="rope_axial_ape", pool="mean")),
    ("eva02_small_patch14_224", 56, dict(rope_ref_grid=16, mlp="swiglu", heads=6)),
    ("eva02_base_patch14_224", 56, dict(rope_ref_grid=16, mlp_sub_norm=True)),
    ("eva02_base_patch16_clip_224", 64, dict(attn_sub_norm=True, mlp_sub_norm=True, pool="cls")),
    ("vit_medium_patch16_rope_reg1_gap_256", 64, dict(posenc="rope_axial", cls_token=False,
                                                     num_registers=1, fc_norm=True)),
    ("vit_pe_spatial_tiny_patch16_512", 64, dict(rope_ref_grid=32, rope_offset=1.0,
                                                 norm_pre=True, final_norm=False)),
]  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def converted(name: str, size: int, tmp_path: Path, **extra: Any) -> tuple[Any, torch.nn.Module]:
    kw = {**SMALL, "img_size": size, **extra}
    tm = random_timm(name, **kw)
    return load_timm(name, save(tm, tmp_path / "w.safetensors"), **kw), tm


@pytest.mark.parametrize(("name", "size", "fields"), CASES, ids=[c[0] for c in CASES])
def test_logits_and_residuals_match_timm(
    name: str, size: int, fields: dict[str, Any], tmp_path: Path
) -> None:
    model, tm = converted(name, size, tmp_path)
    assert {k: getattr(model.cfg, k) for k in fields} == fields
    assert model.cfg.rope_coords == "rescaled"
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    names = [hooks.resid_post(0), hooks.resid_post(1)]
    with torch.no_grad():
        logits, cache = model.run_with_cache(x, names)
        theirs = tm(x)
        feats = tm.forward_intermediates(
            x, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True, norm=False
        )
    assert theirs.abs().max() > 0.3  # a comparison of real numbers, not of zeros
    torch.testing.assert_close(logits, theirs, atol=ATOL, rtol=0)
    for b, (patches, prefix) in enumerate(feats):
        out = torch.cat([prefix, patches], dim=1) if prefix is not None else patches
        torch.testing.assert_close(cache[hooks.resid_post(b)], out, atol=RESID_ATOL, rtol=0)


def timm_row_channels(tm: torch.nn.Module) -> slice:
    """The channels of timm's own (interleaved) table whose planes follow the row: the first half
    with 'ij' indexing (EVA-02), the second with 'xy' (PE)."""
    dh = tm.rope.dim
    return slice(0, dh // 2) if tm.rope.grid_indexing == "ij" else slice(dh // 2, dh)


@pytest.mark.parametrize(("name", "size"), [("eva02_tiny_patch14_224", 56),
                                            ("vit_pe_spatial_tiny_patch16_512", 64)])  # fmt: skip
def test_axis_map_and_row_masks_match_timm_with_its_row_planes_removed(
    name: str, size: int, tmp_path: Path
) -> None:
    """After the q/k channel permutation the column planes come first whatever timm's order; the
    axis map labels them; masking the row planes equals timm with its row bands set to the
    identity in its own table (an explicit construction), and differs from masking the columns."""
    model, tm = converted(name, size, tmp_path)
    P = num_planes(model)
    amap = axis_map(model)
    assert amap.col == tuple(range(P // 2)) and amap.row == tuple(range(P // 2, P))
    assert amap.counts()["mixed"] == amap.counts()["none"] == 0
    # the column step of plane p: ref_grid / grid * theta^(-p / (P/2)) radians per patch (wrapped)
    step = model.cfg.rope_ref_grid / model.cfg.grid * 1e4 ** (-torch.arange(P // 2) / (P // 2))
    wrapped = torch.angle(torch.polar(torch.ones(P // 2), step)).abs().double()
    freq_col = torch.as_tensor(amap.freq_col[0, 0, : P // 2])
    torch.testing.assert_close(freq_col, wrapped, atol=1e-5, rtol=0)

    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with rotary_mask(model, planes=amap.row):
            rows_off = model(x)
        with rotary_mask(model, planes=amap.col):
            cols_off = model(x)
        table = tm.rope.pos_embed.clone()  # [N, 2 dh]: sin, then cos
        sin, cos = table.chunk(2, -1)
        ch = timm_row_channels(tm)
        sin[:, ch], cos[:, ch] = 0.0, 1.0
        tm.rope.pos_embed = torch.cat([sin, cos], -1)
        theirs = tm(x)
    torch.testing.assert_close(rows_off, theirs, atol=ATOL, rtol=0)
    assert (rows_off - cols_off).abs().max() > 1e-2


def test_half_layout_row_first(tmp_path: Path) -> None:
    """timm's rope_rotate_half=True (planes at channels p, p + dh/2), row bands first: the same
    permutation in the "half" layout puts the column planes first, with parity."""
    model, tm = converted("eva02_tiny_patch14_224", 56, tmp_path, rope_rotate_half=True)
    assert model.cfg.rope_layout == "half"
    amap = axis_map(model)
    assert amap.col == tuple(range(16)) and amap.row == tuple(range(16, 32))
    x = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(x), tm(x), atol=ATOL, rtol=0)


def test_other_grid_rescales_each_axis(tmp_path: Path) -> None:
    """A 5 x 4 grid of a model built for 4 x 4 (timm's SBB RoPE ViT, no APE): rows turn 16 / 5,
    columns 16 / 4 reference patches per patch, as timm's dynamic-size model computes them."""
    name = "vit_medium_patch16_rope_reg1_gap_256"
    model, tm = converted(name, 64, tmp_path, dynamic_img_size=True)
    x = torch.randn(2, 3, 80, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x), tm(x), atol=ATOL, rtol=0)
    amap = axis_map(model, grid=(5, 4))
    P = num_planes(model)
    slowest = 1e4 ** (-(P // 2 - 1) / (P // 2))
    assert amap.freq_row[0, 0, -1] == pytest.approx(16 / 5 * slowest, rel=1e-4)
    assert amap.freq_col[0, 0, P // 2 - 1] == pytest.approx(16 / 4 * slowest, rel=1e-4)


def test_rescaled_fields_validated_and_left_out_at_default() -> None:
    """Configs (and fingerprints) written before these fields existed stay the same."""
    base = ModelConfig()
    assert "rope_ref_grid" not in base.to_dict() and "rope_offset" not in base.to_dict()
    cfg = ModelConfig(rope_coords="rescaled", rope_ref_grid=16, rope_offset=1.0)
    assert cfg.to_dict()["rope_ref_grid"] == 16 and cfg.fingerprint() != base.fingerprint()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    bad = [
        (dict(rope_coords="rescaled"), "model.rope_ref_grid"),
        (dict(rope_ref_grid=16), "model.rope_ref_grid"),
        (dict(rope_offset=1.0), "model.rope_offset"),
        (dict(rope_coords="rescaled", rope_ref_grid=-2), "model.rope_ref_grid"),
        (dict(rope_coords="rescaled", rope_ref_grid=8, rope_offset="1"), "model.rope_offset"),
        (dict(rope_coords="rescaled", rope_ref_grid=8, rope_offset=float("nan")), "rope_offset"),
    ]
    for kw, field in bad:
        with pytest.raises(ConfigError, match=field) as e:
            ModelConfig(**kw)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)


def test_export_to_timm_refuses_rescaled_coordinates() -> None:
    """naver's timm RoPE ViT (the export target) rotates on patch indices only."""
    cfg = ModelConfig(**TINY, posenc="rope_axial", rope_coords="rescaled", rope_ref_grid=8)
    with pytest.raises(UserError, match="patch-index coordinates"):
        to_timm(build_model(cfg, seed=0))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: setattr(r, "in_pixels", True), "pixel-frequency bands"),
        (lambda r: setattr(r, "ref_feat_shape", (16, 12)), "non-square grid 16x12"),
        (lambda r: setattr(r, "ref_feat_shape", None), "offset patch indices"),
    ],
    ids=["pixel-bands", "non-square-ref", "offset-without-ref"],
)
def test_what_poslens_cannot_reproduce_is_refused_in_one_line(edit: Any, message: str) -> None:
    name = "vit_pe_spatial_tiny_patch16_512"
    tm = timm.create_model(name, pretrained=False, **SMALL, img_size=64).eval()
    edit(tm.rope)
    with pytest.raises(UserError, match=message) as e:
        convert(tm, name)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"timm:{name} is not supported")
