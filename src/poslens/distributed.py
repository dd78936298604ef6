"""torchrun support: join the process group torchrun describes in the environment.

`torchrun --nproc_per_node N -m poslens train ...` starts N processes with RANK / WORLD_SIZE /
MASTER_ADDR set; each calls `init()`, which joins PyTorch's own process group (gloo on the CPU,
NCCL on CUDA). Without torchrun everything runs as rank 0 of 1 and nothing is initialised.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from typing import Any, TypeVar

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun. Under torchrun the process group is joined on
    first use (gloo: what is exchanged here lives on the CPU) unless `init` joined it already."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available():
        if not dist.is_initialized():
            _join("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init(device: torch.device) -> tuple[int, int]:
    """Join torchrun's process group if the environment asks for one; returns (rank, world)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        _join("nccl" if device.type == "cuda" else "gloo")
    return world()


def _join(backend: str) -> None:
    """Join the process group, and leave it cleanly when the interpreter exits."""
    dist.init_process_group(backend=backend)
    atexit.register(_leave)


def _leave() -> None:
    """Let gloo's worker threads finish, then destroy the group.

    A gloo worker releases a finished collective's tensors just after the caller's wait returns,
    and releasing them takes the GIL. If the main thread has begun interpreter shutdown by then,
    Python 3.11 ends that thread inside a noexcept destructor and the process aborts ("terminate
    called without an active exception", SIGABRT) after all its work is done. Sleeping here
    hands the GIL and the CPU to any worker still holding one.
    """
    if dist.is_initialized():
        time.sleep(0.2)  # ample for a worker thread to be scheduled on a busy 2-core machine
        # cleanup after the work is done and written: a peer already gone is no error to show
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def device_for(device: str) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK under torchrun on GPUs, else as given."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and "LOCAL_RANK" in os.environ:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return dev


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


def is_main() -> bool:
    return world()[0] == 0


def _collective_device() -> torch.device:
    """Where the process group's tensors live: this rank's GPU for NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the torchrun processes in place and return it (one process: untouched)."""
    if world()[1] == 1:
        return t
    dev = _collective_device()
    if t.device == dev:
        dist.all_reduce(t)
    else:  # e.g. a CUDA tensor under gloo: reduce a copy where the backend works
        on_dev = t.to(dev)
        dist.all_reduce(on_dev)
        t.copy_(on_dev)
    return t


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable), in rank order, on every process; [obj] in one process."""
    n = world()[1]
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj)
    return out


def shard(n: int, batch_size: int) -> list[int]:
    """Start indices of the batches of `n` images this rank evaluates: under torchrun rank r takes
    batches r, r + world, ...; in one process all of them, in order."""
    rank, size = world()
    return list(range(0, n, batch_size))[rank::size]


T = TypeVar("T")


def gather(parts: list[tuple[int, T]]) -> list[tuple[int, T]]:
    """Every rank's (batch start, payload) pairs, sorted by start: the single-process order."""
    if world()[1] > 1:
        parts = [item for rank_parts in gather_objects(parts) for item in rank_parts]
    return sorted(parts, key=lambda item: item[0])


def in_order(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Per-batch tensors concatenated in image order, gathered from every rank under torchrun."""
    return torch.cat([t for _, t in gather(parts)])


def sum_count(n: int) -> int:
    """A count summed over the ranks (n itself in one process)."""
    return int(all_reduce_sum(torch.tensor([n], dtype=torch.float64)).item())


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` (picklable) on every process; the others' `obj` is ignored."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = [
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "device_for",
    "gather",
    "gather_objects",
    "in_order",
    "init",
    "is_main",
    "shard",
    "sum_count",
    "world",
]
