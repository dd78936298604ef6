"""Tagged timm checkpoints (`NAME.dino`, `NAME.mae`, `NAME.openai`, ...): their weights load under
the bare name, the classifier taken from the tensors; weights that fit only another tag's
architecture are refused in one line naming that tag."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import poslens
from poslens.errors import CheckpointError
from poslens.models import hooks
from poslens.models.timm_convert import load_timm
from tests.models.test_timm_convert import random_timm, save

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # CI (POSLENS_FULL=1) installs the [timm] extra: a missing timm must fail, not skip
else:
    timm = pytest.importorskip("timm")

SMALL = dict(depth=2, img_size=64)


@pytest.mark.parametrize(
    ("tagged", "classes"),
    [("vit_small_patch16_224.dino", 0), ("vit_base_patch16_clip_224.openai", 512)],
)
def test_tagged_weights_load_under_the_bare_name(tagged: str, classes: int, tmp_path: Path) -> None:
    """A DINO backbone (no classifier) and a CLIP tower (its 512-wide projection as the head)
    under the bare name: the head comes from the file, the outputs are timm's."""
    tm = random_timm(tagged, **SMALL)
    path = save(tm, tmp_path / "w.safetensors")
    bare = tagged.split(".")[0]
    model = load_timm(bare, path, **SMALL)
    assert model.cfg.num_classes == classes
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, cache = model.run_with_cache(x, hooks.FINAL_NORM)
        torch.testing.assert_close(
            cache[hooks.FINAL_NORM], tm.forward_features(x), atol=1e-4, rtol=0
        )
        if classes:
            torch.testing.assert_close(logits, tm(x), atol=1e-4, rtol=0)
        else:
            assert logits.shape == (2, 0)


def test_weights_of_another_tag_name_it(tmp_path: Path) -> None:
    """DINO weights where a 1000-class head is asked for: the error names the tag they fit."""
    tm = random_timm("vit_small_patch16_224.dino", **SMALL)
    path = save(tm, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_timm("vit_small_patch16_224", path, num_classes=1000, **SMALL)
    msg = str(e.value)
    assert "\n" not in msg and "missing tensor head.bias" in msg
    assert "they fit timm:vit_small_patch16_224.dino" in msg


def test_poslens_load_takes_the_tagged_name_too(tmp_path: Path) -> None:
    """timm:NAME.TAG builds the tag's architecture (its classifier), as timm does."""
    tm = random_timm("vit_small_patch16_224.dino", **SMALL)
    path = save(tm, tmp_path / "w.safetensors")
    model = load_timm("vit_small_patch16_224.dino", path, **SMALL)
    assert model.cfg.num_classes == 0
    with pytest.raises(CheckpointError, match="not found"):
        poslens.load("timm:vit_small_patch16_224.dino", weights=tmp_path / "none.safetensors")
