"""Runs survive crashes and mistakes: SIGKILL at any moment, Ctrl-C, divergence, and bad input of every kind.

What a user can rely on is in the README's "Resuming and failures" section; each promise there is a test here.
"""

import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    RECIPES,
    ROOT,
    assert_same_weights,
    load_recipe,
    load_weights,
    read_metrics,
    read_scalars,
    run_subprocess,
    smoke_args,
    synthetic_digits,
    write_table,
)

from benchmarks.mnist_files import write_mnist

# Long enough (about two seconds of training here) to be killed part-way in each of three launches,
# checkpointing at every step so that many kills land in the middle of writing one.
CRASH_RUNS = {
    "tabular_mlp": ["--csv", "{table_csv}", "--target", "label", "--epochs", "12", "--batch-size", "8",
                    "--dropout", "0.2"],
    "mnist_onecycle": ["--data-dir", "{mnist_dir}", "--epochs", "6", "--batch-size", "16", "--width", "4",
                       "--ema", "0.9"],  # the average of the weights is restored exactly too
    "tiny_transformer": ["--text", "{corpus_txt}", "--steps", "360", "--eval-every", "120", "--n-layer", "1",
                         "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
                         "--dropout", "0.1", "--eval-batches", "1", "--sample-tokens", "5", "--peak-flops", "1e11"],
}


def fill(args: list[str], request) -> list[str]:
    return [str(request.getfixturevalue(a[1:-1])) if a.startswith("{") else a for a in args]


REFERENCES: dict[str, Path] = {}


def reference_run(recipe: str, request) -> Path:
    """CRASH_RUNS[recipe] trained once without interruption (a subprocess, as the runs it is compared with): its run
    directory. Shared by the tests of this module: how often a run saves does not change its numbers."""
    if recipe not in REFERENCES:
        run_dir = request.getfixturevalue("tmp_path_factory").mktemp(f"reference-{recipe}")
        result = run_subprocess([f"recipes/{recipe}.py", *fill(CRASH_RUNS[recipe], request), "--run-dir", run_dir])
        assert result.code == 0, result.stderr
        REFERENCES[recipe] = run_dir
    return REFERENCES[recipe]


def start(recipe: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, f"recipes/{recipe}.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("recipe", sorted(CRASH_RUNS))
def test_sigkill_at_random_moments_then_resume_auto_gives_the_same_weights(recipe, request, tmp_path):
    args = [*fill(CRASH_RUNS[recipe], request), "--checkpoint-every", "1", "--resume", "auto"]
    reference = reference_run(recipe, request)

    run_dir, rng, kills = tmp_path / "killed", random.Random(recipe), 0
    checkpoint = run_dir / "checkpoints" / "last.pt"
    for _ in range(3):  # the same command for the first launch and every restart
        process = start(recipe, [*args, "--run-dir", run_dir])
        first = checkpoint.stat().st_mtime_ns if checkpoint.exists() else None
        deadline = time.time() + 60
        while process.poll() is None and time.time() < deadline:  # wait until this launch is training
            if checkpoint.exists() and checkpoint.stat().st_mtime_ns != first:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.communicate()
    assert kills >= 2, "the runs finished before they could be killed: make CRASH_RUNS longer"
    final = run_subprocess([f"recipes/{recipe}.py", *args, "--run-dir", run_dir])
    assert final.code == 0, final.stderr
    steps = read_metrics(reference)["steps"]
    # resumed after the last kill, or (when the third launch was not killed in time) nothing left to do
    assert "resumed at step" in final.stdout or f"already finished: step {steps} of {steps}" in final.stdout
    assert read_metrics(run_dir)["steps"] == steps
    assert read_metrics(run_dir)["train_loss"] == read_metrics(reference)["train_loss"]
    assert_same_weights(load_weights(reference / "checkpoints" / "last.pt"), load_weights(checkpoint))
    # best.pt too (mnist's: the EMA's weights, --ema), and the EMA's average itself, restored exactly
    ours, theirs = (torch.load(run / "checkpoints" / "best.pt", weights_only=True) for run in (run_dir, reference))
    assert ours["step"] == theirs["step"] and ours["averaged"] == theirs["averaged"] == ("--ema" in args)
    assert_same_weights(theirs["model"], ours["model"])
    ours, theirs = (torch.load(run / "checkpoints" / "last.pt", weights_only=True) for run in (run_dir, reference))
    assert ("ema" in ours) == ("ema" in theirs) == ("--ema" in args)
    if "--ema" in args:
        assert ours["ema"]["updates"] == theirs["ema"]["updates"] > 0
        assert_same_weights(theirs["ema"]["module"], ours["ema"]["module"])


def test_a_fresh_start_in_the_folder_of_a_run_killed_before_its_first_save_logs_its_own_curve_alone(
        run_inprocess, tmp_path):
    common = ["--epochs", 1, "--samples", 256, "--batch-size", 32, "--width", 16, "--depth", 2, "--run-dir", tmp_path]
    assert run_inprocess("mixed_precision", *common).code == 0  # 7 steps logged
    shutil.rmtree(tmp_path / "checkpoints")  # as a run killed before it saved leaves its folder: config and events
    (tmp_path / "metrics.json").unlink()
    result = run_inprocess("mixed_precision", *common, "--max-steps", 3, "--resume", "auto")
    assert result.code == 0 and "resumed" not in result.stdout, result.stderr
    assert [step for step, _ in read_scalars(tmp_path)["train/loss"]] == [1, 2, 3]  # not 1, 2, 3, 4, 5, 6, 7


def test_a_save_torn_by_a_crash_is_ignored(run_inprocess, table_csv, tmp_path):
    """A kill in the middle of a save leaves a temporary file beside last.pt: resume uses last.pt, and the
    next save clears the leftover."""
    common = ["--csv", table_csv, "--target", "label", "--epochs", 2, "--batch-size", 32]
    assert run_inprocess("tabular_mlp", *common, "--run-dir", tmp_path / "full").code == 0
    assert run_inprocess("tabular_mlp", *common, "--max-steps", 5, "--run-dir", tmp_path / "cut").code == 0
    torn = tmp_path / "cut" / "checkpoints" / ".last.pt.99999.tmp"
    torn.write_bytes((tmp_path / "cut" / "checkpoints" / "last.pt").read_bytes()[:1000])
    assert run_inprocess("tabular_mlp", *common, "--resume", "auto", "--run-dir", tmp_path / "cut").code == 0
    assert not torn.exists()
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))


