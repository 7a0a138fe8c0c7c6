"""The peak FLOP/s to judge a run's model FLOPs utilisation (MFU) by: a GPU's datasheet figure, else matmuls
measured on the machine itself (the best reading yet, cached per machine)."""

import contextlib
import datetime
import json
import os
import platform
import re
import time
from pathlib import Path

import torch

from common.cli import RecipeError
from common.rundir import write_json
from common.runtime import PRECISION_DTYPES, native_bf16, synchronize


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
    # XDG's rule: an empty or relative XDG_CACHE_HOME is unset. No home folder (env -i, a uid with no passwd entry)
    # leaves "~" as it is (Path.home() raises): no cache then, and each run measures its best of 5
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache")) / "torch-recipes" / "peak_flops.json"
    try:
        known = json.loads(cache.read_text()) if cache.is_absolute() else {}
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
    if cache.is_absolute():  # write_json's RecipeError, of a read-only or full disk: measured next time
        with contextlib.suppress(OSError, RecipeError):
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_json(cache, {**known, key: {"flops": max(readings), "date": datetime.date.today().isoformat()}})
    return max(readings), source
