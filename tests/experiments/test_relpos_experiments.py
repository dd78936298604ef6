"""posenc "relpos" (a learned relative bias, no absolute position) in the experiments: the ones
that apply run on it (depth_profile, position_removal with the bias zeroed as its floor, heads
with a head's bias zeroed, sae_causal), the rotary-plane ones refuse it in one line, and the
intervention zeroes exactly the bias it names."""

from __future__ import annotations

import pytest
import torch

from poslens.data import DataConfig, Task, build_task
from poslens.errors import UserError
from poslens.experiments import (
    axis_map,
    depth_profile,
    heads,
    position_removal,
    sae_causal,
    windows,
)
from poslens.experiments.heads.units import heads_off, intervention_of
from poslens.interventions import rel_bias_zero
from poslens.models import ViT
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=60)
CFG = dict(n_images=40, probe_images=20, batch_size=40, draws=1)


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(DATA)


def relpos() -> ViT:
    """A tiny relpos model whose tables are large enough to change the attention."""
    m = tiny("relpos", num_classes=16)
    with torch.no_grad():
        for b in m.blocks:
            b.attn.rel_pos.table.normal_(0, 2.0)
    return m


def test_rotary_experiments_refuse_relpos_in_one_line() -> None:
    m = relpos()
    for exp in (axis_map, windows):
        why = exp.applies(m)
        assert why is not None and "relpos" in why and "\n" not in why
    for exp in (depth_profile, position_removal, heads, sae_causal):
        assert exp.applies(m) is None, exp.__name__


def test_rel_bias_zero_takes_out_the_named_heads_only() -> None:
    m = relpos()
    x = torch.randn(2, 1, 16, 16)
    name = "blocks.1.attn.hook_rel_bias"
    with torch.no_grad(), rel_bias_zero(m, blocks=[1], heads=[0]):
        _, edited = m.run_with_cache(x, [name, "blocks.0.attn.hook_rel_bias"])
        _, scores = m.run_with_cache(x, ["blocks.1.attn.hook_attn_scores"])
    _, plain = m.run_with_cache(x, [name, "blocks.0.attn.hook_rel_bias",
                                    "blocks.1.attn.hook_attn_scores"])  # fmt: skip
    # the edit zeroes head 0 of block 1 and leaves head 1 and block 0 alone
    assert edited[name][0].abs().max() == 0 and plain[name][0].abs().max() > 0.1
    assert torch.equal(edited[name][1], plain[name][1])
    assert torch.equal(edited["blocks.0.attn.hook_rel_bias"], plain["blocks.0.attn.hook_rel_bias"])
    # and the scores lose exactly that bias
    diff = plain["blocks.1.attn.hook_attn_scores"] - scores["blocks.1.attn.hook_attn_scores"]
    torch.testing.assert_close(diff[:, 0], plain[name][0].expand_as(diff[:, 0]))
    assert diff[:, 1].abs().max() < 1e-6
    assert intervention_of(m) == "rel_bias"
    with pytest.raises(UserError, match="out of range"):
        with rel_bias_zero(m, blocks=[2]):
            pass
    with pytest.raises(UserError, match="no relative position bias"):
        with rel_bias_zero(tiny("ape")):
            pass
    # heads_off on relpos is the bias of those heads zeroed, not their output
    with torch.no_grad(), heads_off(m, [(1, 0)])(m):
        _, off = m.run_with_cache(x, ["blocks.1.attn.hook_attn_scores"])
    torch.testing.assert_close(off["blocks.1.attn.hook_attn_scores"],
                               scores["blocks.1.attn.hook_attn_scores"])  # fmt: skip


def test_experiments_run_on_relpos(task: Task) -> None:
    m = relpos()
    prof = depth_profile.run(m, task, depth_profile.Config(**CFG))
    assert prof.posenc == "relpos" and prof.ssdc_rpi.shape == (3,)
    rem = position_removal.run(m, task, position_removal.Config(**CFG))
    assert rem.floor.name == "floor"
    assert abs(rem.floor.d_margin.mean) > 1e-4  # zeroing the bias changed the margins
    res = heads.run(m, task, heads.Config(**CFG))
    assert res.intervention == "rel_bias"


def test_sae_causal_runs_on_relpos(task: Task) -> None:
    m = relpos()
    cfg = sae_causal.Config(
        sites=("blocks.1.hook_resid_pre",), n_images=30, probe_images=20, batch_size=30,
        train_images=40, epochs=1, k=4, doses=(2,), draws=1,
    )  # fmt: skip
    res = sae_causal.run(m, task, cfg)
    assert [r.site for r in res.results] == ["blocks.1.hook_resid_pre"]
