"""scripts/doctor.py: alternatives measured side by side, and the tuning guide's rules checked on the live run."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from common.runtime import resolve_precision
from scripts import doctor

CPU = torch.device("cpu")

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
    rules = verdicts(doctor.rule_rows(observed, config | {"precision_used": "bf16"}, profile, []))
    assert rules["no conv bias before batch norm"].startswith("bias=False")
    assert rules["channels_last convolutions"].startswith("model.to(memory_format=torch.channels_last)")
    assert rules["evaluation without autograd"] == "wrap evaluation in torch.no_grad()"
    assert rules["debug APIs off"] == "turn off: they slow every step"
    assert rules["zero_grad(set_to_none=True)"].startswith("free the gradients")
    assert "sizes multiples of 8 under autocast" not in rules  # a CPU has no tensor cores to advise about
    on_cuda = config | {"precision_used": "bf16", "device_used": "cuda:0"}
    rules = verdicts(doctor.rule_rows(observed, on_cuda, profile, []))
    assert rules["sizes multiples of 8 under autocast"].startswith("tensor cores")  # 4, 3 and 144 = 4 x 36: 4, 3


def test_a_recipe_that_follows_the_rules_passes_them(tmp_path, mnist_dir):
    recipe = doctor.load_recipe("mnist_onecycle")
    options = ["--data-dir", str(mnist_dir), "--batch-size", "32", "--device", "cpu", "--precision", "fp32"]
    observed, config, profile, unit = doctor.live_run(recipe, options, 12, tmp_path)
    assert unit == "samples" and config["precision_used"] == "fp32" and profile["steps"] >= 5
    rules = verdicts(doctor.rule_rows(observed, config, profile, options))
    for rule in ("evaluation without autograd", "debug APIs off", "zero_grad(set_to_none=True)",
                 "no conv bias before batch norm", "channels_last convolutions"):
        assert rules[rule] == "ok", rule
    assert set(profile["ms_per_step"]) == {"data", "forward", "backward", "optimizer", "rest"}


@pytest.mark.parametrize(("recipe", "options", "tried"), [
    ("mixed_precision", ["--samples", "2048", "--width", "64", "--batch-size", "128", "--precision", "auto"], "batch"),
    ("tabular_mlp", ["--csv", "{table_csv}", "--target", "label", "--batch-size", "32"], "workers"),
])
def test_the_table_and_the_recommendation(recipe, options, tried, table_csv, tmp_path, capsys):
    options = [o.replace("{table_csv}", str(table_csv)) for o in options] + ["--device", "cpu"]
    report = tmp_path / "doctor.json"
    assert doctor.main([recipe, *options, "--rounds", "1", "--try", tried, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    used = resolve_precision("auto", CPU).precision_used if "auto" in options else "fp32"  # what ran, not "auto"
    assert lines[0].startswith(f"doctor: {recipe} on cpu ({used}), 1 interleaved round(s)"), lines[0]
    assert lines[1] == "| rule or alternative | measured | verdict |"
    alternative = "--batch-size 256" if tried == "batch" else "--num-workers"
    row = next(line for line in lines if line.startswith(f"| {alternative}"))
    assert re.fullmatch(r"\| [-\w ]+ \| \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\) \| .+ \|", row), row
    assert re.search(r"\| data loading \| \d+% of a [\d.]+ ms step waits for data \| ", out)
    assert "| host-device syncs | not measured: a CPU has no asynchronous queue to stall | n/a on cpu |" in lines
    said = json.loads(report.read_text())
    assert said["options"] == options and len(said["as_given_samples_per_s"]) == 1
    assert said["as_given_samples_per_s"][0] > 0
    # ratios only (or why one could not run): the baseline's samples/s sat among them under "as given"
    assert "as given" not in said["speedups"] and any(name.startswith(alternative) for name in said["speedups"])
    assert all(isinstance(v, str) or all(0 < r < 20 for r in v) for v in said["speedups"].values())
    assert lines[-1].strip().startswith(f"python recipes/{recipe}.py ")
    assert said["recommended"][: len(options)] == options
    if said["recommended_options"]:
        assert lines[-2].startswith("recommended (")
    else:
        assert lines[-2].startswith("recommended: as given")


RECIPES = ", ".join(sorted(p.stem for p in (doctor.ROOT / "recipes").glob("*.py")))


@pytest.mark.parametrize(("args", "message"), [
    (["mixed_precision", "--run-dir", "x"], "--run-dir: the doctor runs the recipe in run directories of its own, "
     "for its own steps"),
    (["mixed_precision", "--try", "warp"], "argument --try: 'warp': each of bf16, compile, workers, batch"),
    (["mixed_precision", "--try", ",,"], "argument --try: ',,': each of bf16, compile, workers, batch"),  # nothing
    (["mixed_precision", "--window", "100000000"], "arguments --rounds and --window: from 1 to 100 rounds, of 1 to "
     "10,000 steps"),  # (it measured for hours)
    (["mixed_precision", "--rounds", "0"], "arguments --rounds and --window: from 1 to 100 rounds, of 1 to 10,000 "
     "steps"),
    (["mixed_precision", "--json", "best.pt"], "argument --json: give a file name that ends in .json, such as "
     "report.json, not 'best.pt'"),
    (["mixed_precision", "--json", ".json"], "argument --json: give a file name that ends in .json, such as "
     "report.json, not '.json'"),  # was ".json must end in .json"
    (["mixed_precision", "--checkpoint-every", "1"], "--checkpoint-every: the doctor runs the recipe in run "
     "directories of its own, for its own steps"),
    # options that make a recipe do something other than train: nothing to measure (they were tracebacks)
    (["tabular_mlp", "--csv", "{table_csv}", "--target", "label", "--cv", "2", "--rounds", "1"],
     "--cv: the doctor measures a training run, and --cv makes the recipe do something else"),
    (["compiled_model", "--samples", "512", "--traps"],
     "--traps: the doctor measures a training run, and --traps makes the recipe do something else"),
    (["tiny_transformer", "--sample-only", "--init-from", "missing"],
     "--sample-only: the doctor measures a training run, and --sample-only makes the recipe do something else"),
    (["tabular_mlp", "--predict=rows.csv"],
     "--predict: the doctor measures a training run, and --predict makes the recipe do something else"),
    (["mixed_precision", "--compare"],
     "--compare: the doctor measures a training run, and --compare makes the recipe do something else"),
    (["no_such_recipe"], f"argument RECIPE: no recipe 'no_such_recipe'; give one of {RECIPES}, or the path of a "
     "recipe file"),
])
def test_usage_errors(args, message, table_csv, capsys):
    with pytest.raises(SystemExit) as exit_:
        doctor.main([a.replace("{table_csv}", str(table_csv)) for a in args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.endswith(f": error: {message}\n"), err


def test_the_recipes_own_usage_errors_exit_2_and_an_unwritable_json_is_found_before_measuring(tmp_path, capsys):
    assert doctor.main(["mixed_precision", "--width", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the recipe refused its options: ") and "--width" in err and err.count("\n") == 1
    for recipe, *hidden in (["mixed_precision", "--epochs", "0"], ["tiny_transformer", "--warmup-steps", "-3"]):
        assert doctor.main([recipe, *hidden]) == 2  # hidden by the doctor's own --epochs or --warmup-steps after it
        err = capsys.readouterr().err
        assert err.startswith(f"error: the recipe refused its options: Invalid value for '{hidden[0]}'"), err
    (tmp_path / "afile").write_text("")
    assert doctor.main(["mixed_precision", "--json", str(tmp_path / "afile" / "x.json")]) == 1
    assert capsys.readouterr().err == f"error: cannot write --json {tmp_path / 'afile' / 'x.json'}: " \
                                      f"{tmp_path / 'afile'} is not a folder\n"
    (tmp_path / "reports.json").mkdir()
    assert doctor.main(["mixed_precision", "--json", str(tmp_path / "reports.json")]) == 1
    assert capsys.readouterr().err == f"error: cannot write --json {tmp_path / 'reports.json'}: it is a folder\n"
    # a file a report must not replace (a run's config.json, say: it was replaced, the run's record lost)
    for content in ('{"recipe": "mixed_precision", "lr": 0.1}', "not json", "[1]", '["recommended_options"]',
                    '"its recommended_options"'):  # JSON that holds the words, and is no report (was replaced)
        (tmp_path / "config.json").write_text(content)
        assert doctor.main(["mixed_precision", "--json", str(tmp_path / "config.json")]) == 1
        assert capsys.readouterr().err == f"error: cannot write --json {tmp_path / 'config.json'}: it exists and is " \
                                          "no doctor's report (a run's config.json?): choose another\n"
        assert (tmp_path / "config.json").read_text() == content
    # a folder no file can be made in (it measured everything, printed the table, then failed)
    assert doctor.main(["mixed_precision", "--json", "/proc/report.json"]) == 1
    assert capsys.readouterr().err.startswith("error: cannot write --json /proc/report.json: no file can be made in "
                                              "/proc (")
    with pytest.raises(SystemExit):
        doctor.main(["--help"])
    assert "and the rules of PyTorch's Performance Tuning Guide checked against the live run." in \
        " ".join(capsys.readouterr().out.split())


def test_a_recipe_that_fails_as_given_is_one_line(tmp_path, capsys):
    assert doctor.main(["tabular_mlp", "--csv", str(tmp_path / "missing.csv"), "--target", "y"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the recipe fails as given: ") and "missing.csv" in err and err.count("\n") == 1


def test_a_recipe_that_writes_no_throughput_is_one_line(tmp_path, capsys):
    """A recipe file that trains but writes no metrics.json (this one has no __main__ block either) was a
    FileNotFoundError traceback once the live run had passed."""
    (tmp_path / "careless.py").write_text(textwrap.dedent(CARELESS))
    assert doctor.main([str(tmp_path / "careless.py"), "--rounds", "1", "--window", "3", "--try", "workers"]) == 1
    assert capsys.readouterr().err == "error: the recipe fails as given: its r0-0/metrics.json holds no throughput " \
                                      "(samples_per_s or tokens_per_s), which the doctor measures\n"


def test_a_batch_size_the_recipe_chooses_is_a_row_not_measured():
    """tabular_mlp records batch_size null unless given: --try batch measured nothing and said so nowhere."""
    found, rows = doctor.alternatives({"--batch-size"}, [], {"batch_size": None}, ["batch"])
    assert found == {} and rows == [("--batch-size x2", "not measured", "the run records no batch size to double: "
                                     "give --batch-size")]
    found, rows = doctor.alternatives({"--batch-size"}, ["--batch-size=64"], {"batch_size": 64}, ["batch"])
    assert found == {"--batch-size 128": (["--batch-size", "128"], True)} and rows == []
    # the transformer refuses --batch-size beside --global-batch: the one given is doubled
    known = {"--batch-size", "--global-batch"}
    found, rows = doctor.alternatives(known, ["--global-batch", "8"], {"batch_size": 8, "global_batch": 8}, ["batch"])
    assert found == {"--global-batch 16": (["--global-batch", "16"], True)} and rows == []
    # lbfgs takes the whole table: no batch size to try, and none to advise
    found, rows = doctor.alternatives({"--batch-size"}, [], {"batch_size": None, "optimizer_name": "lbfgs"}, ["batch"])
    assert found == {} and rows == [("--batch-size x2", "not measured", "lbfgs trains on the whole table at once")]


def test_what_a_config_file_replays_is_not_tried_again():
    """--config replaying --num-workers 1 or --compile: the run as given was measured against itself, and could be
    recommended ("--num-workers 1 | 1.51x | faster in every round"). The live run's config.json says what it used."""
    known, wanted = {"--num-workers", "--compile"}, ["workers", "compile"]
    found, _ = doctor.alternatives(known, ["--config", "c.json"], {"num_workers": 1, "compile": True}, wanted)
    assert found == {}
    found, _ = doctor.alternatives(known, [], {"num_workers": 0, "compile": False}, ["workers"])
    assert list(found) == [f"--num-workers {min(4, max(1, (os.cpu_count() or 2) - 1))}"]
    found, _ = doctor.alternatives(known, ["--num-workers", "2", "--compile"], {}, wanted)  # no record: as given
    assert found == {}


