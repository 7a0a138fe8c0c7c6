"""Where and how a run computes: device, seeds, precision, and the peak FLOP/s to judge utilisation by.

Recipes wrap their models themselves, in one order: move to the device, wrap in DDP, then compile (compiling
the DDP-wrapped module lets Dynamo split the graph at DDP's gradient buckets, so communication still overlaps
the backward pass). ``unwrap`` undoes both wrappers for checkpoints.
"""

import random
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common.cli import RecipeError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, else mps, else cpu; asking for a device that is absent is a RecipeError."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RecipeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RecipeError(f"--device {name}: MPS is not available on this machine; use --device cpu or auto")
    return device


def seed_everything(seed: int) -> None:
    """Seed python and torch (CPU and every CUDA device). Under DDP pass seed + rank."""
    random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """The autocast context for a precision; fp32 gives a disabled one, so callers need no branch."""
    dtype = AUTOCAST_DTYPES.get(precision, torch.bfloat16)
    return torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32")


def make_grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling: its 5 exponent bits flush small gradients to zero. bf16 has fp32's 8
    exponent bits (only the mantissa is shorter), so its gradients do not underflow and need no scaler."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile's and DDP's wrappers (state_dict keys without prefixes)."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            return model


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024) -> float:
    """Achievable matmul FLOP/s on ``device`` in ``dtype``: the peak to judge model FLOP utilisation by."""
    generator = torch.Generator().manual_seed(0)  # not the global RNG: a resumed run's numbers must not shift
    a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
    a @ b  # warm-up: first-call allocations and kernel selection
    synchronize(device)
    runs, start = 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < 0.25:
        a @ b
        runs += 1
        synchronize(device)
    return 2 * size**3 * runs / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (GPU kernels run asynchronously), so timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
