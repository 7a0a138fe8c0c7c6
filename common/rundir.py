"""The run directory: where a run writes, held by one run at a time, removed again by a run that fails before
its first checkpoint; whether the run in it has finished; JSON files written atomically.

    run = open_run_dir(RECIPE, run_dir, resume)   # run.path; run.resume_from: the checkpoint to go on from
"""

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import typer

from common.cli import RecipeError, launched_as_rank_0, on_exit


@dataclass(frozen=True)
class RunFolder:
    path: Path
    resume_from: Path | None  # the checkpoint to continue from; None: a fresh run
    # the newest checkpoint the folder already held (a resume from any other would overwrite it); None: none
    held: Path | None = field(default=None, compare=False)

    @property
    def resumes_another_run(self) -> bool:
        """Whether it goes on from another folder's checkpoint (whose best.pt stays there), as written or resolved."""
        if self.resume_from is None:
            return False
        resolved = self.resume_from.resolve()
        if Path(os.path.abspath(self.path)) in Path(os.path.abspath(self.resume_from)).parents or \
                self.path.resolve() in resolved.parents:
            return False  # in this folder, as written or once links are followed
        # checkpoints/ may be a link to another disk: last.pt directly in its target, or dcp/step-N (not deeper)
        holders = [resolved.parent, *([resolved.parent.parent] if resolved.parent.name == "dcp" else [])]
        return (self.path / "checkpoints").resolve() not in holders


def last_file(run_dir: Path) -> Path | None:
    """What ``--resume auto`` continues from: checkpoints/last.pt (always whole: it is written atomically)."""
    last = run_dir / "checkpoints" / "last.pt"
    return last if last.is_file() else None


def open_run_dir(recipe: str, run_dir: Path | None, resume: str | None,
                 last_checkpoint: Callable[[Path], Path | None] = last_file, holds_runs: bool = False,
                 resumable: bool = True) -> RunFolder:
    """``--run-dir`` (default runs/RECIPE/TIME) and ``--resume`` (a file, or ``auto``: ``last_checkpoint``). A fresh
    run never starts where checkpoints are, so nothing is overwritten; the folder is this process's until its
    command ends (another run is refused it), and removed then if this call made it and it holds no checkpoint.
    ``holds_runs``: the folder holds runs in sub-folders (folds, say), not one of its own. ``resumable``: False for a
    command that always starts afresh (a comparison, say), which a refusal then does not tell to resume."""
    if resume == "auto" and run_dir is None:
        raise typer.BadParameter("'auto' looks for checkpoints in --run-dir; give --run-dir too", param_hint="--resume")
    if resume != "auto" and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") not in ("", "0"):  # torchrun's
        raise typer.BadParameter("torchrun --max-restarts relaunches this same command after a failure, which then "
                                 "starts over: give --resume auto and a --run-dir", param_hint="--resume")
    created = []
    if run_dir is None:
        run_dir, created = new_run_dir(Path("runs") / recipe / datetime.now().strftime("%Y%m%d-%H%M%S"))
    created = created or [d for d in [run_dir, *run_dir.parents] if not d.exists()]  # runs/, runs/RECIPE/ if new
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=run_dir).close()  # a folder that exists may still be read-only
    except OSError as err:
        raise RecipeError(f"cannot write to --run-dir {run_dir}: {why_not_written(run_dir, err)}") from None
    checkpoints = run_dir / "checkpoints"  # now, not at the first save: a file, or a link to a disk not mounted
    if checkpoints.is_symlink() and not checkpoints.exists():
        raise RecipeError(f"cannot write checkpoints in {run_dir}: {why_not_written(checkpoints, OSError())}")
    if checkpoints.exists() and not checkpoints.is_dir():
        raise RecipeError(f"cannot write checkpoints in {run_dir}: its checkpoints is a file, not a folder")
    lock = hold(run_dir)  # first: what the folder holds is read once no other run can write there
    on_exit(lambda: release(run_dir, lock, created))
    last = last_checkpoint(run_dir)
    held = last or next(run_dir.rglob("*.pt"), None)  # folds or comparisons: runs in sub-folders
    held = held or next(run_dir.glob("checkpoints/dcp/step-*/*.distcp"), None)  # shards, incomplete (a copy?)
    foreign = [name for name in ("config.json", "metrics.json")  # records no run of this recipe wrote: a model's
               if recorded_recipe(run_dir / name) not in (recipe, None)]
    if foreign and (held is None or resume is None):  # another recipe's checkpoints: not to be continued either
        raise RecipeError(f"{run_dir} holds a {' and a '.join(foreign)} that no {recipe} run wrote, which this run "
                          "would overwrite: choose another --run-dir")
    own = None  # a single run's checkpoints, in checkpoints/: whole or not (best.pt alone; shards alone)
    if held is not None:
        own = next((run_dir / "checkpoints").rglob("*.pt"), held if held.suffix == ".distcp" else None)
    other = own if holds_runs else held if own is None else None  # the other kind of run's checkpoints
    best = next(run_dir.glob("checkpoints/best*.pt"), None) if last is None and not holds_runs else None
    if resume in (None, "auto") and best is not None and resumable:  # last.pt deleted: a run writes it first
        raise RecipeError(f"{run_dir} holds checkpoints/{best.name} but no checkpoints/last.pt to continue from: a "
                          "new run there would start afresh over it; move it away, or choose another --run-dir")
    if resume is None and held is not None and (other is None or not resumable):
        how = "continue it with --resume auto, or choose" if resumable else "this command starts afresh: choose"
        raise RecipeError(f"{run_dir} already holds checkpoints; {how} another --run-dir")
    if resume in (None, "auto") and other is not None:  # refused, not started beside (--resume auto would be too)
        what = f"a single run ({other})" if holds_runs else f"runs in sub-folders ({other})"
        raise RecipeError(f"{run_dir} holds {what}, which this command would not continue but start afresh beside: "
                          "choose another --run-dir, or to continue it, give the options it was started with")
    partial = next(filter(Path.is_dir, run_dir.glob("checkpoints/dcp/step-*")), None) if last is None else None
    if resume == "auto" and partial is not None:  # sharded, and none complete (a file missing, or cut short)
        raise RecipeError(f"{run_dir}'s only checkpoints are incomplete ({partial.name} lacks its trainer.pt, "
                          ".metadata or a shard: a copy in progress?), which this run would start afresh over and "
                          "delete: complete them, or remove them")
    if last is None and not holds_runs and recorded_recipe(run_dir / "metrics.json") == recipe:
        raise RecipeError(f"{run_dir} holds a finished run (its metrics.json) but not its checkpoints/last.pt: nothing "
                          "to continue, and a new run there would overwrite its records; choose another --run-dir")
    return RunFolder(run_dir, last if resume == "auto" else Path(resume) if resume else None, held)


