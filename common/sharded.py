"""Sharded checkpoints with torch.distributed.checkpoint (DCP), for models whose state is split across ranks
(FSDP2's DTensor parameters) and that may be resumed at another number of ranks.

    checkpoints/dcp/step-000120/     one complete checkpoint: a folder, made current by renaming it
        __0_0.distcp, __1_0.distcp   each rank's shards of the model and optimizer state (written in parallel)
        .metadata                    which rank wrote which piece of which tensor (DCP's own index)
        trainer.pt                   the rest of the training state: step, RNG, scheduler, best score, config
    checkpoints/dcp/.step-000130.tmp a save in progress, or one a crash cut short: never resumed from
    checkpoints/last.pt, best.pt     at the end of the run, the usual single files (--sample-only, export.py)

Every rank writes its shards into the ``.tmp`` folder; once all have (DCP writes ``.metadata`` last, on rank 0),
rank 0 adds ``trainer.pt`` and renames the folder to ``step-N``: atomic, so a crash leaves it absent or complete.
``get_state_dict`` keys the state by parameter name (DTensor shards); ``dcp.load`` reads into the loader's layout.
"""

import logging
import os
import re
import shutil
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from common.best import BestScore
from common.checkpoint import Checkpointer, diverged, fsync_dir, load_checkpoint, not_written, save_checkpoint
from common.cli import RecipeError
from common.dcp_check import check_dcp_folder, incomplete
from common.resources import local
from common.rundir import RunFolder, last_file
from common.runtime import from_rank_0

KEEP = 3  # complete checkpoints kept, besides the best one
STEP_DIR = re.compile(r"step-(\d+)")