def test_bf16_is_tried_where_the_cpu_multiplies_it_natively_and_said_why_not_elsewhere(monkeypatch):
    """The README's first alternative: no test reached it (an inverted check passed)."""
    from common import runtime

    known, fp32 = {"--precision"}, {"device_used": "cpu", "precision_used": "fp32"}
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert doctor.alternatives(known, [], fp32, ["bf16"]) == ({"--precision bf16": (["--precision", "bf16"], False)},
                                                              [])
    assert doctor.alternatives(known, [], fp32 | {"precision_used": "bf16"}, ["bf16"]) == ({}, [])  # bf16 already
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert doctor.alternatives(known, [], fp32, ["bf16"]) == ({}, [("--precision bf16", "not measured", "no native "
                                                                    "bf16 matmul on this cpu: emulated, it would be "
                                                                    "slower")])


def test_on_cuda_tf32_on_is_ok_and_too_few_steps_count_no_syncs():
    """TF32 was advised with the matmul precision already "high"; one step read as "nan per step", a stall."""
    cuda = {"device_used": "cuda:0", "precision_used": "fp32"}
    assert verdicts(doctor.rule_rows(doctor.Observed(matmul_precision="high"), cuda, {}, []))["TF32 matmuls"] == \
        "ok: TF32 is on"
    assert verdicts(doctor.rule_rows(doctor.Observed(), cuda, {}, []))["TF32 matmuls"].startswith("fp32 as asked")
    assert verdicts(doctor.rule_rows(doctor.Observed(syncs_by_step=[3]), cuda, {}, []))["host-device syncs"] == "n/a"
    assert verdicts(doctor.rule_rows(doctor.Observed(syncs_by_step=[3, 5, 7]), cuda, {}, []))[
        "host-device syncs"].startswith("each stalls the GPU")


