"""Tune tabular_mlp's defaults on seeded splits of a table; report on others.

    python benchmarks/tabular_sweep.py --csv adult.csv --target income --seeds 100,101,102 \
        --variants "default;--num-embedding periodic;--num-embedding periodic PERIODIC_SIGMA=1"

Each variant runs once per seed (the seed also draws the split), in this process. A variant is recipe options,
plus NAME=VALUE words that set one of the recipe's module constants for that variant (PLE_BINS, PERIODIC_SIGMA,
...). Printed per variant: the final validation score of each seed (accuracy, or RMSE for a regression; no
checkpoint chosen on it) and their mean, and the mean seconds per run. ``--cv K`` scores each seed by K-fold
cross-validation instead. Seeds 100 and up are for tuning; benchmark item 13 reports on seeds 0-4 (of the same
rows, though: half of each Adult validation set, and with --cv every row, was validated on in tuning too).
"""

import argparse
import contextlib
import io
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load_recipe
from common.cli import run_recipe


def score(recipe, options: list[str], constants: dict[str, str], run_dir: Path) -> float:
    saved = {name: getattr(recipe, name) for name in constants}
    for name, value in constants.items():
        setattr(recipe, name, type(saved[name])(value))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the runs' own lines: only the scores are shown
            run_recipe(recipe.main, [*options, "--run-dir", str(run_dir)])
    except SystemExit as exit_:
        if exit_.code:
            raise RuntimeError(f"{shlex.join(options)} failed") from None
    finally:
        for name, value in saved.items():
            setattr(recipe, name, value)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if "cv" in metrics:
        return metrics[f"mean_{metrics['metric']}"]
    return metrics["val_acc"] if "val_acc" in metrics else metrics["val_rmse"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--seeds", default="100,101,102", help="seeds (100 and up: tuning)")
    parser.add_argument("--cv", type=int, help="score by K-fold cross-validation")
    parser.add_argument("--variants", default="default", help="';' between them; 'default': no change")
    args = parser.parse_args()
    recipe = load_recipe("tabular_mlp")
    with tempfile.TemporaryDirectory() as work:
        for n, variant in enumerate(args.variants.split(";")):
            words = [] if variant.strip() == "default" else shlex.split(variant)
            constants = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
            options = [w for w in words if w not in {f"{k}={v}" for k, v in constants.items()}]
            base = ["--csv", str(args.csv), "--target", args.target, *(["--cv", str(args.cv)] if args.cv else [])]
            scores, seconds = [], []
            for seed in [int(s) for s in args.seeds.split(",")]:
                started = time.perf_counter()
                scores.append(score(recipe, [*base, "--seed", str(seed), *options], constants,
                                    Path(work) / f"v{n}-s{seed}"))
                seconds.append(time.perf_counter() - started)
            shown = ", ".join(f"{s:.4f}" for s in scores)
            print(f"{variant:60} mean {statistics.mean(scores):.4f}  ({shown})  {statistics.mean(seconds):.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
