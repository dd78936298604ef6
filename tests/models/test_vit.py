from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poslens.errors import ConfigError, UserError
from poslens.interventions import axis_map, rotary_mask
from poslens.models import ModelConfig, build_model
from poslens.models.posenc import apply_rotary, resample_pos_embed
from tests.conftest import TINY, tiny


def test_same_seed_same_weights() -> None:
    a, b = tiny("rope_mixed"), tiny("rope_mixed")
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k


@pytest.mark.parametrize(
    "posenc",
    ["ape", "sincos", "rope_axial", "rope_mixed", "rope_axial_ape", "rope_mixed_ape", "none"],
)
def test_other_grids_run(posenc: str) -> None:
    model = tiny(posenc)
    assert model(torch.randn(2, 1, 24, 20)).shape == (2, 5)


def test_image_not_divisible_by_patch_is_a_user_error() -> None:
    with pytest.raises(UserError, match="not divisible by the patch size 4"):
        tiny()(torch.randn(1, 1, 18, 16))
    with pytest.raises(ConfigError, match="model.image_size"):
        ModelConfig(image_size=30, patch_size=4)


def test_ape_resample_is_identity_on_the_training_grid() -> None:
    pos = torch.randn(1, 16, 8)
    assert resample_pos_embed(pos, (4, 4), (4, 4)) is pos
    up = resample_pos_embed(pos, (4, 4), (8, 8))
    assert up.shape == (1, 64, 8)


def _scores(
    model: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, block: int = 0
) -> torch.Tensor:
    """Attention logits of block `block` when every token's q and k are forced to q and k."""
    x = torch.zeros(1, 1, model.cfg.image_size, model.cfg.image_size)
    hooks = [
        (f"blocks.{block}.attn.hook_q", lambda t, n: q.expand_as(t).clone()),
        (f"blocks.{block}.attn.hook_k", lambda t, n: k.expand_as(t).clone()),
    ]
    with model.hooks(hooks):
        _, cache = model.run_with_cache(x, [f"blocks.{block}.attn.hook_attn_scores"])
    p = model.cfg.num_prefix
    return cache[f"blocks.{block}.attn.hook_attn_scores"][0, :, p:, p:]  # [H, N, N]


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["rope_axial", "rope_mixed"]),
    st.sampled_from(["interleaved", "half"]),
    st.lists(st.integers(0, 3), min_size=6, max_size=6),
    st.integers(0, 1000),
)
def test_rope_score_depends_only_on_the_offset(
    posenc: str, layout: str, c: list[int], seed: int
) -> None:
    """Two pairs of tokens with the same (d_row, d_col) offset get the same attention logit."""
    model = tiny(posenc, rope_layout=layout)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    s = _scores(model, q, k)
    r1, c1, r2, c2, sr, sc = c
    sr, sc = sr - min(r1, r2), sc - min(c1, c2)  # shift that keeps both tokens on the 4x4 grid
    sr, sc = min(sr, 3 - max(r1, r2)), min(sc, 3 - max(c1, c2))
    i, j = r1 * 4 + c1, r2 * 4 + c2
    i2, j2 = (r1 + sr) * 4 + (c1 + sc), (r2 + sr) * 4 + (c2 + sc)
    torch.testing.assert_close(s[:, i, j], s[:, i2, j2], atol=1e-5, rtol=1e-5)


def test_rope_scores_do_vary_with_offset() -> None:
    """Guards the property test above against a model that ignores position altogether."""
    model = tiny("rope_axial")
    g = torch.Generator().manual_seed(0)
    s = _scores(model, torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g))
    assert (s[:, 0, 1] - s[:, 0, 4]).abs().max() > 1e-3


def test_masking_row_planes_makes_scores_invariant_to_row_shifts() -> None:
    model = tiny("rope_axial")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    with rotary_mask(model, planes=axis_map(model).row):
        s = _scores(model, q, k).view(2, 4, 4, 4, 4)  # [H, r_i, c_i, r_j, c_j]
    # the logit between (r_i, c_i) and (r_j, c_j) no longer depends on r_i or r_j
    torch.testing.assert_close(s, s[:, :1, :, :1, :].expand_as(s), atol=1e-5, rtol=1e-5)
    assert (s[:, 0, 0, 0, 0] - s[:, 0, 0, 0, 1]).abs().max() > 1e-3  # columns still matter


@pytest.mark.parametrize("posenc", ["rope_axial", "rope_mixed"])
def test_all_planes_off_equals_the_no_position_model(posenc: str, images: torch.Tensor) -> None:
    rope = tiny(posenc)
    none = build_model(ModelConfig(**{**TINY, "posenc": "none"})).eval()
    state = {k: v for k, v in rope.state_dict().items() if not k.startswith("rotary.")}
    none.load_state_dict(state)
    with rotary_mask(rope):
        masked = rope(images)
    assert (masked - none(images)).abs().max() <= 1e-6
    assert (rope(images) - none(images)).abs().max() > 1e-4  # and the mask was doing something


