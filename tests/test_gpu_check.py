"""benchmarks/gpu_check.sh: --smoke runs its whole plumbing on the CPU (every recipe, DDP under torchrun, the
table); without CUDA and without --smoke it stops at once with one line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import RECIPES, ROOT

from benchmarks.gpu_check import markdown_table, read_run


def gpu_check(*args, timeout: float = 240, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **{k: str(v) for k, v in env.items()}})


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


HEADER = ["recipe", "variant", "throughput", "final train loss", "MFU", "peak GPU memory (MB)", "wall s", "status"]
FSDP_SKIPPED = "skipped: recipes/tiny_transformer.py has no --parallel yet (this row runs once its --help lists it)"


def test_smoke_mode_runs_every_recipe_and_prints_one_table(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    result = gpu_check("--smoke", out, GPU_CHECK_WORK=work)
    assert result.returncode == 0, result.stdout + result.stderr

    lines = table_lines(result.stdout)
    header, separator, *rows = lines
    assert cells(header) == HEADER
    assert set(separator) <= set("|-")
    rows = [cells(row) for row in rows]
    # smoke mode: every recipe once in bf16 (no fp16, no compile), DDP as two gloo processes, and the FSDP2
    # row (the transformer recipe's --parallel fsdp, two gloo processes)
    assert sorted((r[0], r[1]) for r in rows[:-2]) == [(name, "bf16") for name in RECIPES]
    assert (rows[-2][0], rows[-2][1]) == ("ddp_mlp", "torchrun-gloo-bf16-x2")
    assert (rows[-1][0], rows[-1][1]) == ("tiny_transformer", "torchrun-fsdp2-bf16-x2")
    for recipe, _, throughput, loss, mfu, peak, wall, status in rows:
        assert status == "ok", recipe
        value, unit = throughput.split()
        assert float(value.replace(",", "")) > 0
        assert unit == ("tokens/s" if recipe == "tiny_transformer" else "samples/s")
        assert float(loss) > 0 and float(wall) > 0
        assert peak == "-"  # no GPU memory on the CPU
        assert (mfu != "-") == (recipe == "tiny_transformer")

    # the same table on disk, under a line that says what ran where, and the same figures in results.json
    table_md = (out / "table.md").read_text()
    assert table_lines(table_md) == lines
    assert table_md.splitlines()[1].startswith("smoke (CPU) | 2 steps per run | 8 runs done, 0 failed")
    results = json.loads((out / "results.json").read_text())
    assert results["smoke"] is True and results["final"] is True
    assert results["failed"] == 0 and results["runs"] == len(rows)
    for row, figures in zip(rows, results["rows"], strict=True):
        assert (figures["recipe"], figures["variant"]) == (row[0], row[1])
        if figures["status"] == "skipped":
            continue
        assert figures["status"] == "ok" and figures["throughput"] > 0 and figures["peak_gpu_mb"] is None
        assert f"{figures['train_loss']:.4f}" == row[3] and f"{figures['wall_s']:.1f}" == row[6]
        assert figures["metrics"]["steps"] == 2
    assert results["rows"][-2]["metrics"]["world_size"] == 2

    # only a few small files come back from a lent machine: the runs and their logs are in the work folder
    assert sorted(p.name for p in out.iterdir()) == [".gpu_check", "log.txt", "results.json", "table.md"]
    assert (work / "runs" / "mnist_onecycle-bf16" / "metrics.json").is_file()
    log = (out / "log.txt").read_text()
    for probed in ("torchvision ", "typer ", "tensorboard ", "rich ", "ok: torch.amp.GradScaler",
                   "recipes/tiny_transformer.py --help: ok; --parallel listed"):
        assert probed in log
    assert "FAILED" not in log and len(log) < 100_000


def test_a_spent_budget_skips_runs_and_says_so(tmp_path):
    out = tmp_path / "out"
    result = gpu_check("--smoke", out, GPU_CHECK_WORK=tmp_path / "work", GPU_CHECK_BUDGET=0)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = [cells(line) for line in table_lines((out / "table.md").read_text())[2:]]
    assert len(rows) == 8
    assert {r[-1] for r in rows} == {"skipped: the check's 0 s time budget was spent"}
    assert "0 runs done, 0 failed, 8 skipped for time" in (out / "table.md").read_text()
    assert not list((tmp_path / "work" / "runs").iterdir())  # nothing was started


def test_a_check_killed_midway_leaves_the_table_of_what_it_did(tmp_path):
    """Killed with SIGKILL (no trap can run) while its third run is going: the table written before that run
    still holds the two finished runs and says which one did not finish."""
    out, work = tmp_path / "out", tmp_path / "work"
    check = subprocess.Popen(["bash", "benchmarks/gpu_check.sh", "--smoke", str(out)], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WORK": str(work)})
    try:
        for _ in range(600):  # up to 300 s for two runs on a loaded machine
            try:
                results = json.loads((out / "results.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being written
                results = None
            if results and results["runs"] >= 2 and results["rows"][-1]["status"] == "running":
                break
            assert check.poll() is None, "the check ended before it could be killed"
            time.sleep(0.5)
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
        check.wait()
    results = json.loads((out / "results.json").read_text())
    assert results["final"] is False and results["runs"] >= 2
    table_md = (out / "table.md").read_text()
    assert "IN PROGRESS or CUT SHORT" in table_md.splitlines()[1]
    rows = [cells(line) for line in table_lines(table_md)[2:]]
    assert all(r[-1] == "ok" for r in rows[:-1]) and len(rows) == results["runs"] + 1
    assert rows[-1][-1] == "did not finish: the check was stopped during this run"


def test_without_cuda_it_stops_with_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for real")
    result = gpu_check(tmp_path / "out", timeout=60)
    assert result.returncode != 0
    output = (result.stdout + result.stderr).strip().splitlines()
    assert len(output) == 1 and "CUDA" in output[0], output
    assert not (tmp_path / "out").exists()  # nothing written on the wrong machine


def test_failed_and_hung_runs_become_rows_that_say_why(tmp_path):
    torchrun_report = ("Error: Invalid value for '--hidden': must be >= 1 | 0\n"
                       "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                       "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
                       "============================================================\n")
    (tmp_path / "ddp.err").write_text(torchrun_report)
    (tmp_path / "oom.err").write_text("Traceback (most recent call last):\n  File 'x'\n"
                                      "torch.OutOfMemoryError: CUDA out of memory.\nwarning: late\n")
    rows = [read_run(["ddp_mlp", "torchrun", "1", "6.0", str(tmp_path / "none"), str(tmp_path / "ddp.err"), "x", ""]),
            read_run(["mnist_onecycle", "fp16", "1", "3.0", str(tmp_path / "none"), str(tmp_path / "oom.err"), "x"]),
            read_run(["tiny_transformer", "bf16-compile", "124", "180.2", str(tmp_path / "none"), "", "x"]),
            read_run(["tabular_mlp", "bf16", "0", "2.0", str(tmp_path / "none"), "", "x"]),
            read_run(["tiny_transformer", "bf16-compile", "137", "32.0", str(tmp_path / "none"), "", "x",
                      "cut off by the check's 240 s budget: GPU_CHECK_BUDGET gives it more"])]
    assert [r["status"] for r in rows] == ["failed"] * 5
    statuses = [cells(line)[-1] for line in markdown_table(rows).splitlines()[2:]]
    assert statuses == [r"failed: exit 1: Error: Invalid value for '--hidden': must be >= 1 \| 0",
                        "failed: exit 1: torch.OutOfMemoryError: CUDA out of memory.",
                        "failed: timed out after 180 s",
                        f"failed: exit 0 but no {tmp_path / 'none' / 'metrics.json'}",
                        "failed: timed out after 32 s; cut off by the check's 240 s budget: GPU_CHECK_BUDGET gives it "
                        "more"]


def test_notes_and_skips_become_statuses(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text(json.dumps({"samples_per_s": 1234.5, "train_loss": 0.5,
                                                      "memory": {"peak_allocated_bytes": 2e9}}))
    note = "1 nccl rank on 1 GPU: proves the plumbing (process group, DDP wrapper, checkpoints), not scaling"
    rows = [read_run(["ddp_mlp", "torchrun-nccl-bf16-x1", "0", "9.0", str(run_dir), "", "x", note]),
            read_run(["tiny_transformer", "fsdp", "skipped", "0", "-", "-", "-", "no --parallel yet"])]
    assert [r["status"] for r in rows] == ["ok", "skipped"]
    table = [cells(line) for line in markdown_table(rows).splitlines()[2:]]
    assert table[0] == ["ddp_mlp", "torchrun-nccl-bf16-x1", "1,234 samples/s", "0.5000", "-", "2,000", "9.0",
                        f"ok; {note}"]
    assert table[1][-2:] == ["-", "skipped: no --parallel yet"]
