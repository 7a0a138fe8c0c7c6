"""Checkpoints (docs/conventions.md): plain dicts of tensors and numbers, written atomically, loaded safely.

Writing goes to a temporary file beside the target, fsynced, then ``os.replace``d over it: a crash leaves the old
checkpoint or the new one, never half of one. Loading uses ``torch.load(weights_only=True)``: a pickle that would
run code is refused unrun. The model is saved unwrapped (no ``module.`` or ``_orig_mod.`` prefixes)."""

import errno
import math
import os
import random
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from common.cli import DERIVED_KEYS, RecipeError, option_name
from common.rundir import RunFolder, why_not_written
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
    fsync_dir(path.parent)  # the rename itself must reach the disk too


def fsync_dir(path: Path) -> None:
    """Make the folder's entries durable (a rename into it, say)."""
    if sys.platform != "win32":  # Windows opens no folder as a file, nor needs to: NTFS journals the rename
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as err:  # EINVAL and the like: a file system that syncs no folder; the rename stands as it is
            if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS):
                raise
        finally:
            os.close(fd)


def load_checkpoint(path: Path, recipe: str, entry: str = "model") -> dict:
    """A checkpoint written by ``recipe``, with an ``entry``; any problem is one RecipeError saying what to do."""
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
    if not isinstance(state, dict) or entry not in state:
        raise RecipeError(f"{path} is not a training checkpoint of this project (no {entry!r} entry)")
    if state.get("recipe") != recipe:
        raise RecipeError(f"{path} was written by recipe {state.get('recipe')!r}, not {recipe!r}")
    step, epoch = state.get("step", 0), state.get("steps_per_epoch")  # None: a run of steps; 0: one always finished
    if not isinstance(state.get("config", {}), dict) or any(type(n) is not int or n < low for n, low in
                                                            ((step, 0), (1 if epoch is None else epoch, 1))):
        raise RecipeError(f"{path} is damaged: its config is not a dict, or its step or epoch length not a count")
    return state


def load_model_state(model: nn.Module, state_dict: dict, source: Path, what: str = "checkpoint") -> None:
    """``load_state_dict`` with an error that lists what did not match, e.g. a checkpoint of another model."""
    if not isinstance(state_dict, dict):
        raise RecipeError(f"{what} {source} is damaged: its weights are a {type(state_dict).__name__}, not a dict")
    ours = (model := unwrap(model)).state_dict()
    shapes = {key: getattr(value, "shape", None) for key, value in state_dict.items()}  # a weight no tensor: None
    problems = {"missing": sorted(ours.keys() - shapes.keys()), "unexpected": sorted(map(str, shapes.keys() - ours)),
                "wrong shape": sorted(k for k in ours.keys() & shapes.keys() if ours[k].shape != shapes[k])}
    if any(problems.values()):
        shown = "; ".join(f"{label}: {', '.join(keys[:5])}{' ...' * (len(keys) > 5)}"
                          for label, keys in problems.items() if keys)
        raise RecipeError(f"{what} {source} does not fit this model ({shown})")
    model.load_state_dict(state_dict)


def rng_state(loader_generator: torch.Generator | None = None, device: torch.device | None = None) -> dict:
    """Every random stream a run draws from: python, torch, the training device's CUDA generator, the loader's
    (DataLoader workers resumed mid-epoch get new seeds: other random augmentation, the same sample order)."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if on_cuda else None,
            "loader": loader_generator.get_state() if loader_generator is not None else None}


def restore_rng_state(state: dict, loader_generator: torch.Generator | None = None,
                      device: torch.device | None = None) -> None:
    """Put back what ``rng_state`` saved; its CUDA stream onto ``device``, whichever GPU it was saved on."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # weights_only loading gives lists back
    torch.set_rng_state(state["torch"])
    if device is not None and torch.device(device).type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    if loader_generator is not None and state["loader"] is not None:
        loader_generator.set_state(state["loader"])


# Options that only say where and how fast to run (or only cut a run short): a resume may change them.
MAY_CHANGE = DERIVED_KEYS | {"max_steps", "run_dir", "resume", "checkpoint_every", "log_every", "num_workers", "device",
                            "compile", "data_dir", "config_file", "precision", "profile"}


