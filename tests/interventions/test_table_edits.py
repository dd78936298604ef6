"""The position-table edit: the table's least-squares row + column part and its cell residual,
each alone at the table's norm, read through hook_pos_embed and always restored."""

from __future__ import annotations

import pytest
import torch

from poslens.errors import UserError
from poslens.interventions import ape_table_part
from poslens.interventions.position import table_part, zero_table_part
from poslens.metrics.stats import row_col_parts, row_col_share
from poslens.models import hooks
from tests.conftest import tiny


def test_row_col_parts_are_orthogonal_and_sum_to_the_table() -> None:
    t = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(0))  # a non-square grid
    rowcol, cell = row_col_parts(t)
    torch.testing.assert_close(rowcol + cell, t.double())
    assert abs(float((rowcol * cell).sum())) < 1e-10 * float(t.double().pow(2).sum())
    # the residual has no row or column structure left; the additive part is all of it
    torch.testing.assert_close(cell.mean(0), torch.zeros(5, 8, dtype=torch.float64))
    torch.testing.assert_close(cell.mean(1), torch.zeros(4, 8, dtype=torch.float64))
    assert row_col_share(rowcol)["rowcol_share"] == pytest.approx(1.0)
    assert row_col_share(cell)["rowcol_share"] == pytest.approx(0.0, abs=1e-12)
    # the share is the additive part's variance over the table's (both about the grand mean)
    mean = t.double().mean((0, 1))
    share = (rowcol - mean).pow(2).sum() / (t.double() - mean).pow(2).sum()
    assert row_col_share(t)["rowcol_share"] == pytest.approx(float(share))


def _table_seen(model, part: str) -> torch.Tensor:
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    with ape_table_part(model, part):
        _, cache = model.run_with_cache(x, hooks.POS_EMBED)
    return cache[hooks.POS_EMBED][0].reshape(4, 4, -1).double()


@pytest.mark.parametrize("part", ["rowcol", "cell"])
def test_each_part_is_what_the_model_reads_at_the_table_norm(part: str) -> None:
    model = tiny("ape")
    table = model.pos_embed.detach()[0].reshape(4, 4, -1).double()
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
    seen = _table_seen(model, part)
    assert float(seen.norm()) == pytest.approx(float(table.norm()), rel=1e-5)
    share = row_col_share(seen)["rowcol_share"]
    assert share == pytest.approx(1.0 if part == "rowcol" else 0.0, abs=1e-5)
    rowcol, cell = row_col_parts(table)
    expect = rowcol if part == "rowcol" else cell
    cos = float((seen * expect).sum() / (seen.norm() * expect.norm()))
    assert cos == pytest.approx(1.0, abs=1e-6)  # the part itself, only rescaled
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)  # restored on exit
    assert torch.equal(model.pos_embed.detach()[0].reshape(4, 4, -1).double(), table)


def test_an_additive_table_is_its_row_col_part_and_has_no_cell_part() -> None:
    model = tiny("ape", ape_code="rowcol")  # planted r[row] + c[col]: additive by construction
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        intact = model(x)
        with ape_table_part(model, "rowcol"):
            torch.testing.assert_close(model(x), intact, atol=1e-5, rtol=1e-5)
    assert zero_table_part(model, "rowcol") is None
    assert "cell part is zero" in (zero_table_part(model, "cell") or "")
    with pytest.raises(UserError, match="cell part is zero"), ape_table_part(model, "cell"):
        pass  # refused before any forward: no division by a zero norm
    with pytest.raises(UserError, match="is zero"):
        table_part(torch.zeros(1, 16, 8), (4, 4), "rowcol")  # a zero table has no part at all


def test_prefix_tokens_are_unchanged_by_the_edit() -> None:
    model = tiny("ape", num_registers=2)  # CLS + 2 registers, whose inputs carry no table row
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    name = hooks.resid_pre(0)
    _, intact = model.run_with_cache(x, name)
    with ape_table_part(model, "cell"):
        _, edited = model.run_with_cache(x, name)
    p = model.cfg.num_prefix
    assert torch.equal(edited[name][:, :p], intact[name][:, :p])
    assert not torch.allclose(edited[name][:, p:], intact[name][:, p:])


def test_table_edit_needs_a_learned_table_and_a_matching_grid() -> None:
    with pytest.raises(UserError, match="no learned position table"):
        with ape_table_part(tiny("sincos"), "rowcol"):
            pass
    with pytest.raises(UserError, match="unknown table part"):
        table_part(torch.zeros(1, 16, 8), (4, 4), "diagonal")
    with pytest.raises(UserError, match="not a 2x4 grid"):
        table_part(torch.randn(1, 16, 8), (2, 4), "rowcol")


def test_on_another_grid_the_part_is_of_the_table_read_there() -> None:
    model = tiny("ape")  # trained on 4 x 4; a 2 x 8 grid has as many tokens
    x = torch.randn(1, 1, 8, 32, generator=torch.Generator().manual_seed(4))
    with ape_table_part(model, "cell"):
        _, cache = model.run_with_cache(x, hooks.POS_EMBED)
    seen = cache[hooks.POS_EMBED][0].reshape(2, 8, -1)
    read = model.pos_embed_for(2, 8).detach()[0].reshape(2, 8, -1)  # decomposed as 2 x 8
    cell = row_col_parts(read)[1]
    torch.testing.assert_close(seen.double(), cell * (read.norm() / cell.norm()))
    assert not model.patch_embed._forward_hooks  # the grid reader is gone
