"""The run directory: one run at a time in it, no empty folder left by a failed run, and a finished run known
before any data is loaded."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import typer
from conftest import ROOT, read_metrics, write_table

from common import rundir
from common.checkpoint import save_checkpoint
from common.cli import RecipeError
from common.loop import batches_left, epochs_left
from common.rundir import RunFolder, open_run_dir

SLOW = ["--epochs", "200", "--samples", "4096", "--batch-size", "64", "--width", "64", "--depth", "2"]


def start_slow_run(run_dir) -> subprocess.Popen:
    """mixed_precision for far longer than a test lasts; returns once it trains (its config.json is written)."""
    process = subprocess.Popen([sys.executable, "recipes/mixed_precision.py", *SLOW, "--run-dir", run_dir, "--resume",
                                "auto", "--checkpoint-every", "5"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.time() < deadline:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    return process


def test_a_second_launch_on_a_run_directory_in_use_is_refused_naming_the_process(run_inprocess, tmp_path):
    run_dir = tmp_path / "run"
    first = start_slow_run(run_dir)
    try:
        second = run_inprocess("mixed_precision", *SLOW, "--run-dir", run_dir, "--resume", "auto")
        assert second.code == 1
        assert second.stderr.strip() == (f"error: {run_dir} is in use by another run (process {first.pid}: "
                                         f"{sys.executable} recipes/mixed_precision.py {' '.join(SLOW)} --run-dir "
                                         f"{run_dir} --resume auto --checkpoint-every 5); wait for it to end, or "
                                         "choose another --run-dir")
        assert first.poll() is None  # the first run goes on, untouched
    finally:
        first.kill()
        first.wait()


def test_what_a_run_directory_holds_is_read_once_no_other_run_can_write_there(monkeypatch, tmp_path):
    """A run that was still saving as this one started (a scheduler's relaunch while the old job saves on SIGTERM)
    must be seen: read before the lock, its checkpoints would be started afresh over and overwritten."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hold = rundir.hold

    def hold_as_the_other_run_saves(folder: Path) -> int | None:  # its last save lands, then it ends
        save_checkpoint(folder / "checkpoints" / "last.pt", {"model": {}, "recipe": "mixed_precision", "config": {}})
        return hold(folder)

    monkeypatch.setattr(rundir, "hold", hold_as_the_other_run_saves)
    with pytest.raises(RecipeError, match="already holds checkpoints; continue it with --resume auto"):
        open_run_dir("mixed_precision", run_dir, None)
    assert open_run_dir("mixed_precision", run_dir, "auto").resume_from == run_dir / "checkpoints" / "last.pt"


def test_a_file_system_without_flock_runs_unlocked(run_inprocess, tmp_path, monkeypatch):
    """ENOLCK (NFS without lockd, some FUSE mounts): every run was refused, "No locks available" naming no path, and
    left its new folder empty behind it."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    result = run_inprocess("mixed_precision", *MP_TINY, "--run-dir", tmp_path / "run")
    assert result.code == 0 and result.stderr == "", result.stderr
    assert read_metrics(tmp_path / "run")["steps"] > 0 and (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_the_lock_of_a_killed_run_does_not_block_its_restart(run_inprocess, tmp_path):
    run_dir = tmp_path / "run"
    first = start_slow_run(run_dir)
    first.send_signal(signal.SIGKILL)  # no clean-up at all: the kernel drops the lock with the process
    first.wait()
    step = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]  # 5, or later if it ran on
    resumed = run_inprocess("mixed_precision", *SLOW, "--max-steps", step + 2, "--run-dir", run_dir, "--resume",
                            "auto")  # (a fixed --max-steps 12 is below a checkpoint at step 15: refused, as it must be)
    assert resumed.code == 0, resumed.stderr
    assert f"resumed at step {step}" in resumed.stdout and read_metrics(run_dir)["steps"] == step + 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forked DataLoader workers")
def test_a_forked_child_does_not_keep_the_lock_of_its_parent(tmp_path):
    """A DataLoader worker forked while the folder is held shared the lock: after a kill -9 of the run, its orphaned
    workers held the folder for seconds, and the restart (torchrun's, at once) was refused as "in use"."""
    lock = rundir.hold(tmp_path)
    forked, ready = os.pipe()
    child = os.fork()
    if child == 0:  # a worker that lives on
        os.write(ready, b"1")  # (once forked: its fork handlers have run)
        time.sleep(10)
        os._exit(0)
    try:
        assert os.read(forked, 1) == b"1"
        rundir.release(tmp_path, lock, [])  # its parent dies
        again = rundir.hold(tmp_path)  # the restart, while the child still runs
        assert again is not None
        rundir.release(tmp_path, again, [])
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(forked), os.close(ready)


def test_runs_started_together_in_the_default_folder_get_one_each(tmp_path, monkeypatch):
    """The name was chosen while no folder had it, and made later: two runs started at once could both choose it,
    and one was refused ("in use by another run")."""
    monkeypatch.chdir(tmp_path)
    context = multiprocessing.get_context("fork")
    for _ in range(10):
        barrier, results = context.Barrier(2), context.SimpleQueue()

        def start(barrier=barrier, results=results):
            barrier.wait()
            try:
                results.put(str(open_run_dir("rec", None, None).path))
            except RecipeError as err:
                results.put(f"error: {err}")
            os._exit(0)  # the folder stays: the lock goes with the process

        processes = [context.Process(target=start) for _ in range(2)]
        for process in processes:
            process.start()
        paths = [results.get() for _ in processes]
        for process in processes:
            process.join()
        assert len(set(paths)) == 2 and all(Path(path).is_dir() for path in paths), paths
    assert len(list((tmp_path / "runs" / "rec").iterdir())) == 20


def test_a_best_checkpoint_without_its_last_is_not_started_over(tmp_path, capsys):
    """A folder whose last.pt was deleted was told "continue it with --resume auto", which started afresh over its
    best.pt. Nor does --resume auto (a restart) start over it: a run writes a step's last.pt before its best.pt, so
    only a deleted last.pt leaves a best.pt alone (before, a kill between the first two did, and a restart began
    afresh over it)."""
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir / "checkpoints" / "best.pt", {"model": {}, "recipe": "t", "config": {}})
    for resume in (None, "auto"):
        with pytest.raises(RecipeError, match=r"run holds checkpoints/best.pt but no checkpoints/last.pt to continue "
                           "from: a new run there would start afresh over it; move it away, or choose another "
                           "--run-dir$"):
            open_run_dir("t", run_dir, resume)
    assert capsys.readouterr().err == "" and (run_dir / "checkpoints" / "best.pt").is_file()


def test_only_a_step_folder_counts_as_an_incomplete_sharded_checkpoint(tmp_path):
    """glob("step-*/") matches files too on Python 3.10 (folders only from 3.11), which the project supports: a stray
    file named like a step folder refused --resume auto there as an incomplete checkpoint."""
    dcp = tmp_path / "run" / "checkpoints" / "dcp"
    dcp.mkdir(parents=True)
    (dcp / "step-000004").write_text("a note, not a checkpoint")
    assert open_run_dir("t", tmp_path / "run", "auto") == RunFolder(tmp_path / "run", None)
    (dcp / "step-000004").unlink()
    (dcp / "step-000004").mkdir()  # a folder without its files: a copy in progress
    with pytest.raises(RecipeError, match=r"only checkpoints are incomplete \(step-000004 lacks its trainer.pt"):
        open_run_dir("t", tmp_path / "run", "auto")


def test_torchrun_max_restarts_needs_resume_auto(tmp_path, monkeypatch):
    """Each restart ran the same command: without --resume auto it started over (in a new default folder, or was
    refused the folder it had filled), though the recipes say --max-restarts resumes."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    for resume in (None, str(tmp_path / "x.pt")):
        with pytest.raises(typer.BadParameter, match="torchrun --max-restarts relaunches this same command after a "
                           "failure, which then starts over: give --resume auto and a --run-dir"):
            open_run_dir("t", tmp_path / "run", resume)
    assert open_run_dir("t", tmp_path / "run", "auto") == RunFolder(tmp_path / "run", None)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # torchrun's default
    assert open_run_dir("t", tmp_path / "other", None) == RunFolder(tmp_path / "other", None)
    result = subprocess.run([sys.executable, "recipes/ddp_mlp.py", "--run-dir", tmp_path / "ddp"], cwd=ROOT,
                            env={**os.environ, "TORCHELASTIC_MAX_RESTARTS": "1"}, capture_output=True, text=True)
    assert result.returncode == 2 and "--resume" in result.stderr and "--max-restarts" in result.stderr, result.stderr


def test_the_same_process_may_open_a_run_directory_again_once_its_command_has_ended(run_inprocess, tmp_path):
    args = ["--epochs", 1, "--samples", 128, "--batch-size", 64, "--width", 8, "--depth", 1, "--run-dir", tmp_path,
            "--resume", "auto"]
    assert run_inprocess("mixed_precision", *args).code == 0
    assert "already finished" in run_inprocess("mixed_precision", *args).stdout  # the lock went with the command
    smaller = run_inprocess("mixed_precision", *args, "--max-steps", 1).stdout  # below the step the run ended at
    assert smaller.startswith("already finished: step 2 of 2;") and "(its schedule is done)" in smaller
    cut = ["--epochs", 2, *args[2:-4], "--max-steps", 3, "--run-dir", tmp_path / "cut", "--resume", "auto"]
    assert run_inprocess("mixed_precision", *cut).code == 0
    again = run_inprocess("mixed_precision", *cut).stdout  # cut short by --max-steps: how to go on
    assert again.startswith("already finished: step 3 of 3;") and "(a larger --max-steps goes on with it)" in again


def test_an_unfinished_run_resumed_with_a_max_steps_below_its_checkpoint_is_one_line(run_inprocess, tmp_path):
    """Killed after its checkpoint at step 3, relaunched with --max-steps 1: it trained nothing and wrote a finished
    run's metrics.json and done line ("done: steps=3"), with an old evaluation's figures."""
    args = ["--epochs", 2, "--samples", 128, "--batch-size", 64, "--width", 8, "--depth", 1, "--run-dir", tmp_path,
            "--resume", "auto"]
    assert run_inprocess("mixed_precision", *args, "--max-steps", 3).code == 0
    (tmp_path / "metrics.json").unlink()  # as a SIGKILL after the checkpoint at step 3 leaves it
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and "events" not in p.name}
    result = run_inprocess("mixed_precision", *args, "--max-steps", 1)
    last = tmp_path / "checkpoints" / "last.pt"
    assert (result.code, result.stderr) == (1, f"error: checkpoint {last} is at step 3, past where this run ends "
                                               f"(step 1): nothing is left to train in {tmp_path} (a --max-steps "
                                               "above 3, or none, goes on with it)\n")
    assert not (tmp_path / "metrics.json").exists()
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and "events" not in p.name} \
        == before
    finished = run_inprocess("mixed_precision", *args, "--max-steps", 3)  # killed as it finished: it finishes now
    assert finished.code == 0 and finished.done_line.startswith("done: steps=3 "), finished.stderr
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 3


def test_a_fresh_run_that_fails_before_its_first_checkpoint_leaves_no_folder(run_inprocess, tmp_path):
    result = run_inprocess("tabular_mlp", "--csv", tmp_path / "missing.csv", "--target", "y",
                           "--run-dir", tmp_path / "run")
    assert result.code == 1 and "no such file" in result.stderr
    assert not (tmp_path / "run").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("kept")  # a folder that was there before is left as it was
    result = run_inprocess("tabular_mlp", "--csv", tmp_path / "missing.csv", "--target", "y", "--run-dir", existing)
    assert result.code == 1 and sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


def test_a_failed_run_in_the_default_run_directory_leaves_no_empty_runs_folder(run_inprocess, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_inprocess("tabular_mlp", "--csv", tmp_path / "missing.csv", "--target", "y")
    assert result.code == 1 and "no such file" in result.stderr
    assert not (tmp_path / "runs").exists()  # runs/tabular_mlp/TIME, then runs/tabular_mlp, then runs/
    (tmp_path / "runs" / "mnist_onecycle" / "earlier").mkdir(parents=True)  # a folder of runs that was there
    assert run_inprocess("tabular_mlp", "--csv", tmp_path / "missing.csv", "--target", "y").code == 1
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["mnist_onecycle"]


def test_a_finished_run_says_so_before_it_loads_any_data(run_inprocess, tmp_path):
    table = write_table(tmp_path / "t.csv")
    args = ["--csv", table, "--target", "label", "--epochs", 1, "--batch-size", 32, "--run-dir", tmp_path / "run",
            "--resume", "auto"]
    assert run_inprocess("tabular_mlp", *args).code == 0
    steps = read_metrics(tmp_path / "run")["steps"]
    table.unlink()  # a relaunch that read the table would fail now
    again = run_inprocess("tabular_mlp", *args)
    assert again.code == 0, again.stderr
    assert again.stdout.startswith(f"already finished: step {steps} of {steps}")


def test_resume_auto_needs_a_run_directory():
    with pytest.raises(Exception, match="give --run-dir too"):
        open_run_dir("t", None, "auto")
    with pytest.raises(RecipeError, match=f"cannot write to --run-dir .*: {ROOT / 'README.md'} is a file, not a"):
        open_run_dir("t", ROOT / "README.md" / "run", None)


class Loader(list):
    """Just what batches_left uses of a DataLoader: its length, batch size and resumable sampler."""

    batch_size = 4

    def __init__(self, n: int):
        super().__init__(range(n))
        self.sampler = type("Sampler", (), {"skip": 0})()

    def __iter__(self):
        return iter(list(list.__iter__(self))[self.sampler.skip // self.batch_size:])


@pytest.mark.parametrize(("step", "total", "epochs", "batches"), [
    (0, 30, range(0, 3), list(range(10))),  # from the start
    (13, 30, range(1, 3), list(range(3, 10))),  # mid-epoch: the epoch's first 3 batches were trained on
    (20, 30, range(2, 3), list(range(10))),  # at an epoch's end: the next one, whole
    (13, 15, range(1, 2), [3, 4]),  # cut by --max-steps 15 within the epoch
    (30, 30, range(0), []),  # done: nothing left
    (13, 13, range(1, 2), []),  # saved mid-epoch, resumed with --max-steps 13: the epoch's evaluation, no batch
])
def test_a_resumed_loop_goes_on_where_it_stopped(step, total, epochs, batches):
    assert epochs_left(step, 10, total, evaluated_at=0) == epochs  # the last evaluation at step 0: none yet
    assert epochs_left(step, 10, total, evaluated_at=step) == (range(0) if step == total else epochs)  # done with it
    # None: a checkpoint from before evaluated_at was kept, taken as evaluated (as such checkpoints were resumed)
    assert epochs_left(step, 10, total, evaluated_at=None) == (range(0) if step == total else epochs)
    loader = Loader(10)
    assert list(batches_left(loader, step, total)) == batches
    assert loader.sampler.skip == 0  # put back for the next epoch


def test_a_run_resumed_from_another_folders_checkpoint_makes_its_own_best_pt_and_finishes(run_inprocess, mnist_dir,
                                                                                         tmp_path, monkeypatch):
    """mnist_onecycle scores its test set with best.pt at the end: a run continued in a new folder from another's
    last.pt must have one there, chosen among its own evaluations (here none beats the first folder's best), while
    the first folder keeps its own."""
    from conftest import load_recipe

    common = ["mnist_onecycle", "--data-dir", mnist_dir, "--batch-size", 64, "--epochs", 1]
    assert run_inprocess(*common, "--max-steps", 2, "--run-dir", tmp_path / "first").code == 0
    first_best = (tmp_path / "first" / "checkpoints" / "best.pt").read_bytes()
    monkeypatch.setattr(load_recipe("mnist_onecycle"), "evaluate", lambda *args, **kwargs: {"loss": 9.0, "acc": 0.0})
    resumed = run_inprocess(*common, "--resume", tmp_path / "first" / "checkpoints" / "last.pt",
                            "--run-dir", tmp_path / "second")
    assert resumed.code == 0, resumed.stderr
    metrics = json.loads((tmp_path / "second" / "metrics.json").read_text())
    best = torch.load(tmp_path / "second" / "checkpoints" / "best.pt", weights_only=True)
    assert metrics["best_step"] == best["step"] > 2 and metrics["best_val_acc"] == 0.0
    assert (tmp_path / "first" / "checkpoints" / "best.pt").read_bytes() == first_best


MP_TINY = ["--epochs", 1, "--max-steps", 2, "--samples", 128, "--batch-size", 64, "--width", 16, "--depth", 1]


def test_a_folder_with_files_no_run_of_the_recipe_wrote_is_not_overwritten(run_inprocess, tmp_path):
    """--run-dir at a model's folder (Hugging Face's config.json) or a project's: refused, its files untouched; a
    folder where a run of the same recipe failed before its first checkpoint is started again."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_layer": 12}')
    (model / "metrics.json").write_text("not json")
    result = run_inprocess("mixed_precision", *MP_TINY, "--run-dir", model)
    assert result.code == 1
    assert result.stderr == (f"error: {model} holds a config.json and a metrics.json that no mixed_precision run "
                             "wrote, which this run would overwrite: choose another --run-dir\n")
    assert (model / "config.json").read_text() == '{"model_type": "gpt2", "n_layer": 12}'
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "metrics.json"]

    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "config.json").write_text(json.dumps({"recipe": "mixed_precision", "lr": 1.0}))
    again = run_inprocess("mixed_precision", *MP_TINY, "--run-dir", failed)
    assert again.code == 0, again.stderr
    assert json.loads((failed / "config.json").read_text())["lr"] == 1e-3


