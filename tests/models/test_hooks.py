from __future__ import annotations

import pytest
import torch

from poslens.errors import UserError
from tests.conftest import tiny

BLOCK = [
    "hook_resid_pre",
    "ln1.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_rotary",
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "attn.hook_result",
    "hook_attn_out",
    "hook_resid_mid",
    "ln2.hook_normalized",
    "hook_mlp_out",
    "hook_resid_post",
]


def test_full_hook_list_is_pinned() -> None:
    names = tiny("rope_axial_ape").hook_names()
    expected = ["hook_embed", "hook_pos_embed"]
    for b in range(2):
        expected += [f"blocks.{b}.{n}" for n in BLOCK]
    expected += ["ln_final.hook_normalized"]
    assert names == expected


@pytest.mark.parametrize(
    ("posenc", "absent"),
    [
        ("none", {"hook_pos_embed", "blocks.0.attn.hook_rotary", "blocks.0.attn.hook_rot_q"}),
        ("ape", {"blocks.0.attn.hook_rotary", "blocks.1.attn.hook_rot_k"}),
        ("rope_axial", {"hook_pos_embed"}),
    ],
)
def test_hooks_exist_only_where_the_mechanism_does(posenc: str, absent: set[str]) -> None:
    assert not absent & set(tiny(posenc).hook_names())


def test_run_with_cache_stores_only_requested(images: torch.Tensor) -> None:
    model = tiny()
    logits, cache = model.run_with_cache(
        images, ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_pattern"]
    )
    assert set(cache) == {"blocks.1.hook_resid_pre", "blocks.0.attn.hook_pattern"}
    assert cache["blocks.0.attn.hook_pattern"].shape == (3, 2, 17, 17)
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"].sum(-1), torch.ones(3, 2, 17))
    torch.testing.assert_close(logits, model(images))


def test_hooks_are_removed_when_the_body_raises(images: torch.Tensor) -> None:
    model = tiny()
    clean = model(images)
    with (
        pytest.raises(RuntimeError),
        model.hooks([("blocks.0.hook_resid_pre", lambda x, n: x * 0)]),
    ):
        raise RuntimeError("boom")
    assert not any(model._hook_points[n]._forward_hooks for n in model.hook_names())
    torch.testing.assert_close(model(images), clean)


def test_unknown_hook_name_is_a_user_error(images: torch.Tensor) -> None:
    with pytest.raises(UserError, match="unknown hook name 'blocks.7.hook_resid_pre'"):
        tiny().run_with_cache(images, ["blocks.7.hook_resid_pre"])


def test_explicit_attention_path_matches_fused_kernel(images: torch.Tensor) -> None:
    model = tiny("rope_mixed")
    fused = model(images)
    explicit, _ = model.run_with_cache(images, lambda n: n.endswith("hook_pattern"))
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-5)


def test_per_head_results_sum_to_attention_output(images: torch.Tensor) -> None:
    model = tiny()
    _, cache = model.run_with_cache(images, ["blocks.1.attn.hook_result", "blocks.1.hook_attn_out"])
    summed = cache["blocks.1.attn.hook_result"].sum(2) + model.blocks[1].attn.proj.bias
    torch.testing.assert_close(summed, cache["blocks.1.hook_attn_out"], atol=1e-5, rtol=1e-5)


def test_a_hook_can_rewrite_an_activation(images: torch.Tensor) -> None:
    model = tiny()
    with model.hooks([("ln_final.hook_normalized", lambda x, n: torch.zeros_like(x))]):
        out = model(images)
    torch.testing.assert_close(out, model.head.bias.expand(3, -1))
