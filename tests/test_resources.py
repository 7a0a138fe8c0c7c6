"""The memory account every run prints: exact bytes for known optimizers, dtypes, frozen and tied weights."""

import resource
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, SMOKE_ARGS, read_metrics
from torch import nn

from common.loop import train_step
from common.resources import format_account, memory_account, peak_rss_bytes

CPU = torch.device("cpu")


def model_after_one_step(optimizer_factory, dtype=torch.float32, freeze_first=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5)).to(dtype)
    if freeze_first:
        model[0].requires_grad_(False)
    optimizer = optimizer_factory([p for p in model.parameters() if p.requires_grad])
    x, y = torch.randn(8, 10, dtype=dtype), torch.randint(0, 5, (8,))
    train_step(model, optimizer, nn.CrossEntropyLoss(), [(x, y)], device=CPU)
    return model, optimizer


N_PARAMS = 10 * 20 + 20 + 20 * 5 + 5  # 325


@pytest.mark.parametrize(
    ("factory", "state_bytes_per_param", "total_per_param"),
    [
        (lambda p: torch.optim.AdamW(p, lr=1e-3), 8, 16),  # exp_avg + exp_avg_sq
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 4, 12),  # momentum_buffer
        (lambda p: torch.optim.SGD(p, lr=0.1), 0, 8),  # no state at all
    ],
)
def test_fp32_byte_counts_per_parameter(factory, state_bytes_per_param, total_per_param):
    model, optimizer = model_after_one_step(factory)
    account = memory_account(model, optimizer, CPU)
    assert account["parameters"] == account["trainable_parameters"] == N_PARAMS
    assert account["weight_bytes"] == account["gradient_bytes"] == 4 * N_PARAMS
    assert account["optimizer_state_bytes"] == state_bytes_per_param * N_PARAMS
    assert account["model_state_bytes"] == total_per_param * N_PARAMS


def test_adam_step_counters_are_bookkeeping_not_per_parameter_state():
    model, optimizer = model_after_one_step(lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert memory_account(model, optimizer, CPU)["optimizer_bookkeeping_bytes"] == 4 * 4  # one step per tensor


def test_frozen_parameters_hold_no_gradient_and_no_state():
    model, optimizer = model_after_one_step(lambda p: torch.optim.AdamW(p, lr=1e-3), freeze_first=True)
    account = memory_account(model, optimizer, CPU)
    trainable = 20 * 5 + 5
    assert account["parameters"] == N_PARAMS and account["trainable_parameters"] == trainable
    assert account["weight_bytes"] == 4 * N_PARAMS
    assert account["gradient_bytes"] == 4 * trainable
    assert account["optimizer_state_bytes"] == 8 * trainable


def test_bf16_weights_halve_every_part():
    model, optimizer = model_after_one_step(lambda p: torch.optim.AdamW(p, lr=1e-3), dtype=torch.bfloat16)
    account = memory_account(model, optimizer, CPU)
    assert account["model_state_bytes"] == 8 * N_PARAMS  # 2 + 2 + (2 + 2)


def test_tied_weights_are_counted_once():
    embedding = nn.Embedding(7, 3)
    head = nn.Linear(3, 7, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert memory_account(model, optimizer, CPU)["weight_bytes"] == 7 * 3 * 4


def test_table_shows_bytes_per_parameter():
    model, optimizer = model_after_one_step(lambda p: torch.optim.AdamW(p, lr=1e-3))
    table = format_account(memory_account(model, optimizer, CPU), "AdamW")
    assert "325 parameters (325 trainable)" in table
    assert "optimizer state (AdamW)" in table and "16.00 B" in table and "peak process memory" in table


def test_the_transformer_reports_its_account(run_inprocess, corpus_txt, tmp_path):
    """The transformer, whose lesson includes what training costs in memory, prints and keeps its account."""
    args = [a.replace("{corpus_txt}", str(corpus_txt)) for a in SMOKE_ARGS["tiny_transformer"]]
    result = run_inprocess("tiny_transformer", *args, "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    assert "memory after the first step" in result.stdout and "16.00 B" in result.stdout
    memory = read_metrics(tmp_path)["memory"]
    assert memory["model_state_bytes"] == 16 * memory["parameters"]  # fp32 AdamW: weight, gradient, two moments
    assert memory["peak_rss_bytes"] > 0


class FakeGpuMemory:
    """torch.cuda's peak-memory functions on a pretend machine: GPU i peaked at (i + 1) GB."""

    def __init__(self, monkeypatch):
        self.asked, self.reset = [], []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self.reset.append(device))

    def peak(self, device=None):
        self.asked.append(device)
        index = 0 if device is None or torch.device(device).index is None else torch.device(device).index
        return (index + 1) * 10**9


def test_peaks_are_read_on_the_training_device(monkeypatch):
    from common.resources import with_peaks

    gpu = FakeGpuMemory(monkeypatch)
    account = with_peaks({"parameters": 1}, torch.device("cuda", 1))
    assert account["peak_allocated_bytes"] == 2 * 10**9 and gpu.asked == [torch.device("cuda", 1)]
    assert account["parameters"] == 1 and account["peak_rss_bytes"] > 0


def test_a_cpu_run_reports_no_gpu_peak_even_where_cuda_is_up(monkeypatch):
    from common.resources import reset_peak_memory, with_peaks

    gpu = FakeGpuMemory(monkeypatch)
    assert "peak_allocated_bytes" not in with_peaks({}, CPU)
    reset_peak_memory(CPU)
    assert gpu.asked == [] and gpu.reset == []


def test_reset_peak_memory_resets_the_training_device(monkeypatch):
    from common.resources import reset_peak_memory

    gpu = FakeGpuMemory(monkeypatch)
    reset_peak_memory(torch.device("cuda", 1))
    assert gpu.reset == [torch.device("cuda", 1)]


def test_memory_account_reads_the_peak_of_its_device(monkeypatch):
    model, optimizer = model_after_one_step(lambda p: torch.optim.SGD(p, lr=0.1))
    gpu = FakeGpuMemory(monkeypatch)
    account = memory_account(model, optimizer, torch.device("cuda", 2))
    assert account["peak_allocated_bytes"] == 3 * 10**9 and gpu.asked == [torch.device("cuda", 2)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and ru_maxrss across exec: Linux")
def test_peak_rss_is_the_process_own_not_that_of_the_process_that_started_it():
    """ru_maxrss survives fork and exec: a run started by a process holding 1.5 GB would report 1.5 GB. The
    account reads the process's own high-water mark instead."""
    ballast = bytearray(1536 * 2**20)
    ballast[:: 4096] = b"\x01" * len(range(0, len(ballast), 4096))  # touch every page: resident
    code = ("import resource; from common.resources import peak_rss_bytes; "
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    own, inherited = map(int, subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                             check=True).stdout.split())
    del ballast
    assert inherited > 1.5 * 2**30  # what the old figure would have been
    assert 10 * 2**20 < own < 1.2 * 2**30  # python and torch, not the parent's ballast
    assert peak_rss_bytes() <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