def test_a_folder_holding_another_recipes_run_is_refused_without_advice_to_resume_it(run_inprocess, tmp_path):
    """"continue it with --resume auto" would only lead to a second refusal: the checkpoint is another recipe's."""
    assert run_inprocess("mixed_precision", *MP_TINY, "--run-dir", tmp_path).code == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = run_inprocess("compiled_model", *MP_TINY, "--run-dir", tmp_path)
    assert result.code == 1
    assert result.stderr == (f"error: {tmp_path} holds a config.json and a metrics.json that no compiled_model run "
                             "wrote, which this run would overwrite: choose another --run-dir\n")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    resumed = run_inprocess("compiled_model", *MP_TINY, "--run-dir", tmp_path, "--resume", "auto")
    assert resumed.code == 1 and "written by recipe 'mixed_precision', not 'compiled_model'" in resumed.stderr


def test_a_full_disk_at_metrics_json_is_one_line_and_leaves_the_checkpoints(run_inprocess, tmp_path, monkeypatch):
    import errno
    import os
    from pathlib import Path

    write_text = Path.write_text

    def full_for_metrics(self, *args, **kwargs):
        if self.name == ".metrics.json.tmp":
            write_text(self, "{")  # a part written, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_for_metrics)
    run_dir = tmp_path / "run"
    result = run_inprocess("mixed_precision", *MP_TINY, "--run-dir", run_dir)
    assert result.code == 1
    assert result.stderr == f"error: could not write {run_dir / 'metrics.json'}: No space left on device\n"
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("events")) == ["checkpoints",
                                                                                           "config.json"]
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 2