@contextmanager
def quiet_single_process():
    """DCP without its no-process-group warning (one process is meant) or its logged tracebacks (one line will do)."""
    previous = logging.root.manager.disable
    logging.disable(max(previous, logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        logging.disable(previous)


def complete_checkpoints(folder: Path, warn: bool = False) -> list[Path]:
    """The complete step-N checkpoints in ``folder``, oldest first; ``warn``: on stderr, of those that are not."""
    found = []
    steps = [path for path in folder.glob("step-*") if STEP_DIR.fullmatch(path.name) and path.is_dir()]
    for path in sorted(steps, key=lambda path: int(path.name.removeprefix("step-"))):
        if (why := incomplete(path)) is None:
            found.append(path)
        elif warn:  # copied in part, or damaged
            print(f"warning: {path} is incomplete ({why}); not resuming from it", file=sys.stderr)
    for tmp in folder.glob(".step-*.tmp") if warn else []:
        print(f"warning: {tmp} is a save that never finished; ignored", file=sys.stderr)
    return found


def load_trainer_state(path: Path, recipe: str) -> dict:
    """``trainer.pt`` of a DCP checkpoint folder: everything but the model and optimizer tensors."""
    if not path.is_dir():
        return load_checkpoint(path, recipe)
    if not (path / ".metadata").is_file() or not (path / "trainer.pt").is_file():
        raise RecipeError(f"{path} is not a complete sharded checkpoint (no .metadata or trainer.pt)")
    check_dcp_folder(path)  # before DCP unpickles its .metadata and its non-tensor values, running what they name
    return {**load_checkpoint(path / "trainer.pt", recipe, entry="step"), "sharded": True}


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read a DCP checkpoint into ``model`` (and ``optimizer``), resharded to this run's layout."""
    optimizers = [] if optimizer is None else [optimizer]
    model_sd, optim_sd = get_state_dict(model, optimizers)  # also creates AdamW's (still lazy) state
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        with quiet_single_process():
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise_if_interrupted(err)  # a Ctrl-C during the load: that is no damaged checkpoint
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]  # DCP's: a traceback; its last line
        raise RecipeError(f"checkpoint {path} does not fit this model or optimizer, or is damaged: {reason}") from None
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_full(path: Path, checkpoint: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A single-file checkpoint's whole tensors into a sharded model and its optimizer (keyed by parameter name, as
    ``finish`` writes them): every rank holds the file and keeps its own shards."""
    try:
        set_state_dict(model, [optimizer], model_state_dict=checkpoint["model"],
                       optim_state_dict=checkpoint["optimizer"], options=StateDictOptions(full_state_dict=True))
    except (RuntimeError, KeyError, ValueError, TypeError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise RecipeError(f"checkpoint {path} does not fit this model or optimizer: {reason}") from None


def to_single_file(step_dir: Path, out: Path, recipe: str) -> None:
    """A DCP checkpoint folder as the usual single file (full tensors, one process), which ``--sample-only`` and
    scripts/export.py read. The optimizer state stays keyed by parameter name, as get_state_dict gives it."""
    trainer = {key: value for key, value in load_trainer_state(step_dir, recipe).items() if key != "sharded"}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.dcp.tmp")
    try:
        with quiet_single_process(), open(tmp, "wb") as f:  # a file: a failed write is then a Python OSError
            dcp_to_torch_save(step_dir, f)
        tensors = torch.load(tmp, map_location="cpu", weights_only=True)
    finally:
        tmp.unlink(missing_ok=True)
    save_checkpoint(out, {**trainer, **tensors})


def last_sharded(run_dir: Path, warn: bool = False) -> Path | None:
    """The checkpoint ``--resume auto`` continues a sharded run from: its newest complete step folder, else its
    last.pt (``warn``: say which folders are incomplete, and skipped)."""
    found = complete_checkpoints(run_dir / "checkpoints" / "dcp", warn)
    return found[-1] if found else last_file(run_dir)


class ShardedCheckpointer:
    """A run's checkpoints as DCP step folders, which every rank writes its shards into (call ``save`` and
    ``restore`` on every rank), resumable at any number of ranks. A step folder holds the model and optimizer
    shards; ``trainer.pt`` beside them holds the rest, as a ``Checkpointer`` makes it (which this one keeps, as
    ``files``, for that and for the single files). The last ``KEEP`` folders and the best one are kept; ``finish``
    leaves the usual single files last.pt and best.pt for one-process use (sampling, export)."""

    def __init__(self, run: RunFolder, recipe: str, config: dict, *, best: BestScore, **state):
        self.files = Checkpointer(run, recipe, config, **state)
        self.dcp_dir, self.best, self.last_good, self.last_step = self.files.folder / "dcp", best, run.resume_from, None

    @torch.profiler.record_function("checkpoint")  # --profile leaves it out of the step it falls in
    def save(self, step: int, name: str = "last.pt") -> None:
        """Write checkpoints/dcp/step-N (every rank its shards) and make it current once complete. best.pt and
        last.pt of one step are one folder, written once."""
        if step == self.last_step:
            return
        state = self.files.training_state(step)  # first: the log's read-back raises here on a non-finite loss
        final = self.dcp_dir / f"step-{step:06d}"
        if self.last_good and final.resolve() == self.last_good.resolve():  # the step it resumed from (to finish)
            return from_rank_0(lambda: self.complete(state, final, final))  # again: its shards are these weights
        model_sd, optim_sd = get_state_dict(self.files.model, self.files.optimizer)  # (the flag: on a GPU for nccl)
        spoiled = torch.tensor([float(any(v.is_floating_point() and not torch.isfinite(local(v)).all() for v in
                                          model_sd.values()))], device=next(self.files.model.parameters()).device)
        if dist.is_initialized():  # every rank holds other shards: the answer is the group's
            dist.all_reduce(spoiled, op=dist.ReduceOp.MAX)
        if spoiled.item():
            raise diverged(f"the weights hold inf/nan after step {step}", self.last_good)
        tmp = self.dcp_dir / f".{final.name}.tmp"
        from_rank_0(lambda: clear_unfinished(self.dcp_dir))
        try:
            with quiet_single_process():  # dcp.save returns once every rank has written its shards
                dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
        except (OSError, CheckpointException) as err:  # DCP wraps a rank's OSError in its BaseException
            from_rank_0(lambda: shutil.rmtree(tmp, ignore_errors=True))
            raise not_written(final, failure(err, self.dcp_dir), self.last_step or self.files.last_step) from None
        from_rank_0(lambda: self.complete(state, tmp, final))  # no rank goes on before it is complete
        self.last_good, self.last_step = final, step

    def complete(self, state: dict, tmp: Path, final: Path) -> None:
        """Rank 0: add trainer.pt, rename the folder (the moment it counts), prune old ones. ``tmp`` ``final``: the
        step a run resumed from, saved again: its trainer.pt alone (rewritten whole, a kill could lose the step)."""
        try:
            save_checkpoint(tmp / "trainer.pt", state)
            if tmp != final and final.exists():  # an unfinished folder of this step, which a resume skipped
                shutil.rmtree(final)
            os.replace(tmp, final)  # (the same folder: nothing to do)
            fsync_dir(self.dcp_dir)
        except OSError as err:
            if tmp != final:
                shutil.rmtree(tmp, ignore_errors=True)
            raise not_written(final, err, self.last_step or self.files.last_step) from None
        prune(self.dcp_dir, self.best.step)

    def restore(self, checkpoint: dict) -> int:
        """Read a sharded checkpoint's tensors straight into this run's shards (a single file: as ``Checkpointer``
        does), then the rest; returns the step."""
        if checkpoint.get("sharded"):
            load_sharded(self.files.source, self.files.model, self.files.optimizer)
        elif dist.is_initialized():  # a single file (last.pt) into the shards: each rank keeps its part
            load_full(self.files.source, checkpoint, self.files.model, self.files.optimizer)
        else:
            return self.files.restore(checkpoint)
        return self.files.restore_training(checkpoint)

    def finish(self) -> None:
        """Also leave checkpoints/last.pt and best.pt, single files that rank 0 writes from their folders: this
        launch's last, or for a launch that only finished (killed after its last save), the one it resumed from."""
        final = self.last_good if self.last_step is None else self.dcp_dir / f"step-{self.last_step:06d}"
        if final is not None and final.is_dir():
            from_rank_0(lambda: self.write_single_files(final))  # every rank waits, and stops with their error

    def write_single_files(self, final: Path) -> None:
        best = self.dcp_dir / f"step-{self.best.step:06d}"
        try:
            to_single_file(final, self.files.folder / "last.pt", self.files.recipe)
            if best.is_dir():  # the same folder as last.pt's: converted again, cheap
                to_single_file(best, self.files.folder / "best.pt", self.files.recipe)
        except CheckpointException as err:  # DCP's BaseException: a shard damaged since it was written
            reason = (str(failure(err)).strip().splitlines() or ["unreadable"])[-1][:300]  # a Ctrl-C in it: raised
            raise RecipeError(f"could not write the single-file checkpoints in {self.files.folder}: a step folder in "
                              f"{self.dcp_dir} is damaged ({reason})") from None
        except (OSError, RuntimeError) as err:  # a full disk, say (torch.save's RuntimeError, from the OSError)
            err = err.__context__ if isinstance(err.__context__, OSError) else err
            why = err.strerror if isinstance(err, OSError) and err.strerror else f"the write failed ({err})"
            raise RecipeError(f"could not write the single-file checkpoints in {self.files.folder}: {why}; the "
                              f"sharded checkpoints in {self.dcp_dir} are intact") from None


