"""Item 1. Core overhead: train_step + the run's log against the four-line loop."""

import contextlib
import io
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness import CPU, interleaved, load_recipe, summarise
from common.data import synthetic_classification
from common.loop import train_step
from common.rundir import RunFolder
from common.runlog import RunLog


def core_overhead(quick: bool) -> dict:
    mnist = load_recipe("mnist_onecycle")
    steps, repeats = (10, 2) if quick else (40, 16)  # many short pairs: the median shrugs off load spikes
    data = synthetic_classification(64 * steps, 784, 10, seed=0)
    batches = [(x.view(-1, 1, 28, 28), y) for x, y in zip(data.tensors[0].split(64), data.tensors[1].split(64),
                                                           strict=True)]
    loss_fn = nn.CrossEntropyLoss()

    def setup():
        torch.manual_seed(0)
        model = mnist.DigitNet()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def hand_written() -> tuple[float, nn.Module]:
        model, optimizer = setup()
        started = time.perf_counter()
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        return time.perf_counter() - started, model

    def shared() -> tuple[float, nn.Module]:
        model, optimizer = setup()
        with tempfile.TemporaryDirectory() as run_dir:
            log = RunLog(RunFolder(Path(run_dir), None), "bench", total_steps=steps, every=10)
            with contextlib.redirect_stdout(io.StringIO()):  # its lines are part of the cost, not of the report
                log.start(0, {}, CPU)
                started = time.perf_counter()
                for step, batch in enumerate(batches, 1):
                    stats = train_step(model, optimizer, loss_fn, [batch], device=CPU)
                    log.train(step, stats, lr=0.05, items=64)
                log.flush()
                seconds = time.perf_counter() - started
            log.writer.close()
        return seconds, model

    models = {}

    def timed(name, fn):
        def measure():
            seconds, models[name] = fn()
            return seconds
        return measure

    hand_written()  # warm-up: first-call allocations
    times = interleaved(repeats, alternate=True, hand=timed("hand", hand_written), core=timed("core", shared))
    ratios = [c / h for c, h in zip(times["core"], times["hand"], strict=True)]
    same = all(torch.equal(a, b) for a, b in zip(models["hand"].state_dict().values(),
                                                  models["core"].state_dict().values(), strict=True))
    overhead = summarise([100 * (r - 1) for r in ratios])
    return {"item": "Core overhead: train_step + RunLog vs a hand-written loop (MNIST CNN, batch 64)",
            "result": f"{overhead['median']:+.1f}% ({overhead['min']:+.1f} to {overhead['max']:+.1f}); "
                      f"equal weights: {'yes' if same else 'NO'}",
            "target": "<= +3%, equal weights", "met": overhead["median"] <= 3 and same,
            "overhead_percent": overhead, "equal_weights": same}

