"""The Python half of benchmarks/gpu_check.sh: it probes the machine, makes the check's data and turns its
runs into one table.

    python benchmarks/gpu_check.py probe [--need-cuda 0|1]
    python benchmarks/gpu_check.py data DIR [--digits 20000 2000] [--rows 20000]
    python benchmarks/gpu_check.py table OUT --runs RUNS_TSV [--environment TEXT] [--elapsed SECONDS] [--smoke 0|1]
                                      [--steps N] [--running RECIPE/VARIANT] [--final]

``probe`` imports torch once and says in one go what the machine has: its first line, tab-separated, is
for gpu_check.sh (GPUs, datasheet peaks for bf16 and fp16, whether the transformer recipe takes
--parallel, the environment in words); the lines after it are for a person: package versions, which APIs
the project needs that this torch lacks, and a recipe's --help run end to end.
``data`` writes synthetic MNIST-format digits (DIR/MNIST/raw, what torchvision.datasets.MNIST reads) and a
CSV table (DIR/table.csv, target column ``label``): the GPU machine has no network, so nothing is downloaded.
``table`` reads RUNS_TSV (one line per run, written by gpu_check.sh) and each run's metrics.json, prints
a markdown table and writes it to OUT/table.md, with every figure in OUT/results.json. gpu_check.sh calls it
after every run (and with --running before each one), so a check cut short still leaves its table.

``data`` and ``table`` do not import torch: they run in a fraction of a second, even where torch is broken.
"""

