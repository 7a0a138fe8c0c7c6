"""The Python half of scripts/gpu_check.sh: it makes the check's data and turns its runs into one table.

    python scripts/gpu_check.py data DIR [--digits 20000 2000] [--rows 20000]
    python scripts/gpu_check.py table OUT [--environment TEXT] [--elapsed SECONDS] [--smoke 0|1]

``data`` writes synthetic MNIST-format digits (DIR/MNIST/raw, what torchvision.datasets.MNIST reads) and a
CSV table (DIR/table.csv, target column ``label``): the GPU machine has no network, so nothing is downloaded.
``table`` reads OUT/runs.tsv (one line per run, written by gpu_check.sh) and each run's metrics.json, prints
a markdown table and writes it to OUT/table.md, with every figure in OUT/results.json.

Neither command imports torch: they run in a fraction of a second, even on a machine where torch is broken.
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python scripts/gpu_check.py` from a clone

from scripts.mnist_files import write_mnist

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
    recipe, variant, rc, wall_s, run_dir, stderr_log, command = fields
    rc, run_dir = int(rc), Path(run_dir)
    metrics_path = run_dir / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else None
    row = {"recipe": recipe, "variant": variant, "status": "ok", "error": None, "exit_code": rc,
           "wall_s": float(wall_s), "unit": None, "throughput": None, "train_loss": None, "peak_gpu_mb": None,
           "run_dir": str(run_dir), "stderr_log": stderr_log, "command": command, "metrics": metrics}
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


def markdown_table(rows: list[dict]) -> str:
    lines = ["| recipe | variant | throughput | final train loss | peak GPU memory (MB) | wall s | status |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        throughput = f"{number(r['throughput'])} {r['unit']}/s" if r["throughput"] is not None else "-"
        loss = f"{r['train_loss']:.4f}" if isinstance(r["train_loss"], float) else "-"
        status = "ok" if r["status"] == "ok" else f"failed: {r['error']}"
        lines.append(f"| {r['recipe']} | {r['variant']} | {throughput} | {loss} | {number(r['peak_gpu_mb'])} | "
                     f"{r['wall_s']:.1f} | {cell(status)} |")
    return "\n".join(lines)


def make_table(out: Path, environment: str, elapsed: float | None, smoke: bool) -> int:
    runs_file = out / "runs.tsv"
    lines = runs_file.read_text().splitlines() if runs_file.is_file() else []
    rows = [read_run(line.split("\t", 6)) for line in lines if line.strip()]
    table = markdown_table(rows)
    (out / "table.md").write_text(table + "\n")
    failed = sum(r["status"] != "ok" for r in rows)
    results = {"environment": environment, "smoke": smoke, "elapsed_s": elapsed, "runs": len(rows),
               "failed": failed, "rows": rows}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    if failed:
        print(f"\n{failed} of {len(rows)} runs failed")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="write synthetic MNIST IDX files and a CSV table")
    data.add_argument("directory", type=Path)
    data.add_argument("--digits", type=int, nargs=2, default=[20000, 2000], metavar=("TRAIN", "TEST"))
    data.add_argument("--rows", type=int, default=20000)
    table = commands.add_parser("table", help="print OUT's runs as a markdown table; write table.md, results.json")
    table.add_argument("out", type=Path)
    table.add_argument("--environment", default="")
    table.add_argument("--elapsed", type=float, default=None)
    table.add_argument("--smoke", type=int, choices=[0, 1], default=0, help="1: a CPU smoke run")
    args = parser.parse_args(argv)
    if args.command == "data":
        make_data(args.directory, *args.digits, args.rows)
        return 0
    return 1 if make_table(args.out, args.environment, args.elapsed, bool(args.smoke)) else 0


if __name__ == "__main__":
    sys.exit(main())
