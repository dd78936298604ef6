"""Parity with timm for each piece of pretrained architectures (fc_norm, norm_pre, no final norm,
patch-embedding norm, GELU-tanh, QuickGELU, the distillation head, qk-norm, SwiGLU, sub-LN): the
timm model with random weights at a 4 x 4 grid and 2 blocks, saved to a file (offline), converted;
logits, every block's residual and the hook where the piece acts match timm to 1e-4."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import poslens
from poslens.models import hooks
from poslens.models.timm_convert import load_timm
from tests.models.test_timm_convert import random_timm, save

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # CI (POSLENS_FULL=1) installs the [timm] extra: a missing timm must fail, not skip
else:
    timm = pytest.importorskip("timm")

ATOL = 1e-4  # as tests/models/test_timm_convert.py
SMALL = dict(depth=2, num_classes=7)
# (timm name, extra timm arguments, image size, the config pieces the conversion must find)
CASES: list[tuple[str, dict[str, Any], int, dict[str, Any]]] = [
    ("vit_wee_patch16_reg1_gap_256", {}, 64, dict(fc_norm=True, final_norm=False, pool="mean")),
    ("vit_xsmall_patch16_clip_224", {}, 64, dict(norm_pre=True)),
    ("vit_tiny_patch16_224", dict(final_norm=False), 64, dict(final_norm=False, fc_norm=False)),
    ("vit_tiny_patch16_224", dict(embed_norm_layer="layernorm"), 64, dict(patch_norm=True)),
    ("vit_base_patch32_siglip_gap_256", {}, 128, dict(mlp_act="gelu_tanh", pool="mean")),
    ("vit_base_patch32_clip_quickgelu_224", {}, 128, dict(mlp_act="quick_gelu", norm_pre=True)),
    ("deit_tiny_distilled_patch16_224", {}, 64, dict(head_dist=True, num_registers=1)),
    ("vit_tiny_patch16_224", dict(qk_norm=True), 64, dict(qk_norm=True)),
    ("vit_small_patch16_rope_224", dict(qk_norm=True), 64, dict(qk_norm=True, posenc="rope_axial")),
    ("vit_small_plus_patch16_dinov3", {}, 64, dict(mlp="swiglu", posenc="rope_axial")),
    ("vit_tiny_patch16_224", dict(mlp_layer="packed_swiglu"), 64, dict(mlp="swiglu")),
    ("beit3_base_patch16_224", {}, 64, dict(attn_sub_norm=True, mlp_sub_norm=True)),
]


def timm_kwargs(extra: dict[str, Any]) -> dict[str, Any]:
    """Timm arguments, with "packed_swiglu" standing for timm's SwiGLUPacked (GluMlp) class."""
    from timm.layers import SwiGLUPacked

    if extra.get("mlp_layer") == "packed_swiglu":  # a class cannot sit in the ids of a case
        return {**extra, "mlp_layer": SwiGLUPacked, "act_layer": "silu", "mlp_ratio": 2 * 4.0}
    return extra


def piece_hook(cfg: poslens.models.ModelConfig) -> str | None:
    """The hook where a case's piece acts, if it is one of the new hook points."""
    if cfg.fc_norm:
        return hooks.FC_NORM
    if cfg.attn_sub_norm:
        return hooks.sub_norm(1, "attn")
    return None


@pytest.mark.parametrize(("name", "extra", "size", "pieces"), CASES,
                         ids=[f"{c[0]}-{'-'.join(c[3])}" for c in CASES])  # fmt: skip
