"""Where and how a run computes: device, seeds, precision, ranks, and the peak FLOP/s to judge utilisation by.

Recipes wrap their models themselves, in one order: move to the device, wrap in DDP, then compile (compiling
the DDP-wrapped module lets Dynamo split the graph at DDP's gradient buckets, so communication still overlaps
the backward pass). ``unwrap`` undoes both wrappers for checkpoints.

One convention for mixed precision everywhere: ``torch.autocast(device.type, dtype=PRECISION_DTYPES[p],
enabled=p != "fp32")`` around the forward pass, and ``torch.amp.GradScaler(device.type, enabled=p == "fp16")``
always built: disabled, its calls pass the loss and the step straight through.
"""

import contextlib
import datetime
import json
import logging
import os
import platform
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import typer
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common.cli import RecipeError, option_given
from common.rundir import write_json

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


def resolve_precision(precision: str, device: torch.device, checkpoint: dict | None = None) -> tuple[str, str]:
    """``--precision``, with ``auto`` resolved: bf16 where the device runs bf16 matmuls natively, else fp32 (never
    fp16, which needs loss scaling to be safe); a resumed run keeps its checkpoint's precision unless
    --precision is given. Returns the precision and why, for the header and config.json."""
    started = (checkpoint or {}).get("config", {})
    if started.get("precision") in PRECISION_DTYPES and (precision == "auto" or not option_given("precision")):
        auto = str(started.get("precision_reason")).startswith("auto")  # (which a --config replay chooses again)
        return started["precision"], "auto: as its checkpoint ran" if auto else "as its checkpoint ran"
    if precision != "auto":  # (from --config: one the replayed run was given; auto's choice replays as auto)
        return precision, "as given" if option_given("precision") else "from --config" if option_given(
            "config_file") else "the default"
    why = native_bf16(device)
    return ("bf16", f"auto: {why}") if why else ("fp32", f"auto: no native bf16 matmul on this {device.type}")


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


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None) -> float:
    """Achievable matmul FLOP/s on ``device`` in ``dtype``, measured: square products of ``size`` (default 8192
    on CUDA, 1024 elsewhere) run back to back and timed as one batch, doubled until it lasts 0.2 s. A GPU needs
    both: 1024^3 products with a sync after each leave an H100 mostly idle (launch and sync overhead), a peak far
    below the real one and an MFU several times too high. For MFU prefer ``device_peak_flops`` (datasheet
    figures). fp32 is true fp32 unless TF32 was switched on; PyTorch's default is off, and so are the recipes'."""
    device = torch.device(device)
    if size is None:
        size = 8192 if device.type == "cuda" else 1024
    # Not the global RNG: a resumed run's numbers must not shift. On CUDA a generator there avoids making
    # (and copying over) large matrices on the CPU.
    generator = torch.Generator(device if device.type == "cuda" else "cpu").manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator, device=generator.device).to(device, dtype) for _ in range(2))
    out = torch.empty_like(a)
    with torch.no_grad():
        start = time.perf_counter()
        torch.matmul(a, b, out=out)  # warm-up: first-call allocations and kernel selection
        synchronize(device)
        if device.type == "cpu" and (elapsed := time.perf_counter() - start) >= 1.0:
            return 2 * size**3 / elapsed  # emulated (bf16 without AVX-512 BF16): one product is a measurement
        runs = 1
        while True:
            start = time.perf_counter()
            for _ in range(runs):
                torch.matmul(a, b, out=out)
            synchronize(device)  # once per batch: the GPU stays busy from one product to the next
            elapsed = time.perf_counter() - start
            if elapsed >= 0.2:
                return 2 * size**3 * runs / elapsed
            runs *= 2


