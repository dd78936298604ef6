"""Which of timm's pretrained ViT-like architectures poslens converts with parity.

One architecture is checked by building it with random weights (`pretrained=False`, never a
download) at a 4 x 4 patch grid and 2 blocks, converting it, and comparing poslens' logits with
timm's on one batch: "parity" (max |difference| <= PARITY_ATOL), "refused" (a one-line UserError
naming the missing feature), "large" (over the parameter cap at full size, not built), "unbuilt"
(timm cannot build it at the small grid), or a bug: "mismatch" (converted with other outputs) or
"crash" (any other exception). Used by tests/models/test_timm_coverage.py and
benchmarks/timm_coverage.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poslens._timm import import_timm
from poslens.errors import UserError

# timm modules whose architectures count as ViT-like (253 pretrained ones in timm 1.0.31)
VIT_MODULES = (
    "vision_transformer",
    "eva",
    "deit",
    "beit",
    "vision_transformer_relpos",
    "naflexvit",
)
PARITY_ATOL = 1e-4  # as the conversion tests
MAX_PARAMS = 700_000_000
SMALL_DEPTH, SMALL_GRID, NUM_CLASSES = 2, 4, 7
# family: the first pattern found in the name (after the module's own family)
FAMILY_PATTERNS = (
    ("eva02", "EVA-02"), ("eva_", "EVA"), ("_pe_", "Perception Encoder"), ("siglip", "SigLIP"),
    ("clip", "CLIP"), ("dinov3", "DINOv3"), ("dinov2", "DINOv2"), ("aimv2", "AIMv2"),
    ("deit", "DeiT"), ("_rope_", "RoPE ViT"), ("radio", "RADIO"), ("sapiens", "Sapiens"),
    ("tipsv2", "TIPSv2"), ("beit3", "BEiT-3"), ("lingbot", "LingBot"), ("flexivit", "FlexiViT"),
    ("_gap", "ViT (GAP)"),
)  # fmt: skip
MODULE_FAMILIES = {"beit": "BEiT", "vision_transformer_relpos": "relpos ViT",
                   "naflexvit": "NaFlexViT"}  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """What happened to one architecture: status (see the module doc), detail (the refusal's
    reason, the error, or the max difference) and its full-size parameter count (-1 unknown)."""

    name: str
    family: str
    status: str
    detail: str
    params: int


def vit_like_names() -> list[str]:
    """timm's ViT-like architectures that have pretrained weights, without tags, sorted."""
    timm = import_timm()
    from timm.models._registry import get_arch_name

    module = timm.models._registry._model_to_module
    names = {get_arch_name(n) for n in timm.list_models(pretrained=True)}
    return sorted(n for n in names if module.get(n) in VIT_MODULES)


def family_of(name: str) -> str:
    """The family an architecture's name belongs to (CLIP, SigLIP, EVA-02, DeiT, ...)."""
    timm = import_timm()
    module = timm.models._registry._model_to_module.get(name, "")
    if module in MODULE_FAMILIES:
        return MODULE_FAMILIES[module]
    for pattern, family in FAMILY_PATTERNS:
        if pattern in name:
            return family
    return "ViT" if re.match(r"vit_|test_vit", name) else module


def full_size_params(name: str) -> int:
    """Parameters of `name` at its full size, counted on the meta device (nothing allocated)."""
    timm = import_timm()
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    return sum(p.numel() for p in model.parameters())


def small_kwargs(name: str) -> dict[str, Any]:
    """timm arguments of the small build: 2 blocks, a 4 x 4 patch grid, a 7-class head."""
    timm = import_timm()
    cfg = timm.models.get_pretrained_cfg(name)
    patch = re.search(r"patch(\d+)", name)
    p = int(patch.group(1)) if patch else 16
    kw: dict[str, Any] = {"depth": SMALL_DEPTH, "num_classes": NUM_CLASSES}
    if cfg is None or "naflex" not in name:
        kw["img_size"] = SMALL_GRID * p
    return kw


def perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """Add noise to every parameter (LayerScale, positions, tokens strongly) so every converted
    tensor matters; rotary frequencies stay as built."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("freqs"):
                continue
            big = any(s in n for s in ("gamma", "pos_embed", "token", "norm"))
            p.add_(torch.randn(p.shape, generator=gen) * (0.5 if big else 0.05))
    return model


def check(name: str, max_params: int = MAX_PARAMS) -> Outcome:
    """Build, convert and compare one architecture (see the module doc)."""
    from poslens.models.timm_convert import check_rotary, convert
    from poslens.models.vit import ViT

    family = family_of(name)
    try:
        params = full_size_params(name)
    except Exception as e:  # any failure to build is an outcome of the sweep, not a crash of it
        return Outcome(name, family, "unbuilt", _first_line(e), -1)
    if params > max_params:
        return Outcome(name, family, "large", f"{params / 1e6:.0f}M parameters", params)
    kw = small_kwargs(name)
    try:
        tm = _build(name, kw)
    except UserError:  # per-block arguments (Sapiens' kv heads) need the full depth
        kw.pop("depth")
        try:
            tm = _build(name, kw)
        except Exception as e:  # any failure to build is an outcome of the sweep, not a crash of it
            return Outcome(name, family, "unbuilt", _first_line(e), params)
    except Exception as e:  # any failure to build is an outcome of the sweep, not a crash of it
        return Outcome(name, family, "unbuilt", _first_line(e), params)
    try:
        cfg, sd = convert(tm, name)
        model = ViT(cfg)
        model.load_state_dict(sd)
        model.eval()
        check_rotary(model, tm, name)
    except UserError as e:
        reason = str(e).split(" is not supported: ", 1)[-1]
        return Outcome(name, family, "refused", reason, params)
    except Exception as e:  # a conversion bug, reported as one
        return Outcome(name, family, "crash", f"{type(e).__name__}: {_first_line(e)}", params)
    size = cfg.image_size
    x = torch.randn(2, cfg.in_chans, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = tm(x)
        diff = float((model(x) - theirs).abs().max())
    if float(theirs.abs().max()) < 1e-2:  # logits near zero would compare nothing
        return Outcome(name, family, "mismatch", "timm's logits are near zero", params)
    status = "parity" if diff <= PARITY_ATOL else "mismatch"
    return Outcome(name, family, status, f"{diff:.1e}", params)


def _build(name: str, kw: dict[str, Any]) -> nn.Module:
    from poslens.models.timm_convert import create_timm

    torch.manual_seed(0)
    return perturbed(create_timm(name, **kw)).eval()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["MAX_PARAMS", "Outcome", "check", "family_of", "vit_like_names"]
