"""Up-front checks, each a one-line UserError before any work: memory estimated from a config
against what this machine has, the torch device, and an output folder that can be written.

The estimates are deliberately rough (within a small factor): they exist to refuse sizes that
cannot possibly fit (a batch of 1e8 images, a width of 1e6) at once, with the estimate in the
message, instead of a multi-GB allocation, an out-of-memory kill or a run that never ends.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poslens._config import MAX_STEPS, MAX_THREADS, short_repr
from poslens.errors import ArgumentError, ConfigError, LimitError, OutputError

if TYPE_CHECKING:
    from poslens.data import DataConfig
    from poslens.models.config import ModelConfig
    from poslens.sae.config import SAEConfig
    from poslens.training.config import RunConfig

FLOAT = 4  # bytes per float32 value


@dataclass(frozen=True)
class Bound:
    """The range a count may take, with the unit and the reason for the upper end."""

    low: int
    high: int
    unit: str
    why: str


# Every count a user can pass (flags, --set fields, study fields), bounded here and nowhere else;
# check_count applies them. A count above its bound is a typo, not a plan: `--seeds 1000000000`
# spent minutes resolving the plan before any work. Sizes that can fit or not depending on the
# machine (batch sizes, widths) are checked against its memory below instead.
COUNTS: dict[str, Bound] = {
    "seeds": Bound(
        1, 1_000, "seeds", "each seed trains and analyses every model once more; 5 decide a claim"
    ),
    "images": Bound(
        10, 100_000_000, "images", "evaluated one by one; ImageNet's whole training set is 1.3M"
    ),
    "draws": Bound(1, 1_000, "draws", "each random control is rerun once per draw"),
    "planes": Bound(
        1,
        65_536,
        "rotary planes",
        "a head has head_dim / 2 planes; the model's own count is checked when it is loaded",
    ),
    "doses": Bound(1, 1_000_000, "latents", "an SAE here has at most a few thousand latents"),
    "steps": Bound(1, MAX_STEPS, "steps", "over a day even at 100 steps/s"),
    "threads": Bound(0, MAX_THREADS, "threads", "torch accepts any count and fails later"),
}


def check_count(name: str, value: Any, kind: str) -> None:
    """ConfigError naming `name` unless `value` is an integer within COUNTS[kind] (a tuple of
    counts: each of them)."""
    bound = COUNTS[kind]
    for v in value if isinstance(value, tuple | list) else (value,):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{name} must be an integer count of {bound.unit}, got {v!r}")
        if v < bound.low:
            raise ConfigError(f"{name} must be at least {bound.low:,}, got {v:,}")
        if v > bound.high:
            raise ConfigError(
                f"{name} {v:,} is more than the {bound.high:,} {bound.unit} poslens allows "
                f"({bound.why})"
            )


Part = tuple[str, float]  # (what it is, with the fields that size it; bytes)


def fmt_bytes(n: float) -> str:
    """Bytes for people: '512 MB', '3.2 TB' (decimal units)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"  # unreachable