# Dense (no 2:4 sparsity) peaks in FLOP/s from NVIDIA's datasheets, SXM boards unless named. fp32 is the
# plain CUDA-core figure, tf32 the tensor-core one used for fp32 only when TF32 is switched on. The most
# specific name comes first: "H100 PCIe" and "H100 NVL" before "H100" (the SXM part is "H100 80GB HBM3").
# A GPU missing here is measured instead (device_peak_flops says which).
DATASHEET_PEAKS = [
    (r"H200 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    (r"GH200|H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    (r"H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    (r"H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    (r"H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    (r"A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
]


def precision_name(dtype: torch.dtype) -> str | None:
    """``torch.bfloat16`` -> "bf16": PRECISION_DTYPES read backwards."""
    return next((name for name, known in PRECISION_DTYPES.items() if known == dtype), None)


def datasheet_peak(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """The datasheet figure for a GPU name (``torch.cuda.get_device_name``) and dtype, or None if unknown."""
    key = "tf32" if dtype == torch.float32 and tf32 else precision_name(dtype)
    for pattern, figures in DATASHEET_PEAKS:
        if re.search(rf"(?<![A-Za-z0-9])(?:{pattern})(?![A-Za-z0-9])", device_name) and key in figures:
            return figures[key]
    return None


def device_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """The peak FLOP/s to judge MFU by, and where it comes from: a GPU's datasheet figure when its name is
    known (MFU's usual denominator), else ``measure_matmul_flops`` (an achievable peak: MFU reads higher
    than against a datasheet). fp32 on CUDA counts TF32 only when it is switched on (off by default)."""
    device = torch.device(device)
    if device.type != "cuda":  # a CPU multiplies fp16, and bf16 without bf16 units, in fp32: fp32's peak bounds it
        emulated = dtype == torch.float16 or dtype == torch.bfloat16 and not native_bf16(device)
        return measured_peak(device, torch.float32 if device.type == "cpu" and emulated else dtype, device.type)
    name = torch.cuda.get_device_name(device)
    tf32 = torch.get_float32_matmul_precision() != "highest"  # also follows allow_tf32
    if (figure := datasheet_peak(name, dtype, tf32)) is None:
        return measured_peak(device, dtype, name)
    return figure, f"datasheet: {name}, {'tf32' if dtype == torch.float32 and tf32 else precision_name(dtype)} dense"


def measured_peak(device: torch.device, dtype: torch.dtype, where: str) -> tuple[float, str]:
    """``measure_matmul_flops``'s best reading yet on this machine, dtype, thread count and torch version, kept in
    ~/.cache/torch-recipes/peak_flops.json. A first run takes the best of 5 (fewer if each takes seconds, as emulated
    bf16 does), later runs one more, kept only if higher: a busy machine only lowers readings, so MFU of two runs
    differs by their speed, and a first reading taken under load (once an MFU of 236%) does not stay."""
    if where == "cpu":  # another machine (a different cloud instance) is measured anew
        models = re.findall(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()) if Path(
            "/proc/cpuinfo").is_file() else []
        # A VM's model name may be only "AMD EPYC", with or without bf16 units (4x fp32, or 0.01x): units count too
        units = f"{torch.backends.cpu.get_cpu_capability()}; {native_bf16(device) or 'no native bf16'}"
        where = f"{models[0] if models else platform.processor() or 'cpu'} ({units}), {torch.get_num_threads()} threads"
    key = f"{where} | {dtype} | torch {torch.__version__}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch-recipes" / "peak_flops.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}  # a damaged file is measured over, and replaced
    source, entry = f"measured: back-to-back {dtype} matmuls on {where}", known.get(key)
    kept = entry["flops"] if isinstance(entry, dict) and type(entry.get("flops")) in (int, float) and \
        0 < entry["flops"] < float("inf") else None
    started, readings = time.perf_counter(), [measure_matmul_flops(device, dtype)]
    while kept is None and len(readings) < 5 and time.perf_counter() - started < 3.0:
        readings.append(measure_matmul_flops(device, dtype))
    if kept is not None and kept >= max(readings):
        return kept, f"{source}, best reading on {entry.get('date', 'an earlier day')} (cached in {cache})"
    with contextlib.suppress(OSError, RecipeError):  # write_json's, of a read-only or full disk: measured next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache, {**known, key: {"flops": max(readings), "date": datetime.date.today().isoformat()}})
    return max(readings), source


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (GPU kernels run asynchronously), so timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
