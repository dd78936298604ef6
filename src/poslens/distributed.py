"""torchrun support: join the process group torchrun describes in the environment.

`torchrun --nproc_per_node N -m poslens train ...` starts N processes with RANK / WORLD_SIZE /
MASTER_ADDR set; each calls `init()`, which joins PyTorch's own process group (gloo on the CPU,
NCCL on CUDA). Without torchrun everything runs as rank 0 of 1 and nothing is initialised.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun. Under torchrun the process group is joined on
    first use (gloo: what is exchanged here lives on the CPU) unless `init` joined it already."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available():
        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init(device: torch.device) -> tuple[int, int]:
    """Join torchrun's process group if the environment asks for one; returns (rank, world)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return world()


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


__all__ = ["barrier", "device_for", "init", "is_main", "world"]
