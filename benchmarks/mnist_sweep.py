"""Tune mnist_onecycle's defaults on seeded splits of the official test set, report on others.

    python benchmarks/mnist_sweep.py MNIST_DIR --splits 100,101 --variants "default;--width 24;--max-lr 0.2"

Each split shuffles the 10,000 official test digits with its seed (mixing the cleaner first 5,000, written by
census staff, with the harder last 5,000, by students), trains on 5,000 and tests on the other 5,000, 3 epochs.
Splits 100 and up are for tuning; benchmark item 3 reports on splits 0-4, which no default was chosen on (other
shuffles of the same digits, though: docs/benchmarks.md says how much they share).
"""

import argparse
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.mnist_files import split_test_set


def test_accuracy(split: Path, run_dir: Path, extra: list[str], seed: int) -> float:
    out = subprocess.run([sys.executable, "recipes/mnist_onecycle.py", "--epochs", "3", "--seed", str(seed),
                          "--data-dir", str(split), "--run-dir", str(run_dir), *extra], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return float(re.search(r"test_acc=([\d.]+)", out)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mnist_dir", type=Path, help="the official test set's two .gz files")
    parser.add_argument("--splits", default="100,101", help="split seeds (100 and up: tuning)")
    parser.add_argument("--seeds", default="0", help="training seeds")
    parser.add_argument("--variants", default="default", help="option sets, ';' between them; 'default': none")
    args = parser.parse_args()
    splits, seeds = [int(s) for s in args.splits.split(",")], [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as work:
        folders = {s: split_test_set(args.mnist_dir, Path(work) / f"split{s}", 5000, seed=s).parents[1]
                   for s in splits}
        for variant in args.variants.split(";"):
            extra = [] if variant.strip() == "default" else shlex.split(variant)
            scores = [test_accuracy(folders[s], Path(work) / f"run-{s}-{seed}-{len(extra)}-{abs(hash(variant))}",
                                    extra, seed) for s in splits for seed in seeds]
            shown = ", ".join(f"{100 * a:.2f}" for a in scores)
            print(f"{variant:32} mean {100 * statistics.mean(scores):.2f}  ({shown})", flush=True)


if __name__ == "__main__":
    main()