@pytest.mark.parametrize(("recipe", "signum"), [("mnist_onecycle", signal.SIGINT), ("tiny_transformer", signal.SIGINT),
                                                ("mnist_onecycle", signal.SIGTERM)])
def test_ctrl_c_or_sigterm_saves_prints_how_to_resume_and_exits(recipe, signum, request, tmp_path):
    """Ctrl-C (SIGINT), or SIGTERM as a scheduler or spot instance sends it before killing a job: a checkpoint
    at the step the run had reached, the command that resumes, and the shell's exit status (128 + signal)."""
    args = [*fill(CRASH_RUNS[recipe], request), "--checkpoint-every", "5"]
    reference = reference_run(recipe, request)

    run_dir = tmp_path / "interrupted"
    process = start(recipe, [*args, "--run-dir", run_dir])
    deadline = time.time() + 60
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stdout + stderr
    lines = stdout.strip().splitlines()
    assert len(lines) >= 2, stdout + stderr
    assert lines[-2].startswith("interrupted at step ") and lines[-2].endswith("; checkpoint saved. Resume with:")
    stopped_at = int(lines[-2].split("interrupted at step ")[1].split(";")[0])
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["step"] == stopped_at  # saved at the step it stopped, not at the last --checkpoint-every

    command = shlex.split(lines[-1])
    assert command[:2] == ["python", f"recipes/{recipe}.py"] and command[-4:] == ["--resume", "auto", "--run-dir",
                                                                                 str(run_dir)]
    resumed = run_subprocess([sys.executable, *command[1:]])
    assert resumed.code == 0, resumed.stderr
    assert f"resumed at step {stopped_at}" in resumed.stdout
    assert_same_weights(load_weights(reference / "checkpoints" / "last.pt"),
                        load_weights(run_dir / "checkpoints" / "last.pt"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_sigterm_after_the_training_loop_exits_143_and_the_resume_finishes(recipe, run_inprocess, request, tmp_path,
                                                                          monkeypatch):
    """A SIGTERM in the test evaluation or as the run finishes printed "saving a checkpoint after this step",
    saved nothing more and exited 0, as if done. Now: 143 at once, the command that resumes, which finishes, without
    evaluating the cut's step again (which tabular_mlp's --keep-best and --patience counted as a new evaluation)."""
    from common.runlog import RunLog

    finish = RunLog.finish

    def sigterm_then_finish(log, *args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # as a scheduler's, once the loop is over
        return finish(log, *args, **kwargs)

    args = [*smoke_args(recipe, request), "--max-steps", 3, "--run-dir", tmp_path / "run"]  # a cut mid-epoch
    with monkeypatch.context() as patched:
        patched.setattr(RunLog, "finish", sigterm_then_finish)
        stopped = run_inprocess(recipe, *args)
    assert stopped.code == 143, stopped.stderr
    lines = stopped.stdout.strip().splitlines()
    assert lines[-2].startswith("interrupted at step ") and lines[-2].endswith("; checkpoint saved. Resume with:")
    assert "saving a checkpoint after this step" not in stopped.stdout
    assert lines[-1].endswith(f"--resume auto --run-dir {tmp_path / 'run'}")
    assert not (tmp_path / "run" / "metrics.json").exists()
    step = int(lines[-2].split("interrupted at step ")[1].split(";")[0])
    resumed = run_inprocess(recipe, *args, "--resume", "auto")
    assert resumed.code == 0, resumed.stderr
    assert read_metrics(tmp_path / "run")["steps"] == step == 3 and resumed.done_line.startswith("done: ")
    assert "val_loss " not in resumed.stdout, resumed.stdout  # an evaluation's line (the done line has val_loss=)


@pytest.mark.parametrize("recipe", ["tabular_mlp", "tiny_transformer"])
def test_a_checkpoint_from_before_evaluated_at_was_kept_is_not_evaluated_again(recipe, run_inprocess, request,
                                                                                tmp_path, monkeypatch):
    """Killed after a cut's last save: a checkpoint without the step of its last evaluation is taken as evaluated,
    as it always was (evaluated again, tabular_mlp's --keep-best held the step twice)."""
    from common.runlog import RunLog

    args = [*smoke_args(recipe, request), "--max-steps", 3, "--run-dir", tmp_path / "run"]
    with monkeypatch.context() as patched:
        patched.setattr(RunLog, "finish", lambda *args, **kwargs: signal.raise_signal(signal.SIGTERM))
        assert run_inprocess(recipe, *args).code == 143
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["log"].pop("evaluated_at") == 3
    torch.save(checkpoint, path)
    resumed = run_inprocess(recipe, *args, "--resume", "auto")
    assert resumed.code == 0 and "val_loss " not in resumed.stdout, resumed.stdout
    assert read_metrics(tmp_path / "run")["steps"] == 3


def test_divergence_stops_with_the_step_and_keeps_the_last_good_checkpoint(run_inprocess, table_csv, tmp_path):
    result = run_inprocess("tabular_mlp", "--csv", table_csv, "--target", "label", "--optimizer", "sgd",
                           "--lr", 1e30, "--checkpoint-every", 1, "--batch-size", 16, "--run-dir", tmp_path)
    assert result.code == 1
    assert result.stderr.count("\n") == 1
    assert "training diverged: the loss is nan at step 2" in result.stderr
    assert f"the last good checkpoint is {tmp_path / 'checkpoints' / 'last.pt'}" in result.stderr
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert state["step"] == 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_fp16_overflows_are_counted_not_fatal(run_inprocess, tmp_path):
    # an overflowing first step: the default initial scale times this model's large first losses
    result = run_inprocess("mixed_precision", "--precision", "fp16", "--samples", 256, "--batch-size", 64,
                           "--width", 32, "--depth", 2, "--lr", 1.0, "--epochs", 2, "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    metrics = read_metrics(tmp_path)
    assert 1 <= metrics["skipped_steps"] < metrics["steps"] == 8 and math.isfinite(metrics["train_loss"])
    assert metrics["scale"] == 65536 / 2 ** metrics["skipped_steps"]  # halved once per skipped step


# ------------------------------------------------------------------------------------------------------
# The bad-input matrix: every recipe, every kind of mistake

OTHER_ENUM = {"tabular_mlp": ["--task", "clustering"], "tiny_transformer": ["--attention", "flash"],
              "compiled_model": ["--mode", "fastest"], "ddp_mlp": ["--backend", "mpi"],
              "mixed_precision": ["--precision", "int8"], "mnist_onecycle": ["--device", "gpu"]}
LENGTH_OPTION = {"tiny_transformer": "--steps"}
NEIGHBOUR = {name: RECIPES[(i + 1) % len(RECIPES)] for i, name in enumerate(RECIPES)}

USAGE_CASES = {  # exit 2: (extra arguments, text the error line must hold)
    "precision": (["--precision", "fp8"], "'--precision'"),
    "device": (["--device", "tpu"], "'--device'"),
    "other enum": (None, "Invalid value for"),
    "zero length": (None, "x>=1"),
    "negative length": (None, "x>=1"),
    "zero batch size": (["--batch-size", "0"], "'--batch-size'"),
    "negative batch size": (["--batch-size", "-4"], "'--batch-size'"),
    "zero lr": (["--lr", "0"], "must be a finite number > 0"),
    "negative lr": (["--lr", "-0.1"], "must be a finite number > 0"),
    "infinite lr": (["--lr", "inf"], "must be a finite number > 0"),
}
RUNTIME_CASES = [  # exit 1
    "missing checkpoint", "random bytes", "truncated checkpoint", "other recipe's checkpoint", "pickle payload",
    "older version's checkpoint", "another run's checkpoint", "damaged step", "damaged epoch length",
    "damaged optimizer", "damaged scheduler", "cuda absent", "unwritable run dir", "resumed with another schedule",
]
INPUT_CASES = {  # recipe inputs, exit 1
    "tabular_mlp": ["missing csv", "empty csv", "header-only csv", "no such target", "one-class target",
                    "resumed with another optimizer", "resumed with adam instead of adamw",
                    "resumed with another batch size"],
    "tiny_transformer": ["non-utf8 text", "too-short text", "resumed with another batch size",
                         "resumed with another gradient accumulation", "text is a directory"],
    "mnist_onecycle": ["corrupt idx", "resumed with another batch size", "resumed on other data"],
    "ddp_mlp": ["corrupt idx", "nccl without cuda", "resumed with another batch size"],
    "mixed_precision": ["resumed with another batch size"],
    "compiled_model": ["resumed with another batch size"],
}
CASES = ([(r, c) for r in RECIPES for c in USAGE_CASES] + [(r, c) for r in RECIPES for c in RUNTIME_CASES]
         + [(r, c) for r, cases in INPUT_CASES.items() for c in cases])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    """recipe -> a run directory that holds a real checkpoint of it (trained once per module)."""
    from conftest import load_recipe

    from common.cli import run_recipe

    runs = {}

    def get(recipe: str) -> Path:
        if recipe not in runs:
            run_dir = tmp_path_factory.mktemp(f"trained_{recipe}")
            try:
                run_recipe(load_recipe(recipe).main, [*smoke_args(recipe, request), "--run-dir", str(run_dir)])
            except SystemExit as exit_:
                assert exit_.code in (0, None)
            runs[recipe] = run_dir
        return runs[recipe]

    return get


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def bad_arguments(recipe: str, case: str, request, tmp_path: Path, trained) -> tuple[list, int, str]:
    """The arguments that make ``case`` happen, the exit code expected, and text the error must hold."""
    length = LENGTH_OPTION.get(recipe, "--epochs")
    if case in USAGE_CASES:
        extra, text = USAGE_CASES[case]
        if case == "other enum":
            extra = OTHER_ENUM[recipe]
            text = f"'{extra[0]}'"
        elif case.endswith("length"):
            extra, text = [length, "0" if case.startswith("zero") else "-3"], f"'{length}'"
        return extra, 2, text
    resume = ["--resume", "auto"]
    fresh = ["--run-dir", tmp_path / "fresh"]  # bad data for a new run: the checkpoint's options are not in the way
    checkpoint = tmp_path / "bad.pt"
    good = trained(recipe) / "checkpoints" / "last.pt"
    if case == "missing checkpoint":
        return ["--resume", tmp_path / "nope.pt"], 1, "nope.pt does not exist"
    if case == "random bytes":
        checkpoint.write_bytes(random.Random(0).randbytes(3000))
        return ["--resume", checkpoint], 1, "corrupt, truncated, or not a PyTorch checkpoint"
    if case == "truncated checkpoint":
        checkpoint.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        return ["--resume", checkpoint], 1, "corrupt, truncated, or not a PyTorch checkpoint"
    if case == "other recipe's checkpoint":
        return ["--resume", trained(NEIGHBOUR[recipe]) / "checkpoints" / "last.pt"], 1, \
            f"written by recipe '{NEIGHBOUR[recipe]}', not '{recipe}'"
    if case == "another run's checkpoint":  # of the same options: going on from it here would overwrite last.pt
        return ["--resume", good], 1, "already holds checkpoints, and --resume"
    if case == "pickle payload":
        state = torch.load(good, weights_only=True)
        state["extra"] = Payload(tmp_path / "payload-ran")
        torch.save(state, checkpoint)
        return ["--resume", checkpoint], 1, "refuses to run"
    if case == "older version's checkpoint":  # as written before the log's state was kept in it
        state = torch.load(good, weights_only=True)
        del state["log"]
        state["step"] = 1  # not at its end: a finished checkpoint is refused before it is restored
        torch.save(state, checkpoint)
        # in a new run directory: going on from it in the existing one is refused before it is restored
        return ["--resume", checkpoint, *fresh], 1, "lacks part of the training state, or holds it in another form " \
            "(KeyError"
    if case in ("damaged step", "damaged epoch length", "damaged optimizer"):  # loadable, and yet a traceback
        state = torch.load(good, weights_only=True)
        state |= {"damaged step": {"step": "5"}, "damaged epoch length": {"steps_per_epoch": "14"},
                  "damaged optimizer": {"optimizer": "x", "step": 1}}[case]
        torch.save(state, checkpoint)
        return ["--resume", checkpoint, *fresh], 1, ("does not fit this run's optimizer" if case == "damaged optimizer"
                                                     else "is damaged: its config is not a dict, or its step or epoch "
                                                     "length not a count")
    if case == "damaged scheduler":  # a dict, but not of this schedule: it would resume at the wrong rates
        state = torch.load(good, weights_only=True)
        state |= {"scheduler": {"lr": 1}, "step": 1}
        torch.save(state, checkpoint)
        return ["--resume", checkpoint, *fresh], 1, "lacks part of the training state, or holds it in another form " \
            "(KeyError: 'scheduler "
    if case == "cuda absent":
        return [*resume, "--device", "cuda"], 1, "CUDA is not available"
    if case == "resumed with another schedule":  # the saved schedule would silently override the new length
        return [*resume, length, "500"], 1, f"was started with other options ({length} "
    if case == "resumed with another optimizer":
        return [*resume, "--optimizer", "sgd"], 1, "--optimizer adamw there, sgd here"
    if case == "resumed with adam instead of adamw":  # the same settings' names; only their values differ
        return [*resume, "--optimizer", "adam"], 1, "(--optimizer adamw there, adam here)"
    if case == "resumed with another batch size":  # other batches: the resume point would be off
        # the transformer compares the global batch (per process x processes x accumulation): 8 x 1 x 1 saved
        text = "(--global-batch 8 there, 16 here)" if recipe == "tiny_transformer" else "(--batch-size "
        return [*resume, "--batch-size", "16"], 1, text
    if case == "resumed with another gradient accumulation":  # the stream's position would point at other data
        return [*resume, "--grad-accum", "3"], 1, "(--global-batch 8 there, 24 here)"
    if case == "resumed on other data":  # the same options, but an epoch of other length
        other = tmp_path / "other-mnist"
        write_mnist(other, synthetic_digits(256, 0), synthetic_digits(32, 1))
        return [*resume, "--data-dir", other], 1, "steps per epoch, this run"
    if case == "text is a directory":
        return [*fresh, "--text", tmp_path], 1, f"--text {tmp_path}: is a directory"
    if case == "one-class target":
        (tmp_path / "one.csv").write_text("x,label\n" + "".join(f"{i},yes\n" for i in range(40)))
        text = "target column 'label' holds 1 distinct value(s)"
        return [*fresh, "--csv", tmp_path / "one.csv"], 1, text
    if case == "nccl without cuda":
        return [*resume, "--backend", "nccl", "--device", "cpu"], 1, "--backend nccl runs on CUDA devices only"
    if case == "unwritable run dir":
        (tmp_path / "a-file").write_text("not a folder")
        return ["--run-dir", tmp_path / "a-file" / "run"], 1, "cannot write to --run-dir"
    if case == "missing csv":
        return [*fresh, "--csv", tmp_path / "nope.csv"], 1, "nope.csv: no such file"
    if case == "empty csv":
        (tmp_path / "e.csv").write_text("")
        return [*fresh, "--csv", tmp_path / "e.csv"], 1, "is empty"
    if case == "header-only csv":
        (tmp_path / "h.csv").write_text("age,income,colour,city,label\n")
        return [*fresh, "--csv", tmp_path / "h.csv"], 1, "has a header but no data rows"
    if case == "no such target":
        return [*fresh, "--target", "price"], 1, "target column 'price' is not in the table"
    if case == "non-utf8 text":
        (tmp_path / "latin1.txt").write_bytes("caf\u00e9 na\u00efve ".encode("latin-1") * 50)
        return [*fresh, "--text", tmp_path / "latin1.txt"], 1, "is not UTF-8 text"
    if case == "too-short text":
        (tmp_path / "short.txt").write_text("tiny")
        return [*fresh, "--text", tmp_path / "short.txt"], 1, "too short for --block-size"
    if case == "corrupt idx":
        corrupt = tmp_path / "mnist"
        write_mnist(corrupt, synthetic_digits(64, 0), synthetic_digits(32, 1))
        images = corrupt / "MNIST" / "raw" / "train-images-idx3-ubyte"
        images.write_bytes(images.read_bytes()[:5000])  # truncated: fewer pixels than the header promises
        return [*resume, "--data-dir", corrupt], 1, "MNIST files in"
    raise AssertionError(case)


@pytest.mark.parametrize(("recipe", "case"), CASES)
def test_bad_input_is_one_clear_line_and_loses_nothing(recipe, case, run_inprocess, request, trained, tmp_path):
    run_dir = tmp_path / "existing-run"
    # an existing run directory with a real checkpoint, which the failed command must leave untouched
    source = trained(recipe)
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in ("last.pt", "config.json"):
        sub = "checkpoints/" if name.endswith(".pt") else ""
        (run_dir / f"{sub}{name}").write_bytes((source / f"{sub}{name}").read_bytes())
    before = snapshot(run_dir)

    extra, code, text = bad_arguments(recipe, case, request, tmp_path, trained)
    args = [*smoke_args(recipe, request), "--run-dir", run_dir, *extra]  # later options win
    result = run_inprocess(recipe, *args)

    output = result.stdout + result.stderr
    assert result.code == code, output
    assert "Traceback" not in output
    errors = [line for line in result.stderr.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1 and text in errors[0], result.stderr
    if code == 1:
        assert result.stderr.strip() == errors[0]  # the whole of stderr is that one line
    assert snapshot(run_dir) == before  # not a file added, changed or removed
    assert not (tmp_path / "fresh").exists()  # a run that fails before its first checkpoint leaves no folder
    assert not (tmp_path / "payload-ran").exists()


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}


# cut by --max-steps part-way through an epoch; run to the end of its last epoch; run to its last step
@pytest.mark.parametrize("recipe", ["mixed_precision", "compiled_model", "tabular_mlp", "tiny_transformer"])
def test_relaunching_a_finished_run_trains_nothing_and_keeps_its_results(recipe, run_inprocess, request, tmp_path):
    args = [*smoke_args(recipe, request), "--run-dir", tmp_path, "--resume", "auto"]
    assert run_inprocess(recipe, *args).code == 0
    first = read_metrics(tmp_path)
    steps = first["steps"]
    before = snapshot(tmp_path)
    result = run_inprocess(recipe, *args)  # "the same command on every restart", once more after the end
    assert result.code == 0, result.stderr
    assert f"already finished: step {steps} of {steps}; nothing trained" in result.stdout
    cut_short = recipe in ("mixed_precision", "compiled_model")  # by --max-steps (smoke_args): how to go on
    why = "a larger --max-steps goes on with it" if cut_short else "its schedule is done"
    assert result.stdout.rstrip().endswith(f"left as it was ({why})")
    assert snapshot(tmp_path) == before  # no extra step, metrics.json and TensorBoard files as they were

    (tmp_path / "metrics.json").unlink()  # as if stopped between the last checkpoint and the end of the run
    result = run_inprocess(recipe, *args)
    assert result.code == 0, result.stderr
    assert "already finished" not in result.stdout
    metrics = read_metrics(tmp_path)
    assert metrics["steps"] == steps and "val_loss" in metrics  # the last evaluation's figures, and finished
    # this launch trained nothing: the run's own training loss and throughput (not none), and its wall time the
    # earlier launch's up to its last checkpoint, and more (it was ~1 ms, this launch's own)
    assert metrics["train_loss"] == first["train_loss"]
    unit = "tokens_per_s" if recipe == "tiny_transformer" else "samples_per_s"
    assert metrics[unit] == first[unit] > 0
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["log"]["wall_s"]
    assert 0 < saved <= first["wall_s"] and metrics["wall_s"] > saved


def test_a_full_disk_under_tensorboard_is_one_line_and_the_run_resumes(tmp_path):
    """TensorBoard's writer thread meets the full disk (a file-size limit here: the event file outgrows this small
    model's checkpoints) and the main thread at its next write: one line, not the thread's traceback and then the
    main thread's; the checkpoints are whole, and the run resumes to its end."""
    run_dir = tmp_path / "run"
    args = ["recipes/mixed_precision.py", "--samples", 4096, "--width", 1, "--depth", 1, "--epochs", 20,
            "--batch-size", 128, "--device", "cpu", "--log-every", 1, "--run-dir", run_dir]
    result = run_subprocess(args, max_file_bytes=48 * 1024)
    assert result.code == 1 and result.stderr == "error: File too large (any checkpoint written is intact)\n", \
        result.stderr
    assert 0 < torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] < 640
    resumed = run_subprocess([*args, "--resume", "auto"])
    assert resumed.code == 0, resumed.stderr
    assert read_metrics(run_dir)["steps"] == 640


def stop_after_step(last: int, monkeypatch) -> None:
    """A SIGTERM once step ``last`` is logged: the recipe's StopRequest saves that step and exits 143."""
    from common.runlog import RunLog

    train = RunLog.train

    def stopped(self, step, stats, **kwargs):
        train(self, step, stats, **kwargs)
        if step == last:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(RunLog, "train", stopped)


# each cut by --max-steps 3 part-way through its first epoch
@pytest.mark.parametrize("recipe", ["mixed_precision", "compiled_model", "mnist_onecycle", "ddp_mlp", "tabular_mlp"])
def test_a_stop_at_the_last_step_of_a_cut_run_evaluates_first_and_resumes_to_the_same_end(recipe, run_inprocess,
                                                                                          request, tmp_path,
                                                                                          monkeypatch):
    """The cut's evaluation comes before its checkpoint, as an epoch's does: stopped there, the run had saved the
    step unevaluated, and its resume finished without scores or best.pt (or, with a test set, failed for want of
    best.pt)."""
    args = [*smoke_args(recipe, request), "--max-steps", 3]
    assert run_inprocess(recipe, *args, "--run-dir", tmp_path / "whole").code == 0
    stop_after_step(3, monkeypatch)  # the last one
    run_dir = tmp_path / "stopped"
    assert run_inprocess(recipe, *args, "--run-dir", run_dir).code == 143
    assert torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["step"] == 3
    monkeypatch.undo()
    resumed = run_inprocess(recipe, *args, "--run-dir", run_dir, "--resume", "auto")
    assert resumed.code == 0, resumed.stderr
    whole, metrics = read_metrics(tmp_path / "whole"), read_metrics(run_dir)
    assert metrics["steps"] == 3 and metrics["best_step"] == 3
    assert {k: v for k, v in metrics.items() if k.startswith(("val_", "test_", "best_"))} == \
        {k: v for k, v in whole.items() if k.startswith(("val_", "test_", "best_"))}
    for name in ("last.pt", "best.pt"):
        assert_same_weights(torch.load(run_dir / "checkpoints" / name, weights_only=True)["model"],
                            torch.load(tmp_path / "whole" / "checkpoints" / name, weights_only=True)["model"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_stop_between_evaluations_resumed_with_max_steps_at_its_step_evaluates_there(recipe, run_inprocess,
                                                                                      request, tmp_path, monkeypatch):
    """Stopped at step 2 mid-epoch (the transformer: between evaluations), saved unevaluated, and resumed with
    --max-steps 2: the resume trained nothing and evaluated nothing, so it finished with no scores and no best.pt (or
    failed for want of it, with a test set)."""
    args = smoke_args(recipe, request)
    assert run_inprocess(recipe, *args, "--max-steps", 2, "--run-dir", tmp_path / "whole").code == 0
    stop_after_step(2, monkeypatch)
    run_dir = tmp_path / "stopped"
    assert run_inprocess(recipe, *args, "--run-dir", run_dir).code == 143
    assert not (run_dir / "checkpoints" / "best.pt").exists()  # saved before any evaluation
    monkeypatch.undo()
    resumed = run_inprocess(recipe, *args, "--run-dir", run_dir, "--resume", "auto", "--max-steps", 2)
    assert resumed.code == 0, resumed.stderr
    whole, metrics = read_metrics(tmp_path / "whole"), read_metrics(run_dir)
    assert metrics["steps"] == 2 and metrics["best_step"] == 2
    assert {k: v for k, v in metrics.items() if k.startswith(("val_", "test_", "best_"))} == \
        {k: v for k, v in whole.items() if k.startswith(("val_", "test_", "best_"))}
    assert_same_weights(torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["model"],
                        torch.load(tmp_path / "whole" / "checkpoints" / "best.pt", weights_only=True)["model"])


class Killed(BaseException):
    """The process dying between two writes: no handler catches it, only the clean-ups run (as they do not on
    SIGKILL, where the kernel drops the folder's lock instead)."""


# the variants of writing the best weights: the EMA's (mnist), best-stepN.pt beside best.pt (tabular), DDP's rank 0
BEST_VARIANTS = {"mnist_onecycle": ["--ema", "0.9"], "tabular_mlp": ["--keep-best", "2"]}


# each killed at its last evaluation; tabular_mlp also at the first of two, whose resume trains on
@pytest.mark.parametrize(("recipe", "epochs"), [(recipe, None) for recipe in RECIPES] + [("tabular_mlp", 2)])
def test_a_kill_between_last_pt_and_best_pt_is_made_good_by_the_resume(recipe, epochs, run_inprocess, request,
                                                                       tmp_path, monkeypatch):
    """last.pt comes first, recording the step as the best, and a resume at that step writes best.pt again. (best.pt
    came first: killed before last.pt, the resume replayed from an older last.pt, and where the replay was not exact
    best.pt held weights of a step that the run's record did not.)"""
    import common.checkpoint

    args = [*smoke_args(recipe, request), *BEST_VARIANTS.get(recipe, []), *(["--epochs", epochs] if epochs else [])]
    assert run_inprocess(recipe, *args, "--run-dir", tmp_path / "whole").code == 0
    save, written = common.checkpoint.save_checkpoint, []

    def killed_before_best(path, state):
        if path.name.startswith("best"):
            raise Killed
        save(path, state)
        written.append((path.name, state["step"]))

    monkeypatch.setattr(common.checkpoint, "save_checkpoint", killed_before_best)
    run_dir = tmp_path / "killed"
    with pytest.raises(Killed):
        run_inprocess(recipe, *args, "--run-dir", run_dir)
    end = read_metrics(tmp_path / "whole")["steps"]
    killed_at = end // (epochs or 1)  # the first evaluation's step: the first best.pt comes at once
    assert end % (epochs or 1) == 0  # (epochs of equal length)
    assert written == [("last.pt", killed_at)] and not list(run_dir.glob("checkpoints/best*.pt"))
    monkeypatch.undo()
    resumed = run_inprocess(recipe, *args, "--run-dir", run_dir, "--resume", "auto")
    assert resumed.code == 0, resumed.stderr
    scores = [{k: v for k, v in read_metrics(folder).items() if k.startswith(("val_", "test_", "best_"))}
              for folder in (run_dir, tmp_path / "whole")]
    assert scores[0] == scores[1]
    names = [sorted(path.name for path in (folder / "checkpoints").glob("best*.pt")) for folder in (run_dir,
                                                                                                   tmp_path / "whole")]
    kept = [f"best-step{step}.pt" for step in range(killed_at, end + 1, killed_at)] if recipe == "tabular_mlp" else []
    assert names[0] == names[1] == sorted([*kept, "best.pt"])  # tabular: each evaluation kept (--keep-best 2)
    for name in names[0]:
        ours, theirs = (torch.load(folder / "checkpoints" / name, weights_only=True)
                        for folder in (run_dir, tmp_path / "whole"))
        averaged = recipe == "mnist_onecycle" and name == "best.pt"  # the EMA's weights
        assert (ours["step"], ours["averaged"]) == (theirs["step"], theirs["averaged"])
        assert ours["averaged"] == averaged and ours["step"] == (scores[0]["best_step"] if name == "best.pt" else
                                                                 int(name[len("best-step"):-3]))
        assert_same_weights(ours["model"], theirs["model"])


def test_a_kill_before_a_kept_checkpoint_not_the_best_is_made_good_by_the_resume(run_inprocess, table_csv, tmp_path,
                                                                                monkeypatch):
    """--keep-best 2, scores 0.9 then 0.5: killed after step 14's last.pt, before its best-step14.pt (kept, though
    not the best), the resume writes the file that its record keeps."""
    import common.checkpoint

    scores = iter([0.9, 0.5])
    monkeypatch.setattr(load_recipe("tabular_mlp"), "evaluate",
                        lambda *args, **kwargs: {"loss": 1.0, "acc": next(scores)})
    save = common.checkpoint.save_checkpoint

    def killed_before_step_14s_file(path, state):
        if path.name == "best-step14.pt":
            raise Killed
        save(path, state)

    monkeypatch.setattr(common.checkpoint, "save_checkpoint", killed_before_step_14s_file)
    run_dir = tmp_path / "run"
    args = ["--csv", table_csv, "--target", "label", "--epochs", 2, "--batch-size", 32, "--keep-best", 2, "--run-dir",
            run_dir, "--resume", "auto"]
    with pytest.raises(Killed):
        run_inprocess("tabular_mlp", *args)
    monkeypatch.setattr(common.checkpoint, "save_checkpoint", save)
    assert run_inprocess("tabular_mlp", *args).code == 0
    assert sorted(path.name for path in (run_dir / "checkpoints").glob("best*.pt")) == ["best-step14.pt",
                                                                                          "best-step7.pt", "best.pt"]
    files = {name: torch.load(run_dir / "checkpoints" / name, weights_only=True)["step"] for name in
             ("best-step14.pt", "best.pt", "last.pt")}
    assert files == {"best-step14.pt": 14, "best.pt": 7, "last.pt": 14}
    assert_same_weights(*(load_weights(run_dir / "checkpoints" / name) for name in ("best-step14.pt", "last.pt")))
    assert [kept[1] for kept in torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["kept"]["kept"]] \
        == [7, 14]


@pytest.mark.parametrize(("every", "expected"), [
    (7, [7, 14, 15, 21, 28, 30]),  # every 7 steps, and at the end of each epoch
    (5, [5, 10, 15, 20, 25, 30]),  # an epoch's last step once, after its evaluation: a resume never skips one
])
def test_checkpoint_every_writes_at_those_steps(run_inprocess, tmp_path, monkeypatch, every, expected):
    import common.checkpoint
    from common.checkpoint import save_checkpoint

    saved = []  # (file name, step) of every checkpoint the run writes, in order

    def recording_save(path, state):
        saved.append((path.name, state["step"]))
        save_checkpoint(path, state)

    monkeypatch.setattr(common.checkpoint, "save_checkpoint", recording_save)
    path = write_table(tmp_path / "t.csv")  # 240 training rows: 15 steps per epoch at batch 16
    result = run_inprocess("tabular_mlp", "--csv", path, "--target", "label", "--batch-size", 16,
                           "--checkpoint-every", every, "--epochs", 2, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert [step for name, step in saved if name == "last.pt"] == expected
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 30


@pytest.mark.parametrize("recipe", ["mnist_onecycle", "tabular_mlp", "tiny_transformer"])
@pytest.mark.parametrize("value", ["inf", "-0.5", "1e40"])  # 1e40: finite, but past float32 (a traceback in SGD)
def test_weight_decay_must_be_finite_and_not_negative(run_inprocess, recipe, value):
    result = run_inprocess(recipe, "--weight-decay", value)
    assert result.code == 2
    assert "'--weight-decay'" in result.stderr and "must be a finite number >= 0" in result.stderr
    lr = run_inprocess(recipe, "--lr", "3e38")  # Adam's step, lr / (1 - beta1), overflowed float32 from 3.4e37
    assert lr.code == 2 and "must be a finite number > 0 (at most 1e30), got 3e+38" in lr.stderr


@pytest.mark.parametrize("recipe", ["mnist_onecycle", "ddp_mlp"])
def test_relaunching_a_finished_run_does_not_score_the_test_set_again(recipe, run_inprocess, request, tmp_path,
                                                                      monkeypatch):
    from conftest import load_recipe

    args = [*smoke_args(recipe, request), "--run-dir", tmp_path, "--resume", "auto"]
    assert run_inprocess(recipe, *args).code == 0
    before = snapshot(tmp_path)
    assert "test_acc" in read_metrics(tmp_path)
    monkeypatch.setattr(load_recipe(recipe), "evaluate", lambda *a, **k: pytest.fail("evaluated after the end"))
    result = run_inprocess(recipe, *args)
    assert result.code == 0, result.stderr
    assert "already finished" in result.stdout and snapshot(tmp_path) == before


@pytest.mark.parametrize("recipe", ["tabular_mlp", "mnist_onecycle"])
def test_a_scheduler_state_without_a_private_field_of_this_torch_resumes(recipe, run_inprocess, request, trained,
                                                                         tmp_path):
    """A torch release adds bookkeeping fields (``_is_initial``) that an older one's checkpoint lacks: only the
    schedule's own settings (its public names) must be there."""
    state = torch.load(trained(recipe) / "checkpoints" / "last.pt", weights_only=True)
    assert "_is_initial" in state["scheduler"]
    del state["scheduler"]["_is_initial"]
    state["step"] = 1  # not at its end: a finished checkpoint is refused before it is restored
    torch.save(state, tmp_path / "older.pt")
    result = run_inprocess(recipe, *smoke_args(recipe, request), "--resume", tmp_path / "older.pt", "--run-dir",
                           tmp_path / "run")
    assert result.code == 0, result.stderr
    finished = json.loads((trained(recipe) / "metrics.json").read_text())["steps"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == finished
