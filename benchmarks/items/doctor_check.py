"""Item 15. The doctor is right: for each recipe, what scripts/doctor.py recommends, measured again on its own."""

import json
import statistics
import sys
from pathlib import Path

from benchmarks.harness import ROOT, device_args, run_command, summarise
from benchmarks.mnist_files import split_test_set
from scripts.doctor import throughput


def recipe_options(quick: bool, mnist_dir: Path | None, adult_csv: Path | None, work: Path) -> dict[str, list]:
    """Each recipe with options a user would run it with here (real data where there is some)."""
    options = {"mixed_precision": [], "compiled_model": [], "tiny_transformer": []}
    if mnist_dir is not None:
        digits = split_test_set(mnist_dir, work / "doctor_mnist", 5000, seed=0).parents[1]
        options |= {"mnist_onecycle": ["--data-dir", digits], "ddp_mlp": ["--data-dir", digits]}
    if adult_csv is not None:
        options["tabular_mlp"] = ["--csv", adult_csv, "--target", "income"]
    if quick:
        options = {"mixed_precision": ["--samples", 2048, "--width", 64]}
    return {name: [str(a) for a in args] + device_args() for name, args in options.items()}


def doctor_check(quick: bool, mnist_dir: Path | None, adult_csv: Path | None, work: Path) -> dict:
    rounds = 1 if quick else 5
    rows, met, figures = [], [], {}
    for name, options in recipe_options(quick, mnist_dir, adult_csv, work).items():
        report = work / f"doctor_{name}.json"
        extra = ["--try", "bf16", "--rounds", "1", "--window", "3"] if quick else []
        run_command([sys.executable, "scripts/doctor.py", name, *options, *extra, "--json", report])
        said = json.loads(report.read_text())
        if not said["recommended_options"]:
            rows.append(f"{name}: as given (nothing faster)")
            figures[name] = {"recommended": [], "said": None}
            continue
        claimed = statistics.median(said["speedups"]["recommended"])
        window = said["window"]
        speeds = {"as given": [], "recommended": []}
        for r in range(rounds):  # interleaved and alternating, as the doctor measures, apart and with more rounds
            for variant in ["recommended", "as given"] if r % 2 else ["as given", "recommended"]:
                chosen = said["options"] if variant == "as given" else said["recommended"]
                run_dir = work / f"doctor_{name}_{r}_{len(speeds[variant])}"
                speeds[variant].append(throughput(ROOT / "recipes" / f"{name}.py", [*chosen, *said["measured_with"]],
                                                  3 * window, window, run_dir))
        again = summarise([b / a for a, b in zip(speeds["as given"], speeds["recommended"], strict=True)])
        ok = abs(again["median"] / claimed - 1) <= 0.15
        met.append(ok)
        rows.append(f"{name}: {' '.join(said['recommended_options'])} said {claimed:.2f}x, measured again "
                    f"{again['median']:.2f}x ({again['min']:.2f}-{again['max']:.2f})")
        figures[name] = {"recommended": said["recommended_options"], "said": claimed, "again": again}
    return {"item": f"The doctor is right: each recipe's recommended options measured again on their own ({rounds} "
                    "interleaved rounds)", "result": "; ".join(rows),
            "target": "within 15% of the speed-up the doctor said", "met": all(met) if met else None, **figures}
