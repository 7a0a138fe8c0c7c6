"""Checkpoints per CONVENTIONS.md: plain dicts of tensors and numbers, written atomically, loaded safely.

- Writing goes to a temporary file in the same folder, is flushed and fsynced, then ``os.replace``d over
  the target: a crash at any moment leaves either the old checkpoint or the new one, never half of one.
- Loading uses ``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers; a
  pickle that would run code is refused before any of it runs.
- The model is saved unwrapped (no ``module.`` / ``_orig_mod.`` prefixes), so a checkpoint from a
  compiled or DDP run loads into a plain model.
"""

import os
import random
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from common.cli import RecipeError
from common.resume import check_same_run
from common.runtime import unwrap


def save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a run killed in the middle of a save
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # Make the rename itself durable: the folder entry must reach the disk too.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path, recipe: str) -> dict:
    """Load a checkpoint written by ``recipe``; any problem is one RecipeError saying what to do."""
    if not path.is_file():
        raise RecipeError(f"checkpoint {path} does not exist")
    try:
        with warnings.catch_warnings():  # a foreign file's pickle-protocol warning would only add noise
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        code = re.search(r"GLOBAL (\S+)", str(err))
        if code:  # a pickle that would import and call something: refused before anything ran
            reason = f"it refers to Python code ({code.group(1)}) that safe loading refuses to run"
        else:
            reason = "it is corrupt, truncated, or not a PyTorch checkpoint"
        raise RecipeError(f"cannot load checkpoint {path}: {reason}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise RecipeError(f"{path} is not a training checkpoint of this project (no 'model' entry)")
    if state.get("recipe") != recipe:
        raise RecipeError(f"{path} was written by recipe {state.get('recipe')!r}, not {recipe!r}")
    return state


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint to resume from: ``last.pt`` (always complete, thanks to the atomic writes)."""
    path = run_dir / "checkpoints" / "last.pt"
    return path if path.is_file() else None


def load_model_state(model: nn.Module, state_dict: dict, source: Path) -> None:
    """``load_state_dict`` with an error that lists what did not match, e.g. a checkpoint of another model."""
    model = unwrap(model)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = sorted(
        k for k in set(expected) & set(state_dict) if tuple(expected[k].shape) != tuple(state_dict[k].shape)
    )
    if missing or unexpected or mismatched:
        parts = [
            f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
            for label, keys in [("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched)]
            if keys
        ]
        raise RecipeError(f"checkpoint {source} does not fit this model ({'; '.join(parts)})")
    model.load_state_dict(state_dict)


def rng_state(loader_generator: torch.Generator | None = None, device: torch.device | None = None) -> dict:
    """Every random stream a run draws from, so a resumed run continues with the same numbers.

    ``device``: the training device. On CUDA its generator alone is saved, not every visible GPU's: a run
    draws only on its own device, and a list per GPU would tie the checkpoint to the machine's GPU count.
    ``None`` (or a CPU/MPS device): the CPU streams only.

    Two limits: under DDP only rank 0 saves, so every rank resumes with rank 0's streams (the recipes draw
    no per-rank random numbers after start-up; add a gather here before adding dropout to ddp_mlp). And the
    loader generator seeds DataLoader workers: with workers, the rest of an epoch resumed part-way gets new
    worker seeds, which matters only for random augmentation inside workers (the order of samples does not
    depend on it; see ResumableSampler)."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if on_cuda else None,
        "loader": loader_generator.get_state() if loader_generator is not None else None,
    }


def restore_rng_state(state: dict, loader_generator: torch.Generator | None = None,
                      device: torch.device | None = None) -> None:
    """Put back what ``rng_state`` saved. The CUDA stream goes to ``device``'s generator (``None``: CPU
    streams only), whatever GPU or how many GPUs the checkpoint was written on."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # weights_only loading gives lists back
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device is not None and torch.device(device).type == "cuda" and cuda is not None:
        device = torch.device(device)
        if isinstance(cuda, list | tuple):
            # Checkpoints before the one-device form held one state per GPU visible to the saving process.
            # Its own GPU's entry is the one it drew from; with fewer GPUs visible at save time than our
            # index there is no stream to continue, and the generator keeps its seeded state.
            index = device.index if device.index is not None else torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
    if loader_generator is not None and state["loader"] is not None:
        loader_generator.set_state(state["loader"])


def training_state(
    recipe: str,
    config: dict,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    scaler: torch.amp.GradScaler | None,
    step: int,
    epoch: int,
    loader_generator: torch.Generator | None = None,
    steps_per_epoch: int | None = None,
    **extra,
) -> dict:
    """The checkpoint dict of CONVENTIONS.md; ``extra`` holds what the recipe needs to rebuild its model
    and data (vocabulary, feature statistics, best metric so far)."""
    return {
        "recipe": recipe,
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": step,
        "epoch": epoch,
        "steps_per_epoch": steps_per_epoch,
        "rng": rng_state(loader_generator),
        "config": config,
        **extra,
    }


def restore_training_state(
    state: dict,
    source: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    scaler: torch.amp.GradScaler | None,
    loader_generator: torch.Generator | None = None,
    steps_per_epoch: int | None = None,
) -> None:
    """Put model, optimizer, scheduler, scaler and RNG streams back where ``training_state`` found them,
    after ``check_same_run`` made sure that this run's options are the ones the checkpoint was trained with."""
    load_model_state(model, state["model"], source)
    check_same_run(state, source, optimizer, scheduler, steps_per_epoch)
    try:
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
    except (ValueError, KeyError, RuntimeError) as err:
        raise RecipeError(f"checkpoint {source} does not fit this run's optimizer or schedule: {err}") from None
    restore_rng_state(state["rng"], loader_generator)
