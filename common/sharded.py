"""Sharded checkpoints with torch.distributed.checkpoint (DCP), for models whose state is split across ranks
(FSDP2's DTensor parameters) and that may be resumed at another number of ranks.

    checkpoints/dcp/step-000120/     one complete checkpoint: a folder, made current by renaming it
        __0_0.distcp, __1_0.distcp   each rank's shards of the model and optimizer state (written in parallel)
        .metadata                    which rank wrote which piece of which tensor (DCP's own index)
        trainer.pt                   the rest of the training state: step, RNG, scheduler, best score, config
    checkpoints/dcp/.step-000130.tmp a save in progress, or one a crash cut short: never resumed from
    checkpoints/last.pt, best.pt     at the end of the run, the usual single files (--sample-only, export.py)

Every rank writes its own shards into the ``.tmp`` folder; once all have finished (DCP's ``.metadata`` is
written last, by rank 0, after the others report), rank 0 adds ``trainer.pt`` and renames the folder to
``step-N``. A rename is atomic: a crash at any moment leaves the folder either absent or complete. The last
``KEEP`` complete checkpoints and the best one are kept, older ones deleted.

``get_state_dict`` gives the model and optimizer state keyed by parameter name (not by an optimizer's
parameter index), with DTensor shards under FSDP and plain tensors in one process; ``dcp.load`` reads into
whatever layout the loading run has, so a checkpoint written at 2 ranks loads at 1 (or 4): resharding is a
property of the format. Without a process group, DCP reads and writes in one process.
"""

import logging
import os
import re
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from common.checkpoint import load_checkpoint, save_checkpoint
from common.cli import RecipeError
from common.resources import local
from common.resume import check_same_run
from common.rundir import prepare_run_dir
from common.tracking import Run

KEEP = 3  # complete checkpoints kept, besides the best one
STEP_DIR = re.compile(r"step-(\d+)")


@contextmanager
def quiet_single_process():
    """Without a process group DCP reads and writes in one process, as meant here: no warning about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def complete_checkpoints(folder: Path, warn: bool = False) -> list[Path]:
    """The complete step-N checkpoints in ``folder``, oldest first; ``warn``: on stderr, of those that are not."""
    found = []
    steps = [path for path in folder.glob("step-*") if STEP_DIR.fullmatch(path.name) and path.is_dir()]
    for path in sorted(steps, key=lambda path: int(path.name.removeprefix("step-"))):
        if (path / ".metadata").is_file() and (path / "trainer.pt").is_file():
            found.append(path)
        elif warn:  # copied in part, or damaged
            print(f"warning: {path} is incomplete (no .metadata or trainer.pt); not resuming from it", file=sys.stderr)
    if warn:
        for tmp in folder.glob(".step-*.tmp"):
            print(f"warning: {tmp} is a save that never finished; ignored", file=sys.stderr)
    return found


def load_trainer_state(path: Path, recipe: str) -> dict:
    """``trainer.pt`` of a DCP checkpoint folder: everything but the model and optimizer tensors."""
    if not path.is_dir():
        return load_checkpoint(path, recipe)
    if not (path / ".metadata").is_file() or not (path / "trainer.pt").is_file():
        raise RecipeError(f"{path} is not a complete sharded checkpoint (no .metadata or trainer.pt)")
    try:
        state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception:
        raise RecipeError(f"cannot load {path / 'trainer.pt'}: it is corrupt or not a checkpoint") from None
    if not isinstance(state, dict) or state.get("recipe") != recipe:
        raise RecipeError(f"{path} was written by recipe {state.get('recipe') if isinstance(state, dict) else None!r}, "
                          f"not {recipe!r}")
    return {**state, "sharded": True}


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read a DCP checkpoint into ``model`` (and ``optimizer``), resharded to this run's layout."""
    optimizers = [] if optimizer is None else [optimizer]
    model_sd, optim_sd = get_state_dict(model, optimizers)  # also creates AdamW's (still lazy) state
    state = {"model": model_sd, "optimizer": optim_sd}
    previous = logging.root.manager.disable
    # DCP logs tracebacks for a damaged .metadata (root logger); the error below says it in one line
    logging.disable(max(previous, logging.WARNING))
    try:
        with quiet_single_process():
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException...
        failures = err.failures.values() if isinstance(err, CheckpointException) else []
        interrupted = [e for e, _ in failures if isinstance(e, KeyboardInterrupt | SystemExit)]
        if interrupted:  # ...that also wraps a Ctrl-C during the load: that is no damaged checkpoint
            raise interrupted[0] from None
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]  # DCP's: a traceback; its last line
        raise RecipeError(f"checkpoint {path} does not fit this model or optimizer, or is damaged: {reason}") from None
    finally:
        logging.disable(previous)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def to_single_file(step_dir: Path, out: Path, recipe: str) -> None:
    """A DCP checkpoint folder as the usual single file (full tensors, one process), which ``--sample-only`` and
    scripts/export.py read. The optimizer state stays keyed by parameter name, as get_state_dict gives it."""
    trainer = load_trainer_state(step_dir, recipe)
    trainer.pop("sharded", None)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.dcp.tmp")
    try:
        dcp_to_torch_save(step_dir, tmp)
        tensors = torch.load(tmp, map_location="cpu", weights_only=True)
    finally:
        tmp.unlink(missing_ok=True)
    save_checkpoint(out, {**trainer, **tensors})


