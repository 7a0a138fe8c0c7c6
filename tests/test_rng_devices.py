"""Checkpoints keep the CUDA generator of the training device only: on a CPU machine the CUDA functions are
faked, with a pretend number of GPUs, to check which generator is saved and which one is restored."""

import random

import pytest
import torch

from common.checkpoint import restore_rng_state, rng_state


class FakeCuda:
    """torch.cuda's RNG functions on a pretend machine with ``count`` GPUs, each with its own state."""

    def __init__(self, monkeypatch, count: int):
        self.count = count
        self.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(count)}
        self.set_calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)
        for name in ("get_rng_state_all", "set_rng_state_all"):  # the per-GPU list form is gone
            monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: pytest.fail(f"{name} was called"))

    def index(self, device) -> int:
        device = torch.device(device)
        index = device.index if device.index is not None else 0
        if index >= self.count:  # what the real functions do for an absent GPU
            raise IndexError("list index out of range")
        return index

    def get(self, device="cuda"):
        return self.states[self.index(device)].clone()

    def set(self, state, device="cuda"):
        self.set_calls.append((self.index(device), state.clone()))


def test_saves_the_training_devices_generator_only(monkeypatch):
    FakeCuda(monkeypatch, count=4)
    state = rng_state(device=torch.device("cuda", 2))
    assert torch.equal(state["cuda"], torch.full((8,), 2, dtype=torch.uint8))


def test_cpu_runs_and_the_default_keep_no_cuda_state(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    assert rng_state()["cuda"] is None
    assert rng_state(device=torch.device("cpu"))["cuda"] is None


def test_restores_onto_a_machine_with_fewer_gpus(monkeypatch):
    FakeCuda(monkeypatch, count=4)
    saved = rng_state(device=torch.device("cuda", 3))  # written on GPU 3 of 4
    cuda = FakeCuda(monkeypatch, count=1)  # resumed where one GPU is visible
    restore_rng_state(saved, device=torch.device("cuda", 0))
    assert len(cuda.set_calls) == 1
    index, state = cuda.set_calls[0]
    assert index == 0 and torch.equal(state, torch.full((8,), 3, dtype=torch.uint8))


def test_restores_the_cpu_streams_too(monkeypatch):
    FakeCuda(monkeypatch, count=1)
    random.seed(5)
    torch.manual_seed(5)
    saved = rng_state(device=torch.device("cuda", 0))
    expected = (random.random(), torch.rand(3))
    random.seed(6)
    torch.manual_seed(6)
    restore_rng_state(saved, device=torch.device("cuda", 0))
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_cpu_resume_restores_no_cuda_state(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=2)
    saved_on_gpu = rng_state(device=torch.device("cuda", 1))
    restore_rng_state(saved_on_gpu)  # resumed on the CPU: the CUDA stream is not needed
    restore_rng_state(saved_on_gpu, device=torch.device("cpu"))
    assert cuda.set_calls == []


def test_round_trip_through_a_checkpoint_file(monkeypatch, tmp_path):
    """weights_only loading must accept the saved form (a tensor or None under "cuda")."""
    from common.checkpoint import save_checkpoint

    FakeCuda(monkeypatch, count=2)
    path = tmp_path / "rng.pt"
    save_checkpoint(path, {"rng": rng_state(device=torch.device("cuda", 1))})
    loaded = torch.load(path, weights_only=True)["rng"]
    cuda = FakeCuda(monkeypatch, count=2)
    restore_rng_state(loaded, device=torch.device("cuda", 0))
    assert [(i, s[0].item()) for i, s in cuda.set_calls] == [(0, 1)]