def test_cudnn_benchmark_is_asked_of_every_convolution_model_on_cuda():
    """It was passed for a model whose convolutions were all channels_last, whatever the flag."""
    cuda = {"device_used": "cuda:0", "precision_used": "bf16"}
    conv = doctor.Observed(matrices={"Conv2d0": (32, 16)}, cudnn_benchmark=False)
    assert verdicts(doctor.rule_rows(conv, cuda, {}, []))["cudnn.benchmark"].startswith("fixed-size convolutions")
    conv.cudnn_benchmark = True
    assert verdicts(doctor.rule_rows(conv, cuda, {}, []))["cudnn.benchmark"] == "ok"
    linear = doctor.Observed(matrices={"Linear0": (32, 16)}, cudnn_benchmark=False)
    assert verdicts(doctor.rule_rows(linear, cuda, {}, []))["cudnn.benchmark"] == "ok"


def test_options_a_config_replays_are_refused_as_if_given(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"recipe": "mixed_precision", "compare_precisions": True, "max_steps": 50}))
    with pytest.raises(SystemExit) as exit_:
        doctor.main(["mixed_precision", "--config", str(config)])
    assert exit_.value.code == 2 and capsys.readouterr().err.endswith(
        "error: --config sets --compare, which the doctor cannot take: replay a copy of the file without it\n")


