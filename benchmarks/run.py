"""What each recipe and the core cost, measured side by side in one run.

    python benchmarks/run.py --mnist-dir DIR --adult-csv FILE --out benchmark.json  # all 16: 25-40 minutes on 2 cores
    python benchmarks/run.py --only 1,2,3,4,5,6,7,8,9,10,11 ...  # the short items, not 12-16: about 5 minutes
    python benchmarks/run.py --quick --out quick.json  # every item, tiny sizes: checks the script runs
    python benchmarks/run.py --device cuda ...         # the recipes on a GPU (default: cpu, even there)

Prints a markdown table and writes the same figures as JSON. This machine (like most) is shared and noisy:
every speed figure is a ratio of two things measured in the same run, interleaved, repeated, and reported as
the median with the min-max range. Real data is used when given: ``--mnist-dir``, a folder with the official
MNIST test set (``t10k-images-idx3-ubyte.gz`` and ``t10k-labels-idx1-ubyte.gz``, as torchvision leaves them
in ``data/MNIST/raw``, the default) and ``--adult-csv``, the Adult census table as one CSV with a header row;
without them those items are skipped (or run on synthetic data) with a note. Nothing here is a test: tests never time.

Every recipe run, in a subprocess or in this process, gets --device explicitly: left to `auto`, a recipe
would pick CUDA where there is one, and the DDP item would start two ranks on one GPU. Items 1 and 2 measure
the core's own (CPU-side) cost and always run on the CPU. Each item is a file of benchmarks/items/, imported
only when it runs; an item that fails, in its imports or after, is recorded with its error and the others
still run; the exit status is then 1.
"""

import argparse
import importlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # common/ and benchmarks/ from a clone, without installing

import torch

from benchmarks import harness
from benchmarks.harness import CPU, cpu_hardware, describe_hardware
from scripts.plot_runs import cannot_write_in

MNIST_FILES = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")  # the official test set (torchvision's)


def device_name(value: str) -> torch.device:
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not one of cpu, cuda, cuda:N, mps")
    return torch.device(value)


