"""Item 4. Tiny transformer: tokens/s and MFU, ours against nanoGPT's model, fp32/bf16, eager/compiled."""

import statistics
import time

import torch
from torch import nn

from benchmarks import harness
from benchmarks.harness import interleaved, load_recipe, summarise
from benchmarks.nanogpt import NanoGPT
from common.loop import train_step
from common.peak_flops import device_peak_flops, measure_matmul_flops


def tokens_per_second(model: nn.Module, precision: str, steps: int, fused: bool, batch: int = 32,
                      block: int = 128) -> float:
    """Training throughput of one setup (model and optimizer) with the same step: AdamW with weight decay on
    matrices (both projects' grouping), clipping 1.0, random tokens; ``fused``: torch's fused AdamW kernel
    (one kernel for every tensor) or its default (foreach) implementation."""
    tt = load_recipe("tiny_transformer")
    optimizer = torch.optim.AdamW(tt.parameter_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), fused=fused)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(256, (batch, block), generator=g), torch.randint(256, (batch, block), generator=g)
    for _ in range(2):  # warm-up (and compilation, when compiled)
        stats = train_step(model, optimizer, tt.lm_loss, [(x, y)], device=harness.DEVICE, precision=precision,
                           max_grad_norm=1.0)
    stats.loss.item()  # a GPU's queued warm-up work is done before the clock starts
    started = time.perf_counter()
    for _ in range(steps):
        stats = train_step(model, optimizer, tt.lm_loss, [(x, y)], device=harness.DEVICE, precision=precision,
                           max_grad_norm=1.0)
    stats.loss.item()
    return steps * batch * block / (time.perf_counter() - started)