def test_sigterm_is_one_line_and_leaves_no_temporary_folder(tmp_path):
    """Every run is in a temporary folder "removed afterwards": after a SIGTERM too (it was left behind)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    args = [sys.executable, "scripts/doctor.py", "mixed_precision", "--samples", "1024", "--width", "16",
            "--batch-size", "64", "--precision", "fp32", "--device", "cpu", "--try", "workers", "--window", "10000"]
    proc = subprocess.Popen(args, cwd=doctor.ROOT, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp.glob("doctor.*/r0-0/events.out.tfevents.*")) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the first run measured in a process of its own trains
    if not list(tmp.glob("doctor.*/r0-0/events.out.tfevents.*")):
        proc.kill()
        pytest.fail("the run never started: the signal would test nothing")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "error: interrupted; nothing measured\n")
    assert list(tmp.glob("doctor.*")) == []  # (torch may leave its compile cache there: not ours)


def stub_measurements(monkeypatch, alone: dict[str, list[float]], together: list[float] | str | None = None) -> None:
    """The doctor's live run and side-by-side runs replaced by fixed figures: --compile and --num-workers 1 apply,
    measured ``alone`` each, and ``together`` when both are measured at once."""
    live = (doctor.Observed(steps=30), {"device_used": "cpu", "precision_used": "fp32"},
            {"ms_per_step": {"data": 1.0, "forward": 9.0}}, "samples")
    monkeypatch.setattr(doctor, "live_run", lambda recipe, options, steps, work: live)
    monkeypatch.setattr(doctor, "alternatives", lambda known, options, config, wanted: (
        {"--compile": (["--compile"], False), "--num-workers 1": (["--num-workers", "1"], False)}, []))

    def side_by_side(recipe_path, variants, rounds, steps, window, work):
        figures = {"recommended": together} if "recommended" in variants else dict(alone)
        return figures | {"as given": [100.0] * 3}

    monkeypatch.setattr(doctor, "side_by_side", side_by_side)


@pytest.mark.parametrize(("alone", "together", "recommended", "said"), [
    # faster in every round, but by under 1.1x: nothing is recommended, and the line says why
    ({"--compile": [1.05, 1.04, 1.06], "--num-workers 1": [0.9, 1.0, 0.95]}, None, [],
     "recommended: as given; no alternative was faster in every round by 1.1x or more"),
    # each faster alone, slower together: the best one alone, never the combination
    ({"--compile": [1.3, 1.2, 1.25], "--num-workers 1": [1.2, 1.15, 1.3]}, [0.8, 0.85, 0.9], ["--compile"],
     "together, --compile and --num-workers 1 measured 0.85x (0.80-0.90), not clearly faster"),
    # the combination fails in its own process (out of memory, say): its message, and the best one alone
    ({"--compile": [1.3, 1.2, 1.25], "--num-workers 1": [1.2, 1.15, 1.3]}, "error: out of memory", ["--compile"],
     "together, --compile and --num-workers 1 failed (error: out of memory): the best of them alone"),
    ({"--compile": [1.3, 1.2, 1.25], "--num-workers 1": [1.2, 1.15, 1.3]}, [1.4, 1.5, 1.45],
     ["--compile", "--num-workers 1"], "recommended (1.45x (1.40-1.50) the throughput as given)"),
])
def test_what_the_doctor_recommends(alone, together, recommended, said, monkeypatch, tmp_path, capsys):
    stub_measurements(monkeypatch, alone, together)
    report = tmp_path / "doctor.json"
    assert doctor.main(["mnist_onecycle", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert said in out
    assert json.loads(report.read_text())["recommended_options"] == recommended
    command = out.splitlines()[-1]
    assert ("--compile" in command) == ("--compile" in recommended)
    assert ("--num-workers 1" in command) == ("--num-workers 1" in recommended)
    stub_measurements(monkeypatch, alone, together)
    assert doctor.main(["mnist_onecycle", "--json", str(report)]) == 0  # an earlier report is replaced
    assert json.loads(report.read_text())["recommended_options"] == recommended


@pytest.mark.parametrize(("ratios", "verdict"), [([0.80, 1.20, 1.25], "no clear gain here"),
                                               ([1.15, 1.20, 1.25], "faster per sample, but it changes the training")])
def test_an_alternative_that_changes_the_training_gets_the_same_test_of_faster(ratios, verdict, monkeypatch,
                                                                               capsys):
    """Slower in one round is not faster, whether or not the alternative changes the training (a larger batch)."""
    stub_measurements(monkeypatch, {"--num-workers 1": ratios, "--batch-size 64": ratios})
    monkeypatch.setattr(doctor, "alternatives", lambda known, options, config, wanted: (
        {"--num-workers 1": (["--num-workers", "1"], False), "--batch-size 64": (["--batch-size", "64"], True)}, []))
    assert doctor.main(["mnist_onecycle"]) == 0
    out = capsys.readouterr().out
    assert f"| --batch-size 64 | 1.20x ({min(ratios):.2f}-1.25) | {verdict}" in out


def test_the_variants_alternate_which_runs_first_and_are_paired_by_round(monkeypatch, tmp_path):
    """A B C A B C ran the run as given first in every round; its speed-ups are each round's own ratios."""
    measured = {"as given": iter([100.0, 50.0]), "bf16": iter([200.0, 150.0]), "--compile": iter([110.0, 40.0])}
    order = []

    def throughput(recipe_path, options, steps, window, run_dir):
        name = {(): "as given", ("--precision", "bf16"): "bf16", ("--compile",): "--compile"}[tuple(options)]
        order.append((name, run_dir.name))
        return next(measured[name])

    monkeypatch.setattr(doctor, "throughput", throughput)
    speedups = doctor.side_by_side(tmp_path / "recipe.py", {"as given": [], "bf16": ["--precision", "bf16"],
                                                            "--compile": ["--compile"]}, 2, 9, 3, tmp_path)
    assert order == [("as given", "r0-0"), ("bf16", "r0-1"), ("--compile", "r0-2"),
                     ("--compile", "r1-2"), ("bf16", "r1-1"), ("as given", "r1-0")]
    assert speedups == {"bf16": [2.0, 3.0], "--compile": [1.1, 0.8], "as given": [100.0, 50.0]}