def test_piece_matches_timm(
    name: str, extra: dict[str, Any], size: int, pieces: dict[str, Any], tmp_path: Path
) -> None:
    kw = {**SMALL, "img_size": size, **timm_kwargs(extra)}
    tm = random_timm(name, **kw)
    model = load_timm(name, save(tm, tmp_path / "w.safetensors"), **kw)
    assert {k: getattr(model.cfg, k) for k in pieces} == pieces
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    names = [hooks.resid_pre(0), hooks.resid_post(0), hooks.resid_post(1), hooks.FINAL_NORM]
    site = piece_hook(model.cfg)
    names += [site] if site else []
    with torch.no_grad():
        logits, cache = model.run_with_cache(x, names)
        theirs = tm(x)
        feats = tm.forward_intermediates(
            x, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True, norm=False
        )
        tokens = tm.forward_features(x)  # after the final norm (or none)
        embedded = tm._pos_embed(tm.patch_embed(x))
        embedded = tm.norm_pre(embedded[0] if isinstance(embedded, tuple) else embedded)
    assert theirs.abs().max() > 0.1  # a comparison of real numbers, not of zeros
    torch.testing.assert_close(logits, theirs, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache[hooks.resid_pre(0)], embedded, atol=ATOL, rtol=0)
    for b, feat in enumerate(feats):  # (patches, prefix), or the patches alone without prefix
        out = torch.cat([feat[1], feat[0]], dim=1) if isinstance(feat, tuple) else feat
        torch.testing.assert_close(cache[hooks.resid_post(b)], out, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache[hooks.FINAL_NORM], tokens, atol=ATOL, rtol=0)
    if site == hooks.FC_NORM:
        pooled = tm.forward_head(tokens, pre_logits=True)
        torch.testing.assert_close(cache[site], pooled, atol=ATOL, rtol=0)
    elif site is not None:  # the sub-LN of block 1's attention, on its input's attention output
        block = tm.blocks[1]
        seen: list[torch.Tensor] = []
        handle = block.attn.norm.register_forward_hook(lambda m, i, o: seen.append(o))
        with torch.no_grad():
            tm(x)
        handle.remove()
        torch.testing.assert_close(cache[site], seen[0], atol=ATOL, rtol=0)


def test_patch_embedding_norm_is_what_hook_embed_reads(tmp_path: Path) -> None:
    """hook_embed is the patch embedding after timm's patch_embed.norm, before any position."""
    kw = {**SMALL, "img_size": 64, "embed_norm_layer": "layernorm"}
    tm = random_timm("vit_tiny_patch16_224", **kw)
    model = load_timm("vit_tiny_patch16_224", save(tm, tmp_path / "w.safetensors"), **kw)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        _, cache = model.run_with_cache(x, hooks.EMBED)
        torch.testing.assert_close(cache[hooks.EMBED], tm.patch_embed(x), atol=ATOL, rtol=0)


def test_distilled_deit_reads_both_heads_and_keeps_every_token(tmp_path: Path) -> None:
    """The logits are the mean of the CLS head and the distillation head (register 0); the CLS
    exit stays off, since the distillation token's last-block output reaches the logits."""
    name = "deit_tiny_distilled_patch16_224"
    kw = {**SMALL, "img_size": 64}
    tm = random_timm(name, **kw)
    model = load_timm(name, save(tm, tmp_path / "w.safetensors"), **kw)
    assert not model.cls_exit()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        _, cache = model.run_with_cache(x, hooks.FINAL_NORM)
        tokens = cache[hooks.FINAL_NORM]
        cls_only = tm.head(tokens[:, 0])
        assert not torch.allclose(model(x), cls_only, atol=1e-3)  # the second head counts
        mean = (cls_only + tm.head_dist(tokens[:, 1])) / 2
        torch.testing.assert_close(model(x), mean, atol=ATOL, rtol=0)


def test_sub_norm_keeps_the_per_head_decomposition(tmp_path: Path) -> None:
    """With a sub-LN before proj, hook_result still sums (plus the bias) to the attention output,
    and zeroing one head's result changes the logits (the intervention API works on it)."""
    name = "beit3_base_patch16_224"
    kw = {**SMALL, "img_size": 64}
    tm = random_timm(name, **kw)
    model = load_timm(name, save(tm, tmp_path / "w.safetensors"), **kw)
    x = torch.randn(2, 3, 64, 64)
    result, out = hooks.attn(1, "result"), hooks.block_out(1, "attn")
    with torch.no_grad():
        base, cache = model.run_with_cache(x, [result, out])
        summed = cache[result].sum(dim=2) + model.blocks[1].attn.proj.bias
        torch.testing.assert_close(summed, cache[out], atol=ATOL, rtol=0)

        def drop_head(t: torch.Tensor, _name: str) -> torch.Tensor:
            t = t.clone()
            t[:, :, 0] = 0
            return t

        with model.hooks([(result, drop_head)]):
            edited = model(x)
    torch.testing.assert_close(base, tm(x), atol=ATOL, rtol=0)
    assert (edited - base).abs().max() > 1e-3


def test_converted_pieces_round_trip_through_save_and_load(tmp_path: Path) -> None:
    """poslens.save writes the pieces into config.json; poslens.load rebuilds the same model."""
    name = "vit_xsmall_patch16_clip_224"
    kw = {**SMALL, "img_size": 64}
    model = load_timm(name, save(random_timm(name, **kw), tmp_path / "w.safetensors"), **kw)
    folder = poslens.save(model, tmp_path / "ckpt")
    back = poslens.load(folder)
    assert back.cfg == model.cfg and back.cfg.norm_pre
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
