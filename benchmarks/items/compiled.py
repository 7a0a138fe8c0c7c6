"""Item 6. torch.compile: the compiled_model recipe's gated MLP, eager against compiled."""

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks import harness
from benchmarks.harness import interleaved, load_recipe, summarise
from common.data import synthetic_classification
from common.loop import train_step


def compiled(quick: bool, work: Path) -> dict:
    """The compiled_model recipe's gated MLP (64 wide, 8 blocks, batch 16384), eager and torch.compile'd from
    the same initial weights, fed the same batches: after the compiled one's first (compiling) step, blocks of
    steps interleaved (eager, compiled, eager, ...), each block's seconds per step. Compile time is the first
    compiled step less a steady one; the loss difference is the two models' last losses after the same steps."""
    import copy

    cm = load_recipe("compiled_model")
    width, batch, block, repeats = (32, 1024, 3, 1) if quick else (64, 16384, 10, 5)
    torch.manual_seed(0)
    models = {"eager": cm.GatedMLP(width, 8).to(harness.DEVICE)}
    models["compiled"] = torch.compile(copy.deepcopy(models["eager"]), backend="eager" if quick else "inductor")
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for k, m in models.items()}
    data = synthetic_classification(batch * 4, cm.N_FEATURES, cm.N_CLASSES, seed=0)
    batches = list(zip(data.tensors[0].split(batch), data.tensors[1].split(batch), strict=True))
    loss_fn = nn.CrossEntropyLoss()
    position = {"eager": 0, "compiled": 0}
    losses = {}

    def steps(name: str, n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            b = batches[position[name] % len(batches)]
            position[name] += 1
            stats = train_step(models[name], optimizers[name], loss_fn, [b], device=harness.DEVICE)
        losses[name] = stats.loss.item()  # waits for the device
        return (time.perf_counter() - started) / n

    first = {name: steps(name, 1) for name in models}  # compiled: Dynamo + Inductor, forward and backward
    runs = interleaved(repeats, eager=lambda: steps("eager", block), compiled=lambda: steps("compiled", block))
    speedup = summarise([e / c for e, c in zip(runs["eager"], runs["compiled"], strict=True)])
    compile_s = max(0.0, first["compiled"] - statistics.median(runs["compiled"]))
    loss_diff = abs(losses["eager"] - losses["compiled"])
    return {"item": f"torch.compile: the recipe's gated MLP ({width} wide, 8 blocks, batch {batch}), steady state, "
                    f"{repeats} interleaved blocks of {block} steps",
            "result": f"{speedup['median']:.2f}x eager ({speedup['min']:.2f}-{speedup['max']:.2f}) after "
                      f"{compile_s:.1f} s of compiling; loss difference {loss_diff:.1e}",
            "target": ">= 1.2x", "met": speedup["median"] >= 1.2, "speedup": speedup["median"],
            "speedup_range": speedup, "compile_s": compile_s, "loss_diff": loss_diff,
            "step_ms": {k: 1000 * statistics.median(v) for k, v in runs.items()}}

