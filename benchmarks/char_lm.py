"""A character-level text that exists offline, the recipe's split of it, and a model's loss on the whole
validation split: how item 12 and benchmarks/beta2_sweep.py score tiny_transformer runs."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import harness
from benchmarks.harness import device_args, load_recipe, run_command

TEXT_CHARS = 1_115_394  # the length of nanoGPT's shakespeare_char input.txt


def char_text(path: Path, chars: int = TEXT_CHARS) -> Path:
    """A character-level text of ``chars`` characters that exists offline everywhere: the start of this
    Python's standard library as the recipe reads it (top-level modules in sorted order), written to ``path``."""
    tt = load_recipe("tiny_transformer")
    path.write_text(tt.stdlib_corpus().decode("utf-8")[:chars], encoding="utf-8")
    return path


def char_split(path: Path) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(vocab, train, val) of a text as the recipe splits it with --vocab chars: the sorted characters
    seen, the first 90% of the tokens and the last 10%."""
    tt = load_recipe("tiny_transformer")
    data = path.read_bytes()
    vocab = "".join(sorted(set(data.decode("utf-8"))))
    tokens = tt.encode(data, vocab)
    split = int(0.9 * len(tokens))
    return vocab, tokens[:split], tokens[split:]


@torch.no_grad()
def score_windows(model: nn.Module, tokens: torch.Tensor, block: int, batch: int = 256) -> float:
    """Mean next-token loss (nats) over the whole of ``tokens``, cut into non-overlapping windows of
    ``block``: every token but the first is predicted once (a window's first from no context). The tail
    shorter than a window is left out. Unlike the recipes' few random validation batches, nothing is sampled."""
    was_training = model.training
    model.eval()
    n = (len(tokens) - 1) // block
    x = tokens[: n * block].long().view(n, block)
    y = tokens[1 : n * block + 1].long().view(n, block)
    total = 0.0
    for xb, yb in zip(x.split(batch), y.split(batch), strict=True):
        logits = model(xb.to(harness.DEVICE))
        total += F.cross_entropy(logits.flatten(0, 1).float(), yb.to(harness.DEVICE).flatten(), reduction="sum").item()
    model.train(was_training)
    return total / (n * block)


def recipe_val_loss(run_dir: Path, val: torch.Tensor) -> float:
    """score_windows of the model in a tiny_transformer run's last.pt."""
    tt = load_recipe("tiny_transformer")
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True, map_location=harness.DEVICE)
    model = tt.GPT(tt.GPTConfig(**checkpoint["model_config"])).to(harness.DEVICE)
    model.load_state_dict(checkpoint["model"])
    return score_windows(model, val, model.config.block_size)


def train_recipe_lm(text: Path, run_dir: Path, settings: dict, seed: int) -> tuple[float, float]:
    """Train recipes/tiny_transformer.py on ``text`` (--vocab chars) with ``settings`` (option -> value, e.g.
    {"--beta2": 0.99}); returns (seconds, loss on the whole validation split)."""
    options = [str(a) for k, v in settings.items() for a in (k, v)]
    seconds, _ = run_command([sys.executable, "recipes/tiny_transformer.py", "--text", text, "--vocab", "chars",
                              *options, "--eval-every", settings["--steps"], "--eval-batches", 1,
                              "--sample-tokens", 1, "--seed", seed, "--run-dir", run_dir,
                              *device_args()])
    return seconds, recipe_val_loss(run_dir, char_split(text)[2])

