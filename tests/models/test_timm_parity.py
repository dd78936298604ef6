"""Numerical parity with timm on shared weights: attention, the whole APE ViT, and axial RoPE."""

from __future__ import annotations

import os

import pytest
import torch

from poslens.models import ModelConfig, build_model
from poslens.models.posenc import apply_rotary, rotary_table
from tests.conftest import TINY

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # CI (POSLENS_FULL=1) installs the [timm] extra: a missing timm must fail, not skip
else:
    timm = pytest.importorskip("timm")


def timm_to_poslens(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a timm VisionTransformer (no_embed_class=True) state dict to poslens names."""
    out = {}
    for k, v in sd.items():
        k = (
            k.replace("patch_embed.proj.", "patch_embed.")
            .replace(".norm1.", ".ln1.")
            .replace(".norm2.", ".ln2.")
        )
        if k.startswith("norm."):
            k = "ln_final." + k[len("norm.") :]
        out[k] = v
    return out


def test_attention_matches_timm() -> None:
    from timm.layers import Attention as TimmAttention

    from poslens.models.vit import Attention

    torch.manual_seed(0)
    theirs = TimmAttention(32, num_heads=4, qkv_bias=True).eval()
    ours = Attention(32, 4, qkv_bias=True, rope_layout=None).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 17, 32)
    torch.testing.assert_close(ours(x, None), theirs(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("explicit", [False, True])
def test_ape_vit_matches_timm(explicit: bool) -> None:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    theirs = VisionTransformer(
        img_size=16,
        patch_size=4,
        in_chans=1,
        num_classes=5,
        embed_dim=32,
        depth=2,
        num_heads=2,
        no_embed_class=True,
        global_pool="token",
    ).eval()
    with torch.no_grad():
        theirs.pos_embed.normal_(std=0.5)
        theirs.cls_token.normal_(std=0.5)
    ours = build_model(ModelConfig(**{**TINY, "posenc": "ape"})).eval()
    ours.load_state_dict(timm_to_poslens(theirs.state_dict()))
    x = torch.randn(4, 1, 16, 16)
    names = lambda n: explicit and n.endswith("hook_pattern")  # noqa: E731
    logits, _ = ours.run_with_cache(x, names)
    torch.testing.assert_close(logits, theirs(x), atol=1e-5, rtol=1e-5)
    # per-block residuals too
    feats = theirs.forward_intermediates(x, intermediates_only=True, output_fmt="NLC", norm=False)
    _, cache = ours.run_with_cache(x, [f"blocks.{b}.hook_resid_post" for b in range(2)])
    for b in range(2):
        torch.testing.assert_close(
            cache[f"blocks.{b}.hook_resid_post"][:, 1:], feats[b], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("side", [12, 24])
def test_ape_at_another_grid_matches_timm(side: int) -> None:
    """The learned table resampled to a smaller (downsampled: timm antialiases) and a larger
    grid, as timm's dynamic_img_size resamples it."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    theirs = VisionTransformer(img_size=20, patch_size=4, in_chans=1, num_classes=5,
                               embed_dim=32, depth=2, num_heads=2, no_embed_class=True,
                               global_pool="token", dynamic_img_size=True).eval()  # fmt: skip
    with torch.no_grad():
        theirs.pos_embed.normal_(std=0.5)
    ours = build_model(ModelConfig(**{**TINY, "posenc": "ape", "image_size": 20})).eval()
    ours.load_state_dict(timm_to_poslens(theirs.state_dict()))
    x = torch.randn(2, 1, side, side)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_axial_rope_matches_timm_up_to_plane_order() -> None:
    """timm's RotaryEmbeddingCat (EVA / naver axial RoPE) puts row planes first; poslens puts
    column planes first. With that plane permutation the rotations agree exactly."""
    from timm.layers import RotaryEmbeddingCat, apply_rot_embed_cat

    dh, nb = 16, 4  # head dim, planes per axis
    rope = RotaryEmbeddingCat(dh, temperature=100.0, in_pixels=False, feat_shape=[4, 4])
    emb = rope.get_embed()  # [N, 2 * dh]: sin then cos, each repeated per channel pair
    model = build_model(ModelConfig(**{**TINY, "posenc": "rope_axial", "rope_theta": 100.0}))
    table = rotary_table(model.rotary(4, 4), num_prefix=0)[0]  # [2, 1, N, P]
    q = torch.randn(2, 2, 16, dh)
    theirs = apply_rot_embed_cat(q, emb)
    # our plane p (channels 2p, 2p+1) is their plane perm[p]
    perm = torch.cat([torch.arange(nb, 2 * nb), torch.arange(nb)])
    chan = torch.stack([2 * perm, 2 * perm + 1], -1).flatten()
    ours = apply_rotary(q[..., chan], table, "interleaved")
    out = torch.empty_like(ours)
    out[..., chan] = ours
    torch.testing.assert_close(out, theirs, atol=1e-6, rtol=1e-5)
