from __future__ import annotations

import pytest

from poslens.errors import ConfigError
from poslens.sae import SAEConfig


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"k": 0}, "sae.k"),
        ({"expansion": 1.5}, "sae.expansion"),
        ({"batch": -1}, "sae.batch"),
        ({"lr": -1e-3}, "sae.lr"),
        ({"lr": float("nan")}, "sae.lr"),
        ({"steps": 0}, "sae.steps"),
        ({"aux_k": 0}, "sae.aux_k"),
        ({"aux_coef": -1.0}, "sae.aux_coef"),
        ({"decay_frac": 1.5}, "sae.decay_frac"),
        ({"dead_tokens": 0}, "sae.dead_tokens"),
        ({"whiten": "yes"}, "sae.whiten"),
        ({"include_prefix": 1}, "sae.include_prefix"),
        ({"site": ""}, "sae.site"),
        ({"seed": -1}, "sae.seed"),
    ],
)
def test_bad_values_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SAEConfig(**kw)  # type: ignore[arg-type]


def test_from_dict_names_unknown_fields_and_round_trips() -> None:
    cfg = SAEConfig(k=8, whiten=True, steps=10)
    assert SAEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"unknown field sae\.topk"):
        SAEConfig.from_dict({"topk": 3})


def test_derived_sizes_and_lr_scaling() -> None:
    cfg = SAEConfig(expansion=4, k=16)
    assert cfg.d_sae(128) == 512 and cfg.aux_k_for(128) == 64
    assert cfg.lr_for(2**14) == pytest.approx(2e-4)  # Gao et al.'s reference width
    assert cfg.lr_for(2**12) == pytest.approx(4e-4)  # 1 / sqrt(width)
    assert SAEConfig(lr=1e-3).lr_for(2**12) == 1e-3
    with pytest.raises(ConfigError, match=r"sae\.k=16 must be below d_sae=12"):
        cfg.d_sae(3)
