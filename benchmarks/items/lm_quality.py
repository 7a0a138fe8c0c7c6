"""Item 12. Language-model quality: the recipe against nanoGPT's model and training loop, same settings."""

import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import harness
from benchmarks.char_lm import TEXT_CHARS, char_split, char_text, score_windows, train_recipe_lm
from benchmarks.harness import summarise
from benchmarks.nanogpt import NanoGPT

# nanoGPT's data/shakespeare_char + config/train_shakespeare_char.py with its README's CPU overrides
NANOGPT_CPU = {"block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128, "lr": 1e-3,
               "min_lr": 1e-4, "warmup": 100, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "grad_clip": 1.0}


def nanogpt_train(train: torch.Tensor, vocab_size: int, steps: int, seed: int, c: dict = NANOGPT_CPU) -> nn.Module:
    """nanoGPT's train.py loop, rebuilt: random windows from the global RNG (get_batch), the rate set every
    iteration (linear warmup, cosine to min_lr at lr_decay_iters = max_iters), AdamW over its two groups (decay
    on tensors of 2+ dimensions), clipping, no gradient accumulation, dropout 0. AdamW is torch's fused kernel,
    the implementation the recipe uses (nanoGPT fuses on CUDA only; on a CPU it would run the foreach one)."""
    torch.manual_seed(1337 + seed)  # nanoGPT: 1337 + seed_offset
    model = NanoGPT(vocab_size, c["block_size"], c["n_layer"], c["n_head"], c["n_embd"]).to(harness.DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=c["lr"], betas=(c["beta1"], c["beta2"]), fused=True)

    def get_lr(it: int) -> float:
        if it < c["warmup"]:
            return c["lr"] * (it + 1) / (c["warmup"] + 1)
        ratio = (it - c["warmup"]) / max(1, steps - c["warmup"])
        return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["lr"] - c["min_lr"])

    block, data = c["block_size"], train.long()
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        ix = torch.randint(len(data) - block, (c["batch_size"],))
        x = torch.stack([data[i : i + block] for i in ix]).to(harness.DEVICE)
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix]).to(harness.DEVICE)
        logits = model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def lm_quality(quick: bool, work: Path) -> dict:
    """Validation loss of the recipe against nanoGPT's model and loop, trained alike: the same character-level
    text (char_text: the first 1,115,394 characters of this Python's standard library, 90/10 split), the same
    shape (nanoGPT's CPU configuration: 4 layers, 128 wide, 4 heads, block 64, batch 12), steps and optimizer
    settings (lr 1e-3 to 1e-4 by cosine after 100 warmup steps, betas 0.9/0.99, weight decay 0.1, clipping 1.0),
    two seeds each; both scored by score_windows on the whole validation split."""
    c = NANOGPT_CPU
    text = char_text(work / "lm_text.txt", 20_000 if quick else TEXT_CHARS)
    steps, seeds = (5, [0]) if quick else (600, [0, 1])
    vocab, train, val = char_split(text)
    settings = {"--steps": steps, "--batch-size": c["batch_size"], "--block-size": c["block_size"],
                "--n-layer": c["n_layer"], "--n-head": c["n_head"], "--n-embd": c["n_embd"], "--lr": c["lr"],
                "--min-lr-ratio": c["min_lr"] / c["lr"], "--warmup-steps": min(c["warmup"], steps - 1),
                "--beta1": c["beta1"], "--beta2": c["beta2"], "--weight-decay": c["weight_decay"],
                "--max-grad-norm": c["grad_clip"]}
    config = c | {"warmup": min(c["warmup"], steps - 1)}
    losses = {"ours": [], "nanogpt": []}
    for seed in seeds:  # interleaved: ours, nanoGPT, ours, ...
        losses["ours"].append(train_recipe_lm(text, work / f"lm_run{seed}", settings, seed)[1])
        model = nanogpt_train(train, len(vocab), steps, seed, config)
        losses["nanogpt"].append(score_windows(model, val, c["block_size"]))
    figures = {k: summarise(v) for k, v in losses.items()}
    diff = statistics.mean(losses["ours"]) - statistics.mean(losses["nanogpt"])
    shown = "; ".join(f"{name} {', '.join(f'{v:.4f}' for v in values)}" for name, values in losses.items())
    return {"item": f"Language-model quality: ours vs nanoGPT's model and loop, same text, shape (4x128, block 64, "
                    f"batch 12), {steps} steps and optimizer; validation loss on the whole split, nats/char",
            "result": f"{shown} (seeds {', '.join(map(str, seeds))}); ours minus nanoGPT {diff:+.4f}",
            "target": "ours <= nanoGPT + 0.02 nats/char (the seed-to-seed spread)", "met": diff <= 0.02,
            "val_loss": figures, "val_loss_runs": losses, "difference": diff, "steps": steps,
            "text_chars": len(text.read_text(encoding="utf-8"))}

