"""What torchrun tells each process it starts, read and checked. A hand-set environment that no group of processes
could have (a RANK at or past WORLD_SIZE, a port past 65535) is one line, not a traceback or a rendezvous that
waits for a rank that never comes."""

import os

import torch

from common.cli import RecipeError


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) from torchrun's RANK, LOCAL_RANK and WORLD_SIZE (with MASTER_ADDR and
    MASTER_PORT, which the rendezvous reads); None without RANK: plain ``python``, one process."""
    if "RANK" not in os.environ:
        return None
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
    values = [os.environ.get(name, "") for name in names]
    if not all(v.isascii() and v.isdigit() for v in values) or not os.environ.get("MASTER_ADDR"):
        raise RecipeError("RANK is set, but not all of torchrun's LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
                          "MASTER_PORT: launch with torchrun, or unset RANK")
    rank, local_rank, world_size, port = map(int, values)
    if not (rank < world_size and local_rank < world_size and 1 <= port <= 65535):
        given = ", ".join(f"{name} {value}" for name, value in zip(names, values, strict=True))
        raise RecipeError(f"{given}: no group of processes has these (RANK and LOCAL_RANK below WORLD_SIZE, "
                          "MASTER_PORT from 1 to 65535): launch with torchrun, or unset RANK")
    return rank, local_rank, world_size


def gpu_of(local_rank: int) -> torch.device:
    """The GPU of the process with this LOCAL_RANK, one GPU per process: more processes on this machine than it has
    GPUs is one line, not CUDA's "invalid device ordinal" in a traceback."""
    if local_rank >= (count := torch.cuda.device_count()):
        raise RecipeError(f"LOCAL_RANK {local_rank}, but this machine has {count} CUDA device(s): start at most "
                          f"{count} processes on it (torchrun --nproc_per_node), or use --device cpu")
    return torch.device("cuda", local_rank)