def prune(dcp_dir: Path, best_step: int) -> None:
    """Keep the last ``KEEP`` complete checkpoints and the best one (best.pt is made from it at the end)."""
    best = dcp_dir / f"step-{best_step:06d}"
    for path in set(complete_checkpoints(dcp_dir)[:-KEEP]) - {best}:
        shutil.rmtree(path, ignore_errors=True)


def clear_unfinished(dcp_dir: Path) -> None:
    """Remove the saves a crash cut short (.step-N.tmp)."""
    dcp_dir.mkdir(parents=True, exist_ok=True)
    for stale in dcp_dir.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def raise_if_interrupted(err: BaseException) -> None:
    """DCP's CheckpointException holds each failing rank's exception: a Ctrl-C (or exit) among them is raised."""
    causes = [e for e, _ in err.failures.values()] if isinstance(err, CheckpointException) else []
    if interrupted := next((e for e in causes if isinstance(e, KeyboardInterrupt | SystemExit)), None):
        raise interrupted from None


def failure(err: BaseException, folder: Path | None = None) -> OSError:
    """The OSError behind a failed save (else the first error, with ``folder``'s free space); a Ctrl-C is raised."""
    raise_if_interrupted(err)
    if not isinstance(err, CheckpointException):
        return err
    # a failed write: a RuntimeError ("unexpected pos") from the OSError, lost where DCP gathers the ranks' errors
    causes = [e.__context__ if isinstance(e.__context__, OSError) else e for e, _ in err.failures.values()] or [err]
    found = next((e for e in causes if isinstance(e, OSError)), None)
    free = (f"; {shutil.disk_usage(folder).free / 2**20:,.1f} MB free on that disk" if folder and folder.is_dir()
            else "")  # without the OSError, the free space tells whether the disk filled up
    return found or OSError(f"{causes[0]}{free}")

