"""The pieces of pretrained architectures as config fields (ModelConfig.ARCH_FIELDS): validated by
name, left out of saved configs at their default (older checkpoints and hashes unchanged), saved
and loaded, and refused where a path computes only the plain ViT (ensembles, timm export)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import poslens
from poslens.errors import ConfigError, UserError
from poslens.models import ModelConfig, build_model
from poslens.models.config import ARCH_FIELDS
from poslens.models.ensemble import StackedViT
from tests.conftest import TINY, tiny

ALL_ON = dict(patch_norm=True, norm_pre=True, qk_norm=True, attn_sub_norm=True, mlp="swiglu",
              mlp_sub_norm=True, final_norm=False, fc_norm=True, num_registers=1,
              head_dist=True)  # fmt: skip


def test_defaults_stay_out_of_saved_configs_and_the_fingerprint() -> None:
    """A config without the pieces writes the JSON (and so the hash) it wrote before they existed."""
    cfg = ModelConfig(**TINY)
    assert not set(ARCH_FIELDS) & set(cfg.to_dict()) and cfg.arch_pieces() == []
    text = cfg.canonical_json()
    assert ModelConfig.from_dict(json.loads(text)) == cfg  # a config written before: no fields
    on = ModelConfig(**{**TINY, "posenc": "ape", **ALL_ON})
    assert ModelConfig.from_dict(on.to_dict()) == on
    assert on.fingerprint() != ModelConfig(**{**TINY, "posenc": "ape"}).fingerprint()
    assert on.arch_pieces()[:2] == ["patch_norm", "norm_pre"]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(norm_pre=1), "model.norm_pre"),
        (dict(mlp="geglu"), "model.mlp"),
        (dict(mlp_act="relu"), "model.mlp_act"),
        (dict(mlp="swiglu", mlp_act="quick_gelu"), "model.mlp_act"),
        (dict(head_dist=True), "model.head_dist"),  # needs a register
        (dict(head_dist=True, num_registers=1, pool="mean"), "model.head_dist"),
    ],
)
def test_bad_piece_values_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**TINY, **kw})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict({**TINY, **kw})


def test_every_piece_changes_the_output() -> None:
    """Each field switches on a computation (not a no-op), from the same seed."""
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, value in ALL_ON.items():
            if name == "num_registers":
                continue
            model = tiny("ape", num_registers=1, **{name: value})
            for p in model.parameters():  # norms away from identity, heads apart
                p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
            plain = tiny("ape", num_registers=1)
            plain.load_state_dict(model.state_dict(), strict=False)
            assert not torch.allclose(model(x), plain(x), atol=1e-4), name


def test_quick_gelu_and_gelu_tanh_are_their_formulas() -> None:
    t = torch.linspace(-4, 4, 17)
    assert torch.equal(tiny("ape", mlp_act="quick_gelu").blocks[0].mlp.act(t),
                       t * torch.sigmoid(1.702 * t))  # fmt: skip
    torch.testing.assert_close(tiny("ape", mlp_act="gelu_tanh").blocks[0].mlp.act(t),
                               F.gelu(t, approximate="tanh"))  # fmt: skip


def test_no_final_norm_hands_sae_edits_to_the_site_itself() -> None:
    """norm_site has no LayerNorm to invert when the model has no final norm."""
    from poslens.models import hooks

    assert tiny("ape").norm_site(hooks.FINAL_NORM) is not None
    assert (
        tiny("ape", final_norm=False, fc_norm=True, pool="mean").norm_site(hooks.FINAL_NORM) is None
    )


def test_save_and_load_round_trip_every_piece(tmp_path: Path) -> None:
    model = build_model(ModelConfig(**{**TINY, "posenc": "ape", **ALL_ON}), seed=0).eval()
    back = poslens.load(poslens.save(model, tmp_path / "ckpt"))
    assert back.cfg == model.cfg
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())["model"]
    assert saved["head_dist"] is True and saved["final_norm"] is False


def test_paths_of_the_plain_vit_refuse_the_pieces() -> None:
    cfg = ModelConfig(**{**TINY, "posenc": "ape", "norm_pre": True})
    with pytest.raises(ValueError, match="norm_pre"):
        StackedViT([build_model(cfg, seed=s) for s in range(2)])
    pytest.importorskip("timm")
    from poslens.models.timm_export import timm_kwargs

    with pytest.raises(UserError, match="model.norm_pre"):
        timm_kwargs(cfg)
