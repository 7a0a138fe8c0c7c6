"""Item 6. torch.compile: the compiled_model recipe's gated MLP, eager against compiled."""

import statistics
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import load_recipe, summarise


def compiled(quick: bool, work: Path) -> dict:
    """The compiled_model recipe's gated MLP (64 wide, 8 blocks, batch 16384), eager and torch.compile'd, as the
    recipe's --compare measures it (compiled_model.measure_speed: the same weights and batches, after the
    compiled one's first step, blocks of steps interleaved)."""
    cm = load_recipe("compiled_model")
    width, batch, block, repeats = (32, 1024, 3, 1) if quick else (64, 16384, 10, 5)
    speed = cm.measure_speed(torch.device(harness.DEVICE), width, 8, batch, repeats, block,
                             backend="eager" if quick else "inductor")
    runs = speed["seconds"]
    speedup = summarise([e / c for e, c in zip(runs["eager"], runs["compiled"], strict=True)])
    compile_s, loss_diff = speed["compile_s"], speed["timed_loss_diff"]
    return {"item": f"torch.compile: the recipe's gated MLP ({width} wide, 8 blocks, batch {batch}), steady state, "
                    f"{repeats} interleaved blocks of {block} steps",
            "result": f"{speedup['median']:.2f}x eager ({speedup['min']:.2f}-{speedup['max']:.2f}) after "
                      f"{compile_s:.1f} s of compiling; loss difference {loss_diff:.1e}",
            "target": ">= 1.2x", "met": speedup["median"] >= 1.2, "speedup": speedup["median"],
            "speedup_range": speedup, "compile_s": compile_s, "loss_diff": loss_diff,
            "step_ms": {k: 1000 * statistics.median(v) for k, v in runs.items()}}