def check_same_run(checkpoint: dict, source: Path, config: dict, may_change: set[str] = frozenset()) -> None:
    """Refuse, naming each difference, a resume with other options than the checkpoint's (its optimizer and scheduler
    state would silently override them), bar ``MAY_CHANGE`` and a recipe's ``may_change``; an option recorded on one
    side alone means another version of the recipe (an older one, a copy edited since) started the run."""
    saved, compared = checkpoint.get("config", {}), lambda keys: sorted(keys - MAY_CHANGE - may_change)
    there, here = saved.keys(), config.keys()  # (an option on one side alone: no value here could match it)
    changed = [f"{option_name(k)} {saved[k]} there, {config[k]} here" for k in compared(there & here) if saved[k] !=
               config[k]]
    versions = [f"it records no {option_name(k)} ({config[k]} here)" for k in compared(here - there)]
    versions += [f"it has {option_name(k)} {saved[k]}, which this version lacks" for k in compared(there - here)]
    if versions:
        raise RecipeError(f"checkpoint {source} was started by another version of this recipe ("
                          f"{'; '.join(versions + changed)}): use that version, or start afresh in another --run-dir")
    if changed:  # a process count is no option: say how to launch as many
        processes = saved.get("world_size")
        launch = "" if processes == config.get("world_size") else " in one process (plain python)" if processes == 1 \
            else f" in {processes} processes in all (torchrun's --nnodes x --nproc_per_node)"
        raise RecipeError(f"checkpoint {source} was started with other options ({'; '.join(changed)}): resume "
                          f"with the options it was started with{launch}, or start afresh in another --run-dir")


def resume_checkpoint(run: RunFolder, recipe: str, config: dict, may_change: set[str] = frozenset(),
                      load: Callable[[Path, str], dict] = load_checkpoint) -> dict | None:
    """The checkpoint ``run`` resumes from, loaded safely and checked to be of this run's options; None: none."""
    if run.resume_from is None:
        return None
    checkpoint = load(run.resume_from, recipe)
    if checkpoint.get("averaged"):
        raise RecipeError(f"checkpoint {run.resume_from} holds the averaged (EMA) weights, not the trained ones, so "
                          "no run can go on from it: resume from last.pt, or use it as it is")
    check_same_run(checkpoint, run.resume_from, config, may_change)
    if run.held is not None and run.resume_from.resolve() != run.held.resolve():
        raise RecipeError(f"{run.path} already holds checkpoints, and --resume {run.resume_from} is not its last one: "
                          "going on from it there would overwrite them. Continue that run with --resume auto, or go on "
                          f"from {run.resume_from} in another --run-dir")
    if run.resumes_another_run:  # its best.pt stays there: this folder's best, kept ones and patience are its own
        checkpoint |= {"best": {"score": math.nan, "step": 0}, "kept": {"kept": []}, "patience": {"since_best": 0}}
    return checkpoint


def diverged(what: str, last_good: Path | None) -> RecipeError:
    kept = "no checkpoint yet" if last_good is None else f"the last good checkpoint is {last_good}"
    return RecipeError(f"training diverged: {what}; {kept}. Try a lower --lr")


