"""Checkpoints (docs/conventions.md): plain dicts of tensors and numbers, written atomically, loaded safely.

- Writing goes to a temporary file in the same folder, is flushed and fsynced, then ``os.replace``d over the
  target: a crash at any moment leaves either the old checkpoint or the new one, never half of one.
- Loading uses ``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers; a pickle
  that would run code is refused before any of it runs.
- The model is saved unwrapped (no ``module.`` / ``_orig_mod.`` prefixes), so a checkpoint from a compiled
  or DDP run loads into a plain model.
"""

import math
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from common.cli import RecipeError
from common.runtime import unwrap


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically. An OSError (a full disk, say) leaves no temporary file behind."""
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
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        # torch.save reports a failed write as a RuntimeError ("unexpected pos"); the OSError is its context
        if isinstance(err, RuntimeError) and isinstance(err.__context__, OSError):
            raise err.__context__ from None
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
        raise RecipeError(f"checkpoint {path} {'is a directory' if path.is_dir() else 'does not exist'}")
    try:
        with warnings.catch_warnings():  # a foreign file's pickle-protocol warning would only add noise
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        code = re.search(r"GLOBAL (\S+)", str(err))  # a pickle that would import and call code: refused unrun
        reason = (f"it refers to Python code ({code.group(1)}) that safe loading refuses to run" if code
                  else "it is corrupt, truncated, or not a PyTorch checkpoint")
        raise RecipeError(f"cannot load checkpoint {path}: {reason}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise RecipeError(f"{path} is not a training checkpoint of this project (no 'model' entry)")
    if state.get("recipe") != recipe:
        raise RecipeError(f"{path} was written by recipe {state.get('recipe')!r}, not {recipe!r}")
    return state


def load_model_state(model: nn.Module, state_dict: dict, source: Path) -> None:
    """``load_state_dict`` with an error that lists what did not match, e.g. a checkpoint of another model."""
    model = unwrap(model)
    expected = model.state_dict()
    problems = {
        "missing": sorted(set(expected) - set(state_dict)),
        "unexpected": sorted(set(state_dict) - set(expected)),
        "wrong shape": sorted(k for k in set(expected) & set(state_dict) if expected[k].shape != state_dict[k].shape),
    }
    if any(problems.values()):
        shown = "; ".join(f"{label}: {', '.join(keys[:5])}{' ...' * (len(keys) > 5)}"
                          for label, keys in problems.items() if keys)
        raise RecipeError(f"checkpoint {source} does not fit this model ({shown})")
    model.load_state_dict(state_dict)


def rng_state(loader_generator: torch.Generator | None = None, device: torch.device | None = None) -> dict:
    """Every random stream a run draws from, so a resumed run continues with the same numbers. Only the training
    device's CUDA generator, so the checkpoint does not depend on how many GPUs are visible. (Resumed
    mid-epoch, DataLoader workers get new seeds: that changes random augmentation in them, not sample order.)"""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if on_cuda else None,
            "loader": loader_generator.get_state() if loader_generator is not None else None}


def restore_rng_state(state: dict, loader_generator: torch.Generator | None = None,
                      device: torch.device | None = None) -> None:
    """Put back what ``rng_state`` saved. The CUDA stream goes to ``device``'s generator (``None``: CPU
    streams only), whichever GPU the checkpoint was written on."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # weights_only loading gives lists back
    torch.set_rng_state(state["torch"])
    if device is not None and torch.device(device).type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    if loader_generator is not None and state["loader"] is not None:
        loader_generator.set_state(state["loader"])


@dataclass(eq=False)
class TrainingState:
    """What a checkpoint holds, and how a run is restored from one: model, optimizer, scheduler, scaler,
    the step (which fixes the loader's position), every random stream and the best score so far, plus
    ``extra``: what the recipe needs to rebuild its model and data (sizes, vocabulary, feature statistics)."""

    recipe: str
    config: dict
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scaler: torch.amp.GradScaler | None = None
    loader_generator: torch.Generator | None = None
    steps_per_epoch: int | None = None
    extra: dict = field(default_factory=dict)
    ema: nn.Module | None = None  # an AveragedModel of the weights, with --ema
    step: int = 0
    best_score: float = -math.inf  # higher is better: an accuracy, or minus a loss
    best_step: int = 0
    kept_best: list = field(default_factory=list)  # [score, step] of each checkpoint kept by --keep-best
    evals_since_best: int = 0  # for --patience

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_dict(self) -> dict:
        return {
            "recipe": self.recipe, "config": self.config, "step": self.step,
            "epoch": self.step // self.steps_per_epoch if self.steps_per_epoch else 0,
            "steps_per_epoch": self.steps_per_epoch, "best_score": self.best_score, "best_step": self.best_step,
            "kept_best": self.kept_best, "evals_since_best": self.evals_since_best,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None and self.scaler.is_enabled() else None,
            "rng": rng_state(self.loader_generator, self.device),
            **self.extra,
        }

    def load_state_dict(self, state: dict, source: Path) -> None:
        """Put everything back where ``state_dict`` found it. Call it after the model is on its device
        (optimizer state loads onto the device of the parameters) and after ``check_same_run``."""
        load_model_state(self.model, state["model"], source)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and state["scaler"] is not None:
                self.scaler.load_state_dict(state["scaler"])
            if self.ema is not None:
                self.ema.load_state_dict(state["ema"])
        except (ValueError, KeyError, RuntimeError, TypeError) as err:
            raise RecipeError(f"checkpoint {source} does not fit this run's optimizer or schedule: {err}") from None
        try:  # a checkpoint of an older version of the recipe may lack a part, or hold it in another form
            restore_rng_state(state["rng"], self.loader_generator, self.device)
            self.step, self.best_score, self.best_step = state["step"], state["best_score"], state["best_step"]
            self.kept_best, self.evals_since_best = state["kept_best"], state["evals_since_best"]
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
            raise RecipeError(f"checkpoint {source} lacks part of the training state, or holds it in another "
                              f"form ({type(err).__name__}: {err}): another version of this recipe wrote it") from None