def test_a_finished_checkpoint_continued_in_another_folder_is_one_line(run_inprocess, tmp_path):
    assert run_inprocess("mixed_precision", *MP_TINY, "--run-dir", tmp_path / "done").code == 0
    last = tmp_path / "done" / "checkpoints" / "last.pt"
    result = run_inprocess("mixed_precision", *MP_TINY, "--resume", last, "--run-dir", tmp_path / "more")
    assert result.code == 1
    assert result.stderr == (f"error: checkpoint {last} is at step 2, where this run ends: nothing is left to train "
                             f"in {tmp_path / 'more'} (use the checkpoint as it is)\n")
    assert not (tmp_path / "more").exists()
    shorter = run_inprocess("mixed_precision", *MP_TINY, "--max-steps", 1, "--resume", last, "--run-dir",
                            tmp_path / "more")  # it said "at step 2, where this run ends" of a run to step 1
    assert shorter.code == 1 and shorter.stderr.startswith(f"error: checkpoint {last} is at step 2, past where this "
                                                           "run ends (step 1): nothing is left to train in ")


def test_a_checkpoints_folder_linked_to_another_disk_is_still_the_runs_own(run_inprocess, tmp_path):
    """Resolved, its last.pt lay outside the run folder: each resume was taken for another run's, which reset the best
    score (best.pt was overwritten by a worse model) and made a finished run's relaunch an error."""
    small = ["--samples", 256, "--batch-size", 64, "--width", 16, "--depth", 1, "--epochs", 4, "--lr", 0.05]
    (tmp_path / "plain").mkdir()
    (tmp_path / "linked").mkdir()
    (tmp_path / "bigger_disk").mkdir()
    (tmp_path / "linked" / "checkpoints").symlink_to(tmp_path / "bigger_disk")
    (tmp_path / "by_target").mkdir()  # resumed with --resume naming the file where the link leads
    (tmp_path / "target_disk").mkdir()
    (tmp_path / "by_target" / "checkpoints").symlink_to(tmp_path / "target_disk")
    for run in ("plain", "linked", "by_target"):
        assert run_inprocess("mixed_precision", *small, "--max-steps", 8, "--run-dir", tmp_path / run).code == 0
        last = tmp_path / "target_disk" / "last.pt" if run == "by_target" else "auto"
        resumed = run_inprocess("mixed_precision", *small, "--run-dir", tmp_path / run, "--resume", last)
        assert resumed.code == 0, resumed.stderr
    timing = {"wall_s", "samples_per_s"}
    plain, linked, by_target = ({k: v for k, v in read_metrics(tmp_path / run).items() if k not in timing}
                                for run in ("plain", "linked", "by_target"))
    assert linked == plain and by_target == plain  # by_target's best was reset: a worse best.pt, best_step 16
    steps = [torch.load(tmp_path / run / "checkpoints" / "best.pt", weights_only=True)["step"]
             for run in ("plain", "linked", "by_target")]
    assert steps[0] == steps[1] == steps[2] == plain["best_step"]
    again = run_inprocess("mixed_precision", *small, "--run-dir", tmp_path / "linked", "--resume", "auto")
    assert again.code == 0 and "already finished" in again.stdout, again.stderr


