"""Item 16. The LR finder is useful: a run at scripts/find_lr.py's suggestion against the tuned default."""

import re
import statistics
import sys
from pathlib import Path

from benchmarks.harness import device_args, run_command, summarise
from benchmarks.mnist_files import split_test_set

SEEDS = [0, 1, 2]  # of the training runs; the MNIST split and the range test keep seed 0


def suggestion(recipe: str, options: list, work: Path) -> tuple[str, float]:
    _, out = run_command([sys.executable, "scripts/find_lr.py", recipe, *options, "--plot", work / f"{recipe}_lr.png"])
    option, value = re.search(r"suggested: (--[\w-]+) ([\d.e+-]+)", out).groups()
    return option, float(value)


def score(recipe: str, options: list, metric: str, run_dir: Path) -> float:
    _, out = run_command([sys.executable, f"recipes/{recipe}.py", *options, "--run-dir", run_dir])
    return float(re.search(rf"\b{metric}=([\d.]+)", out)[1])


def lr_finder(quick: bool, mnist_dir: Path | None, adult_csv: Path | None, work: Path) -> dict:
    cases = []
    if mnist_dir is not None:
        digits = split_test_set(mnist_dir, work / "lr_mnist", 1000 if quick else 5000, seed=0).parents[1]
        cases.append(("mnist_onecycle", ["--data-dir", digits, "--epochs", 1 if quick else 3], "test_acc"))
    if adult_csv is not None:
        cases.append(("tabular_mlp", ["--csv", adult_csv, "--target", "income", *(["--epochs", 1] if quick else [])],
                      "val_acc"))
    if not cases:
        return {"item": "The LR finder is useful", "result": "skipped: neither MNIST nor Adult is here",
                "target": "within 0.5 points of the tuned default", "met": None}
    rows, met, figures = [], [], {}
    for recipe, options, metric in cases:
        options = [*options, *device_args()]
        option, rate = suggestion(recipe, options, work)
        # paired by seed (the same split and initialization), as one seed's difference is mostly noise
        tuned, found = [], []
        for seed in SEEDS[:1] if quick else SEEDS:
            seeded = [*options, "--seed", seed]
            tuned.append(score(recipe, seeded, metric, work / f"lr_{recipe}_default_{seed}"))
            found.append(score(recipe, [*seeded, option, rate], metric, work / f"lr_{recipe}_found_{seed}"))
        points = summarise([100 * (f - t) for f, t in zip(found, tuned, strict=True)])
        gap = statistics.mean(found) - statistics.mean(tuned)
        met.append(gap >= -0.005)
        rows.append(f"{recipe}: suggested {option} {rate:g}: mean {metric} {statistics.mean(found):.4f} vs the "
                    f"default's {statistics.mean(tuned):.4f} ({100 * gap:+.2f} points; per seed "
                    f"{points['min']:+.2f} to {points['max']:+.2f}; {len(found)} seeds)")
        figures[recipe] = {"option": option, "suggested": rate, "found": found, "default": tuned}
    return {"item": "The LR finder is useful: runs at find_lr.py's suggestion vs the tuned default (same data and "
                    "epochs, paired by seed)", "result": "; ".join(rows), "target": "mean within 0.5 points of the "
                    "default's accuracy", "met": all(met), **figures}
