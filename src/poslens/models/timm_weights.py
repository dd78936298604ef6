"""Reading timm weights files: the state dict (safetensors, never a pickle), the shape arguments
`poslens export --timm` wrote beside it, the classifier it carries, and the pretrained tags
(`NAME.dino`, `NAME.mae`, `NAME.openai`, ...) whose architecture it fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from poslens._timm import import_timm
from poslens.errors import CheckpointError, UserError
from poslens.io import check_state_dict, load_tensors, read_json


def read_timm_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A local safetensors state dict (timm key names); CheckpointError if absent or unreadable."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"weights file not found: {path}")
    return load_tensors(path)


def load_timm_weights(
    model: nn.Module,
    name: str,
    path: str | Path,
    state: dict[str, torch.Tensor] | None = None,
    **timm_kwargs: Any,
) -> None:
    """Load a local safetensors state dict (timm key names; `state` if already read) into a timm
    model, checking every tensor; when they do not fit, the error names the pretrained tags of
    `name` whose architecture (built with `timm_kwargs`) they fit, e.g. timm:NAME.dino."""
    state = read_timm_weights(path) if state is None else state
    try:
        check_state_dict(state, model.state_dict(), f"{path} (does not fit timm:{name})")
    except CheckpointError as e:
        tags = fitting_tags(name, state, **timm_kwargs)
        if not tags:
            raise
        raise CheckpointError(f"{e}; they fit timm:{', timm:'.join(tags[:3])}") from None
    model.load_state_dict(state)


def head_classes(state: dict[str, torch.Tensor]) -> int:
    """The classes of the classifier a timm state dict carries (0: none, e.g. DINO, MAE, SigLIP
    towers): what tells a tagged checkpoint's head apart under the bare architecture name."""
    head = state.get("head.weight")
    return 0 if head is None or head.ndim != 2 else int(head.shape[0])


def fitting_tags(name: str, state: dict[str, torch.Tensor], **timm_kwargs: Any) -> list[str]:
    """The tagged names of architecture `name` (its pretrained tags, built with `timm_kwargs` but
    the tag's own classifier, on the meta device: nothing allocated, nothing downloaded) whose
    every tensor name and shape `state` matches."""
    timm = import_timm()
    bare = name.split(".", 1)[0]
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    kwargs = {k: v for k, v in timm_kwargs.items() if k != "num_classes"}
    fits = []
    for tagged in timm.list_pretrained(f"{bare}.*"):
        try:
            with torch.device("meta"):
                model = timm.create_model(tagged, pretrained=False, **kwargs)
        except Exception:  # a tag timm cannot build offline is not a candidate
            continue
        if {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes:
            fits.append(tagged)
    return fits


# the timm shape arguments of weights that `poslens export --timm` wrote (models/timm_export.py):
# FILE.timm.json beside FILE.safetensors
KWARGS_SUFFIX = ".timm.json"


def kwargs_file(weights: str | Path) -> Path:
    """Where the timm shape arguments of an exported weights file live."""
    p = Path(weights)
    return p.with_name(p.name.removesuffix(".safetensors") + KWARGS_SUFFIX)


def read_kwargs(weights: str | Path) -> dict[str, Any]:
    """The timm shape arguments written beside `weights` by `export_timm` ({} if none)."""
    f = kwargs_file(weights)
    if not f.is_file():
        return {}
    doc = read_json(f, "timm arguments")
    kwargs = doc.get("kwargs") if isinstance(doc, dict) else None
    if not isinstance(kwargs, dict):
        raise UserError(f"{f} has no 'kwargs' object")
    return kwargs


__all__ = [
    "KWARGS_SUFFIX",
    "fitting_tags",
    "head_classes",
    "kwargs_file",
    "load_timm_weights",
    "read_kwargs",
    "read_timm_weights",
]
