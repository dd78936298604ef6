from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from poslens.errors import UserError
from poslens.interventions import (
    ablate,
    ape_permute,
    ape_zero,
    axis_map,
    mean_activations,
    patch,
    rotary_mask,
    rpi,
)
from tests.conftest import tiny


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_axis_map_of_axial_rope_is_half_row_half_col_and_true(layout: str) -> None:
    model = tiny("rope_axial", rope_layout=layout)
    amap = axis_map(model)
    P = 8
    assert amap.counts() == {"row": 2 * 2 * P // 2, "col": 2 * 2 * P // 2, "mixed": 0, "none": 0}
    # the truth, from the frequencies that generate the tables: fy != 0 means the plane follows rows
    fy = model.rotary.freqs[0, 0, :, 1]
    assert amap.row == tuple(int(p) for p in torch.nonzero(fy).flatten())
    assert set(amap.row) | set(amap.col) == set(range(P))
    np.testing.assert_allclose(amap.score[amap.row_mask], 1.0)
    np.testing.assert_allclose(
        amap.freq[0, 0, :4], model.rotary.freqs[0, 0, :4, 0].numpy(), rtol=1e-6
    )


def test_axis_map_recovers_mixed_directions() -> None:
    model = tiny("rope_mixed", rope_theta=10.0)
    amap = axis_map(model)
    f = model.rotary.freqs.detach().double().numpy()  # [depth, H, P, 2] = (fx, fy)
    np.testing.assert_allclose(
        amap.direction_deg, np.degrees(np.arctan2(f[..., 1], f[..., 0])), atol=1e-6
    )
    expected_alignment = np.abs(f[..., 0] ** 2 - f[..., 1] ** 2) / (f**2).sum(-1)
    np.testing.assert_allclose(amap.alignment, expected_alignment, atol=1e-6)
    assert amap.counts()["mixed"] > 0  # random directions are rarely axis-aligned


def test_rotary_mask_restores_the_model(images: torch.Tensor) -> None:
    model = tiny("rope_axial")
    clean = model(images)
    with rotary_mask(model, planes=[0, 5], blocks=[1]) as mask:
        changed = model(images)
    assert mask.sum() == 2 * 2  # 2 planes x 2 heads in one block
    assert not torch.allclose(changed, clean)
    assert torch.equal(model(images), clean)


def test_rotary_mask_in_one_head_touches_only_that_head(images: torch.Tensor) -> None:
    model = tiny("rope_axial")
    with rotary_mask(model, heads=[1], blocks=[0]):
        _, c = model.run_with_cache(images, ["blocks.0.attn.hook_k", "blocks.0.attn.hook_rot_k"])
    k, rk = c["blocks.0.attn.hook_k"], c["blocks.0.attn.hook_rot_k"]
    assert torch.equal(k[:, 1], rk[:, 1])
    assert not torch.allclose(k[:, 0, 2:], rk[:, 0, 2:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": [2]}, "block 2 out of range"),
        ({"heads": [-1]}, "head -1 out of range"),
        ({"planes": [8]}, "plane 8 out of range"),
    ],
)
def test_rotary_mask_bad_indices(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=message), rotary_mask(tiny("rope_axial"), **kwargs):
        pass


def test_rotary_mask_needs_rope() -> None:
    with pytest.raises(UserError, match="no rotary encoding"), rotary_mask(tiny("ape")):
        pass


def test_rpi_is_invisible_to_a_model_without_position(images: torch.Tensor) -> None:
    """A no-position ViT is permutation-equivariant, so permuting its patches cannot change the CLS."""
    model = tiny("none")
    with rpi(model, seed=3) as perm:
        permuted = model(images)
    assert not torch.equal(perm, torch.arange(16))
    torch.testing.assert_close(permuted, model(images), atol=1e-5, rtol=1e-5)
    ape = tiny("ape", ape_init_std=0.5)
    with rpi(ape, seed=3):
        assert not torch.allclose(ape(images), tiny("ape", ape_init_std=0.5)(images), atol=1e-3)


def test_rpi_moves_content_before_position_is_added(images: torch.Tensor) -> None:
    model = tiny("ape")
    _, clean = model.run_with_cache(images, ["hook_embed", "hook_pos_embed"])
    with rpi(model, seed=0) as perm:
        _, c = model.run_with_cache(images, ["hook_embed", "blocks.0.hook_resid_pre"])
    torch.testing.assert_close(c["hook_embed"], clean["hook_embed"][:, perm])
    expected = clean["hook_embed"][:, perm] + clean["hook_pos_embed"]
    torch.testing.assert_close(c["blocks.0.hook_resid_pre"][:, 1:], expected)


def test_ape_zero_and_permute(images: torch.Tensor) -> None:
    model = tiny("ape", ape_init_std=0.5)
    _, clean = model.run_with_cache(images, ["hook_pos_embed"])
    with ape_zero(model):
        _, c = model.run_with_cache(
            images, ["hook_pos_embed", "hook_embed", "blocks.0.hook_resid_pre"]
        )
    assert torch.equal(c["hook_pos_embed"], torch.zeros_like(clean["hook_pos_embed"]))
    torch.testing.assert_close(c["blocks.0.hook_resid_pre"][:, 1:], c["hook_embed"])
    with ape_permute(model, seed=1) as perm:
        _, p = model.run_with_cache(images, ["hook_pos_embed"])
    assert torch.equal(p["hook_pos_embed"], clean["hook_pos_embed"][:, perm])
    with pytest.raises(UserError, match="no additive position"), ape_zero(tiny("rope_axial")):
        pass


def test_zeroing_every_component_leaves_the_embedding(images: torch.Tensor) -> None:
    model = tiny("ape")
    with ablate(model, "attn"), ablate(model, "mlp"):
        _, c = model.run_with_cache(images, ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post"])
    assert torch.equal(c["blocks.1.hook_resid_post"], c["blocks.0.hook_resid_pre"])


def test_ablating_every_head_leaves_only_the_output_bias(images: torch.Tensor) -> None:
    model = tiny()
    with ablate(model, "attn", blocks=[0], heads=[0, 1]):
        _, c = model.run_with_cache(images, ["blocks.0.hook_attn_out"])
    torch.testing.assert_close(
        c["blocks.0.hook_attn_out"], model.blocks[0].attn.proj.bias.expand(3, 17, -1)
    )


def test_mean_ablation_replaces_by_the_reference_mean(images: torch.Tensor) -> None:
    model = tiny()
    means = mean_activations(model, images, ["blocks.1.hook_mlp_out"])
    with ablate(model, "mlp", blocks=[1], mode="mean", means=means):
        _, c = model.run_with_cache(images[:1], ["blocks.1.hook_mlp_out"])
    torch.testing.assert_close(c["blocks.1.hook_mlp_out"][0], means["blocks.1.hook_mlp_out"])
    with (
        pytest.raises(UserError, match="needs its mean"),
        ablate(model, "attn", mode="mean", means=means),
    ):
        pass


def test_patching_the_clean_residual_undoes_rpi(images: torch.Tensor) -> None:
    model = tiny("ape", ape_init_std=0.5)
    clean, cache = model.run_with_cache(images, ["blocks.1.hook_resid_pre"])
    with contextlib.ExitStack() as stack:
        stack.enter_context(rpi(model, seed=0))
        corrupted = model(images)
        stack.enter_context(patch(model, cache))
        patched = model(images)
    assert not torch.allclose(corrupted, clean, atol=1e-3)
    torch.testing.assert_close(patched, clean)


def test_patch_only_some_tokens(images: torch.Tensor) -> None:
    model = tiny()
    _, cache = model.run_with_cache(images, ["blocks.1.hook_resid_pre"])
    donor = {k: torch.zeros_like(v) for k, v in cache.items()}
    with patch(model, donor, tokens=slice(1, 3)):
        _, c = model.run_with_cache(images, ["blocks.1.hook_resid_pre"])
    got = c["blocks.1.hook_resid_pre"]
    assert torch.equal(got[:, 1:3], torch.zeros_like(got[:, 1:3]))
    assert torch.equal(got[:, 3:], cache["blocks.1.hook_resid_pre"][:, 3:])


def test_pre_rotation_axes_follow_the_oblique_construction() -> None:
    from poslens.interventions.rotary import pre_rotation_axes

    with pytest.raises(UserError, match="oblique"):
        pre_rotation_axes(tiny("rope_axial"))
    model = tiny("rope_axial", rope_variant="oblique", depth=4, rope_blocks="first_half")
    axes = pre_rotation_axes(model)  # [depth, H, P]: 8 planes, columns first (posenc._axial)
    assert (axes[:2] == np.array(["col"] * 4 + ["row"] * 4)).all()
    assert (axes[2:] == "none").all()  # blocks 2, 3 do not rotate
    # the angles agree: the column planes turn by 45 degrees, onto the main diagonal
    direction = axis_map(model).direction_deg[:2]
    np.testing.assert_allclose(direction[axes[:2] == "col"], 45.0, atol=1e-6)