def new_run_dir(base: Path) -> tuple[Path, list[Path]]:
    """A folder of its own, ``base`` or ``base-N`` (two runs started in the same second), made at once: a name
    chosen only while it does not exist could be chosen by two runs started together. With the folders made."""
    created = [d for d in base.parents if not d.exists()]
    for n in range(1000):
        run_dir = base.with_name(f"{base.name}-{n}") if n else base
        try:
            run_dir.mkdir(parents=True)
            return run_dir, [run_dir, *created]
        except FileExistsError:
            continue
        except OSError as err:
            raise RecipeError(f"cannot write to --run-dir {run_dir}: {why_not_written(run_dir, err)}") from None
    raise RecipeError(f"{base.parent} holds 1,000 runs named {base.name}: choose a --run-dir")


def recorded_recipe(path: Path) -> str | None:
    """The recipe a run's config.json or metrics.json names; "" for another file there; None: no such file."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""
    return saved.get("recipe", "") if isinstance(saved, dict) else ""


def why_not_written(path: Path, err: OSError) -> str:
    """What stopped a write to ``path``: a link to nothing, a file in a folder's place, or the system's reason."""
    if dangling := next((p for p in [path, *path.parents] if p.is_symlink() and not p.exists()), None):
        return f"{dangling} is a link to {os.readlink(dangling)}, which does not exist"
    in_the_way = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
    return f"{in_the_way} is a file, not a folder" if in_the_way else str(err.strerror or err)


def hold(run_dir: Path) -> int | None:
    """An exclusive ``flock`` on the folder, or a RecipeError naming the process that has it. The kernel drops it
    when that process ends, however it ends: a killed run never blocks its restart. (No flock on Windows.)"""
    if sys.platform == "win32":
        return None
    import fcntl

    fd = os.open(run_dir, os.O_RDONLY)
    if any(os.path.samestat(os.fstat(fd), os.fstat(held)) for held in HELD_LOCKS):  # this process's already (an
        os.close(fd)  # open not yet released: a test's, a notebook's)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        HELD_LOCKS.add(fd)
        os.register_at_fork(after_in_child=lambda: close_in_forked_child(fd))
        return fd
    except OSError as err:  # held by another run, or a file system without flock (ENOLCK, some NFS): unlocked
        os.close(fd)
        if not isinstance(err, BlockingIOError):
            return None
    holder = "another process"
    with contextlib.suppress(OSError, IndexError):  # /proc/locks: "1: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF"
        for fields in (line.split() for line in Path("/proc/locks").read_text().splitlines()):
            if fields[1] == "FLOCK" and fields[5].endswith(f":{run_dir.stat().st_ino}"):
                command = Path(f"/proc/{fields[4]}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                holder = f"process {fields[4]}: {command}"
    raise RecipeError(f"{run_dir} is in use by another run ({holder}); wait for it to end, or choose another "
                      "--run-dir")


HELD_LOCKS: set[int] = set()  # the file descriptors of the run folders this process holds (hold)


def close_in_forked_child(fd: int) -> None:
    """A forked child (a DataLoader worker) shares the lock until it closes its copy: a run killed with kill -9
    would hold its folder until its orphaned workers noticed, and its immediate restart would be refused."""
    if fd in HELD_LOCKS:
        HELD_LOCKS.discard(fd)
        os.close(fd)


def release(run_dir: Path, lock: int | None, created: list[Path]) -> None:
    if created and next(run_dir.rglob("*.pt"), None) is None and not (run_dir / "metrics.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)  # a mistake, or a crash before the first save: no empty folders
        remove_empty(created[1:])  # and the folders made to hold it
    if lock in HELD_LOCKS:
        HELD_LOCKS.discard(lock)
        os.close(lock)


def remove_empty(created: list[Path]) -> None:
    """Remove folders this process made (innermost first), while nothing is in them."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            break


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException as err:  # a full disk, say (the checkpoints already written are intact), or a signal
        with contextlib.suppress(OSError):  # a disk turned read-only refuses even this (and holds no new file)
            tmp.unlink(missing_ok=True)
        if not isinstance(err, OSError):
            raise
        raise RecipeError(f"could not write {path}: {err.strerror or err}") from None