def test_only_the_linked_checkpoints_folder_itself_is_the_runs_own(tmp_path):
    """The disk a checkpoints/ link leads to may hold other runs too: theirs stay another run's (whose best score a
    resume must not take over), while last.pt and the sharded step folders in the link's own target are this run's."""
    disk = tmp_path / "disk"
    for folder in (disk / "B" / "checkpoints", disk / "dcp" / "step-000004", disk / "C"):
        folder.mkdir(parents=True)  # C: another run's checkpoints/ linked here (a link to disk/C)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "checkpoints").symlink_to(disk)
    for resume, another in [(disk / "B" / "checkpoints" / "last.pt", True), (disk / "last.pt", False),
                            (disk / "dcp" / "step-000004", False), (tmp_path / "elsewhere" / "last.pt", True),
                            (tmp_path / "new" / "checkpoints" / "last.pt", False), (disk / "C" / "last.pt", True)]:
        assert RunFolder(tmp_path / "new", resume).resumes_another_run is another, resume
    (tmp_path / "dcp").mkdir()  # a link to a folder that happens to be named dcp: its last.pt is still the run's
    (tmp_path / "named" / "checkpoints").parent.mkdir()
    (tmp_path / "named" / "checkpoints").symlink_to(tmp_path / "dcp")
    assert RunFolder(tmp_path / "named", tmp_path / "dcp" / "last.pt").resumes_another_run is False


