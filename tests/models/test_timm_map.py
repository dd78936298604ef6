"""MAP attention pooling (SigLIP, Perception Encoder core), RMSNorm and bias-free projections
(AIMv2): parity with timm on random weights saved to a file (2 blocks, 4 x 4 grid), the hooks
where the pool acts, the config fields, and the one-line refusals of what stays unconverted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from poslens.errors import ConfigError, UserError
from poslens.models import ModelConfig, hooks
from poslens.models.timm_convert import convert, load_timm
from poslens.models.vit import build_model
from tests.models.test_timm_convert import random_timm, save

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # noqa: F401  CI installs the [timm] extra: a missing timm must fail, not skip
else:
    pytest.importorskip("timm")

ATOL = 1e-5
SMALL = dict(depth=2, num_classes=7)
NARROW = dict(embed_dim=96, num_heads=4)  # a small width: the same layers, faster
# (timm name, extra timm arguments, image size, the config fields the conversion must find)
CASES: list[tuple[str, dict[str, Any], int, dict[str, Any]]] = [
    ("vit_base_patch16_siglip_224", NARROW, 64, dict(pool="map", cls_token=False, pool_heads=0)),
    ("vit_so400m_patch14_siglip_224", {}, 56, dict(pool="map", heads=16)),  # MLP 4304 wide
    ("test_vit3", {}, 64, dict(pool="map", pool_prefix=True, num_registers=1)),
    # PE core's Eva pool (8 heads of its own, over CLS and patches) on APE instead of its rotary
    ("vit_pe_core_tiny_patch16_384", dict(use_rot_pos_emb=False, attn_pool_mlp_ratio=2.0), 64,
     dict(pool="map", pool_heads=8, pool_prefix=True, pool_mlp_ratio=2.0, norm_pre=True)),
    ("aimv2_large_patch14_224", NARROW, 56,
     dict(norm="rms", proj_bias=False, qkv_bias=False, patch_norm=True, mlp="swiglu")),
    # DINOv3's row-first planes with qk-norm (Sapiens2's layout): the q / k channels are
    # reordered, and their norms' weights with them
    ("vit_small_patch16_dinov3", dict(qk_norm=True), 64, dict(qk_norm=True, rope_layout="half")),
]  # fmt: skip


def build(name: str, extra: dict[str, Any], size: int, tmp_path: Path) -> tuple[Any, Any, dict]:
    """The timm model with random weights, and poslens' conversion of it through a saved file."""
    kw = {**SMALL, "img_size": size, **extra}
    tm = random_timm(name, **kw)
    return tm, load_timm(name, save(tm, tmp_path / "w.safetensors"), **kw), kw


