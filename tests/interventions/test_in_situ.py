"""In-situ controls plant or remove what they claim, leave the original model alone (`edited`) or
restore it exactly (`in_situ`), and refuse models they do not apply to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poslens.errors import UserError
from poslens.experiments.axis_map import fraction_aligned
from poslens.interventions import in_situ as ins
from poslens.interventions.position import seeded_permutation
from poslens.interventions.rotary import axis_map, pre_rotation_axes
from poslens.metrics.stats import row_col_share
from tests.conftest import tiny


def _table(model) -> torch.Tensor:  # type: ignore[no-untyped-def]
    g = model.cfg.grid
    return model.pos_embed.detach()[0].reshape(g, g, -1)


def test_table_edits_plant_and_remove_the_row_column_structure_at_the_tables_norm() -> None:
    m = tiny("ape")
    before = row_col_share(_table(m))["rowcol_share"]
    assert 0.1 < before < 0.9  # a random table: some of each
    rowcol, cell = ins.edited(m, "table_rowcol"), ins.edited(m, "table_cell")
    assert row_col_share(_table(rowcol))["rowcol_share"] == pytest.approx(1.0)
    assert row_col_share(_table(cell))["rowcol_share"] == pytest.approx(0.0, abs=1e-6)
    for e in (rowcol, cell):
        assert float(e.pos_embed.detach().norm()) == pytest.approx(
            float(m.pos_embed.detach().norm()), rel=1e-5
        )
    assert row_col_share(_table(m))["rowcol_share"] == pytest.approx(before)  # m left alone


@pytest.mark.parametrize("posenc", ["rope_axial", "rope_mixed"])
def test_heads_axis_split_leaves_each_head_one_axis(posenc: str) -> None:
    m = ins.edited(tiny(posenc, heads=4), "heads_axis_split")
    f = ins._freqs(m)  # [depth, H, P, 2]
    moving = f.abs().sum(-1) > 0
    col = ins.nearer_axis(f)
    for h in range(4):
        kept = col[:, h][moving[:, h]]
        assert kept.numel() > 0
        assert bool((~kept).all()) if h % 2 == 0 else bool(kept.all())  # even: row, odd: column
    if posenc == "rope_axial":  # the angles the model uses say the same
        amap = axis_map(m)
        assert set(amap.axis[:, 0::2].ravel()) == {"row", "none"}
        assert set(amap.axis[:, 1::2].ravel()) == {"col", "none"}
        # every plane that still turns follows one axis (the stopped ones are not counted)
        assert fraction_aligned(amap.counts()) == 1.0 and amap.counts()["none"] > 0


def test_oblique_edit_turns_every_plane_off_the_axes_and_keeps_its_pre_edit_axis() -> None:
    m = ins.edited(tiny("rope_axial"), "freqs_oblique")
    amap = axis_map(m)
    assert np.all(amap.alignment < 1e-6)  # every plane along a diagonal
    assert m.cfg.rope_variant == "oblique"
    half = m.cfg.head_dim // 4
    pre = pre_rotation_axes(m, amap)
    assert set(pre[..., :half].ravel()) == {"col"} and set(pre[..., half:].ravel()) == {"row"}
    # the same planes as the trained oblique variant's
    torch.testing.assert_close(
        ins._freqs(m), ins._freqs(tiny("rope_axial", rope_variant="oblique"))
    )


@pytest.mark.parametrize("posenc", ["ape", "rope_axial", "relpos"])
def test_position_shuffled_permutes_the_position_signal_across_positions(posenc: str) -> None:
    m = tiny(posenc)
    s = ins.edited(m, "position_shuffled")
    perm = seeded_permutation(m.cfg.grid**2, ins.SHUFFLE_SEED)
    assert not torch.equal(perm, torch.arange(len(perm)))
    if posenc == "ape":
        torch.testing.assert_close(s.pos_embed, m.pos_embed[:, perm])
    elif posenc == "relpos":  # the patch offsets' biases permuted, the prefix entries kept
        n = (2 * m.cfg.grid - 1) ** 2
        offsets = seeded_permutation(n, ins.SHUFFLE_SEED)
        for ours, theirs in zip(s.blocks, m.blocks, strict=True):
            table, orig = ours.attn.rel_pos.table, theirs.attn.rel_pos.table
            torch.testing.assert_close(table[:n], orig[:n][offsets])
            torch.testing.assert_close(table[n:], orig[n:])
    else:
        g = m.cfg.grid
        torch.testing.assert_close(s.rotary(g, g), m.rotary(g, g)[..., perm, :])


def test_in_situ_restores_the_model_exactly_even_on_error(images: torch.Tensor) -> None:
    for posenc, name in (("ape", "table_cell"), ("rope_axial", "freqs_oblique"),
                         ("rope_mixed", "heads_axis_split"), ("rope_axial", "position_shuffled"),
                         ("relpos", "position_shuffled")):  # fmt: skip
        m = tiny(posenc)
        before = m(images)
        with ins.in_situ(m, name) as e:
            assert e is m and not torch.allclose(m(images), before)
        torch.testing.assert_close(m(images), before, rtol=0, atol=0)
        with pytest.raises(RuntimeError), ins.in_situ(m, name):
            raise RuntimeError("inside")
        torch.testing.assert_close(m(images), before, rtol=0, atol=0)
        assert m.cfg.rope_variant == "standard"


def test_unknown_or_inapplicable_controls_are_one_line_errors() -> None:
    with pytest.raises(UserError, match="unknown in-situ control"):
        ins.edited(tiny("ape"), "table_diagonal")
    with pytest.raises(UserError, match="does not apply to rope_axial"):
        ins.edited(tiny("rope_axial"), "table_rowcol")
    with pytest.raises(UserError, match="does not apply to rope_mixed"):
        ins.edited(tiny("rope_mixed"), "freqs_oblique")
    assert ins.split_name(ins.model_name("ape", "table_cell")) == ("ape", "table_cell")
    assert ins.split_name("ape") == ("ape", None)
