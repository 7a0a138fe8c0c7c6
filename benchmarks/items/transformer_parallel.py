"""Item 11. Transformer: DDP and FSDP2 at 2 ranks against 1 process."""

import json
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import run_command


def transformer_parallel(quick: bool, work: Path) -> dict:
    """tiny_transformer at 2 ranks (DDP, FSDP2) against 1 process, the same global batch: tokens/s, peak RSS
    per rank, and FSDP's model state per rank over one process's (issue: <= 0.55x at 2 ranks, default model)."""
    item = "Transformer: DDP and FSDP2 at 2 ranks vs 1 process (default model, one thread each)"
    if harness.DEVICE.type != "cpu":
        return {"item": item, "result": f"skipped: CPU item (gloo), not --device {harness.DEVICE}",
                "target": "<= 0.55x", "met": None}
    steps = 4 if quick else 30
    common = ["recipes/tiny_transformer.py", "--steps", steps, "--eval-every", steps, "--eval-batches", 2,
              "--sample-tokens", 8, "--peak-flops", 1e11, "--global-batch", 32, "--device", "cpu"]
    if quick:
        common += ["--n-layer", 2, "--n-embd", 32, "--block-size", 16]
    figures = {}
    for label, launcher, parallel in [("one", [sys.executable], "none"),
                                      ("ddp", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"],
                                       "ddp"),
                                      ("fsdp", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"],
                                       "fsdp")]:
        run_dir = work / f"tt_{label}"
        run_command([*launcher, *common, "--parallel", parallel, "--run-dir", run_dir], env={"OMP_NUM_THREADS": "1"})
        metrics = json.loads((run_dir / "metrics.json").read_text())
        memory = metrics["memory"]  # rank 0's: per rank
        figures[label] = {"tokens_per_s": metrics["tokens_per_s"], "peak_rss_bytes": memory["peak_rss_bytes"],
                          "model_state_bytes": memory["model_state_bytes"]}
    ratio = figures["fsdp"]["model_state_bytes"] / figures["one"]["model_state_bytes"]
    speed = "; ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s, RSS {v['peak_rss_bytes'] / 2**20:,.0f} MiB/rank"
                      for k, v in figures.items())
    return {"item": item, "result": f"FSDP model state per rank {ratio:.3f}x of one process; {speed}",
            "target": "<= 0.55x", "met": ratio <= 0.55, "memory_ratio": ratio, "runs": figures}

