"""Property tests: whatever a user writes in a config, parsing either succeeds or raises one
ConfigError naming the problem; no other exception ever escapes to become a traceback."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from poslens.errors import ConfigError
from poslens.study import StudyConfig
from poslens.training.config import RunConfig, apply_overrides, preset

FIELDS = {
    "model": ["dim", "depth", "heads", "patch_size", "posenc", "mlp_ratio", "rope_theta", "pool",
              "num_registers", "colour"],
    "data": ["task", "image_size", "n_val", "seed", "relation", "object_scale", "channels",
             "contrast", "path", "n_content"],
    "train": ["steps", "batch_size", "lr", "weight_decay", "warmup_frac", "precision", "seed",
              "threads", "eval_every"],
    "optimizer": ["lr"],
}  # fmt: skip

values = st.one_of(
    st.integers(-5, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=8),
    st.none(),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from(["ape", "rope_axial", "relation", "folder", "cls", "auto", "sector"]),
)


@st.composite
def raw_configs(draw: st.DrawFn) -> Any:
    sections = draw(st.lists(st.sampled_from(list(FIELDS)), unique=True, max_size=4))
    out: dict[str, Any] = {}
    for s in sections:
        keys = draw(st.lists(st.sampled_from(FIELDS[s]), unique=True, max_size=4))
        out[s] = draw(st.one_of(st.just({k: draw(values) for k in keys}), values))  # or not a table
    return draw(st.one_of(st.just(out), values))  # sometimes not even a table


@settings(max_examples=300, deadline=None)
@given(raw_configs())
def test_run_config_parses_or_raises_config_error(raw: Any) -> None:
    try:
        cfg = RunConfig.from_dict(raw)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert cfg.model.dim % cfg.model.heads == 0  # what parsing accepted is buildable


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="abdehlmnoprstx._=0123456789-\"' ", max_size=24), max_size=4))
def test_overrides_parse_or_raise_config_error(items: list[str]) -> None:
    try:
        apply_overrides(preset("ape"), items)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(
    models=st.lists(st.sampled_from(["ape", "rope_axial", "none", "vit", ""]), max_size=3),
    seeds=st.integers(-2, 4),
    n=st.integers(-1, 400),
    probe=st.integers(-1, 400),
    only=st.lists(st.sampled_from(["heads=ape", "heads", "=ape", "nope=ape"]), max_size=2),
)
def test_study_config_builds_or_raises_config_error(
    models: list[str], seeds: int, n: int, probe: int, only: list[str]
) -> None:
    try:
        StudyConfig(models=tuple(models), seeds=seeds, n_images=n, probe_images=probe,
                    only=tuple(only))  # fmt: skip
    except ConfigError as e:
        assert str(e).startswith("study.")