def test_prefix_tokens_are_never_rotated(images: torch.Tensor) -> None:
    model = tiny("rope_mixed", num_registers=2)
    _, c = model.run_with_cache(images, ["blocks.1.attn.hook_q", "blocks.1.attn.hook_rot_q"])
    q, rq = c["blocks.1.attn.hook_q"], c["blocks.1.attn.hook_rot_q"]
    assert torch.equal(q[:, :, :3], rq[:, :, :3])  # CLS + 2 registers untouched
    assert not torch.allclose(q[:, :, 4:], rq[:, :, 4:])


def test_channel_layouts_are_the_same_rotation_up_to_a_channel_permutation(
    images: torch.Tensor,
) -> None:
    """Interleaved pairs (2p, 2p+1) and rotate-half pairs (p, p + dh/2) give the same model once
    q and k channels are permuted accordingly (the map timm checkpoints need)."""
    inter = tiny("rope_axial", rope_layout="interleaved")
    half = tiny("rope_axial", rope_layout="half")
    dh, P, D = 16, 8, 32
    perm = torch.cat(
        [torch.arange(0, dh, 2), torch.arange(1, dh, 2)]
    )  # half channel c <- inter perm[c]
    state = inter.state_dict()
    for b in range(2):
        for part in ("weight", "bias"):
            w = state[f"blocks.{b}.attn.qkv.{part}"].clone()
            for which in (0, 1):  # q and k, not v
                for h in range(2):
                    rows = slice(which * D + h * dh, which * D + (h + 1) * dh)
                    w[rows] = w[rows][perm]
            state[f"blocks.{b}.attn.qkv.{part}"] = w
    half.load_state_dict(state)
    torch.testing.assert_close(half(images), inter(images), atol=1e-5, rtol=1e-5)
    assert P == dh // 2


def test_apply_rotary_identity_is_exact() -> None:
    x = torch.randn(2, 3, 5, 8)
    ident = torch.stack([torch.ones(1, 5, 4), torch.zeros(1, 5, 4)])
    for layout in ("interleaved", "half"):
        assert torch.equal(apply_rotary(x, ident, layout), x)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_apply_rotary_matches_the_per_plane_rotation_bit_for_bit(layout: str) -> None:
    """Plane p turns its channel pair (a, b) to (a cos - b sin, a sin + b cos), nothing else moves."""
    g = torch.Generator().manual_seed(0)
    x, angles = torch.randn(2, 3, 5, 8, generator=g), torch.randn(3, 5, 4, generator=g) * 3
    cos_sin = torch.stack([angles.cos(), angles.sin()])  # [2, H, T, P]
    pairs = [(2 * p, 2 * p + 1) if layout == "interleaved" else (p, p + 4) for p in range(4)]
    want = torch.empty_like(x)
    for p, (i, j) in enumerate(pairs):
        a, b, cos, sin = x[..., i], x[..., j], cos_sin[0, ..., p], cos_sin[1, ..., p]
        want[..., i], want[..., j] = a * cos - b * sin, a * sin + b * cos
    assert torch.equal(apply_rotary(x, cos_sin, layout), want)


def test_cpu_attention_is_fused_only_where_nothing_reads_the_pattern_and_nothing_records() -> None:
    """The fused kernel (faster on CPU without autograd) gives the explicit path's logits; hooks
    on the scores or the pattern, and autograd on CPU, keep the explicit path."""
    model, x = tiny("rope_axial"), torch.randn(3, 1, 16, 16)
    calls: list[str] = []
    fused = torch.nn.functional.scaled_dot_product_attention

    def spy(*a: object, **k: object) -> torch.Tensor:
        calls.append("fused")
        return fused(*a, **k)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        with torch.no_grad():
            plain = model(x)
            assert calls == ["fused", "fused"]
            hooked, cache = model.run_with_cache(x, "blocks.1.attn.hook_pattern")
            assert calls == ["fused", "fused", "fused"]  # block 0 fused, block 1 explicit
            assert cache["blocks.1.attn.hook_pattern"].shape == (3, 2, 17, 17)
            model.run_with_cache(x, "blocks.0.attn.hook_attn_scores")
            assert calls == ["fused"] * 4  # block 0 explicit, block 1 fused
        grad = model(x)  # parameters require grad: autograd records, explicit path
        assert calls == ["fused"] * 4 and grad.requires_grad
    torch.testing.assert_close(plain, hooked, atol=1e-5, rtol=0)
    torch.testing.assert_close(plain, grad.detach(), atol=1e-5, rtol=0)


