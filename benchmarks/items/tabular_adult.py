"""Item 8. Tabular: the Adult census table."""

import re
import sys
from pathlib import Path

from benchmarks.harness import device_args, run_command


def tabular(quick: bool, adult_csv: Path | None, work: Path) -> dict:
    item = "Tabular MLP: validation accuracy on Adult (--target income, default options)"
    if adult_csv is None:
        return {"item": item, "result": "skipped: the Adult CSV is not here (--adult-csv)", "target": ">= 0.85",
                "met": None}
    extra = ["--epochs", 1] if quick else []
    _, out = run_command([sys.executable, "recipes/tabular_mlp.py", "--csv", adult_csv, "--target", "income",
                          *extra, "--run-dir", work / "adult_run", *device_args()])
    acc = float(re.search(r"val_acc=([\d.]+)", out)[1])
    return {"item": item, "result": f"{acc:.4f}", "target": ">= 0.85", "met": acc >= 0.85, "val_acc": acc}

