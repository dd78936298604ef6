"""precision "auto": bf16 where the device runs it natively, else fp32, resolved per run and
recorded as what ran; a pretrained study's default, never a trained one's."""

from __future__ import annotations

from pathlib import Path

import pytest

from poslens import precision as precision_mod
from poslens.cli import main
from poslens.data import DataConfig, build_task
from poslens.experiments import registry
from poslens.experiments.analyze import analyze
from poslens.experiments.config import resolved
from poslens.study import preset
from tests.conftest import tiny


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "fp32")])
def test_auto_resolves_to_bf16_only_where_it_is_native(
    monkeypatch: pytest.MonkeyPatch, native: bool, expected: str
) -> None:
    monkeypatch.setattr(precision_mod, "native_bf16", lambda device: native)
    model = tiny("rope_axial")
    cfg = resolved(registry.get("position_removal").Config(precision="auto", batch_size=7), model)
    assert (cfg.precision, cfg.batch_size) == (expected, 7)
    fixed = resolved(registry.get("position_removal").Config(precision="fp16", batch_size=7), model)
    assert fixed.precision == "fp16"  # an explicit precision is never changed


def test_auto_is_recorded_as_what_ran_and_gives_that_precisions_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision_mod, "native_bf16", lambda device: True)
    task = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=20, n_test=40))
    model = tiny("rope_axial", num_classes=task.num_classes)
    cfg = registry.get("depth_profile").Config(n_images=40, probe_images=20, precision="auto")
    auto = analyze(model, task, ["depth_profile"], [cfg], tmp_path / "a", formats=())
    bf16 = registry.get("depth_profile").Config(n_images=40, probe_images=20, precision="bf16")
    explicit = analyze(model, task, ["depth_profile"], [bf16], tmp_path / "b", formats=())
    fp32 = registry.get("depth_profile").Config(n_images=40, probe_images=20)
    plain = analyze(model, task, ["depth_profile"], [fp32], tmp_path / "c", formats=())
    assert auto["depth_profile"]["config"]["precision"] == "bf16"
    assert auto["depth_profile"]["headline"] == explicit["depth_profile"]["headline"]
    assert auto["depth_profile"]["headline"] != plain["depth_profile"]["headline"]


def test_a_pretrained_study_defaults_to_auto_and_a_trained_one_to_fp32() -> None:
    assert preset("quick").precision == "fp32"
    assert preset("default").precision == "fp32"
    pre = ("timm:vit_tiny_patch16_224=w.safetensors",)
    for name in ("quick", "default", "paper"):
        assert preset(name, pretrained=pre, images="imgs").precision == "auto"
    assert preset("quick", pretrained=pre, images="imgs", precision="fp32").precision == "fp32"


def test_the_cli_study_leaves_the_precision_to_the_preset_unless_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import poslens.study as study

    seen = []

    def fake(cfg, out, **kw):  # type: ignore[no-untyped-def]
        seen.append(cfg.precision)
        return {"claims": [], "timings": {"total_seconds": 0}}

    monkeypatch.setattr(study, "run_study", fake)
    pre = ["--pretrained", "timm:vit_tiny_patch16_224=w.safetensors", "--data", "imgs"]
    for extra in ([], ["--precision", "bf16"], pre, [*pre, "--precision", "fp32"]):
        out = tmp_path / f"o{len(seen)}"
        assert main(["study", "--preset", "quick", "--out", str(out), *extra]) == 0
    assert seen == ["fp32", "bf16", "auto", "fp32"]