def timm_pattern(tm: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The attention [B, H, 1, T] of timm's MAP latent over `tokens`, from its weights."""
    pool = tm.attn_pool
    B, T, D = tokens.shape
    H, dh = pool.num_heads, D // pool.num_heads
    q = pool.q(pool.latent).view(1, H, 1, dh)
    k = pool.kv(tokens)[..., :D].view(B, T, H, dh).transpose(1, 2)
    return ((q * dh**-0.5) @ k.transpose(-2, -1)).softmax(-1)


@pytest.mark.parametrize(("name", "extra", "size", "fields"), CASES, ids=[c[0] for c in CASES])
def test_matches_timm(
    name: str, extra: dict[str, Any], size: int, fields: dict[str, Any], tmp_path: Path
) -> None:
    tm, model, _ = build(name, extra, size, tmp_path)
    assert {k: getattr(model.cfg, k) for k in fields} == fields
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    names = [hooks.FINAL_NORM] + ([hooks.POOLED, hooks.POOL_PATTERN] if "pool" in fields else [])
    with torch.no_grad():
        logits, cache = model.run_with_cache(x, names)
        theirs = tm(x)
        tokens = tm.forward_features(x)
        pooled = tm.forward_head(tokens, pre_logits=True)
    assert theirs.abs().max() > 0.1  # a comparison of real numbers, not of zeros
    torch.testing.assert_close(logits, theirs, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache[hooks.FINAL_NORM], tokens, atol=ATOL, rtol=0)
    if "pool" in fields:
        torch.testing.assert_close(cache[hooks.POOLED], pooled, atol=ATOL, rtol=0)
        pooled_tokens = tokens if model.cfg.pool_prefix else tokens[:, model.cfg.num_prefix :]
        with torch.no_grad():
            expected = timm_pattern(tm, pooled_tokens)
        torch.testing.assert_close(cache[hooks.POOL_PATTERN], expected, atol=ATOL, rtol=0)
        with torch.no_grad():  # unhooked: the fused kernel, as timm's
            torch.testing.assert_close(model(x), theirs, atol=ATOL, rtol=0)


def test_the_pooled_vector_is_what_the_classifier_reads(tmp_path: Path) -> None:
    """Rewriting hook_pooled reaches the logits (head of the new vector), and the MAP pool reads
    the last block's every patch: the CLS exit stays off."""
    _, model, _ = build("vit_base_patch16_siglip_224", NARROW, 64, tmp_path)
    assert not model.cls_exit()
    x = torch.randn(2, 3, 64, 64)
    new = torch.randn(2, model.cfg.dim)
    with torch.no_grad(), model.hooks([(hooks.POOLED, lambda t, _n: new)]):
        logits = model(x)
    torch.testing.assert_close(logits, model.head(new), atol=1e-6, rtol=0)


def test_the_pool_attends_over_the_patches_alone_unless_prefix(tmp_path: Path) -> None:
    """hook_pattern has one column per pooled token: the patches (SigLIP), or registers and
    patches where timm pools the prefix too (test_vit3)."""
    x = torch.randn(1, 3, 64, 64)
    for name, extra, tokens in (("vit_base_patch16_siglip_224", NARROW, 16), ("test_vit3", {}, 17)):
        _, model, _ = build(name, extra, 64, tmp_path)
        with torch.no_grad():
            _, cache = model.run_with_cache(x, hooks.POOL_PATTERN)
        pattern = cache[hooks.POOL_PATTERN]
        assert pattern.shape == (1, model.cfg.map_heads, 1, tokens)
        torch.testing.assert_close(pattern.sum(-1), torch.ones(1, model.cfg.map_heads, 1))


def test_hook_list_of_the_map_pool_is_pinned() -> None:
    """The pool's hooks follow the final norm, in forward order, before fc_norm."""
    cfg = ModelConfig(dim=32, depth=1, heads=2, posenc="ape", pool="map", fc_norm=True)
    names = build_model(cfg, seed=0).hook_names()
    pool = ["hook_attn_scores", "hook_pattern", "hook_z", "hook_attn_out", "norm.hook_normalized",
            "hook_mlp_out", "hook_pooled"]  # fmt: skip
    tail = names[names.index(hooks.FINAL_NORM) + 1 :]
    assert tail == [f"attn_pool.{n}" for n in pool] + [hooks.FC_NORM]
    assert hooks.POOL_PATTERN in names and hooks.POOLED in names


def test_rms_norm_is_timms_and_the_norm_site_inverts_it(tmp_path: Path) -> None:
    """An RMSNorm model's ln1 is torch's RMSNorm (no bias); norm_site returns it, so an SAE
    splice maps its edit back through the root mean square (sae/metrics.py)."""
    _, model, _ = build("aimv2_large_patch14_224", NARROW, 56, tmp_path)
    site = model.norm_site(hooks.normalized(1, "ln1"))
    assert site is not None and site[0] == hooks.resid_pre(1)
    assert isinstance(site[1], torch.nn.RMSNorm) and getattr(site[1], "bias", None) is None
    assert model.blocks[0].attn.proj.bias is None and model.blocks[0].mlp.fc2.bias is None
    x = torch.randn(2, 3, 56, 56)
    names = [hooks.attn(0, "result"), hooks.block_out(0, "attn")]
    with torch.no_grad():  # per-head results still sum to the output without a bias to add
        logits, cache = model.run_with_cache(x, names)
        torch.testing.assert_close(logits, model(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(cache[names[0]].sum(2), cache[names[1]], atol=1e-5, rtol=0)


def test_defaults_keep_every_fingerprint() -> None:
    """The new fields at their defaults are left out of the config text, so existing configs
    and checkpoints keep their fingerprints; set, they change it."""
    cfg = ModelConfig()
    assert not {"norm", "proj_bias", "pool_heads", "pool_mlp_ratio", "pool_prefix"} & set(
        cfg.to_dict()
    )
    for changed in (dict(norm="rms"), dict(proj_bias=False), dict(pool="map"),
                    dict(pool="map", pool_heads=2)):  # fmt: skip
        other = ModelConfig(**changed)  # type: ignore[arg-type]
        assert other.fingerprint() != cfg.fingerprint()
        assert ModelConfig.from_dict(other.to_dict()) == other
    assert ModelConfig(pool="map").arch_pieces() == ["pool"]
    from poslens.limits import param_count  # the memory estimate counts the pool exactly

    for cfg in (ModelConfig(pool="map"), ModelConfig(pool="map", pool_mlp_ratio=2.0)):
        assert param_count(cfg) == build_model(cfg).num_params()
    assert ModelConfig(norm="rms").arch_pieces() == ["norm"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(pool_heads=2), "model.pool_heads"),
        (dict(pool_prefix=True), "model.pool_prefix"),
        (dict(pool_mlp_ratio=2.0), "model.pool_mlp_ratio"),
        (dict(pool="map", pool_heads=3), "model.pool_heads"),
        (dict(pool="map", pool_heads=-1), "model.pool_heads"),
        (dict(norm="batch"), "model.norm"),
        (dict(proj_bias=1), "model.proj_bias"),
    ],
)
def test_bad_fields_are_one_line_config_errors(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig(**fields)  # type: ignore[arg-type]
    assert named in str(e.value) and "\n" not in str(e.value)


def test_the_ensemble_refuses_a_map_pool() -> None:
    from poslens.models.ensemble import StackedViT

    cfg = ModelConfig(dim=32, depth=1, heads=2, posenc="ape", pool="map")
    with pytest.raises(ValueError, match="pool"):
        StackedViT([build_model(cfg, seed=0), build_model(cfg, seed=1)])


def _refusal(tm: Any, name: str) -> str:
    with pytest.raises(UserError) as e:
        convert(tm, name)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"timm:{name} is not supported: ")
    return text


def test_what_stays_unconverted_is_refused_in_one_line() -> None:
    name = "vit_base_patch16_siglip_224"
    tm = random_timm(name, **SMALL, **NARROW, img_size=64)
    tm.attn_pool.pool = "avg"  # several latents averaged: poslens' pool has one
    assert "several latents" in _refusal(tm, name)
    tm = random_timm("vit_tiny_patch16_224", **SMALL, img_size=64, embed_norm_layer="rmsnorm")
    assert "a mix of LayerNorm and RMSNorm" in _refusal(tm, "vit_tiny_patch16_224")
    tm = random_timm("vit_tiny_patch16_224", **SMALL, img_size=64)
    tm.blocks[1].mlp.fc2.bias = None
    assert "biases on some" in _refusal(tm, "vit_tiny_patch16_224")