def machine_memory() -> int:
    """Bytes of memory this process may use: physical RAM, or a smaller cgroup limit."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 1 << 50  # unknown platform: only absurd sizes are refused
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, description) of the memory that holds models and activations on `device`."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = torch.device(device).index or 0
            return torch.cuda.get_device_properties(index).total_memory, f"GPU {device}"
    return machine_memory(), "this machine"


def check_fits(parts: Sequence[Part], what: str, device: str = "cpu") -> None:
    """LimitError with the estimate and its largest part when `parts` exceed the memory."""
    budget, where = device_memory(device)
    total = sum(b for _, b in parts)
    if total <= budget:
        return
    name, biggest = max(parts, key=lambda p: p[1])
    raise LimitError(
        f"{what} needs about {fmt_bytes(total)} of memory, more than {where} has "
        f"({fmt_bytes(budget)}); the largest part is {name}: {fmt_bytes(biggest)}"
    )


def param_count(cfg: ModelConfig) -> float:
    """Parameters of a ViT with this config (as a float: hostile sizes overflow nothing)."""
    d, hidden, patches = float(cfg.dim), float(int(cfg.dim * cfg.mlp_ratio)), float(cfg.grid) ** 2
    per_block = 4 * d * d + 4 * d + 2 * d * hidden + hidden + d + 4 * d
    embed = cfg.in_chans * cfg.patch_size**2 * d + d
    prefix = (int(cfg.cls_token) + cfg.num_registers) * d
    ape = patches * d if cfg.has_pos_table else 0.0
    mixed = 2.0 * cfg.depth * cfg.heads * cfg.head_dim // 2 if cfg.rope_kind == "mixed" else 0.0
    pool = 0.0  # the MAP pool: latent, q, kv, proj, norm and its MLP
    if cfg.pool == "map":
        pool = 4 * d * d + 8 * d + 2 * d * cfg.map_hidden + cfg.map_hidden
    head = 2 * d + (d + 1) * cfg.num_classes
    return embed + prefix + ape + mixed + cfg.depth * per_block + pool + head


def tokens(cfg: ModelConfig, image_size: int | None = None) -> float:
    """Tokens per image (prefix + patches) at `image_size` (default: the config's)."""
    grid = (image_size or cfg.image_size) // cfg.patch_size
    return float(cfg.num_prefix) + float(grid) ** 2


def activation_bytes(
    cfg: ModelConfig, images: float, train: bool, image_size: int | None = None
) -> float:
    """Activations of a forward pass over `images` images (kept for backward when `train`):
    per block the residual-width tensors, the MLP hidden and the attention scores."""
    t, d = tokens(cfg, image_size), float(cfg.dim)
    hidden = d * cfg.mlp_ratio
    per_block = t * (d * (9 if train else 4) + 2 * hidden) + 2 * cfg.heads * t * t
    blocks = cfg.depth if train else 1  # without backward, one block's activations at a time
    return images * (blocks * per_block + t * d * 2) * FLOAT


# batch_size 0: the analysis batch is chosen from the model and the device (auto_batch_size)
AUTO_BATCH = 0
MAX_AUTO_BATCH = 250  # the largest batch chosen (the experiments' former default)
# What one analysis batch may hold on a CPU: a fixed budget, not the free memory, so that the
# batch, and every number to the last bit, is the same on any CPU. A ViT-Ti at 224 px gets 19
# images, a ViT-S 10, a ViT-B 5, the study's small models MAX_AUTO_BATCH. A CPU forward pass of a
# ViT-S is as fast at 10 images a batch as at 38, and it is part of what keeps a pretrained
# study's worker near 2 GiB (docs/runs/2026-12-05-worker-toward-2-gb.md).
CPU_BATCH_BYTES = 128 * 2**20
GPU_FREE_SHARE = 0.5  # of a GPU's free memory, for one batch's activations and cached sites


def analysis_batch_bytes(cfg: ModelConfig, images: float) -> float:
    """One analysis batch: a forward's activations plus every site's raw and normalised residual
    cached (what the readout's RPI pass holds for SSDC at every site)."""
    t, d, sites = tokens(cfg), float(cfg.dim), cfg.depth + 1
    return activation_bytes(cfg, images, train=False) + images * t * d * 2 * sites * FLOAT


def auto_batch_size(cfg: ModelConfig, device: str = "cpu") -> int:
    """The analysis batch for batch_size 0: as many images as CPU_BATCH_BYTES hold on a CPU, or
    GPU_FREE_SHARE of its free memory on a GPU (float32 sizes: bf16 leaves headroom), 1 to
    MAX_AUTO_BATCH."""
    budget = float(CPU_BATCH_BYTES)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            budget = GPU_FREE_SHARE * free
    return int(max(1, min(MAX_AUTO_BATCH, budget // analysis_batch_bytes(cfg, 1))))


def image_bytes(n: float, channels: int, image_size: int) -> float:
    return float(n) * channels * float(image_size) ** 2 * FLOAT


def data_parts(data: DataConfig) -> list[Part]:
    """The fixed val and test splits a task builds (procedural tasks render them in memory)."""
    return [
        (
            f"the val and test images (data.n_val={data.n_val:,} + data.n_test={data.n_test:,} at "
            f"data.image_size={data.image_size:,})",
            image_bytes(data.n_val + data.n_test, data.channels, data.image_size),
        )
    ]


def _task_parts(data: object) -> list[Part]:
    """data_parts of a procedural task's DataConfig; nothing for anything else (image folders
    are sized by their files, pretrained images by the folder given)."""
    from poslens.data import DataConfig

    return data_parts(data) if isinstance(data, DataConfig) and data.task != "folder" else []


def model_parts(cfg: ModelConfig, optimizer: bool = False) -> list[Part]:
    """The weights (and, when training, gradients and two AdamW moments)."""
    copies = 4 if optimizer else 1
    return [
        (
            f"the model's {param_count(cfg):.3g} parameters (model.dim={cfg.dim:,}, "
            f"model.depth={cfg.depth:,}, model.num_registers={cfg.num_registers:,})",
            param_count(cfg) * FLOAT * copies,
        )
    ]


def check_model(cfg: ModelConfig, device: str = "cpu") -> None:
    """Before a model is built: its weights alone must fit."""
    check_fits(model_parts(cfg), "the model", device)


def check_training(cfg: RunConfig, device: str = "cpu") -> None:
    """Before training: weights + optimiser state + one batch's activations, and the data."""
    import dataclasses

    data = cfg.data
    if data.image_size % cfg.model.patch_size:
        return  # model_config_for refuses it with its own message
    model = dataclasses.replace(cfg.model, image_size=data.image_size, in_chans=data.channels)
    batch = cfg.train.batch_size
    parts = [
        *model_parts(model, optimizer=True),
        (
            f"the activations of one batch (train.batch_size={batch:,} x {tokens(model):,.0f} "
            f"tokens at data.image_size={data.image_size:,} x model.dim={model.dim:,} x "
            f"model.depth={model.depth:,} blocks)",
            activation_bytes(model, batch, train=True)
            + image_bytes(batch, data.channels, data.image_size),
        ),
    ]
    if data.task != "folder":
        parts += data_parts(data)
    check_fits(parts, "training", device)


def check_analysis(
    cfg: ModelConfig,
    n_images: int,
    probe_images: int,
    batch_size: int,
    device: str = "cpu",
    data: object = None,
) -> None:
    """Before an analysis: the evaluation images, one batch's activations with cached sites, and
    the probes' features (every site's patch tokens of the probe images)."""
    t, d, sites = tokens(cfg), float(cfg.dim), cfg.depth + 1
    batch_size = batch_size or auto_batch_size(cfg, device)
    parts = [
        *model_parts(cfg),
        (
            f"the evaluation images (--images {n_images:,})",
            image_bytes(n_images, cfg.in_chans, cfg.image_size),
        ),
        (
            f"the activations of one batch (--batch-size {batch_size:,})",
            activation_bytes(cfg, batch_size, train=False) + batch_size * t * d * sites * FLOAT,
        ),
        (
            f"the probe features (--probe-images {probe_images:,} x {t:,.0f} tokens x {sites} "
            f"sites x model.dim={cfg.dim:,})",
            float(probe_images) * t * d * sites * FLOAT,
        ),
    ]
    parts += _task_parts(data)
    check_fits(parts, "the analysis", device)


def check_sae(
    cfg: ModelConfig,
    sae: SAEConfig,
    n_images: int,
    device: str = "cpu",
    data: object = None,
) -> None:
    """Before SAE training: the training images, their activations, the SAE with Adam state and
    its batch; and a step count that can finish (see poslens._config.MAX_STEPS)."""
    from poslens._config import bounded_steps

    per_image = tokens(cfg) - (0 if sae.include_prefix else cfg.num_prefix)
    d_in, n_tokens = float(cfg.dim), float(n_images) * per_image
    d_sae = float(sae.expansion) * d_in
    parts = [
        *model_parts(cfg),
        (
            f"the training images (--images {n_images:,})",
            image_bytes(n_images, cfg.in_chans, cfg.image_size),
        ),
        (
            f"the activations of {n_tokens:,.0f} tokens (--images {n_images:,})",
            n_tokens * d_in * FLOAT,
        ),
        (
            f"the SAE with its optimiser (expansion {sae.expansion:,} x d_in {cfg.dim:,})",
            (2 * d_sae * d_in + d_sae + d_in) * FLOAT * 4 + 3 * sae.batch * d_sae * FLOAT,
        ),
    ]
    parts += _task_parts(data)
    check_fits(parts, "the SAE", device)
    if sae.steps is None:  # epochs x batches per epoch
        bounded_steps(
            f"the SAE's steps (--epochs {sae.epochs:,} x {n_tokens:,.0f} tokens / {sae.batch:,})",
            sae.epochs * math.ceil(n_tokens / sae.batch),
        )


DEVICE_TYPES = ("cpu", "cuda", "mps")


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; any other name unchanged."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str, here: bool = True, flag: str = "--device") -> None:
    """A device torch knows and this machine has: cpu, cuda[:N] with CUDA, mps on Apple.
    here=False: only the name (the work runs elsewhere, e.g. as SLURM jobs). `flag` names the
    option or argument in the error."""
    if name in ("cpu", "auto"):
        return
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ArgumentError(
            f"{flag} {name!r} is not a device poslens can use (cpu, cuda, cuda:N, mps or auto)"
        ) from None
    if dev.type not in DEVICE_TYPES:
        raise ArgumentError(f"{flag} {name!r}: poslens runs on cpu, cuda or mps, not {dev.type}")
    if not here:
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(
                f"{flag} {name}: torch {torch.__version__} sees no CUDA GPU on this machine; "
                f"use {flag} cpu or auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArgumentError(
                f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                f"numbered from 0"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ArgumentError(f"{flag} {name}: MPS is not available on this machine; use {flag} cpu")


def device_argument(device: Any) -> str:
    """The Python API's `device` argument (a string or a torch.device): resolved ("auto") and
    checked as --device is, an ArgumentError naming `device` where torch would fail later."""
    import torch

    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise ArgumentError(
            f"device must be a string such as 'cpu', 'cuda:0' or 'auto', got "
            f"{type(device).__name__} {short_repr(device)}"
        )
    device = resolve_device(device)
    check_device(device, flag="device")
    return device


def _is_link_loop(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def check_output_file(path: str | Path, flag: str) -> None:
    """`path` can be written as a file: not empty, not a folder, in a folder that is (or can be
    created as) a writable one. Checked before any work, so a refused command writes nothing."""
    if not str(path).strip():
        raise OutputError(f"{flag} is empty; give a file name")
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{flag} {p} is a folder, not a file")
    check_output_dir(p.parent, flag)


def check_output_dir(path: str | Path, flag: str = "--out") -> None:
    """`path` is a folder, or can be created as one, and a file can be written there (tested by
    writing and removing one temporary file, so read-only mounts and permissions both count;
    nothing is created when `path` does not exist yet). An empty `path` is refused: Path('')
    is the current folder, which nobody means by --out ''."""
    if not str(path).strip():
        raise OutputError(f"{flag} is empty; give a folder (--out . for the current one)")
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise OutputError(f"{flag} {p} is a file, not a folder")
        probe = p
        while not probe.exists() and probe != probe.parent:
            if os.path.lexists(probe):  # a link that leads nowhere: mkdir would fail after the work
                loop = _is_link_loop(probe)
                raise OutputError(
                    f"{flag} {p} cannot be created: {probe} is a "
                    f"{'symbolic link loop' if loop else 'broken symbolic link'}"
                )
            probe = probe.parent
        if not probe.is_dir():
            raise OutputError(f"{flag} {p} cannot be created: {probe} is a file, not a folder")
    except OSError as e:
        raise OutputError(f"{flag} {p} cannot be used ({e.strerror or e})") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".poslens-write-test.", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise OutputError(
            f"{flag} {p} is not writable: cannot create a file in {probe} ({e.strerror or e})"
        ) from None
