"""nanoGPT's train.py as it runs on a CPU, rebuilt as a script to time against (benchmark item 14).

    python benchmarks/nanogpt_train.py DATA_DIR --max-iters 2000 --out-dir OUT

DATA_DIR holds train.bin and val.bin (uint16 token ids, as nanoGPT's data/shakespeare_char/prepare.py writes
them) and meta.pkl's one fact, the vocabulary size, as vocab_size.txt. What it does is train.py with
config/train_shakespeare_char.py and its README's CPU overrides (``--device=cpu --compile=False
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``): fp32 (train.py autocasts only on CUDA), AdamW as its
configure_optimizers builds it (fused only on CUDA), the rate set every iteration (linear warmup from 0 over 100
iterations, cosine to 1e-4), a loss estimate on 20 batches of each split every 250 iterations (iterations 0 to
max_iters inclusive, as train.py counts them) with a checkpoint when the validation loss improves, and a printed
line (loss.item()) every iteration. Its model is benchmarks/nanogpt.py's.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.nanogpt import NanoGPT

CPU = {"block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128, "learning_rate": 1e-3,
       "min_lr": 1e-4, "warmup_iters": 100, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "grad_clip": 1.0,
       "eval_interval": 250, "eval_iters": 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--max-iters", type=int, default=2000)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    c, max_iters = CPU, args.max_iters
    torch.manual_seed(1337)
    data = {split: np.memmap(args.data_dir / f"{split}.bin", dtype=np.uint16, mode="r") for split in ("train", "val")}
    vocab_size = int((args.data_dir / "vocab_size.txt").read_text())

    def get_batch(split: str):
        ix = torch.randint(len(data[split]) - c["block_size"], (c["batch_size"],))
        x = torch.stack([torch.from_numpy(data[split][i : i + c["block_size"]].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[split][i + 1 : i + 1 + c["block_size"]].astype(np.int64)) for i in ix])
        return x, y

    model = NanoGPT(vocab_size, c["block_size"], c["n_layer"], c["n_head"], c["n_embd"])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]))  # fused: CUDA only

    def loss_of(x, y):
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        model.eval()
        out = {split: torch.stack([loss_of(*get_batch(split)) for _ in range(c["eval_iters"])]).mean().item()
               for split in ("train", "val")}
        model.train()
        return out

    def get_lr(it: int) -> float:
        if it < c["warmup_iters"]:
            return c["learning_rate"] * it / c["warmup_iters"]
        if it > max_iters:
            return c["min_lr"]
        ratio = (it - c["warmup_iters"]) / (max_iters - c["warmup_iters"])
        return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])

    args.out_dir.mkdir(parents=True, exist_ok=True)
    best_val, t0, x, y = 1e9, time.time(), *get_batch("train")
    for it in range(max_iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        if it % c["eval_interval"] == 0:
            losses = estimate_loss()
            print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val:
                best_val = losses["val"]
                if it > 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it},
                               args.out_dir / "ckpt.pt")
        loss = loss_of(x, y)
        x, y = get_batch("train")  # the next batch, fetched while (on a GPU) the backward pass is queued
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        print(f"iter {it}: loss {loss.item():.4f}, time {(t1 - t0) * 1000:.2f}ms")
        t0 = t1


if __name__ == "__main__":
    main()
