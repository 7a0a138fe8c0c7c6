"""Item 14. Fast out of the box: tiny_transformer with its defaults against nanoGPT's train.py as it sets itself up
on a CPU, at nanoGPT's shakespeare-char CPU configuration, launch to exit."""

import statistics
import sys
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.char_lm import TEXT_CHARS, char_split, char_text, recipe_val_loss
from benchmarks.harness import device_args, interleaved, run_command, summarise
from common.runtime import native_bf16

# config/train_shakespeare_char.py with the README's CPU overrides; the rest is each project's own default
SHAPE = {"--block-size": 64, "--batch-size": 12, "--n-layer": 4, "--n-head": 4, "--n-embd": 128, "--lr": 1e-3,
         "--min-lr-ratio": 0.1, "--warmup-steps": 100, "--beta2": 0.99, "--weight-decay": 0.1, "--max-grad-norm": 1.0}


def defaults_vs_peer(quick: bool, work: Path) -> dict:
    steps, repeats = (10, 1) if quick else (2000, 2)
    text = char_text(work / "peer_text.txt", 20_000 if quick else TEXT_CHARS)
    vocab, train, val = char_split(text)
    data = work / "peer_data"
    data.mkdir(exist_ok=True)
    for name, tokens in (("train", train), ("val", val)):  # as nanoGPT's prepare.py writes them
        np.asarray(tokens, dtype=np.uint16).tofile(data / f"{name}.bin")
    (data / "vocab_size.txt").write_text(str(len(vocab)))
    shape = SHAPE | ({"--warmup-steps": steps // 10} if quick else {})  # a warm-up shorter than the run
    options = [str(a) for k, v in shape.items() for a in (k, v)]
    runs = {"auto": [], "fp32": []}

    quick_extra = ["--eval-batches", 1, "--sample-tokens", 1] if quick else []  # quick: the path, not the figures

    def recipe(precision: str) -> float:
        repeat = len(runs[precision])  # each repeat its own seed: the losses' mean is over as many runs
        run_dir = work / f"peer_{precision}_{repeat}"
        seconds, _ = run_command([sys.executable, "recipes/tiny_transformer.py", "--text", text, "--vocab", "chars",
                                  "--steps", steps, *options, *(["--precision", "fp32"] if precision == "fp32" else []),
                                  "--seed", repeat, *quick_extra, "--run-dir", run_dir, *device_args()])
        runs[precision].append(run_dir)
        return seconds

    def nanogpt() -> float:
        return run_command([sys.executable, "benchmarks/nanogpt_train.py", data, "--max-iters", steps - 1,
                            "--out-dir", work / "peer_nanogpt"])[0]

    seconds = interleaved(repeats, alternate=True,  # every other round in reverse: none always runs first
                          nanogpt=nanogpt, auto=lambda: recipe("auto"), fp32=lambda: recipe("fp32"))
    speedup = summarise([n / a for n, a in zip(seconds["nanogpt"], seconds["auto"], strict=True)])
    losses = {p: [recipe_val_loss(d, val) for d in dirs] for p, dirs in runs.items()}
    gap = abs(statistics.mean(losses["auto"]) - statistics.mean(losses["fp32"]))
    native = native_bf16(harness.DEVICE)
    goal = 1.3 if native else 1.05
    return {"item": f"Fast out of the box: tiny_transformer's defaults (auto precision) vs nanoGPT's train.py as it "
                    f"sets itself up on a {harness.DEVICE.type} (shakespeare-char CPU configuration, {steps} steps, "
                    "launch to exit, the same text); validation loss on the whole split",
            "result": f"{speedup['median']:.2f}x nanoGPT's speed ({speedup['min']:.2f}-{speedup['max']:.2f}; "
                      f"{statistics.median(seconds['auto']):.0f} s vs {statistics.median(seconds['nanogpt']):.0f} s, "
                      f"{repeats} interleaved); fp32 {statistics.median(seconds['fp32']):.0f} s; validation loss auto "
                      f"{statistics.mean(losses['auto']):.4f} vs fp32 {statistics.mean(losses['fp32']):.4f} "
                      f"(difference {gap:.4f}; means over seeds {', '.join(map(str, range(repeats)))})",
            "target": f">= {goal}x ({'native' if native else 'no native'} bf16 here), loss within 0.01 of fp32",
            "met": speedup["median"] >= goal and gap <= 0.01, "run_seconds": seconds, "val_loss": losses,
            "speedup": speedup}
