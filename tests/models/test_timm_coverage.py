"""The coverage sweep in small (needs timm): one architecture per family of timm's pretrained
ViT-like architectures (the smallest by name) plus a seeded sample of the rest, each under a
100M-parameter cap, built with random weights at a 4 x 4 grid and 2 blocks. Every one must load
with parity or be refused in one line naming the missing feature; none may load with other
outputs or crash. The full sweep is benchmarks/timm_coverage.py (docs/pretrained.md)."""

from __future__ import annotations

import os
import random

import pytest

from poslens.models.timm_coverage import Outcome, check, family_of, vit_like_names

if os.environ.get("POSLENS_FULL") == "1":
    import timm  # noqa: F401 - CI (POSLENS_FULL=1) installs the [timm] extra: it must not skip
else:
    pytest.importorskip("timm")

CAP = 100_000_000
SAMPLE = 6
# a size order read from the words of names (vit_WORD_patch...): unknown words rank last
SIZES = ("test", "tiny", "xsmall", "small", "wee", "pwee", "little", "medium", "betwixt", "base")
# families whose smallest architecture poslens converts (a regression fails here)
CONVERTED = {"ViT", "DeiT", "CLIP", "DINOv2", "DINOv3", "RoPE ViT", "ViT (GAP)", "FlexiViT",
             "EVA-02", "SigLIP", "Perception Encoder", "BEiT", "relpos ViT"}  # fmt: skip


def size_rank(name: str) -> int:
    words = name.split("_")
    return next((i for i, word in enumerate(SIZES) if word in words), len(SIZES))


def sample() -> list[str]:
    """The smallest-named architecture of each family, then SAMPLE more drawn with a fixed seed."""
    names = vit_like_names()
    families: dict[str, list[str]] = {}
    for name in names:
        families.setdefault(family_of(name), []).append(name)
    picked = [min(group, key=lambda n: (size_rank(n), n)) for group in families.values()]
    rest = sorted(set(names) - set(picked))
    return picked + random.Random(0).sample(rest, SAMPLE)


@pytest.fixture(scope="module")
def outcomes() -> list[Outcome]:
    return [check(name, CAP) for name in sample()]


def test_every_architecture_converts_with_parity_or_is_refused_in_one_line(
    outcomes: list[Outcome],
) -> None:
    for o in outcomes:
        assert o.status in ("parity", "refused", "large"), o
        if o.status == "refused":
            assert o.detail and "\n" not in o.detail, o


def test_the_families_poslens_converts_still_convert(outcomes: list[Outcome]) -> None:
    converted = {o.family for o in outcomes if o.status == "parity"}
    assert CONVERTED <= converted, sorted(CONVERTED - converted)