def check_device(device: torch.device) -> str | None:
    """Why ``device`` cannot be used here, or None."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {device}: CUDA is not available on this machine; use --device cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return f"--device {device}: MPS is not available on this machine; use --device cpu"
    return None


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def run_items(items: dict[int, Callable[[], dict]], chosen: list[int]) -> dict[int, dict]:
    """Each chosen item in turn; one that raises becomes a result that says why, and the rest still run."""
    results = {}
    for number in chosen:
        started = time.perf_counter()
        try:
            result = items[number]()
        except Exception as err:  # noqa: BLE001 - any failure of one item must not lose the others' figures
            result = {"item": f"item {number}", "result": f"failed: {one_line(err)}", "target": "-", "met": None,
                      "error": one_line(err)}
        results[number] = result | {"seconds": time.perf_counter() - started}
        print(f"[{number}] {results[number]['result']}  ({results[number]['seconds']:.0f} s)", file=sys.stderr)
    return results


def item(module: str, function: str, *args) -> Callable[[], dict]:
    """Item ``function`` of benchmarks/items/``module``.py, imported only when it runs: an item whose
    imports fail (a core module it needs being rewritten, say) fails alone, like one that raises."""

    def run() -> dict:
        return getattr(importlib.import_module(f"benchmarks.items.{module}"), function)(*args)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every item runs")
    parser.add_argument("--mnist-dir", type=Path,
                        help="folder with the official MNIST test set, t10k-*-ubyte.gz (default: data/MNIST/raw)")
    parser.add_argument("--adult-csv", type=Path, help="the Adult census table as one CSV with a header row")
    parser.add_argument("--only", help="comma-separated item numbers, e.g. 1,4")
    parser.add_argument("--device", type=device_name, default=CPU,
                        help="where the recipes run: cpu (default, also on a GPU machine), cuda, cuda:N, mps")
    args = parser.parse_args()
    # checked before any item runs: a bad --out found after 40 minutes of measuring would lose them
    if args.out and (args.out.is_dir() or not args.out.parent.is_dir()):
        parser.error(f"argument --out: {args.out} is a folder or in a missing one; give a .json file's path")
    if args.out and args.out.exists():
        try:
            open(args.out, "ab").close()  # to append: nothing in it changes
        except OSError as err:
            parser.error(f"argument --out: cannot write {args.out}: {err.strerror or err}")
    elif args.out and (problem := cannot_write_in(args.out.parent)):
        parser.error(f"argument --out: {problem}")
    if args.mnist_dir and (absent := [name for name in MNIST_FILES if not (args.mnist_dir / name).is_file()]):
        parser.error(f"argument --mnist-dir: {args.mnist_dir} holds no {' or '.join(absent)} (MNIST's test set)")
    if args.adult_csv and not args.adult_csv.is_file():
        parser.error(f"argument --adult-csv: {args.adult_csv} is not a file")
    # the items run the recipes from the repository's root: a path relative to here must not change meaning
    args.mnist_dir, args.adult_csv = (path and path.resolve() for path in (args.mnist_dir, args.adult_csv))
    if problem := check_device(args.device):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(1)
    harness.DEVICE = args.device
    mnist_dir = args.mnist_dir or ROOT / "data" / "MNIST" / "raw"  # left out: skipped where it is not
    mnist_dir = mnist_dir if all((mnist_dir / name).is_file() for name in MNIST_FILES) else None
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        items = {1: item("core_overhead", "core_overhead", args.quick),
                 2: item("input_pipeline", "input_pipeline", args.quick, mnist_dir),
                 3: item("mnist_small_data", "mnist_vs_examples", args.quick, mnist_dir, work),
                 4: item("transformer_speed", "transformer", args.quick),
                 5: item("mixed_precision", "mixed_precision", args.quick),
                 6: item("compiled", "compiled", args.quick, work),
                 7: item("ddp", "ddp", args.quick, work),
                 8: item("tabular_adult", "tabular", args.quick, args.adult_csv, work),
                 9: item("kv_cache", "kv_cache", args.quick),
                 10: item("tabular_scale", "tabular_scale", args.quick, work),
                 11: item("transformer_parallel", "transformer_parallel", args.quick, work),
                 12: item("lm_quality", "lm_quality", args.quick, work),
                 13: item("tabular_vs_boosting", "tabular_vs_boosting", args.quick, args.adult_csv, work),
                 14: item("defaults_vs_peer", "defaults_vs_peer", args.quick, work),
                 15: item("doctor_check", "doctor_check", args.quick, mnist_dir, args.adult_csv, work),
                 16: item("lr_finder", "lr_finder", args.quick, mnist_dir, args.adult_csv, work)}
        given = args.only.split(",") if args.only is not None else list(map(str, items))
        if unknown := sorted(set(given) - set(map(str, items))):  # "" too: --only "" is not every item
            parser.error(f"argument --only: no item {', '.join(map(repr, unknown))} (items are "
                         f"{', '.join(map(str, items))})")
        chosen = list(dict.fromkeys(map(int, given)))
        hardware = cpu_hardware()
        if harness.DEVICE.type == "cuda":
            hardware["gpu"] = torch.cuda.get_device_name(harness.DEVICE)
        print(describe_hardware(hardware), file=sys.stderr)
        results = run_items(items, chosen)

    machine = (f"{hardware['cpu_model']} ({platform.machine()}), {os.cpu_count()} cores, torch {torch.__version__}, "
               f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    on_device = f"; recipes on {harness.DEVICE}{' (' + hardware['gpu'] + ')' if 'gpu' in hardware else ''}"
    lines = [f"Measured on: {machine}{on_device}{' (quick mode)' if args.quick else ''}",
             describe_hardware(hardware), "",
             "| # | item | result | target | met |", "|---|---|---|---|---|"]
    for number, r in results.items():
        met = "FAILED" if "error" in r else {True: "yes", False: "no", None: "n/a"}[r["met"]]
        lines.append(f"| {number} | {r['item']} | {r['result']} | {r['target']} | {met} |")
    print("\n".join(lines))
    if args.out:
        try:
            args.out.write_text(json.dumps({"machine": machine, "quick": args.quick, "device": str(harness.DEVICE),
                                            "hardware": hardware, "items": {str(k): v for k, v in results.items()}},
                                           indent=2, default=str))
        except OSError as err:  # a full disk, say: the table above still holds the figures
            print(f"error: cannot write --out {args.out}: {err.strerror or err}", file=sys.stderr)
            sys.exit(1)
    failed = [f"{number} ({r['error']})" for number, r in results.items() if "error" in r]
    if failed:
        print(f"error: {len(failed)} of {len(results)} items failed: {'; '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