def already_finished(run: RunFolder, checkpoint: dict | None, *, max_steps: int | None, epochs: int | None = None,
                     steps: int | None = None) -> bool:
    """Whether metrics.json says the run ended at the checkpoint's step: where its schedule ends (``epochs`` of the
    checkpoint's epoch length, or ``steps``), ``--max-steps``, or early (patience); then a relaunch (the same
    command) says so and leaves the results as they are. A checkpoint past the end of an unfinished run: RecipeError."""
    try:
        step, schedule = checkpoint["step"], steps or epochs * checkpoint["steps_per_epoch"]
    except (KeyError, TypeError):  # no checkpoint, or not ours
        return False
    end = min(schedule, max_steps or schedule)
    try:
        metrics = json.loads((run.path / "metrics.json").read_text())
        early = metrics.get("stopped_early") is True
        done = metrics["steps"] == step and (step >= end or early)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no metrics (yet, or killed before), not ours
        done = early = False
    # (a checkpoint at the end, without metrics: the run was killed as it finished, and finishes now)
    if (run.resumes_another_run and step >= end) or (not done and step > end):
        where = "where this run ends" if step == end else f"past where this run ends (step {end})"
        goes_on = "use the checkpoint as it is" if run.resumes_another_run else \
            f"a --max-steps above {step}, or none, goes on with it"
        raise RecipeError(f"checkpoint {run.resume_from} is at step {step}, {where}: nothing is left to train in "
                          f"{run.path} ({goes_on})")
    if done and launched_as_rank_0():
        why = ("stopped early: its score no longer improved" if early else  # (a smaller --max-steps is no reason)
               "its schedule is done" if step >= schedule else "a larger --max-steps goes on with it")
        print(f"already finished: step {step} of {min(schedule, max(end, step))}; nothing trained, {run.path} left as "
              f"it was ({why})", flush=True)
    return done