def transformer(quick: bool) -> dict:
    """Tokens/s of the recipe's GPT against nanoGPT's (train.py's defaults: bias=False), 4x128, block 128,
    batch 32, fp32, interleaved (ours, nanoGPT, nanoGPT as shipped, ...). The headline ratio gives both the
    same optimizer implementation (fused AdamW); the second line is each project as it sets itself up: the
    recipe fuses AdamW on a CPU, nanoGPT only on CUDA. MFU: model FLOPs per token (6 per parameter plus
    attention) x tokens/s, over the datasheet peak where one is known (GPUs), and over measured matmul
    FLOP/s (named as such: an achievable peak, so that MFU reads higher)."""
    tt = load_recipe("tiny_transformer")
    shape = {"block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}

    def ours(attention: str = "sdpa"):
        torch.manual_seed(0)
        return tt.GPT(tt.GPTConfig(vocab_size=256, attention=attention, **shape)).to(harness.DEVICE)

    def nanogpt():
        torch.manual_seed(0)
        return NanoGPT(256, **shape).to(harness.DEVICE)

    steps, repeats, batch = (2, 1, 4) if quick else (15, 5, 32)  # quick: the path, not the figures
    nanogpt_fuses = harness.DEVICE.type == "cuda"  # nanoGPT's configure_optimizers: fused only on CUDA
    side_by_side = interleaved(repeats, alternate=True,  # every other round in reverse: none always runs first
                               ours=lambda: tokens_per_second(ours(), "fp32", steps, fused=True, batch=batch),
                               nanogpt=lambda: tokens_per_second(nanogpt(), "fp32", steps, fused=True, batch=batch),
                               nanogpt_own=lambda: tokens_per_second(nanogpt(), "fp32", steps, fused=nanogpt_fuses,
                                                                     batch=batch))
    same = summarise([a / b for a, b in zip(side_by_side["ours"], side_by_side["nanogpt"], strict=True)])
    own = summarise([a / b for a, b in zip(side_by_side["ours"], side_by_side["nanogpt_own"], strict=True)])
    flops_per_token = ours().flops_per_token()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    sources = {name: device_peak_flops(harness.DEVICE, dtype) for name, dtype in dtypes.items()} \
        if harness.DEVICE.type == "cuda" else {}  # a GPU's datasheet figure, where its name is known
    datasheet = {name: figure for name, (figure, source) in sources.items() if source.startswith("datasheet")}
    # measured in this run, the best of a few: the recipes' cached figure may be another day's, on a busier machine
    measured = {name: max(measure_matmul_flops(harness.DEVICE, dtype) for _ in range(1 if quick else 3))
                for name, dtype in dtypes.items()}
    variants = {"fp32 eager": statistics.median(side_by_side["ours"])}
    bf16_steps = 1 if measured["bf16"] < 0.2 * measured["fp32"] else steps  # emulated bf16 is very slow: one step
    # bf16 as the recipe runs it by default (--attention auto: einsum on a CPU, whose fused attention is slow in bf16)
    variants["bf16 eager"] = tokens_per_second(ours(tt.resolve_attention("auto", harness.DEVICE, "bf16")), "bf16",
                                               bf16_steps, fused=True, batch=batch)
    # quick mode only checks the path: Dynamo without Inductor's (slow) code generation
    variants["fp32 compiled"] = tokens_per_second(torch.compile(ours(), backend="eager" if quick else "inductor"),
                                                  "fp32", steps, fused=True, batch=batch)
    precision_of = {"fp32 eager": "fp32", "bf16 eager": "bf16", "fp32 compiled": "fp32"}
    # datasheet: each variant against its precision's peak, as MFU is usually quoted; measured: against the
    # fastest matmul measured here in either precision (emulated bf16, without native units, is slower than fp32)
    mfu_datasheet = {name: flops_per_token * tps / datasheet[precision_of[name]]
                     for name, tps in variants.items() if precision_of[name] in datasheet}
    mfu_measured = {name: flops_per_token * tps / max(measured.values()) for name, tps in variants.items()}

    def shown_mfu(name):
        parts = [f"{mfu_datasheet[name]:.0%} of datasheet"] if name in mfu_datasheet else []
        return ", ".join([*parts, f"{mfu_measured[name]:.0%} of measured matmul"])

    shown = ", ".join(f"{name} {tps:,.0f} tok/s (MFU {shown_mfu(name)})" for name, tps in variants.items())
    own_line = ("the same setup on CUDA (nanoGPT fuses there too)" if nanogpt_fuses else
                f"{own['median']:.2f}x ({own['min']:.2f}-{own['max']:.2f}) against nanoGPT as it sets itself up "
                f"(unfused AdamW on a CPU, {statistics.median(side_by_side['nanogpt_own']):,.0f} tok/s)")
    return {"item": f"Tiny transformer (4x128, block 128, batch {batch}, fp32): ours vs nanoGPT's model (bias=False, "
                    "its train.py default), same optimizer (fused AdamW)",
            "result": f"same optimizer: {same['median']:.2f}x nanoGPT ({same['min']:.2f}-{same['max']:.2f}; "
                      f"{statistics.median(side_by_side['ours']):,.0f} vs "
                      f"{statistics.median(side_by_side['nanogpt']):,.0f} tok/s, {repeats} interleaved runs); "
                      f"recipe's own setup: {own_line}; {shown}",
            "target": ">= 1.00x nanoGPT, same optimizer", "met": same["median"] >= 1.0, "ratio_vs_nanogpt": same,
            "ratio_vs_nanogpt_own_setup": own, "tokens_per_s": variants,
            "nanogpt_tokens_per_s": {"same_optimizer": statistics.median(side_by_side["nanogpt"]),
                                     "own_setup": statistics.median(side_by_side["nanogpt_own"])},
            "mfu": mfu_datasheet or mfu_measured, "mfu_datasheet": mfu_datasheet, "mfu_measured_matmul": mfu_measured,
            "peak_flops": {"datasheet": datasheet, "measured_matmul": measured},
            "peak_flops_source": {"datasheet": {name: source for name, (_, source) in sources.items()},
                                  "measured_matmul": f"best of {1 if quick else 3} in this run"}}

