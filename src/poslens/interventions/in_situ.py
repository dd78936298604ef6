"""In-situ controls: the studied model's own weights edited so that a claim's mechanism is planted
(positive) or removed (negative) by construction, with the signal its rule measures kept.

A rule's trained controls are small models trained here; they say nothing about a pretrained
ViT-B's scale, architecture or weights. An in-situ control is the studied model itself, edited:
the same rule run on it through the same pipeline shows whether the rule can see (or stays quiet
about) that mechanism *in this model*. Each edit is persistent on the model it is given (the
study loads a fresh model for every stage); `edited` returns an edited copy and `in_situ` edits a
model for the length of a `with` block and restores it.

Edits (METHODS.md, "Calibration"):
- table_rowcol (APE): the table replaced by its least-squares row + column part at the table's
  norm: row and column features by construction.
- table_cell (APE): the table replaced by its cell residual at the same norm: a position signal
  with no row or column structure.
- heads_axis_split (RoPE): in even heads every plane that follows the column (its frequency's
  nearer axis) is stopped, in odd heads every row plane: each head follows one axis.
- freqs_oblique (axial RoPE): every plane's frequency turned by 45 degrees; the planes follow the
  diagonals, and are split by their pre-edit axes (rope_variant "oblique").
- position_shuffled (any encoding): the position signal permuted across positions (the APE
  table's rows, or the rotary angles' tokens): present, but where the model does not expect it.

Two controls are fine-tunes, not edits: no edit plants the rebuild claim's compensation, which is
learned. finetune_held_out (positive) and finetune_late (negative) are the studied RoPE weights
fine-tuned with rotations withheld in held-out or late windows (training.finetune); the study
builds them from its images (`Edit.finetune` names the schedule), `apply` cannot.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from poslens.errors import UserError
from poslens.interventions.position import seeded_permutation, table_part
from poslens.models.config import ModelConfig
from poslens.models.vit import ViT

POSITIVE, NEGATIVE = "positive", "negative"
SEP = "~"  # an in-situ control's model name: "<studied model>~<edit>"
SHUFFLE_SEED = 0  # the permutation of position_shuffled


@dataclass(frozen=True)
class Edit:
    """One in-situ control: `name`, its `role`, what it plants or removes (`plants`, a phrase),
    the models it applies to and the edit itself (in place, on the model given)."""

    name: str
    role: str
    plants: str
    applies: Callable[[ModelConfig], bool]
    apply: Callable[[ViT], None]
    finetune: str = ""  # a fine-tune control: its withheld-window schedule (training.finetune)


def _table(part: str) -> Callable[[ViT], None]:
    def edit(model: ViT) -> None:
        if model.pos_embed is None:
            raise UserError(f"{model.cfg.posenc} has no learned position table to edit")
        g = model.cfg.grid
        with torch.no_grad():
            model.pos_embed.copy_(table_part(model.pos_embed.detach(), (g, g), part))

    return edit


def _freqs(model: ViT) -> torch.Tensor:
    """The model's frequencies as one [depth, H, P, 2] tensor (fx: column, fy: row)."""
    if model.rotary is None:
        raise UserError(f"{model.cfg.posenc} has no rotary encoding to edit")
    cfg = model.cfg
    f = model.rotary.freqs.detach()
    return f.expand(cfg.depth, cfg.heads, *f.shape[-2:]).clone()


def set_freqs(model: ViT, freqs: torch.Tensor) -> None:
    """Override the rotary frequencies [depth, H, P, 2] (fx multiplies the column, fy the row):
    a learned table is overwritten in place, a fixed one replaced (it is not saved)."""
    assert model.rotary is not None
    if isinstance(model.rotary.freqs, torch.nn.Parameter):
        with torch.no_grad():
            model.rotary.freqs.copy_(freqs)
    else:
        model.rotary.freqs = freqs.to(model.rotary.freqs.device)


def nearer_axis(freqs: torch.Tensor) -> torch.Tensor:
    """[..., P] True where a plane's frequency [..., P, 2] is nearer the column axis (|fx| >=
    |fy|), False where nearer the row."""
    return freqs[..., 0].abs() >= freqs[..., 1].abs()


def _heads_axis_split(model: ViT) -> None:
    f = _freqs(model)
    col = nearer_axis(f)  # [depth, H, P]
    even = (torch.arange(model.cfg.heads) % 2 == 0)[None, :, None]
    stop = torch.where(even, col, ~col)  # even heads keep the row planes, odd heads the column
    set_freqs(model, f.masked_fill(stop[..., None], 0.0))


def _oblique(model: ViT) -> None:
    f = _freqs(model)
    c = math.sqrt(0.5)
    fx, fy = f[..., 0], f[..., 1]
    set_freqs(model, torch.stack([c * (fx - fy), c * (fx + fy)], -1))
    # the planes' pre-edit axes are the axial construction's (interventions.rotary)
    model.cfg = replace(model.cfg, rope_variant="oblique")


