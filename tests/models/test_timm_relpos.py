"""Relative position bias: timm BEiT and VisionTransformerRelPos convert to posenc "relpos" with
parity (random weights, tables included), the hook reads and zeroes the bias, the table's index
follows timm's, and what poslens cannot reproduce is refused in one line."""

from __future__ import annotations

import os

import pytest
import torch

from poslens.errors import UserError
from poslens.models import ModelConfig, build_model
from poslens.models.relpos import rel_pos_index, table_from_bias
from poslens.models.timm_convert import convert, create_timm
from poslens.models.vit import ViT

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # noqa: F401  (CI installs the [timm] extra: a missing timm must fail)
else:
    pytest.importorskip("timm")

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
PARITY = 1e-5


def _random(tm: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random (BEiT initialises its tables and timm its biases at zero)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in tm.parameters():
            p.normal_(0, 0.3)
    return tm


def _converted(name: str, **kw: object) -> tuple[torch.nn.Module, ViT]:
    torch.manual_seed(0)
    tm = _random(create_timm(name, **{**SMALL, **kw}))
    cfg, sd = convert(tm, name)
    model = ViT(cfg)
    model.load_state_dict(sd)
    return tm, model.eval()


CASES = [
    ("beit_base_patch16_224", {}),  # per-block tables, q/v bias, LayerScale, mean pool + fc_norm
    ("beit_base_patch16_224", {"use_shared_rel_pos_bias": True}),  # per-block + shared, summed
    ("beit_base_patch16_224", {"use_shared_rel_pos_bias": True, "use_rel_pos_bias": False}),
    ("beit_base_patch16_224", {"global_pool": "token"}),  # CLS pooling, final norm
    ("vit_relpos_base_patch16_224", {}),  # RelPosMlp (log coords), no CLS token
    ("vit_relpos_medium_patch16_cls_224", {}),  # RelPosMlp with a CLS token (zero prefix bias)
    ("vit_srelpos_small_patch16_224", {}),  # one shared RelPosMlp
    ("vit_relpos_base_patch16_224", {"rel_pos_type": "bias", "class_token": True}),  # RelPosBias
    ("vit_relpos_base_patch16_224", {"rel_pos_type": "mlp_swin"}),  # 16 sigmoid(MLP)
]


@pytest.mark.parametrize(("name", "kw"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_relpos_architectures_convert_with_parity(name: str, kw: dict[str, object]) -> None:
    tm, model = _converted(name, **kw)
    assert model.cfg.posenc == "relpos" and model.cfg.family == "relative"
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        theirs = tm(x)
        assert theirs.abs().max() > 0.1  # the comparison below is not between near-zero logits
        assert (model(x) - theirs).abs().max() <= PARITY
        # the hooked (written-out) path adds the same bias as the fused one
        hooked, _ = model.run_with_cache(x, lambda n: n.endswith("hook_pattern"))
        assert (hooked - theirs).abs().max() <= PARITY


def test_rel_bias_hook_reads_and_zeroes_the_bias_timm_adds() -> None:
    tm, model = _converted("beit_base_patch16_224", use_shared_rel_pos_bias=True)
    x = torch.randn(2, 3, 32, 32)
    name = "blocks.1.attn.hook_rel_bias"
    with torch.no_grad():
        _, cache = model.run_with_cache(x, [name])
        theirs = tm.blocks[1].attn._get_rel_pos_bias()[0] + tm.rel_pos_bias()
        assert cache[name].shape == (2, 17, 17)  # [H, T, T]
        torch.testing.assert_close(cache[name], theirs, atol=1e-6, rtol=0)
        # zeroing every block's bias is timm's model without relative bias
        names = [n for n in model.hook_names() if n.endswith("hook_rel_bias")]
        assert len(names) == 2
        with model.hooks([(n, lambda t, _n: torch.zeros_like(t)) for n in names]):
            removed = model(x)
        for b in tm.blocks:
            b.attn.relative_position_bias_table.zero_()
        tm.rel_pos_bias.relative_position_bias_table.zero_()
        assert (removed - tm(x)).abs().max() <= PARITY
        assert (removed - model(x)).abs().max() > 1e-3  # the bias mattered


def test_index_follows_timm() -> None:
    from timm.layers.pos_embed_rel import gen_relative_position_index

    for prefix in (0, 1):
        theirs = gen_relative_position_index((3, 3), class_token=bool(prefix))
        assert torch.equal(rel_pos_index(3, 3, 3, prefix), theirs)


def test_table_from_bias_flags_a_bias_that_is_not_relative() -> None:
    bias = torch.randn(2, 9, 9)  # no offset structure
    _, diff = table_from_bias(bias, 3, 0)
    assert diff > 0.1
    table = torch.randn(25, 2)
    index = rel_pos_index(3, 3, 3, 0)
    exact = table[index.reshape(-1)].T.reshape(2, 9, 9)
    rebuilt, diff = table_from_bias(exact, 3, 0)
    assert diff == 0 and torch.equal(rebuilt, table)


def test_smaller_grid_reads_the_learned_offsets() -> None:
    """On a smaller grid every offset is one the table learned: the bias there is the native
    bias restricted to the patches of the top-left window (prefix entries unchanged)."""
    big = rel_pos_index(4, 4, 4, 1)
    small = rel_pos_index(2, 3, 4, 1)
    keep = [0] + [1 + r * 4 + c for r in range(2) for c in range(3)]
    assert torch.equal(small, big[keep][:, keep])


def test_residual_post_norm_block_is_refused_in_one_line() -> None:
    tm = create_timm("vit_relpos_base_patch16_rpn_224", **SMALL)
    with pytest.raises(UserError, match="ResPostRelPosBlock") as e:
        convert(tm, "vit_relpos_base_patch16_rpn_224")
    assert "\n" not in str(e.value)


def test_relpos_with_an_absolute_embedding_is_refused() -> None:
    tm = create_timm("beit_base_patch16_224", use_abs_pos_emb=True, **SMALL)
    with pytest.raises(UserError, match="relative position bias with an absolute"):
        convert(tm, "beit_base_patch16_224")


def test_default_fingerprint_is_unchanged_and_relpos_differs() -> None:
    assert ModelConfig().fingerprint() == "ea2bbfff51488c39"  # main's, before relpos existed
    model = build_model(ModelConfig(posenc="relpos", dim=32, depth=2, heads=2), seed=0)
    assert "blocks.0.attn.rel_pos.table" in dict(model.named_parameters())
    assert model.pos_embed is None and model.rotary is None
