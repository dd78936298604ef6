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


def test_hook_list_of_the_pretrained_pieces_is_pinned() -> None:
    """Sub-norms and fc_norm add their outputs where they act, in forward order; patch_norm,
    norm_pre and qk-norm act where hook_embed, blocks.0.hook_resid_pre and hook_q/k read."""
    pieces = dict(patch_norm=True, norm_pre=True, qk_norm=True, attn_sub_norm=True,
                  mlp_sub_norm=True, final_norm=False, fc_norm=True, pool="mean")  # fmt: skip
    names = tiny("rope_axial_ape", **pieces).hook_names()
    expected = ["hook_embed", "hook_pos_embed"]
    for b in range(2):
        block = list(BLOCK)
        block.insert(block.index("attn.hook_result"), "attn.norm.hook_normalized")
        block.insert(block.index("hook_mlp_out"), "mlp.norm.hook_normalized")
        expected += [f"blocks.{b}.{n}" for n in block]
    expected += ["ln_final.hook_normalized", "fc_norm.hook_normalized"]
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


def test_cache_until_stops_after_the_last_requested_site(images: torch.Tensor) -> None:
    """The same activations as a full pass, no block after the last one run, no hook left."""
    model = tiny()
    names = ["blocks.0.hook_resid_pre", "blocks.0.ln1.hook_normalized"]
    _, full = model.run_with_cache(images, names)
    ran: list[int] = []
    hooks = [blk.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
             for i, blk in enumerate(model.blocks)]  # fmt: skip
    try:
        got = model.cache_until(images, names)
    finally:
        for h in hooks:
            h.remove()
    assert ran == [0] and set(got) == set(names)
    for n in names:
        torch.testing.assert_close(got[n], full[n])
    assert not any(model._hook_points[n]._forward_hooks for n in model.hook_names())


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


def test_caching_every_hook_changes_no_activation(images: torch.Tensor) -> None:
    """What benchmarks/pretrained_forward.py times: a cache of every hook holds the values each
    hook sees when read alone; only hook_result reroutes the attention output (sum of per-head
    outputs instead of one projection), so values downstream of it agree to rounding."""
    model = tiny("rope_axial_ape")
    names = model.hook_names()
    no_result = [n for n in names if not n.endswith("hook_result")]
    logits, full = model.run_with_cache(images, names)
    _, partial = model.run_with_cache(images, no_result)
    torch.testing.assert_close(logits, model(images), atol=1e-5, rtol=1e-5)
    for name in names:
        _, alone = model.run_with_cache(images, [name])
        torch.testing.assert_close(full[name], alone[name], atol=1e-5, rtol=1e-5)
        if name in partial:
            assert torch.equal(partial[name], alone[name]), name


def test_per_head_results_are_each_heads_share_of_the_projection(images: torch.Tensor) -> None:
    model = tiny()
    attn = model.blocks[0].attn
    _, cache = model.run_with_cache(images, ["blocks.0.attn.hook_z", "blocks.0.attn.hook_result"])
    z, result = cache["blocks.0.attn.hook_z"], cache["blocks.0.attn.hook_result"]  # [B, H, T, dh]
    for h in range(attn.heads):
        cols = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
        expected = z[:, h] @ attn.proj.weight[:, cols].T  # [B, T, D]
        torch.testing.assert_close(result[:, :, h], expected, atol=1e-6, rtol=1e-5)


def test_an_in_place_edit_of_per_head_results_reaches_the_output(images: torch.Tensor) -> None:
    """Zeroing a head in place is the same as returning the zeroed tensor (the output is always
    the sum of the result the hooks leave, never a separate projection)."""
    model = tiny()

    def zero_in_place(t: torch.Tensor, name: str) -> None:
        t[:, :, 0] = 0

    def zero_returned(t: torch.Tensor, name: str) -> torch.Tensor:
        t = t.clone()
        t[:, :, 0] = 0
        return t

    with model.hooks([("blocks.1.attn.hook_result", zero_in_place)]):
        in_place = model(images)
    with model.hooks([("blocks.1.attn.hook_result", zero_returned)]):
        returned = model(images)
    assert torch.equal(in_place, returned)
    assert (in_place - model(images)).abs().max() > 1e-4


def test_the_hook_vocabulary_names_real_hook_points() -> None:
    """Every name the builders in models/hooks.py make is a hook point of the ViT, and
    block_of / norm_of read them back: a renamed module or hook fails here, not in an analysis."""
    from poslens.models import hooks as h

    pieces = dict(attn_sub_norm=True, mlp_sub_norm=True, fc_norm=True)
    for posenc, kw in (("rope_axial", {}), ("ape", {}), ("ape", pieces), ("relpos", {})):
        m = tiny(posenc, **kw)
        names = set(m.hook_names())
        built = [h.EMBED, h.FINAL_NORM] + ([h.POS_EMBED] if posenc == "ape" else [])
        built += [h.FC_NORM] if kw else []
        for b in range(m.cfg.depth):
            built += [h.sub_norm(b, "attn"), h.sub_norm(b, "mlp")] if kw else []
            built += [h.resid_pre(b), h.resid_mid(b), h.resid_post(b), h.normalized(b, "ln1"),
                      h.normalized(b, "ln2"), h.block_out(b, "attn"), h.block_out(b, "mlp")]  # fmt: skip
            built += [
                h.attn(b, n)
                for n in h.ATTN_HOOKS
                if (posenc == "rope_axial" or "rot" not in n)
                and (posenc == "relpos" or n != "rel_bias")
            ]
            assert h.block_of(h.resid_pre(b)) == h.block_of(h.attn(b, "pattern")) == b
            assert h.norm_of(h.normalized(b, "ln2")) == "ln2"
        assert set(built) <= names, sorted(set(built) - names)
        assert h.block_of(h.FINAL_NORM) is None and h.norm_of(h.FINAL_NORM) == "ln_final"
        assert h.norm_of(h.resid_pre(0)) is None and h.block_of("blocks.x.hook_z") is None
        # every hook name of the model is one the vocabulary can build
        assert names <= set(built), sorted(names - set(built))