class Checkpointer:
    """A run's checkpoints, RUN_DIR/checkpoints/NAME, and restoring a run from one. Each holds the model, optimizer,
    scheduler, GradScaler, step (the loader's position), every random stream, the recipe and its options, the run's
    other ``parts`` (log, best score, EMA: with ``state_dict`` and ``load_state_dict``) and ``data`` to rebuild its
    model and data (a vocabulary, say). With several processes, rank 0 saves (``from_rank_0``), every rank restores."""

    def __init__(self, run: RunFolder, recipe: str, config: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 scaler: torch.amp.GradScaler | None = None, loader_generator: torch.Generator | None = None,
                 steps_per_epoch: int | None = None, parts: dict | None = None, data: dict | None = None,
                 data_id: str | None = None):
        self.folder, self.source, self.recipe, self.config = run.path / "checkpoints", run.resume_from, recipe, config
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.loader_generator, self.steps_per_epoch = loader_generator, steps_per_epoch
        self.parts, self.data, self.data_id = parts or {}, data or {}, data_id  # data_id: the training data's checksum
        self.last_good, self.last_step = run.resume_from, None  # what a failure leaves to resume from

    def training_state(self, step: int) -> dict:
        """Everything but the model and optimizer tensors."""
        return {"recipe": self.recipe, "config": self.config, "step": step, "steps_per_epoch": self.steps_per_epoch,
                "data_id": self.data_id, "epoch": step // self.steps_per_epoch if self.steps_per_epoch else 0,
                **{name: part.state_dict() for name, part in self.parts.items()},
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None and self.scaler.is_enabled() else None,
                "rng": rng_state(self.loader_generator, next(self.model.parameters()).device), **self.data}

    @torch.profiler.record_function("checkpoint")  # --profile leaves it out of the step it falls in
    def save(self, step: int, name: str = "last.pt", weights: nn.Module | None = None) -> None:
        """Write checkpoints/NAME, never with spoiled weights; ``weights``: another module's as its model (an EMA's)."""
        state = self.training_state(step)  # first: the log's read-back raises here on a non-finite loss
        state |= {"model": unwrap(weights or self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
                  "averaged": weights is not None}  # an EMA's weights, not the trained ones: no run goes on from them
        # A step can end with a finite loss yet inf/nan gradients, which spoil the weights it just updated.
        spoiled = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if spoiled:
            raise diverged(f"the weights hold inf/nan after step {step} ({spoiled[0]})", self.last_good)
        try:
            save_checkpoint(path := self.folder / name, state)
        except OSError as err:
            raise not_written(path, err, self.last_step) from None
        if name == "last.pt":
            self.last_good, self.last_step = path, step

    def restore(self, checkpoint: dict) -> int:
        """Put back what ``save`` saved, once the model is on its device (as its optimizer state is); the step."""
        load_model_state(self.model, checkpoint["model"], self.source)
        try:
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError, AttributeError) as err:
            raise RecipeError(f"checkpoint {self.source} does not fit this run's optimizer: {err}") from None
        return self.restore_training(checkpoint)

    def restore_training(self, checkpoint: dict) -> int:
        """What ``training_state`` saved; the step."""
        if checkpoint.get("steps_per_epoch") != self.steps_per_epoch:
            raise RecipeError(f"checkpoint {self.source} has {checkpoint.get('steps_per_epoch')} steps per epoch, this "
                              f"run {self.steps_per_epoch}: resume with the data and processes it was started with")
        if None not in (checkpoint.get("data_id"), self.data_id) and checkpoint["data_id"] != self.data_id:
            raise RecipeError(f"checkpoint {self.source} was trained on other data (its training data's checksum "
                              f"{checkpoint['data_id']}, this run's {self.data_id}): resume with the data it was "
                              "started with, or start afresh in another --run-dir")
        try:  # a checkpoint of an older version of the recipe may lack a part, or hold it in another form
            if self.scheduler is not None:  # its load_state_dict takes any dict: one without its settings (public
                settings = {key for key in self.scheduler.state_dict() if not key.startswith("_")}  # names) is junk
                if missing := settings - checkpoint["scheduler"].keys():
                    raise KeyError(f"scheduler {', '.join(sorted(missing))}")
                self.scheduler.load_state_dict(checkpoint["scheduler"])
            if self.scaler is not None and checkpoint["scaler"] is not None:
                self.scaler.load_state_dict(checkpoint["scaler"])
            for name, part in self.parts.items():
                part.load_state_dict(checkpoint[name])
            restore_rng_state(checkpoint["rng"], self.loader_generator, next(self.model.parameters()).device)
            self.last_step = checkpoint["step"]  # a failed save then names it as the checkpoint left intact
            return self.last_step
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
            raise RecipeError(f"checkpoint {self.source} lacks part of the training state, or holds it in another "
                              f"form ({type(err).__name__}: {err}): another version of this recipe wrote it") from None


def not_written(path: Path, err: OSError, last_step: int | None) -> RecipeError:
    intact = "no earlier checkpoint" if last_step is None else f"the previous checkpoint (step {last_step}) is intact"
    return RecipeError(f"could not write checkpoint {path}: {why_not_written(path.parent, err)}; {intact}")