class ShardedRun(Run):
    """A ``Run`` whose checkpoints are DCP folders written by every rank, resumable (``--resume auto``, or a step
    folder) at any number of ranks; it ends with single-file copies of the last and best. Until then the best
    step's folder (its step is in metrics.json), kept by pruning, stands for best.pt."""

    def open_run_dir(self, run_dir: Path | None, resume: str | None) -> tuple[Path, Path | None, dict | None]:
        run_dir, last = prepare_run_dir(self.recipe, run_dir, resume, self.is_main)
        self.dcp_dir = run_dir / "checkpoints" / "dcp"
        if resume in (None, "auto"):  # rank 0 looks: every rank must read the same checkpoint
            found = self.from_rank_0(lambda: complete_checkpoints(self.dcp_dir, warn=True))
            if found and resume is None:
                raise RecipeError(f"{run_dir} already holds checkpoints; continue it with --resume auto, or choose "
                                  "another --run-dir")
            path = found[-1] if found else last
        else:
            path = Path(resume)
        return run_dir, path, load_trainer_state(path, self.recipe) if path else None

    @property
    def last_checkpoint(self) -> Path:
        written = self.dcp_dir / f"step-{self.last_saved:06d}"
        return written if written.is_dir() else self.resume_path  # resumed from elsewhere, nothing saved here yet

    def start(self, *, model, optimizer, **kwargs) -> None:
        if self.checkpoint and self.checkpoint.get("sharded"):
            # Options first (a model of another shape fails there, in one line), then the tensors, straight into
            # this run's shards; Run.start restores the rest and finds the model and optimizer in place.
            epochs, loader = kwargs.get("epochs"), kwargs.get("loader")  # the epoch length as Run.start finds it
            steps_per_epoch = len(loader) if epochs else kwargs.get("eval_every") or kwargs.get("steps")
            check_same_run(self.checkpoint, self.resume_path, self.config, steps_per_epoch, self.may_change)
            load_sharded(self.resume_path, model, optimizer)
            self.checkpoint = {**self.checkpoint, "model": dict(model.state_dict()),
                               "optimizer": optimizer.state_dict()}
        super().start(model=model, optimizer=optimizer, **kwargs)

    def save(self, name: str = "last.pt") -> None:
        """Write checkpoints/dcp/step-N (every rank its shards) and make it current once complete."""
        if name != "last.pt":  # best.pt: the step folder written next is the best one; pruning keeps it
            return
        self.flush()  # raises on a non-finite loss before anything is written
        model_sd, optim_sd = get_state_dict(self.state.model, self.state.optimizer)
        spoiled = torch.tensor([float(any(v.is_floating_point() and not torch.isfinite(local(v)).all()
                                          for v in model_sd.values()))])
        if self.world_size > 1:  # every rank holds other shards: the answer is the group's
            dist.all_reduce(spoiled, op=dist.ReduceOp.MAX)
        if spoiled.item():
            raise self.diverged(f"the weights hold inf/nan after step {self.step}")
        trainer = {k: v for k, v in self.state.state_dict().items() if k not in ("model", "optimizer")}
        final = self.dcp_dir / f"step-{self.step:06d}"
        tmp = self.dcp_dir / f".{final.name}.tmp"
        try:
            if self.is_main:
                self.dcp_dir.mkdir(parents=True, exist_ok=True)
                for stale in self.dcp_dir.glob(".step-*.tmp"):  # saves a crash cut short
                    shutil.rmtree(stale, ignore_errors=True)
            if self.world_size > 1:
                dist.barrier()
            with quiet_single_process():  # dcp.save returns once every rank has written its shards
                dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
            if self.is_main:
                save_checkpoint(tmp / "trainer.pt", trainer)
                if final.exists():  # the same step again (resumed at the end only to evaluate)
                    shutil.rmtree(final)
                os.replace(tmp, final)  # the moment the checkpoint counts
                fsync_dir(self.dcp_dir)
                self.prune()
        except OSError as err:
            intact = "no earlier checkpoint" if self.last_saved is None else \
                f"the previous checkpoint (step {self.last_saved}) is intact"
            raise RecipeError(f"could not write checkpoint {final}: {err.strerror or err}; {intact}") from None
        if self.world_size > 1:
            dist.barrier()  # no rank goes on (or stops) before the checkpoint is complete
        self.last_saved = self.step
        self.window_start = time.perf_counter()  # evaluating and saving are not training time
        if self.stop_agreed():
            self.close()
            self.stop.exit(self.step, self.run_dir)

    def prune(self) -> None:
        best = self.dcp_dir / f"step-{self.state.best_step:06d}"
        for path in complete_checkpoints(self.dcp_dir)[:-KEEP]:
            if path != best:
                shutil.rmtree(path, ignore_errors=True)

    def finish(self, metrics: dict | None = None) -> dict:
        """Also leave checkpoints/last.pt and best.pt, single files that rank 0 writes from their folders."""
        if not self.finished and self.last_saved is not None:
            self.from_rank_0(self.write_single_files)  # every rank waits for them, and stops with their error
        return super().finish(metrics)

    def write_single_files(self) -> None:
        final, best = (self.dcp_dir / f"step-{step:06d}" for step in (self.last_saved, self.state.best_step))
        try:
            to_single_file(final, self.run_dir / "checkpoints" / "last.pt", self.recipe)
            if self.state.best_step and best.is_dir():  # the same folder as last.pt's: converted again, cheap
                to_single_file(best, self.run_dir / "checkpoints" / "best.pt", self.recipe)
        except OSError as err:  # a full disk, say: the sharded checkpoints are what counts, and they are whole
            raise RecipeError(f"could not write the single-file checkpoints in {self.run_dir / 'checkpoints'}: "
                              f"{err.strerror or err}; the sharded checkpoints in {self.dcp_dir} are intact") from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

