"""recipes/ddp_mlp.py under torchrun on CPU with gloo: equivalence, multiple nodes, restarts, failures."""

import math
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ROOT,
    TORCHRUN,
    assert_same_weights,
    load_recipe,
    load_weights,
    read_metrics,
    read_scalars,
    run_subprocess,
    run_torchrun,
    worker_died_of_a_signal,
    worker_pids,
)

SMALL = ["--hidden", 64, "--precision", "fp32"]  # exact comparisons: fp32 rounds alike at any batch split


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, timeout: float = 180):
    return run_torchrun(list(args), timeout=timeout)


def test_plain_python_needs_no_process_group(run_inprocess, mnist_dir, tmp_path):
    result = run_inprocess("ddp_mlp", "--data-dir", mnist_dir, "--run-dir", tmp_path / "run", "--epochs", 3,
                           "--batch-size", 32, *SMALL)
    assert result.code == 0, result.stderr
    assert "1 process(es)" in result.stdout and "global batch 32 (1 x 32)" in result.stdout
    assert f"device cpu, {torch.get_num_threads()} thread(s)" in result.stdout  # each process's CPU threads
    metrics = read_metrics(tmp_path / "run")
    assert metrics["world_size"] == 1 and metrics["steps"] == 3 * 14  # 470 training digits (512 less 42 held out) at 32
    assert metrics["val_acc"] > 0.5


def test_two_processes_equal_one_process_with_twice_the_batch(run_inprocess, mnist_dir, tmp_path):
    common = ["--data-dir", mnist_dir, "--epochs", 2, *SMALL]
    two = torchrun("--nproc_per_node=2", "recipes/ddp_mlp.py", *common, "--batch-size", 16,
                   "--run-dir", tmp_path / "two")
    assert two.code == 0, two.stderr
    assert "global batch 32 (2 x 16)" in two.stdout
    # torchrun gives each process OMP_NUM_THREADS threads, 1 where it is not set; the header says which
    assert f"device cpu, {os.environ.get('OMP_NUM_THREADS', '1')} thread(s)" in two.stdout
    one = run_inprocess("ddp_mlp", *common, "--batch-size", 32, "--run-dir", tmp_path / "one")
    assert one.code == 0, one.stderr
    assert read_metrics(tmp_path / "two")["steps"] == read_metrics(tmp_path / "one")["steps"] == 28
    a = load_weights(tmp_path / "two" / "checkpoints" / "last.pt")
    b = load_weights(tmp_path / "one" / "checkpoints" / "last.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    # evaluation is split across ranks and all-reduced: the same numbers as one process evaluating all
    assert read_metrics(tmp_path / "two")["val_acc"] == read_metrics(tmp_path / "one")["val_acc"]
    # the training loss logged is the global batch's (all-reduced each step), not rank 0's half of it
    torch.testing.assert_close([v for _, v in read_scalars(tmp_path / "two")["train/loss"]],
                               [v for _, v in read_scalars(tmp_path / "one")["train/loss"]], rtol=1e-4, atol=1e-6)

    # stopped part-way through epoch 2 and resumed: each rank skips what it saw, then goes on as if never stopped
    cut = [*common, "--batch-size", 16, "--run-dir", tmp_path / "cut", "--resume", "auto"]
    assert torchrun("--nproc_per_node=2", "recipes/ddp_mlp.py", *cut, "--max-steps", 21).code == 0
    assert torch.load(tmp_path / "cut" / "checkpoints" / "last.pt", weights_only=True)["step"] == 21
    resumed = torchrun("--nproc_per_node=2", "recipes/ddp_mlp.py", *cut)
    assert resumed.code == 0, resumed.stderr
    assert_same_weights(a, load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))
    assert read_metrics(tmp_path / "cut")["steps"] == 28