def test_a_run_folder_that_cannot_hold_checkpoints_is_refused_before_training(run_inprocess, tmp_path):
    """A file named checkpoints was found at the first save, an epoch later, as "File exists"; a link to nothing
    was "File exists" too."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("notes")
    result = run_inprocess("mixed_precision", "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr == f"error: cannot write checkpoints in {tmp_path / 'run'}: its " \
        "checkpoints is a file, not a folder\n" and result.stdout == ""
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]
    (tmp_path / "run" / "checkpoints").unlink()  # a link to a disk not mounted: found at the first save, an epoch on
    (tmp_path / "run" / "checkpoints").symlink_to(tmp_path / "unmounted")
    result = run_inprocess("mixed_precision", "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr == f"error: cannot write checkpoints in {tmp_path / 'run'}: " \
        f"{tmp_path / 'run' / 'checkpoints'} is a link to {tmp_path / 'unmounted'}, which does not exist\n"
    assert result.stdout == "" and [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    result = run_inprocess("mixed_precision", "--run-dir", tmp_path / "dangling")
    assert result.code == 1 and result.stderr == f"error: cannot write to --run-dir {tmp_path / 'dangling'}: " \
        f"{tmp_path / 'dangling'} is a link to {tmp_path / 'nowhere'}, which does not exist\n"


def test_a_symlink_loop_is_one_line(run_inprocess, tmp_path):
    """Path.resolve raises RuntimeError on a loop (Python 3.11), which was a traceback."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    result = run_inprocess("mnist_onecycle", "--data-dir", tmp_path / "loop", "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr == f"error: Symlink loop from '{tmp_path / 'loop'}'\n"
    assert not (tmp_path / "run").exists()
    (tmp_path / "loop.py").symlink_to(tmp_path / "loop.py")
    result = subprocess.run([sys.executable, "scripts/eject.py", "mixed_precision", tmp_path / "loop.py"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == f"error: Symlink loop from '{tmp_path / 'loop.py'}'\n"
