"""What every benchmark item shares: where the recipes run, the recipes themselves, interleaved repeats
reported as median and range, recipe runs in subprocesses, and the CPU the figures were made on.

``DEVICE`` is set once by benchmarks/run.py (its --device) before any item runs; items read it as
``harness.DEVICE``, never copy it at import.
"""

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.runtime import measure_matmul_flops

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


def cpu_hardware() -> dict:
    """The CPU's model name, its bf16 instruction flags (Linux /proc/cpuinfo), and bf16 against fp32 matmul
    GFLOP/s measured here. Without AVX-512 BF16 or AMX, bf16 is emulated: an Intel AVX-512F CPU without BF16
    ran it at 0.2x fp32; an AMD EPYC with avx512_bf16 runs it faster than fp32."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # one block per core: the first says it
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: no flags; the measurement below still says how bf16 runs
        pass
    model = model or platform.processor() or platform.machine()
    fp32, bf16 = measure_matmul_flops(CPU, torch.float32), measure_matmul_flops(CPU, torch.bfloat16)
    native = {flag: flag in flags for flag in ("avx512f", "avx512_bf16", "amx_bf16")} if flags else {}
    return {"cpu_model": model, "cpu_flags": native, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_native": (native["avx512_bf16"] or native["amx_bf16"]) if native else None,
            "fp32_gflops": fp32 / 1e9, "bf16_gflops": bf16 / 1e9, "bf16_over_fp32": bf16 / fp32}


def describe_hardware(hardware: dict) -> str:
    native = {True: "native bf16 (" + ", ".join(f for f in ("avx512_bf16", "amx_bf16") if hardware["cpu_flags"][f])
                    + ")",
              False: "no native bf16 (neither avx512_bf16 nor amx_bf16: emulated)",
              None: "bf16 flags unknown (no /proc/cpuinfo)"}[hardware["bf16_native"]]
    return (f"CPU {hardware['cpu_model']}: {native}; matmul bf16 {hardware['bf16_gflops']:.0f} vs fp32 "
            f"{hardware['fp32_gflops']:.0f} GFLOP/s ({hardware['bf16_over_fp32']:.2f}x)")

