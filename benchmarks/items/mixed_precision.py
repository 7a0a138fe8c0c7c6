"""Item 5. Mixed precision: the mixed_precision recipe's MLP in fp32, bf16 and fp16 autocast."""

import torch

from benchmarks import harness
from benchmarks.harness import load_recipe, summarise


def mixed_precision(quick: bool) -> dict:
    """Seconds per training step of the recipe's MLP (784-1024x3-10, AdamW, batch 512) in fp32, bf16 and fp16
    autocast, measured as the recipe's --compare measures them (mixed_precision.measure_speed: fresh models, the
    median of a few steps after a warm-up, interleaved fp32, bf16, fp16, fp32, ...); the speed-up is fp32's
    seconds over the other's, per round."""
    mp = load_recipe("mixed_precision")
    sizes = {"width": 128 if quick else 1024, "depth": 3, "batch_size": 64 if quick else 512}
    repeats = 1 if quick else 3
    runs = mp.measure_speed(torch.device(harness.DEVICE), **sizes, repeats=repeats)
    rows = {p: summarise([f / x for f, x in zip(runs["fp32"], runs[p], strict=True)]) for p in runs}
    return {"item": "Mixed precision: speed-up over fp32, the recipe's MLP (784-1024x3-10, batch 512), "
                    f"{repeats} interleaved rounds",
            "result": ", ".join(f"{p} {rows[p]['median']:.2f}x ({rows[p]['min']:.2f}-{rows[p]['max']:.2f})"
                                for p in ("bf16", "fp16")),
            "target": "bf16 >= 1.5x (needs native bf16 matmul: AVX-512 BF16/AMX or a GPU)",
            "met": rows["bf16"]["median"] >= 1.5, "speedup": {p: r["median"] for p, r in rows.items()},
            "speedup_range": rows, "seconds_per_step": runs}

