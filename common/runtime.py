"""Where and how a run computes: device, seeds, precision and ranks.

Recipes wrap their models themselves, in one order: move to the device, wrap in DDP, then compile (compiling
the DDP-wrapped module lets Dynamo split the graph at DDP's gradient buckets, so communication still overlaps
the backward pass). ``unwrap`` undoes both wrappers for checkpoints.

One convention for mixed precision everywhere: ``torch.autocast(device.type, dtype=PRECISION_DTYPES[p],
enabled=p != "fp32")`` around the forward pass, and ``torch.amp.GradScaler(device.type, enabled=p == "fp16")``
always built: disabled, its calls pass the loss and the step straight through.
"""

import logging
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist
import typer
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common.cli import RecipeError, option_given

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, else mps, else cpu; asking for a device that is absent is a RecipeError. Sets fp32 to
    true fp32 (no TF32 in convolutions either)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RecipeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RecipeError(f"--device {name}: MPS is not available on this machine; use --device cpu or auto")
    # fp32 is fp32: cuDNN's convolutions use TF32 (10 mantissa bits) by default, matmuls not; fewer: --precision
    torch.backends.cudnn.allow_tf32 = False
    if device.type != "cuda":  # torch.compile's C++ toolchain warns of a CUDA it will not use: noise on a CPU
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    return device


def seed_everything(seed: int) -> None:
    """Seed python and torch (CPU and every CUDA device). The DDP and FSDP recipes pass the same seed on every
    rank: a resume restores rank 0's random streams on all of them."""
    random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """The autocast context for a precision; fp32 gives a disabled one, so callers need no branch."""
    return torch.autocast(device.type, dtype=PRECISION_DTYPES[precision], enabled=precision != "fp32")


def native_bf16(device: torch.device) -> str | None:
    """Why ``device`` multiplies bf16 natively, or None: CUDA from compute capability 8.0 (Ampere) on; a CPU with
    AVX-512 BF16 or AMX, or Arm's BF16 (its flags in /proc/cpuinfo: found, not guessed from the model's name)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"CUDA compute capability {major}.{minor} >= 8.0" if major >= 8 else None
    if device.type == "cpu":
        found = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})  # bf16: Arm's (Graviton3, Neoverse V1)
        return f"the CPU has {' and '.join(found)}" if found else None
    return None  # MPS: fp32 by itself


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo: x86's "flags", Arm's "Features"); none known elsewhere."""
    try:
        return set(re.findall(r"^(?:flags|Features)\s*:(.*)$", cpuinfo.read_text(), flags=re.M)[0].split())
    except (OSError, IndexError):
        return set()


class ChosenPrecision(NamedTuple):
    """What config.json records of ``--precision``: the option as given (``auto`` stays auto, so that a --config
    replay chooses again; a resume not given one keeps its checkpoint's), the precision it runs in, and why."""
    precision: str
    precision_used: str
    precision_reason: str


def resolve_precision(precision: str, device: torch.device, checkpoint: dict | None = None) -> ChosenPrecision:
    """``--precision``, with ``auto`` resolved: bf16 where the device runs bf16 matmuls natively, else fp32 (never
    fp16, which needs loss scaling to be safe); a resumed run keeps its checkpoint's precision unless
    --precision fp32, bf16 or fp16 is given (auto keeps it)."""
    started = (checkpoint or {}).get("config", {})
    used = started.get("precision_used", started.get("precision"))  # (a checkpoint from before precision_used)
    if used in PRECISION_DTYPES and (precision == "auto" or not option_given("precision")):
        return ChosenPrecision(started["precision"], used, "as its checkpoint ran")
    if precision != "auto":
        why = "as given" if option_given("precision") else "from --config" if option_given("config_file") else \
            "the default"
        return ChosenPrecision(precision, precision, why)
    if why := native_bf16(device):
        return ChosenPrecision("auto", "bf16", f"auto: {why}")
    return ChosenPrecision("auto", "fp32", f"auto: no native bf16 matmul on this {device.type}")


def from_rank_0(work: Callable[[], T]) -> T:
    """``work()`` on rank 0 alone, and its result, or its error, on every rank: what one process decides for all
    (a run directory's name, whether a checkpoint was written), with no rank left waiting in vain. Without a
    process group it is just ``work()``."""
    if not dist.is_initialized():
        return work()
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [work()]
        except (RecipeError, typer.BadParameter) as err:
            outcome = [err]
        except OSError as err:
            outcome = [RecipeError(f"{err.filename or 'a file'}: {err.strerror or err}")]
    dist.broadcast_object_list(outcome)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile's and DDP's wrappers (state_dict keys without prefixes)."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            return model


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (GPU kernels run asynchronously), so timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
