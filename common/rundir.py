"""The run directory before and around training: resolving ``--run-dir`` and ``--resume``, JSON files
written atomically, Ctrl-C and SIGTERM turned into a request to stop, and the command that resumes a run."""

import json
import os
import shlex
import signal
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import typer

from common.cli import RecipeError


def plain_config(options: dict) -> dict:
    """Options as JSON-, TensorBoard- and checkpoint-safe values (paths become strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def prepare_run_dir(recipe: str, run_dir: Path | None, resume: str | None,
                    is_main: bool = True) -> tuple[Path, Path | None]:
    """Resolve ``--run-dir`` and ``--resume`` into (run directory, checkpoint to resume from or None).

    Refuses to start a fresh run in a folder that already holds checkpoints: nothing gets overwritten.
    """
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
            probe = run_dir / ".write-test"
            probe.touch()
            probe.unlink()
        except OSError as err:
            raise RecipeError(f"cannot write to --run-dir {run_dir}: {err.strerror or err}") from None
    resume_path = (last if last.is_file() else None) if resume == "auto" else Path(resume) if resume else None
    return run_dir, resume_path


def resume_command(run_dir: Path) -> str:
    """This process's own command line, made to continue from ``run_dir``'s last checkpoint."""
    args, skip = [], False
    for arg in sys.argv[1:]:
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
    """Ctrl-C (SIGINT) and SIGTERM (what schedulers and spot instances send before killing a job) as a
    request that the training loop honours between two steps, instead of an exception that could land half-way
    through an optimizer step. A second signal quits at once. The exit status is the shell's: 128 + signal."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: Callable[[str], None]):
        self.signal: int | None = None
        self.announce = announce
        self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def exit_if_requested(self, step: int, run_dir: Path) -> None:
        """Called once a checkpoint of ``step`` is safely written: say how to resume, then exit."""
        if self.requested:
            self.restore()
            self.announce(f"interrupted at step {step}; checkpoint saved. Resume with:")
            self.announce(f"  {resume_command(run_dir)}")
            sys.exit(128 + self.signal)  # SystemExit: atexit still closes the run's writers

    def handle(self, signum, frame) -> None:
        if self.requested:
            sys.exit(128 + signum)
        self.signal = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.announce(f"{name}: saving a checkpoint after this step (send it again to quit without saving)")

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
