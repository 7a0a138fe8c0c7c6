"""scripts/doctor.py: alternatives measured side by side, and the tuning guide's rules checked on the live run."""

import json
import re
import textwrap

import pytest

from scripts import doctor

# A recipe that breaks every rule the live run can see: a convolution with a bias before a batch norm, inputs
# not in channels_last, anomaly detection on, gradients zeroed in place, and evaluation with autograd recording.
CARELESS = '''
from pathlib import Path

import torch
from torch import nn


def main(lr: float = 0.1, max_steps: int = 8, profile: int | None = None, log_every: int = 10,
         run_dir: Path = Path("r")):
    torch.autograd.set_detect_anomaly(True)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(3, (16,))
    try:
        for _ in range(max_steps):
            optimizer.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        model(x).sum()  # no torch.no_grad(): a graph is recorded for nothing
    finally:
        torch.autograd.set_detect_anomaly(False)
'''


def verdicts(rows) -> dict[str, str]:
    return {rule: verdict for rule, _, verdict in rows}


def test_the_live_run_sees_each_broken_rule(tmp_path):
    (tmp_path / "careless.py").write_text(textwrap.dedent(CARELESS))
    recipe = doctor.load_recipe(str(tmp_path / "careless.py"))
    observed, config, profile, _ = doctor.live_run(recipe, [], 6, tmp_path)
    assert observed.steps == 6 and observed.anomaly_mode
    assert observed.grads_reused == 5  # every step after the first found last step's gradient tensors
    rules = verdicts(doctor.rule_rows(observed, config | {"precision": "bf16"}, profile, []))
    assert rules["no conv bias before batch norm"].startswith("bias=False")
    assert rules["channels_last convolutions"].startswith("model.to(memory_format=torch.channels_last)")
    assert rules["evaluation without autograd"] == "wrap evaluation in torch.no_grad()"
    assert rules["debug APIs off"] == "turn off: they slow every step"
    assert rules["zero_grad(set_to_none=True)"].startswith("free the gradients")
    assert rules["sizes multiples of 8 under autocast"].startswith("tensor cores")  # 4, 3 and 144 = 4 x 36: 4, 3


def test_a_recipe_that_follows_the_rules_passes_them(tmp_path, mnist_dir):
    recipe = doctor.load_recipe("mnist_onecycle")
    options = ["--data-dir", str(mnist_dir), "--batch-size", "32", "--device", "cpu", "--precision", "fp32"]
    observed, config, profile, unit = doctor.live_run(recipe, options, 12, tmp_path)
    assert unit == "samples" and config["precision"] == "fp32" and profile["steps"] >= 5
    rules = verdicts(doctor.rule_rows(observed, config, profile, options))
    for rule in ("evaluation without autograd", "debug APIs off", "zero_grad(set_to_none=True)",
                 "no conv bias before batch norm", "channels_last convolutions"):
        assert rules[rule] == "ok", rule
    assert set(profile["ms_per_step"]) == {"data", "forward", "backward", "optimizer", "rest"}


@pytest.mark.parametrize(("recipe", "options", "tried"), [
    ("mixed_precision", ["--samples", "2048", "--width", "64", "--batch-size", "128"], "batch"),
    ("tabular_mlp", ["--csv", "{table_csv}", "--target", "label", "--batch-size", "32"], "workers"),
])
def test_the_table_and_the_recommendation(recipe, options, tried, table_csv, tmp_path, capsys):
    options = [o.replace("{table_csv}", str(table_csv)) for o in options] + ["--device", "cpu"]
    report = tmp_path / "doctor.json"
    assert doctor.main([recipe, *options, "--rounds", "1", "--try", tried, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"doctor: {recipe} on cpu")
    assert lines[1] == "| rule or alternative | measured | verdict |"
    alternative = "--batch-size 256" if tried == "batch" else "--num-workers"
    row = next(line for line in lines if line.startswith(f"| {alternative}"))
    assert re.fullmatch(r"\| [-\w ]+ \| \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\) \| .+ \|", row), row
    assert re.search(r"\| data loading \| \d+% of a [\d.]+ ms step waits for data \| ", out)
    assert "| host-device syncs | not measured: a CPU has no asynchronous queue to stall | n/a on cpu |" in lines
    said = json.loads(report.read_text())
    assert said["options"] == options and len(said["speedups"]["as given"]) == 1
    assert lines[-1].strip().startswith(f"python recipes/{recipe}.py ")
    assert said["recommended"][: len(options)] == options
    if said["recommended_options"]:
        assert lines[-2].startswith("recommended (")
    else:
        assert lines[-2].startswith("recommended: as given")


@pytest.mark.parametrize(("args", "message"), [
    (["mixed_precision", "--run-dir", "x"], "--run-dir: the doctor runs the recipe in run directories of its own"),
    (["mixed_precision", "--try", "warp"], "argument --try"),
])
def test_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        doctor.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_recipe_that_fails_as_given_is_one_line(tmp_path, capsys):
    assert doctor.main(["tabular_mlp", "--csv", str(tmp_path / "missing.csv"), "--target", "y"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the recipe fails as given: ") and "missing.csv" in err and err.count("\n") == 1