import argparse
import importlib
import importlib.metadata
import inspect
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/gpu_check.py` from a clone

from benchmarks.mnist_files import write_mnist

# ----------------------------------------------------------------------------------------------------
# Probe

# What the project calls that an older torch lacks (the lent machine once had torch 2.11 against our pin):
# (what, where it is used, the torch that added it, a check that it is there).
def _has_fsdp2() -> bool:
    from torch.distributed.fsdp import fully_shard  # noqa: F401 - public from torch 2.6 on

    return True


def _api_checks():
    import torch
    import torch.distributed as dist

    return [
        ("torch.amp.GradScaler(device)", "fp16 runs (common/runtime.py)", "2.3",
         lambda: hasattr(torch.amp, "GradScaler")),
        ("init_process_group(device_id=)", "torchrun runs (common/runtime.py)", "2.3",
         lambda: "device_id" in inspect.signature(dist.init_process_group).parameters),
        # the argument is older (CUDA only): a version check, as the CPU kernel shows only when called
        ("fused AdamW on the CPU", "tiny_transformer --device cpu", "2.4",
         lambda: version_tuple(torch.__version__) >= (2, 4)),
        ("torch.compiler.disable / list_backends", "compiled_model", "2.1",
         lambda: hasattr(torch.compiler, "disable") and hasattr(torch.compiler, "list_backends")),
        ("torch.distributed.fsdp.fully_shard (FSDP2)", "the FSDP2 row, once the transformer has --parallel",
         "2.6", _has_fsdp2),
    ]


def probe(need_cuda: bool) -> int:
    """Print the machine line for gpu_check.sh, then (with a GPU, or when none is needed) the details."""
    helper = None
    if not need_cuda:  # start the --help run now: it overlaps with the imports below
        helper = start_help()
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - whatever breaks the import, the shell says it in one line
        print(f"error: cannot import torch ({type(err).__name__}: {err})")
        return 1
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = f"{n} x {torch.cuda.get_device_name(0)}" if n else "no CUDA device"
    environment = f"torch {torch.__version__} (CUDA {torch.version.cuda}), {gpu}"
    peaks = {"bf16": "-", "fp16": "-"}  # "-": unknown (an empty field would vanish in the shell's read)
    if n:
        from common.peak_flops import datasheet_peak

        name = torch.cuda.get_device_name(0)
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            figure = datasheet_peak(name, dtype)
            peaks[key] = f"{figure:.4g}" if figure else "-"
    if need_cuda and not n:
        print(f"0\t-\t-\t0\t{environment}")
        return 0
    helper = helper or start_help()
    details = []
    pinned = pinned_torch()
    if pinned and version_tuple(torch.__version__) < version_tuple(pinned):
        details.append(f"warning: torch {torch.__version__} is older than the pin {pinned} in requirements.txt")
    for module in ("torchvision", "typer", "tensorboard", "rich", "numpy"):
        try:
            importlib.import_module(module)
            details.append(f"{module} {importlib.metadata.version(module)}")
        except Exception as err:  # noqa: BLE001
            details.append(f"MISSING {module}: {type(err).__name__}: {err}")
    for what, where, since, check in _api_checks():
        try:
            present = bool(check())
        except Exception:  # noqa: BLE001 - an ImportError or a changed signature: the API is not there
            present = False
        details.append(f"{'ok' if present else 'MISSING'}: {what}, for {where} (torch >= {since})")
    try:
        out, _ = helper.communicate(timeout=60)
        help_ok, help_text = helper.returncode == 0, out
    except subprocess.TimeoutExpired:
        helper.kill()
        help_ok, help_text = False, "timed out after 60 s"
    parallel = int(help_ok and "--parallel" in help_text)
    details.append("recipes/tiny_transformer.py --help: " + (
        f"ok; --parallel {'listed' if parallel else 'not listed (the FSDP2 row is skipped)'}" if help_ok
        else "FAILED: " + " ".join(help_text.strip().splitlines()[-1:])))
    print("\t".join([str(n), peaks["bf16"], peaks["fp16"], str(parallel), environment]))
    print("\n".join(details))
    return 0


def start_help() -> subprocess.Popen:
    """One recipe's --help: torch, typer and rich imported together, the way every run will."""
    return subprocess.Popen([sys.executable, str(ROOT / "recipes" / "tiny_transformer.py"), "--help"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            cwd=ROOT)


def pinned_torch() -> str | None:
    requirements = ROOT / "requirements.txt"
    found = re.search(r"^torch==(\S+)", requirements.read_text(), re.M) if requirements.is_file() else None
    return found[1] if found else None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


# ----------------------------------------------------------------------------------------------------
# Data


def synthetic_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learnable fake digits: class k is a bright 8x8 square at a class-specific place (shifted by up to
    two pixels, with random brightness) on a noisy background. Same idea as tests/conftest.py's, a little
    less trivial so that the loss still moves after the first few steps."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
    shifts = rng.integers(-2, 3, (n, 2))
    brightness = rng.integers(150, 256, n)
    for i, k in enumerate(labels):
        row = 2 + (k // 5) * 12 + shifts[i, 0]
        col = 2 + (k % 5) * 5 + shifts[i, 1]
        row, col = min(max(row, 0), 20), min(max(col, 0), 20)
        images[i, row : row + 8, col : col + 8] = brightness[i]
    return images, labels


def write_table(path: Path, n: int, seed: int = 0) -> Path:
    """A CSV with numeric, categorical and missing values; the label depends on both kinds of column."""
    rng = np.random.default_rng(seed)
    colours, cities = ["red", "green", "blue", "black"], ["Oslo", "Lima", "Pune"]
    ages, incomes = rng.integers(18, 80, n), rng.normal(50, 15, n)
    colour_ids, city_ids = rng.integers(0, 4, n), rng.integers(0, 3, n)
    lines = ["age,income,colour,city,label"]
    for i in range(n):
        colour = colours[colour_ids[i]]
        label = "yes" if (ages[i] > 45) ^ (colour in ("red", "blue")) else "no"
        income = "" if i % 17 == 0 else f"{incomes[i]:.2f}"  # missing numbers
        city = "?" if i % 23 == 0 else cities[city_ids[i]]  # missing categories
        lines.append(f"{ages[i]},{income},{colour},{city},{label}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def make_data(directory: Path, n_train: int, n_test: int, n_rows: int) -> None:
    write_mnist(directory, synthetic_digits(n_train, seed=1), synthetic_digits(n_test, seed=2))
    write_table(directory / "table.csv", n_rows)
    print(f"data: {n_train:,} train / {n_test:,} test digits in {directory / 'MNIST' / 'raw'}, "
          f"{n_rows:,} rows in {directory / 'table.csv'}")


# ----------------------------------------------------------------------------------------------------
# Results

TIMED_OUT = {124, 137}  # timeout(1): 124 after SIGTERM, 137 when --kill-after had to SIGKILL
# A recipe's `error: ...` line, or Typer's `Error: Invalid value ...` (possibly behind torchrun's "[rankN]:")
ERROR_LINE = re.compile(r"^(\[rank\d+\]:\s*)?error:", re.IGNORECASE)
# A Python exception, but not torchrun's own ChildFailedError, which only says that a worker failed
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?(?![\w.]*ChildFailedError)[\w.]*(Error|Exception|Interrupt)\b")


def error_line(stderr: str) -> str:
    """The line of a failed run's stderr that says what went wrong: the recipe's one-line ``error: ...``
    if there is one, else a Python exception line (torchrun appends its own report after the worker's
    traceback), else the last line that holds any text."""
    lines = [line.strip() for line in stderr.splitlines() if any(c.isalnum() for c in line)]
    for pattern in (ERROR_LINE, EXCEPTION_LINE):
        matches = [line for line in lines if pattern.search(line)]
        if matches:
            return matches[-1]
    return lines[-1] if lines else "(nothing on stderr)"


def read_run(fields: list[str]) -> dict:
    """One line of runs.tsv: RECIPE VARIANT EXIT WALL_S RUN_DIR STDERR_LOG COMMAND [NOTE]. EXIT ``skipped``
    is a run not started, NOTE saying why; otherwise NOTE qualifies an ok run (a 1-rank DDP run)."""
    recipe, variant, rc, wall_s, run_dir, stderr_log, command, *rest = fields
    note = rest[0] if rest else ""
    row = {"recipe": recipe, "variant": variant, "status": "ok", "error": None, "exit_code": None,
           "wall_s": float(wall_s), "unit": None, "throughput": None, "train_loss": None, "mfu": None,
           "peak_gpu_mb": None, "note": note or None, "run_dir": run_dir, "stderr_log": stderr_log,
           "command": command, "metrics": None}
    if rc == "skipped":
        row["status"] = "skipped"
        return row
    rc, run_dir = int(rc), Path(run_dir)
    metrics_path = run_dir / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else None
    row["exit_code"], row["metrics"] = rc, metrics
    if rc in TIMED_OUT:
        row["status"], row["error"] = "failed", f"timed out after {float(wall_s):.0f} s"
    elif rc != 0:
        stderr = Path(stderr_log).read_text(errors="replace") if Path(stderr_log).is_file() else ""
        row["status"], row["error"] = "failed", f"exit {rc}: {error_line(stderr)}"
    elif metrics is None:
        row["status"], row["error"] = "failed", f"exit 0 but no {metrics_path}"
    if metrics:
        for unit in ("samples", "tokens"):
            if f"{unit}_per_s" in metrics:
                row["unit"], row["throughput"] = unit, metrics[f"{unit}_per_s"]
        row["train_loss"] = metrics.get("train_loss")
        row["mfu"] = metrics.get("mfu")  # the transformer's model FLOP utilisation
        peak = metrics.get("memory", {}).get("peak_allocated_bytes")  # present only when CUDA was used
        row["peak_gpu_mb"] = peak / 1e6 if peak is not None else None
    return row


def cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")  # one line, and no column breaks inside a cell
    return text if len(text) <= limit else text[: limit - 3] + "..."


def number(value: float | None, digits: str = ",.0f") -> str:
    if value is None or not math.isfinite(value):
        return "-" if value is None else str(value)
    return f"{value:{digits}}" if abs(value) >= 100 else f"{value:.3g}"


def status_text(r: dict) -> str:
    if r["status"] == "ok":
        return f"ok; {r['note']}" if r["note"] else "ok"
    if r["status"] == "skipped":
        return f"skipped: {r['note']}"
    if r["status"] == "running":
        return "did not finish: the check was stopped during this run"
    return f"failed: {r['error']}" + (f"; {r['note']}" if r["note"] else "")


def markdown_table(rows: list[dict]) -> str:
    lines = ["| recipe | variant | throughput | final train loss | MFU | peak GPU memory (MB) | wall s | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        throughput = f"{number(r['throughput'])} {r['unit']}/s" if r["throughput"] is not None else "-"
        loss = f"{r['train_loss']:.4f}" if isinstance(r["train_loss"], float) else "-"
        mfu = f"{r['mfu']:.1%}" if isinstance(r["mfu"], float) else "-"
        wall = f"{r['wall_s']:.1f}" if r["status"] not in ("skipped", "running") else "-"
        lines.append(f"| {r['recipe']} | {r['variant']} | {throughput} | {loss} | {mfu} | "
                     f"{number(r['peak_gpu_mb'])} | {wall} | {cell(status_text(r), 240)} |")
    return "\n".join(lines)


def make_table(out: Path, runs_file: Path, environment: str, elapsed: float | None, smoke: bool,
               steps: int | None = None, running: str | None = None, final: bool = False) -> int:
    """Write OUT/table.md and OUT/results.json from the runs so far; print the table when ``final``.
    Returns the number of failed runs, plus those skipped because the time budget was spent."""
    lines = runs_file.read_text().splitlines() if runs_file.is_file() else []
    # at most 8 fields: COMMAND is written with printf %q, so it holds no tab of its own
    rows = [read_run(line.split("\t", 7)) for line in lines if line.strip()]
    if running:
        recipe, _, variant = running.partition("/")
        rows.append({"recipe": recipe, "variant": variant, "status": "running", "error": None, "note": None,
                     "wall_s": 0.0, "unit": None, "throughput": None, "train_loss": None, "mfu": None,
                     "peak_gpu_mb": None, "metrics": None})
    failed = sum(r["status"] == "failed" for r in rows)
    over_budget = sum(r["status"] == "skipped" and "budget" in (r["note"] or "") for r in rows)
    done = sum(r["status"] in ("ok", "failed") for r in rows)
    state = "finished" if final else "IN PROGRESS or CUT SHORT (this file is rewritten after every run)"
    head = [f"gpu_check: {environment}", f"{'smoke (CPU) | ' if smoke else ''}{steps or '?'} steps per run | "
            f"{done} runs done, {failed} failed, {over_budget} skipped for time | "
            f"{elapsed if elapsed is not None else 0:.0f} s | {state}"]
    table = markdown_table(rows)
    notes = table_notes(rows)
    (out / "table.md").write_text("\n".join(head) + "\n\n" + table + "\n" + ("\n" + notes + "\n" if notes else ""))
    results = {"environment": environment, "smoke": smoke, "steps": steps, "elapsed_s": elapsed, "final": final,
               "runs": done, "failed": failed, "skipped_for_time": over_budget, "rows": rows}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if final:
        print(table)
        if notes:
            print("\n" + notes)
        if failed or over_budget:
            print(f"\n{failed} of {done} runs failed, {over_budget} skipped for time")
    return failed + over_budget


def table_notes(rows: list[dict]) -> str:
    """What a reader needs to judge the figures, for the runs present."""
    notes = []
    if any(r["mfu"] is not None for r in rows):
        notes.append("- MFU: model FLOPs per token x tokens/s over the peak given by --peak-flops (a datasheet "
                     "figure, when gpu_check knows the GPU; see log.txt), else the recipe's measured matmul peak.")
    if any(r["peak_gpu_mb"] is not None for r in rows):
        notes.append("- Peak GPU memory: torch.cuda.max_memory_allocated at the end of the run, counted from the "
                     "end of set-up (model, optimizer, compile).")
    if rows:
        notes.append("- fp32 would be true fp32 (TF32 is off by default); throughput leaves out each run's first "
                     "logged window, so the compiled variants' compile time is not in it.")
    return "\n".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="write synthetic MNIST IDX files and a CSV table")
    data.add_argument("directory", type=Path)
    data.add_argument("--digits", type=int, nargs=2, default=[20000, 2000], metavar=("TRAIN", "TEST"))
    data.add_argument("--rows", type=int, default=20000)
    table = commands.add_parser("table", help="the runs as a markdown table in OUT/table.md, figures in results.json")
    table.add_argument("out", type=Path)
    table.add_argument("--runs", type=Path, required=True, help="runs.tsv, one line per run")
    table.add_argument("--environment", default="")
    table.add_argument("--elapsed", type=float, default=None)
    table.add_argument("--smoke", type=int, choices=[0, 1], default=0, help="1: a CPU smoke run")
    table.add_argument("--steps", type=int, default=None)
    table.add_argument("--running", help="RECIPE/VARIANT: the run about to start")
    table.add_argument("--final", action="store_true", help="the check is over: print the table too")
    check = commands.add_parser("probe", help="the machine, its packages and APIs, and one recipe's --help")
    check.add_argument("--need-cuda", type=int, choices=[0, 1], default=1)
    args = parser.parse_args(argv)
    if args.command == "data":
        make_data(args.directory, *args.digits, args.rows)
        return 0
    if args.command == "probe":
        return probe(bool(args.need_cuda))
    failed = make_table(args.out, args.runs, args.environment, args.elapsed, bool(args.smoke), args.steps,
                        args.running, args.final)
    return 1 if failed and args.final else 0


if __name__ == "__main__":
    sys.exit(main())