def test_no_temporary_folder_is_one_line_not_a_traceback(monkeypatch, tmp_path, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # as a read-only or missing TMPDIR
    assert doctor.main(["mixed_precision", "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: No such file or directory: {tmp_path / 'gone' / 'doctor.'}") and \
        err.count("\n") == 1, err


def test_a_baseline_that_fails_in_its_own_process_is_one_line(monkeypatch, tmp_path, capsys):
    def throughput(recipe_path, options, steps, window, run_dir):
        raise RuntimeError("error: out of memory")

    monkeypatch.setattr(doctor, "throughput", throughput)
    with pytest.raises(doctor.DoctorError, match="the recipe fails as given: error: out of memory"):
        doctor.side_by_side(tmp_path / "recipe.py", {"as given": [], "--compile": ["--compile"]}, 2, 9, 3, tmp_path)


FAKE_RUN = '''
import json, sys
from pathlib import Path

run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
run_dir.mkdir(parents=True)
(run_dir / "metrics.json").write_text(json.dumps({"steps": 5, "samples_per_s": 100.0, "argv": sys.argv}))
sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
'''


def test_a_run_that_ends_before_the_measured_steps_or_is_interrupted_is_no_throughput(tmp_path):
    """Ended early (--patience, a short run), its only window would be the start-up one: not a figure to compare.
    Stopped by Ctrl-C (exit 130): the doctor stops too."""
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE_RUN)
    with pytest.raises(RuntimeError, match=r"the run ended at step 5 of the 9 measured \(--patience, or a short run"):
        doctor.throughput(fake, ["--exit", "0"], 9, 3, tmp_path / "short")
    assert doctor.throughput(fake, ["--exit", "0"], 5, 3, tmp_path / "whole") == 100.0
    with pytest.raises(KeyboardInterrupt):
        doctor.throughput(fake, ["--exit", "130"], 9, 3, tmp_path / "stopped")


def test_an_epoch_recipe_is_measured_for_all_its_steps_not_its_few_epochs(monkeypatch, tmp_path, capsys):
    """A run of 2 epochs of a few steps would end before the steps the doctor measures: it is given enough."""
    seen = []

    def throughput(recipe_path, options, steps, window, run_dir):
        seen.append(options)
        return 100.0

    monkeypatch.setattr(doctor, "throughput", throughput)
    assert doctor.main(["mixed_precision", "--epochs", "2", "--samples", "512", "--width", "8", "--batch-size", "64",
                        "--rounds", "1", "--try", "batch", "--window", "3"]) == 0
    assert seen and all(options[-2:] == ["--epochs", "1000000"] for options in seen)
    assert "--epochs 2" in capsys.readouterr().out.splitlines()[-1]  # the command recommended is the user's


def test_host_device_syncs_are_counted_over_the_steps_not_the_set_up_and_the_saves():
    """Moving a model to the GPU and saving checkpoints copy every tensor, each a sync: counted over the whole run and
    divided by its steps, they made every CUDA run read as stalling (the warnings are made here: no GPU)."""
    import warnings

    import torch

    observed = doctor.Observed()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def syncs(n: int) -> None:
        observed.warnings.extend(warnings.WarningMessage("called a synchronizing CUDA operation", UserWarning, "x", 1)
                                 for _ in range(n))

    remove = doctor.watch(observed)
    try:
        syncs(100)  # set-up: the model onto the GPU, tensor by tensor
        for step in range(1, 6):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            syncs(1)  # the step's one read-back
            if step == 2:
                syncs(40)  # an epoch's end inside the window: an evaluation and its checkpoint
        syncs(60)  # best.pt and last.pt
    finally:
        remove()
    assert observed.steps == 5 and observed.syncs_per_step == 1.0