def test_rope_coords_default_is_left_out_of_saved_configs() -> None:
    """Configs written before rope_coords existed (and the study's checkpoint hashes) stay the same."""
    assert "rope_coords" not in ModelConfig().to_dict()
    cfg = ModelConfig(rope_coords="centered")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="model.rope_coords"):
        ModelConfig(rope_coords="pixels")


@pytest.mark.parametrize("posenc", ["rope_axial", "rope_mixed_ape"])
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_unhooked_rotation_is_the_hooked_rotation_bit_for_bit(posenc: str, layout: str) -> None:
    """Without hooks on q, k or the table, q and k rotate together in the qkv linear's layout:
    the same numbers, forward and backward, as the per-head path that hooks see."""
    model = tiny(posenc, rope_layout=layout, num_registers=1).train()
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    grads = []
    for hooked in (False, True):
        model.zero_grad()
        # ln_final hooked in both passes: every token goes through the last block (no CLS exit)
        noop = [("ln_final.hook_normalized", lambda t, n: None)]
        noop += [("blocks.1.attn.hook_rot_k", lambda t, n: None)] if hooked else []
        with model.hooks(noop):
            out = model(x)
        out.square().sum().backward()
        grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_sincos_temperature_sets_the_table_and_defaults_stay_out_of_saved_configs() -> None:
    """Pair i of an axis turns temperature^(-i / (dim/4)) rad per patch; the default (10000) is
    left out of saved configs, so sincos checkpoints written before the field keep their hash."""
    assert "sincos_temperature" not in ModelConfig(posenc="sincos").to_dict()
    cfg = ModelConfig(**{**TINY, "posenc": "sincos", "sincos_temperature": 100.0})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    model = build_model(cfg, seed=0).eval()
    table = model.pos_embed_for(4, 4)  # [1, 16, 32]: column sin | column cos | row sin | row cos
    quarter = cfg.dim // 4
    col1 = table[0, 1]  # token (row 0, col 1)
    for i in range(quarter):
        angle = torch.tensor(100.0 ** (-i / quarter))
        torch.testing.assert_close(col1[i], angle.sin())
        torch.testing.assert_close(col1[quarter + i], angle.cos())
    default = build_model(ModelConfig(**{**TINY, "posenc": "sincos"}), seed=0).eval()
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(model(x), default(x))  # same weights, another table
    with pytest.raises(ConfigError, match="model.sincos_temperature"):
        ModelConfig(posenc="ape", sincos_temperature=100.0)
    with pytest.raises(ConfigError, match="model.sincos_temperature"):
        ModelConfig(posenc="sincos", sincos_temperature=0.0)


@pytest.mark.parametrize("posenc", ["ape", "rope_axial", "rope_mixed", "relpos"])
def test_a_pass_resumed_from_a_residual_is_the_whole_pass_bit_for_bit(posenc: str) -> None:
    """forward(residual(x, b), start_at=b) is forward(x), also on another grid and with a
    rotary mask on the later blocks; hooks before block b do not fire, those after do."""
    model = tiny(posenc, depth=3)
    for shape in ((3, 1, 16, 16), (2, 1, 24, 20)):
        x = torch.randn(*shape)
        grid = model.grid_of(x)
        with torch.no_grad():
            for b in (1, 2, 3):
                resid = model.residual(x, b)
                assert resid.shape == (len(x), model.cfg.num_prefix + grid[0] * grid[1], 32)
                # a residual after the last block ran it for every token: the whole pass then
                # does too (its CLS exit would round the last block differently)
                model.train_cls_exit = b < 3
                assert torch.equal(model(resid, start_at=b, grid=grid), model(x))
            model.train_cls_exit = True
    if model.cfg.uses_rope:
        x = torch.randn(3, 1, 16, 16)
        mask = torch.zeros(3, model.cfg.heads, model.cfg.head_dim // 2, dtype=torch.bool)
        mask[2:, 0] = True  # planes of head 0, in block 2 only
        with torch.no_grad(), rotary_mask(model, mask):
            resumed = model(model.residual(x, 2), start_at=2)
            whole = model(x)
        assert torch.equal(resumed, whole)
        with torch.no_grad():
            assert not torch.allclose(whole, model(x))  # the mask did change block 2
    names = ["blocks.0.hook_resid_post", "blocks.2.hook_resid_pre"]
    with torch.no_grad():
        _, cache = model.run_with_cache(model.residual(x[..., :16, :16], 1), names, start_at=1)
    assert list(cache) == ["blocks.2.hook_resid_pre"]
    with pytest.raises(ValueError, match="start_at"):
        model(torch.randn(3, 1, 16, 16), start_at=1)  # images, not a residual
    with pytest.raises(ValueError, match="block"):
        model.residual(x, 0)