def test_the_readme_two_node_commands_train_together(mnist_dir, tmp_path):
    """docs/scaling.md's commands for two hosts, run as two launches on this machine (HOST0 = 127.0.0.1)."""
    readme = (ROOT / "docs" / "scaling.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("torchrun --nnodes=2")]
    assert [re.search(r"--node-rank=(\d)", c)[1] for c in commands] == ["0", "1"]
    assert all("--rdzv-backend=c10d" in c for c in commands)
    for attempt in range(2):  # one more try after a worker's death by signal: see conftest.run_torchrun
        port = free_port()
        nodes = []
        for command in commands:
            words = shlex.split(command.replace("HOST0:29500", f"127.0.0.1:{port}")
                                .replace("/shared/runs/ddp", str(tmp_path / f"run{attempt}")))
            extra = ["--data-dir", mnist_dir, "--epochs", 1, "--batch-size", 16, *SMALL]
            nodes.append(subprocess.Popen([str(w) for w in [*TORCHRUN, *words[1:], *extra]], cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env={**os.environ, "PYTHONFAULTHANDLER": "1"}))
        outputs = [node.communicate(timeout=180)[0] for node in nodes]
        codes = [node.returncode for node in nodes]
        if codes == [0, 0] or attempt == 1 or not any(worker_died_of_a_signal(o) for o in outputs):
            break
        report = "\n".join(output[-3000:] for output in outputs)
        warnings.warn(f"a torchrun worker died of a signal; trying once more:\n{report}", stacklevel=1)
    print("\n----\n".join(outputs))  # pytest shows it in full when the test fails
    assert codes == [0, 0], "\n----\n".join(output[-3000:] for output in outputs)
    done = [line for output in outputs for line in output.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and "world_size=2" in done[0]  # one rank 0 in the whole group
    assert read_metrics(tmp_path / f"run{attempt}")["world_size"] == 2


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_killed_worker_is_restarted_and_resumes_to_the_same_weights(mnist_dir, tmp_path):
    common = ["--nproc_per_node=2", "--max-restarts=1", "recipes/ddp_mlp.py", "--data-dir", mnist_dir,
              "--epochs", 40, "--batch-size", 16, "--checkpoint-every", 100, "--resume", "auto", *SMALL]
    reference = torchrun(*common, "--run-dir", tmp_path / "reference")
    assert reference.code == 0, reference.stderr

    run_dir = tmp_path / "killed"
    launcher = subprocess.Popen([str(c) for c in [*TORCHRUN, *common, "--run-dir", run_dir]], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    workers = worker_pids(launcher.pid)
    assert launcher.poll() is None and workers, "the run ended before a worker could be killed"
    os.kill(workers[-1], signal.SIGKILL)
    output = launcher.communicate(timeout=180)[0]
    assert launcher.returncode == 0, output
    assert "resumed at step" in output  # the restarted group found the checkpoint
    assert read_metrics(run_dir)["steps"] == 40 * 14
    assert_same_weights(load_weights(tmp_path / "reference" / "checkpoints" / "last.pt"),
                        load_weights(run_dir / "checkpoints" / "last.pt"))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="signals a launcher")
def test_sigterm_to_torchrun_saves_every_rank_at_the_same_step_and_resumes(mnist_dir, tmp_path):
    common = ["--nproc_per_node=2", "recipes/ddp_mlp.py", "--data-dir", mnist_dir, "--epochs", 40,
              "--batch-size", 16, "--checkpoint-every", 1000, "--log-every", 10, *SMALL]
    reference = torchrun(*common, "--run-dir", tmp_path / "reference")
    assert reference.code == 0, reference.stderr

    run_dir = tmp_path / "stopped"
    launcher = subprocess.Popen([str(c) for c in [*TORCHRUN, *common, "--run-dir", run_dir]], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert launcher.poll() is None, "the run ended before it could be stopped"
    launcher.send_signal(signal.SIGTERM)  # torchrun passes it on to every worker
    output = launcher.communicate(timeout=120)[0]
    stopped_at = int(re.search(r"interrupted at step (\d+); checkpoint saved", output)[1])
    # the ranks agree on a step every --log-every steps, and after each evaluation (14 steps an epoch)
    assert (stopped_at % 10 == 0 or stopped_at % 14 == 0) and stopped_at < 560
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == stopped_at
    assert "torchrun --nproc_per_node=2 recipes/ddp_mlp.py" in output  # how to resume

    resumed = torchrun(*common, "--run-dir", run_dir, "--resume", "auto")
    assert resumed.code == 0, resumed.stderr
    assert f"resumed at step {stopped_at}" in resumed.stdout
    assert_same_weights(load_weights(tmp_path / "reference" / "checkpoints" / "last.pt"),
                        load_weights(run_dir / "checkpoints" / "last.pt"))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="signals one worker")
def test_sigterm_to_one_rank_alone_stops_every_rank_at_the_same_step(mnist_dir, tmp_path):
    """A scheduler may signal one process (its node's): the ranks agree to stop if any was asked (a MAX of their
    flags), so the others stop and save with it rather than train on, or wait for it, alone."""
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([str(c) for c in [*TORCHRUN, "--nproc_per_node=2", "recipes/ddp_mlp.py", "--data-dir",
                                                  mnist_dir, "--epochs", 40, "--batch-size", 16, "--checkpoint-every",
                                                  1000, "--log-every", 10, *SMALL, "--run-dir", run_dir]],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert launcher.poll() is None, "the run ended before it could be stopped"
    ranks = {pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in worker_pids(launcher.pid)}
    rank_1 = next(pid for pid, env in ranks.items() if b"RANK=1" in env)
    os.kill(rank_1, signal.SIGTERM)  # rank 1 alone; rank 0 saves
    output = launcher.communicate(timeout=120)[0]
    stopped_at = int(re.search(r"interrupted at step (\d+); checkpoint saved", output)[1])
    assert stopped_at < 560 and torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == stopped_at
    assert not (run_dir / "metrics.json").exists()  # no rank trained on to the end (a finished run writes it)
    assert "torchrun --nproc_per_node=2 recipes/ddp_mlp.py" in output  # how to resume


def test_a_failure_on_the_ranks_ends_them_all_with_the_one_line_error(mnist_dir, tmp_path):
    # a rank left waiting for the other would hang until the timeout, which fails the test
    result = torchrun("--nproc_per_node=2", "recipes/ddp_mlp.py", "--data-dir", mnist_dir,
                      "--resume", tmp_path / "missing.pt", "--run-dir", tmp_path / "run", *SMALL, timeout=120)
    assert result.code != 0
    # Every rank meets it, and rank 0 alone says it, on a line of its own (the others exit with the same status)
    errors = [line for line in result.stderr.splitlines() if "error: " in line]
    assert errors == [f"error: checkpoint {tmp_path / 'missing.pt'} does not exist"]
    # torchrun's own report of the failed ranks (its ChildFailedError) quotes the reason from each error file
    assert f"traceback : checkpoint {tmp_path / 'missing.pt'} does not exist" in result.stdout + result.stderr


def test_a_run_ended_under_torchrun_leaves_no_folder_of_its_dataloader_workers(mnist_dir, tmp_path):
    """torchrun's ranks end in os._exit, killing their DataLoader workers first: each worker's temporary folder
    (multiprocessing's pymp-*, for passing batches) stayed in /tmp after every run that failed or was stopped."""
    (tmp_path / "tmp").mkdir()
    result = run_subprocess([*TORCHRUN, "--nproc_per_node=2", "recipes/ddp_mlp.py", "--data-dir", mnist_dir,
                             "--num-workers", 2, "--batch-size", 16, "--lr", 1e30, "--run-dir", tmp_path / "run",
                             *SMALL], timeout=120, env={"TMPDIR": str(tmp_path / "tmp")})
    assert result.code == 1 and "error: training diverged" in result.stderr, result.stderr
    assert not list((tmp_path / "tmp").glob("pymp-*"))  # were 4: one per worker


def test_a_failure_before_the_process_group_is_printed_by_rank_0_every_time(tmp_path):
    """Met by every rank before the group exists (--backend nccl on a CPU, --device cuda without one): rank 1 exited
    at once, torchrun then ended rank 0 with SIGTERM, often before it had printed: no error line (2 of 4 tries)."""
    for attempt in range(3):  # a race: one try could pass by luck
        result = run_subprocess([*TORCHRUN, "--nproc_per_node=2", "recipes/ddp_mlp.py", "--backend", "nccl",
                                 "--device", "cpu", "--run-dir", tmp_path / f"run{attempt}"], timeout=120)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.code == 1 and errors == ["error: --backend nccl runs on CUDA devices only, not cpu: use "
                                               "--backend gloo or auto"], result.stderr
        # rank 0 ended on its own (exit 1), not by torchrun (143 or -15); rank 1, waiting, may be ended either way
        assert re.findall(r"rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: (-?\d+)", result.stderr) == ["1"], \
            result.stderr
    assert not list(tmp_path.iterdir())


def test_a_failure_found_by_rank_0_alone_ends_every_rank_with_its_one_line_error(mnist_dir, tmp_path):
    """Rank 0 alone resolves the run directory; what it refuses (here: checkpoints a fresh run would overwrite)
    reaches every rank as the same error, instead of a lost connection and a traceback on the others."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"an earlier run's checkpoint")
    # run_subprocess, not torchrun(): its one more try (for a worker killed by a signal) would empty --run-dir
    result = run_subprocess([*TORCHRUN, "--nproc_per_node=2", "recipes/ddp_mlp.py", "--data-dir", mnist_dir,
                             "--run-dir", run_dir, *SMALL], timeout=120)
    assert result.code != 0
    output = result.stdout + result.stderr  # torchrun's own traceback (ChildFailedError) aside, no worker's one
    assert 'recipes/ddp_mlp.py", line' not in output and 'common/rundir.py", line' not in output
    assert "Connection reset" not in output
    errors = [line for line in result.stderr.splitlines() if "error: " in line]  # rank 0's, alone
    assert len(errors) == 1 and errors[0].startswith("error: ") and "already holds checkpoints" in errors[0]
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == b"an earlier run's checkpoint"


def test_a_run_saved_by_two_processes_is_not_resumed_by_one(run_inprocess, mnist_dir, tmp_path):
    """ddp_mlp's batch is per process: at another world size the global batch is another, an epoch has another
    number of steps, and the checkpoint's position in the epoch would point at other digits. Refused in one line
    (even where the epoch lengths happen to agree); nothing overwritten."""
    run_dir = tmp_path / "run"
    first = torchrun("--nproc_per_node=2", "recipes/ddp_mlp.py", "--data-dir", mnist_dir, "--run-dir", run_dir,
                     "--epochs", 2, "--batch-size", 32, "--max-steps", 3, *SMALL)
    assert first.code == 0, first.stderr
    saved = (run_dir / "checkpoints" / "last.pt").read_bytes()
    alone = run_inprocess("ddp_mlp", "--data-dir", mnist_dir, "--run-dir", run_dir, "--epochs", 2, "--batch-size",
                          32, *SMALL, "--resume", "auto")
    assert alone.code == 1 and alone.stderr.startswith("error: ") and len(alone.stderr.strip().splitlines()) == 1
    assert "other options (world size 2 there, 1 here): resume with the options it was started with in 2 processes " \
        "in all (torchrun's --nnodes x --nproc_per_node), or start afresh" in alone.stderr
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == saved
    # A replay of its config.json is a new run, free to use one process, but not silently: another global batch
    replay = run_inprocess("ddp_mlp", "--config", run_dir / "config.json", "--max-steps", 1, "--run-dir",
                           tmp_path / "replay")
    assert replay.code == 0 and replay.stderr == (f"warning: {run_dir / 'config.json'} ran as 2 processes, this run "
                                                   "as 1: another global batch, so other numbers than its own\n")


def test_one_process_under_torchrun_is_wrapped_in_ddp_for_real(mnist_dir, tmp_path):
    """As on a one-GPU machine: a process group of one, and the model in DistributedDataParallel. The worker's
    clean-ups run as it leaves: here the notice that --profile's steps never came."""
    result = torchrun("--nproc_per_node=1", "recipes/ddp_mlp.py", "--data-dir", mnist_dir, "--epochs", 1,
                      "--batch-size", 32, "--max-steps", 3, "--run-dir", tmp_path / "run", "--profile", 100, *SMALL)
    assert result.code == 0, result.stderr
    assert "global batch 32 (1 x 32) | model DistributedDataParallel" in result.stdout
    assert "profile: the run ended before 100 steps could be profiled after the warm-up\n" in result.stderr


def test_a_resume_may_change_the_backend(run_inprocess, mnist_dir, tmp_path):
    """gloo or auto (gloo on a CPU, nccl on CUDA) say how to talk, not what to train: a resume was refused."""
    args = ["--data-dir", mnist_dir, "--epochs", 1, "--batch-size", 32, "--run-dir", tmp_path / "run", *SMALL]
    assert run_inprocess("ddp_mlp", *args, "--max-steps", 2).code == 0
    resumed = run_inprocess("ddp_mlp", *args, "--max-steps", 4, "--backend", "gloo", "--resume", "auto")
    assert resumed.code == 0, resumed.stderr
    assert "resumed at step 2" in resumed.stdout and read_metrics(tmp_path / "run")["steps"] == 4


HAND_SET = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
NOT_ALL = ("error: RANK is set, but not all of torchrun's LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: launch "
           "with torchrun, or unset RANK\n")


@pytest.mark.parametrize("recipe", ["ddp_mlp", "tiny_transformer"])
@pytest.mark.parametrize(("environment", "message"), [
    ({"RANK": "1"}, NOT_ALL), ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "x"}, NOT_ALL),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}, NOT_ALL),
    (HAND_SET | {"WORLD_SIZE": "\u00b2"}, NOT_ALL),  # a digit to str.isdigit, not to int(): a ValueError traceback
    # set by hand, no group could have them: tracebacks (TCPStore world size 0; port 70000), or, RANK 1 of 1, a
    # rendezvous that waited for ever and ignored SIGTERM
    *((HAND_SET | odd, f"error: RANK {(HAND_SET | odd)['RANK']}, LOCAL_RANK 0, WORLD_SIZE "
       f"{(HAND_SET | odd)['WORLD_SIZE']}, MASTER_PORT {(HAND_SET | odd)['MASTER_PORT']}: no group of processes has "
       "these (RANK and LOCAL_RANK below WORLD_SIZE, MASTER_PORT from 1 to 65535): launch with torchrun, or unset "
       "RANK\n") for odd in ({"WORLD_SIZE": "0"}, {"MASTER_PORT": "70000"}, {"RANK": "1"})),
])
def test_a_stray_rank_variable_is_one_line(recipe, environment, message, run_inprocess, mnist_dir, tmp_path,
                                           monkeypatch):
    """RANK set outside torchrun (by a cluster's own launcher, say) without the rest of torchrun's variables, or
    with values no group has: a KeyError or ValueError traceback, or none from the rendezvous."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "text.txt").write_text("to be or not to be " * 200)
    data = ["--data-dir", mnist_dir] if recipe == "ddp_mlp" else ["--text", tmp_path / "text.txt"]
    result = run_inprocess(recipe, *data, "--max-steps", 1, "--run-dir", tmp_path / "run")
    assert (result.code, result.stderr) == (1, message)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("world_size", "shown"), [
    (2, "torchrun --nproc_per_node=2 recipes/ddp_mlp.py --epochs 2 --resume auto --run-dir 'runs/a b'"),
    # a group launched without torchrun (srun, or RANK and WORLD_SIZE by hand): it said "python ...", one process,
    # which a checkpoint of two refuses
    ("2 by hand", "2 processes, launched as before: python recipes/ddp_mlp.py --epochs 2 --resume auto --run-dir "
                  "'runs/a b'"),
    ("1 by hand", "python recipes/ddp_mlp.py --epochs 2 --resume auto --run-dir 'runs/a b'"),
    ("4 without a RANK", "python recipes/ddp_mlp.py --epochs 2 --resume auto --run-dir 'runs/a b'"),  # no group
    (4, "torchrun --nnodes=2 --nproc_per_node=2 --node-rank=N RDZV recipes/ddp_mlp.py --epochs 2 --resume auto "
        "--run-dir 'runs/a b'\n  (on each node: N its --node-rank, RDZV the --rdzv-* options it was launched with)"),
])
def test_the_resume_command_of_a_run_over_several_nodes_names_them(world_size, shown, monkeypatch):
    """It said torchrun --nproc_per_node=2 alone, which started a one-node run: refused at another world size."""
    from common.stop import resume_command

    monkeypatch.setattr("sys.argv", ["recipes/ddp_mlp.py", "--resume", "auto", "--epochs", "2", "--run-dir=x"])
    if isinstance(world_size, str):
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        if "RANK" in world_size:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", "0")
        world_size = world_size.split()[0]
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert resume_command(Path("runs/a b")) == shown


def test_a_save_that_fails_on_rank_0_alone_ends_every_rank_with_its_one_line(mnist_dir, small_disk):
    """Rank 0 writes the checkpoints while the others wait: its full disk must reach them as the same error, not
    leave them in a barrier (gloo: "Connection closed by peer"; NCCL: a hang until the watchdog)."""
    run_dir = small_disk / "run"  # config.json and the events fit; a checkpoint of the model does not
    result = run_subprocess([*TORCHRUN, "--nproc_per_node=2", "recipes/ddp_mlp.py", "--data-dir", mnist_dir,
                             "--epochs", 1, "--batch-size", 32, "--max-steps", 2, "--run-dir", run_dir, *SMALL],
                            timeout=120)
    assert result.code != 0
    errors = [line for line in result.stderr.splitlines() if "error: " in line]
    assert errors == [f"error: could not write checkpoint {run_dir / 'checkpoints' / 'last.pt'}: No space left on "
                      "device; no earlier checkpoint"], result.stderr[-2000:]
    assert "Connection closed" not in result.stdout + result.stderr and 'ddp_mlp.py", line' not in result.stderr


def test_the_test_set_is_scored_with_the_weights_best_pt_holds(run_inprocess, mnist_dir, tmp_path, monkeypatch):
    """The reported test figures are the deployed model's (best.pt), not the last step's."""
    from common.data import load_mnist, make_loader

    recipe = load_recipe("ddp_mlp")
    real, scripted = recipe.evaluate, [0.9, 0.5, 0.4]  # validation accuracy of the 3 epochs: the first is the best
    monkeypatch.setattr(recipe, "evaluate", lambda *a: {"loss": 1.0, "acc": scripted.pop(0)} if scripted else real(*a))
    run_dir = tmp_path / "run"
    result = run_inprocess("ddp_mlp", "--epochs", 3, "--batch-size", 64, "--data-dir", mnist_dir, "--precision", "fp32",
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    metrics = read_metrics(run_dir)
    assert metrics["best_step"] == metrics["steps"] // 3
    test_loader = make_loader(torch.utils.data.TensorDataset(*load_mnist(mnist_dir, train=False)), 1000, train=False)
    scores = {}
    for name in ("best.pt", "last.pt"):
        model = recipe.MLP(torch.load(run_dir / "checkpoints" / name, weights_only=True)["config"]["hidden"])
        model.load_state_dict(load_weights(run_dir / "checkpoints" / name))
        scores[name] = real(model, test_loader, torch.device("cpu"), "fp32")
    assert (metrics["test_acc"], metrics["test_loss"]) == pytest.approx((scores["best.pt"]["acc"],
                                                                         scores["best.pt"]["loss"]))
    assert metrics["test_loss"] != pytest.approx(scores["last.pt"]["loss"])


def test_evaluation_runs_in_the_precision_the_model_trains_in():
    """Like every recipe's evaluation: the figures are those of the model as it runs (bf16 autocast here)."""
    recipe = load_recipe("ddp_mlp")
    torch.manual_seed(0)
    model = recipe.MLP(64)
    images, labels = torch.randn(256, 784), torch.randint(10, (256,))
    loader = [(images, labels)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_loss = torch.nn.functional.cross_entropy(model(images).float(), labels).item()
    fp32_loss = torch.nn.functional.cross_entropy(model(images), labels).item()
    assert bf16_loss != pytest.approx(fp32_loss, abs=1e-6)
    cpu = torch.device("cpu")
    assert recipe.evaluate(model, loader, cpu, "bf16")["loss"] == pytest.approx(bf16_loss, abs=1e-6)
    assert recipe.evaluate(model, loader, cpu, "fp32")["loss"] == pytest.approx(fp32_loss, abs=1e-6)


def test_one_process_stops_at_the_step_it_was_signalled_not_at_the_next_log_line(run_inprocess, mnist_dir, tmp_path,
                                                                                  monkeypatch):
    """Only torchrun's ranks must agree on a stop (every --log-every steps); plain python read its flag only there
    too, so with a long --log-every a SIGTERM waited for the epoch's end."""
    recipe, steps = load_recipe("ddp_mlp"), []
    step = recipe.train_step

    def step_then_ctrl_c(*args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C during the third step
        return step(*args, **kwargs)

    monkeypatch.setattr(recipe, "train_step", step_then_ctrl_c)
    result = run_inprocess("ddp_mlp", "--data-dir", mnist_dir, "--batch-size", 16, "--epochs", 1, "--log-every", 100,
                           *SMALL, "--run-dir", tmp_path / "run")
    assert result.code == 130, result.stderr
    assert "interrupted at step 3; checkpoint saved" in result.stdout
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3


@pytest.mark.parametrize("recipe", ["ddp_mlp", "tiny_transformer"])
def test_one_process_under_torchrun_agrees_to_stop_without_a_collective(recipe, monkeypatch):
    """It checks every step; with a process group of one, each check was an all-reduce and a GPU sync."""
    module = load_recipe(recipe)
    monkeypatch.setattr(module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(module.dist, "all_reduce", lambda *args, **kwargs: pytest.fail("a collective with no peer"))
    for requested in (False, True):
        assert module.stop_agreed(SimpleNamespace(requested=requested), torch.device("cpu")) is requested


def test_evaluation_runs_the_module_inside_ddp_not_ddps_forward(tmp_path):
    """DDP's forward broadcasts buffers (a BatchNorm's) from rank 0: ranks whose evaluation shards hold unequal
    numbers of batches (2,001 digits over 2 ranks) would wait for each other's broadcast forever."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ddp_mlp = load_recipe("ddp_mlp")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)))
        forwards = []
        model.register_forward_pre_hook(lambda module, args: forwards.append(module))
        batches = [(torch.zeros(4, 1, 28, 28), torch.tensor([0, 1, 2, 3]))]
        figures = ddp_mlp.evaluate(model, batches, torch.device("cpu"), "fp32")
    finally:
        dist.destroy_process_group()
    assert forwards == [] and figures["loss"] == pytest.approx(math.log(10), abs=0.5)


def test_more_processes_on_a_machine_than_it_has_gpus_is_one_line(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU machine: rank 1's set_device raised CUDA's "invalid device ordinal",
    a traceback, since no process group was there yet to carry a one-line error."""
    from common.cli import RecipeError
    from common.torchrun import gpu_of

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_of(0) == torch.device("cuda", 0)
    with pytest.raises(RecipeError, match=r"^LOCAL_RANK 1, but this machine has 1 CUDA device\(s\): start at most 1 "
                       r"processes on it \(torchrun --nproc_per_node\), or use --device cpu$"):
        gpu_of(1)
    for recipe in ("ddp_mlp", "tiny_transformer"):  # where each process picks its GPU
        assert "device = gpu_of(local_rank)" in (ROOT / "recipes" / f"{recipe}.py").read_text()
