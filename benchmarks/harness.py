"""What every benchmark item shares: where the recipes run, the recipes themselves, interleaved repeats
reported as median and range, recipe runs in subprocesses, and the CPU the figures were made on.

``DEVICE`` is set once by benchmarks/run.py (its --device) before any item runs; items read it as
``harness.DEVICE``, never copy it at import.
"""

import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.peak_flops import measure_matmul_flops
from common.runtime import cpu_flags

BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # as common.runtime.native_bf16 reads them; bf16: Arm's

ROOT = Path(__file__).resolve().parents[1]

CPU = torch.device("cpu")
DEVICE = CPU  # where the recipes run: --device, set by benchmarks/run.py's main() and passed to every recipe run


def device_args() -> list[str]:
    """The recipes' --device option for DEVICE: always given, never left to the recipe's `auto`."""
    return ["--device", str(DEVICE)]


def load_recipe(name: str):
    """A recipe's module (recipes are scripts; the benchmark measures their models and commands)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summarise(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved(repeats: int, alternate: bool = False, **measure: Callable[[], float]) -> dict[str, list[float]]:
    """Run each measurement ``repeats`` times in turn (A B A B ...), so drifting machine load hits all alike.
    ``alternate``: every other round in reverse (A B B A ...), so that neither always runs first."""
    results = {name: [] for name in measure}
    for round_ in range(repeats):
        names = list(measure)[::-1] if alternate and round_ % 2 else list(measure)
        for name in names:
            results[name].append(measure[name]())
    return results


def run_command(args: list, env: dict | None = None, cwd: Path = ROOT) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args[:3]))} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - started, proc.stdout


def cpu_hardware(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU's model name, its bf16 instruction flags (Linux's /proc/cpuinfo, read as the recipes' --precision
    auto reads them: x86's AVX-512 BF16 and AMX, Arm's BF16), and bf16 against fp32 matmul GFLOP/s measured here.
    Without them bf16 is emulated: an Intel AVX-512F CPU without BF16 ran it at 0.2x fp32; an AMD EPYC with
    avx512_bf16 runs it faster than fp32. ``bf16_native`` is None where the flags are unknown (not Linux)."""
    flags = cpu_flags(cpuinfo)
    try:
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), flags=re.M)[1]
    except (OSError, TypeError):  # not Linux, or an Arm cpuinfo, which names no model
        model = platform.processor() or platform.machine()
    fp32, bf16 = measure_matmul_flops(CPU, torch.float32), measure_matmul_flops(CPU, torch.bfloat16)
    bf16_flags = sorted(flags & BF16_FLAGS)
    return {"cpu_model": model, "bf16_flags": bf16_flags, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_native": bool(bf16_flags) if flags else None,
            "fp32_gflops": fp32 / 1e9, "bf16_gflops": bf16 / 1e9, "bf16_over_fp32": bf16 / fp32}


def describe_hardware(hardware: dict) -> str:
    if hardware["bf16_native"] is None:
        native = "bf16 flags unknown (no /proc/cpuinfo)"
    elif hardware["bf16_native"]:
        native = f"native bf16 ({', '.join(hardware['bf16_flags'])})"
    else:
        native = "no native bf16 (none of avx512_bf16, amx_bf16, Arm's bf16: emulated)"
    return (f"CPU {hardware['cpu_model']}: {native}; matmul bf16 {hardware['bf16_gflops']:.0f} vs fp32 "
            f"{hardware['fp32_gflops']:.0f} GFLOP/s ({hardware['bf16_over_fp32']:.2f}x)")

