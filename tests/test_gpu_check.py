"""scripts/gpu_check.sh: --smoke runs its whole plumbing on the CPU (every recipe, DDP under torchrun, the
table); without CUDA and without --smoke it stops at once with one line."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import RECIPES, ROOT

from scripts.gpu_check import markdown_table, read_run


def gpu_check(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHON": sys.executable})


def table_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("|")]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def test_smoke_mode_runs_every_recipe_and_prints_one_table(tmp_path):
    out = tmp_path / "out"
    result = gpu_check("--smoke", out)
    assert result.returncode == 0, result.stdout + result.stderr

    lines = table_lines(result.stdout)
    header, separator, *rows = lines
    assert cells(header) == ["recipe", "variant", "throughput", "final train loss", "peak GPU memory (MB)",
                             "wall s", "status"]
    assert set(separator) <= set("|-")
    rows = [cells(row) for row in rows]
    # smoke mode: every recipe once in bf16 (no fp16, no compile), then DDP as two gloo processes
    assert sorted((r[0], r[1]) for r in rows[:-1]) == [(name, "bf16") for name in RECIPES]
    assert (rows[-1][0], rows[-1][1]) == ("ddp_mlp", "torchrun-bf16-x2")
    for recipe, _, throughput, loss, peak, wall, status in rows:
        assert status == "ok", recipe
        value, unit = throughput.split()
        assert float(value.replace(",", "")) > 0
        assert unit == ("tokens/s" if recipe == "tiny_transformer" else "samples/s")
        assert float(loss) > 0 and float(wall) > 0
        assert peak == "-"  # no GPU memory on the CPU

    # the same table on disk, and the same figures in results.json
    assert (out / "table.md").read_text() == "\n".join(lines) + "\n"
    results = json.loads((out / "results.json").read_text())
    assert results["smoke"] is True and results["failed"] == 0 and results["runs"] == len(rows)
    for row, figures in zip(rows, results["rows"], strict=True):
        assert (figures["recipe"], figures["variant"], figures["status"]) == (row[0], row[1], "ok")
        assert figures["throughput"] > 0 and figures["peak_gpu_mb"] is None
        assert f"{figures['train_loss']:.4f}" == row[3] and f"{figures['wall_s']:.1f}" == row[5]
        assert figures["metrics"]["steps"] == 2
    assert results["rows"][-1]["metrics"]["world_size"] == 2


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
    rows = [read_run(["ddp_mlp", "torchrun", "1", "6.0", str(tmp_path / "none"), str(tmp_path / "ddp.err"), "x"]),
            read_run(["mnist_onecycle", "fp16", "1", "3.0", str(tmp_path / "none"), str(tmp_path / "oom.err"), "x"]),
            read_run(["tiny_transformer", "bf16-compile", "124", "180.2", str(tmp_path / "none"), "", "x"]),
            read_run(["tabular_mlp", "bf16", "0", "2.0", str(tmp_path / "none"), "", "x"])]
    assert [r["status"] for r in rows] == ["failed"] * 4
    statuses = [cells(line)[-1] for line in markdown_table(rows).splitlines()[2:]]
    assert statuses == [r"failed: exit 1: Error: Invalid value for '--hidden': must be >= 1 \| 0",
                        "failed: exit 1: torch.OutOfMemoryError: CUDA out of memory.",
                        "failed: timed out after 180 s",
                        f"failed: exit 0 but no {tmp_path / 'none' / 'metrics.json'}"]
