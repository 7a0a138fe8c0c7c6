"""The run directory before and around training: resolving ``--run-dir`` and ``--resume``, JSON files
written atomically, Ctrl-C and SIGTERM turned into a request to stop, and the command that resumes a run."""

import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import typer

from common.cli import RecipeError


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def prepare_run_dir(recipe: str, run_dir: Path | None, resume: str | None,
                    is_main: bool = True) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None) from ``--run-dir`` and ``--resume``. A fresh run never
    starts in a folder that holds checkpoints: nothing gets overwritten."""
    if resume == "auto" and run_dir is None:
        raise typer.BadParameter("'auto' looks for checkpoints in --run-dir; give --run-dir too", param_hint="--resume")
    if run_dir is None:
        run_dir = base = Path("runs") / recipe / datetime.now().strftime("%Y%m%d-%H%M%S")
        n = 1
        while run_dir.exists():  # two runs started in the same second
            run_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
    last = run_dir / "checkpoints" / "last.pt"  # always complete, thanks to the atomic writes
    if resume is None and last.is_file():
        raise RecipeError(f"{run_dir} already holds checkpoints; continue it with --resume auto, or choose another "
                          "--run-dir")
    if is_main:
        try:
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=run_dir).close()  # a folder that exists may still be read-only
        except OSError as err:
            raise RecipeError(f"cannot write to --run-dir {run_dir}: {err.strerror or err}") from None
    resume_path = (last if last.is_file() else None) if resume == "auto" else Path(resume) if resume else None
    return run_dir, resume_path


def resume_command(run_dir: Path) -> str:
    """This process's own command line, made to continue from ``run_dir``'s last checkpoint."""
    args, skip = [], False
    for arg in sys.argv[1:]:  # --resume and --run-dir are left out, with their values
        if skip:
            skip = False
        elif arg in ("--resume", "--run-dir"):
            skip = True
        elif not arg.startswith(("--resume=", "--run-dir=")):
            args.append(arg)
    launcher = ["torchrun", f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"] if "LOCAL_WORLD_SIZE" in os.environ \
        else ["python"]  # under torchrun: its options beyond the process count are not known here
    return shlex.join([*launcher, sys.argv[0], *args, "--resume", "auto", "--run-dir", str(run_dir)])


class StopRequest:
    """Ctrl-C and SIGTERM (sent by schedulers and spot instances before a kill) as a request honoured between two
    steps, not an exception half-way through one. A second signal quits at once. Exit status: 128 + signal."""

    def __init__(self, announce: Callable[[str], None]):
        self.signal: int | None = None
        self.announce = announce
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def exit(self, step: int, run_dir: Path) -> None:
        """Once a checkpoint of ``step`` is written: say how to resume, and exit (SystemExit: atexit still runs)."""
        if self.requested:
            self.announce(f"interrupted at step {step}; checkpoint saved. Resume with:\n  {resume_command(run_dir)}")
        sys.exit(128 + (self.signal or signal.SIGTERM))  # a rank not signalled itself: as if SIGTERMed

    def handle(self, signum, frame) -> None:
        if self.requested:
            sys.exit(128 + signum)
        self.signal = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.announce(f"{name}: saving a checkpoint after this step (send it again to quit without saving)")

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