def _shuffled(model: ViT) -> None:
    cfg = model.cfg
    perm = seeded_permutation(cfg.grid**2, SHUFFLE_SEED)
    if model.pos_embed is not None:
        with torch.no_grad():
            model.pos_embed.copy_(model.pos_embed[:, perm])
    if model.rotary is not None:
        model.rotary.shuffle_seed = SHUFFLE_SEED
    if cfg.uses_relpos:  # the biases of the patch offsets permuted among the offsets
        n = (2 * cfg.grid - 1) ** 2
        offsets = seeded_permutation(n, SHUFFLE_SEED)
        with torch.no_grad():
            for block in model.blocks:
                table = block.attn.rel_pos.table
                table[:n] = table[:n][offsets].clone()


def _needs_images(model: ViT) -> None:
    raise UserError(
        "a fine-tune control is trained from the study's images (training.finetune), not edited"
    )


def _standard_axial(cfg: ModelConfig) -> bool:
    return cfg.rope_kind == "axial" and cfg.rope_variant == "standard"


_EDITS = (
    Edit(
        "table_rowcol",
        POSITIVE,
        "the position table replaced by its least-squares row + column part at the table's "
        "norm: row and column features by construction",
        lambda c: c.has_pos_table,
        _table("rowcol"),
    ),
    Edit(
        "table_cell",
        NEGATIVE,
        "the position table replaced by its cell residual at the same norm: a position signal "
        "with no row or column structure",
        lambda c: c.has_pos_table,
        _table("cell"),
    ),
    Edit(
        "heads_axis_split",
        POSITIVE,
        "in every block, even heads keep only their row planes and odd heads only their column "
        "planes: each head follows one axis by construction",
        lambda c: c.uses_rope and c.heads >= 2,
        _heads_axis_split,
    ),
    Edit(
        "freqs_oblique",
        NEGATIVE,
        "every plane turned by 45 degrees and split by its pre-edit axis: each half follows both "
        "axes, so removing it costs both",
        _standard_axial,
        _oblique,
    ),
    Edit(
        "position_shuffled",
        NEGATIVE,
        "the position signal permuted across positions (the table's rows, the rotations' "
        "tokens or the relative bias's offsets): present, not where the model reads it",
        lambda c: c.has_pos_table or c.uses_rope or c.uses_relpos,
        _shuffled,
    ),
    Edit(
        "finetune_held_out",
        POSITIVE,
        "fine-tuned from the studied weights with rotations withheld in random windows other "
        "than the tested one: later blocks trained to put position back, tested on a window "
        "never withheld",
        lambda c: c.uses_rope,
        _needs_images,
        finetune="held_out",
    ),
    Edit(
        "finetune_late",
        NEGATIVE,
        "fine-tuned as long with rotations withheld in the late blocks only: nothing is trained "
        "to compensate for the early blocks",
        lambda c: c.uses_rope,
        _needs_images,
        finetune="late",
    ),
)
EDITS: dict[str, Edit] = {e.name: e for e in _EDITS}


def get(name: str) -> Edit:
    if name not in EDITS:
        raise UserError(f"unknown in-situ control {name!r}; expected one of {', '.join(EDITS)}")
    return EDITS[name]


def model_name(model: str, edit: str) -> str:
    """The study's name of `model` under in-situ control `edit`: 'ape~table_rowcol'."""
    return f"{model}{SEP}{edit}"


def split_name(name: str) -> tuple[str, str | None]:
    """'ape~table_rowcol' -> ('ape', 'table_rowcol'); a plain model name -> (name, None)."""
    base, sep, edit = name.partition(SEP)
    return (base, edit) if sep else (name, None)


def apply(model: ViT, name: str) -> ViT:
    """Edit `model` in place with in-situ control `name` (UserError where it does not apply)."""
    e = get(name)
    if not e.applies(model.cfg):
        raise UserError(f"in-situ control {name} does not apply to {model.cfg.posenc} models")
    e.apply(model)
    return model


def edited(model: ViT, name: str) -> ViT:
    """An edited copy of `model`; the model itself is left as it is."""
    return apply(copy.deepcopy(model), name)


@contextlib.contextmanager
def in_situ(model: ViT, name: str) -> Iterator[ViT]:
    """`model` under in-situ control `name` inside the block, restored after it (on error too)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}  # learned freqs included
    cfg, rotary = model.cfg, model.rotary
    fixed = (rotary.freqs, rotary.shuffle_seed) if rotary is not None else None
    try:
        yield apply(model, name)
    finally:
        model.cfg = cfg
        model.load_state_dict(state)
        if rotary is not None and fixed is not None:  # what the state dict does not hold
            if not isinstance(fixed[0], torch.nn.Parameter):
                rotary.freqs = fixed[0]
            rotary.shuffle_seed = fixed[1]


__all__ = [
    "EDITS",
    "NEGATIVE",
    "POSITIVE",
    "SEP",
    "Edit",
    "apply",
    "edited",
    "get",
    "in_situ",
    "model_name",
    "nearer_axis",
    "set_freqs",
    "split_name",
]
