"""The run directory before and around training: resolving ``--run-dir`` and ``--resume``, JSON files
written atomically, Ctrl-C turned into a request, and the command that resumes a run."""

import json
import os
import shlex
import signal
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import typer

from common.checkpoint import latest_checkpoint
from common.cli import RecipeError
from common.runtime import DistInfo


def plain_config(options: dict) -> dict:
    """Options as JSON-, TensorBoard- and checkpoint-safe values (paths become strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def prepare_run_dir(
    recipe: str, run_dir: Path | None, resume: str | None, dist_info: DistInfo = DistInfo()
) -> tuple[Path, Path | None]:
    """Resolve ``--run-dir`` and ``--resume`` into (run directory, checkpoint to resume from or None).

    Refuses to start a fresh run in a folder that already holds checkpoints: nothing gets overwritten.
    """
    if resume == "auto" and run_dir is None:
        raise typer.BadParameter("'auto' looks for checkpoints in --run-dir; give --run-dir too", param_hint="--resume")
    if run_dir is None:
        run_dir = Path("runs") / recipe / datetime.now().strftime("%Y%m%d-%H%M%S")
        if dist_info.is_main:
            base, n = run_dir, 1
            while run_dir.exists():  # two runs started in the same second
                run_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
    resume_path = latest_checkpoint(run_dir) if resume == "auto" else Path(resume) if resume else None
    if resume is None and latest_checkpoint(run_dir) is not None:
        raise RecipeError(
            f"{run_dir} already holds checkpoints; continue it with --resume auto, or choose another --run-dir"
        )
    if dist_info.is_main:
        try:
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write-test"
            probe.touch()
            probe.unlink()
        except OSError as err:
            raise RecipeError(f"cannot write to --run-dir {run_dir}: {err.strerror or err}") from None
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
    return shlex.join(["python", sys.argv[0], *args, "--resume", "auto", "--run-dir", str(run_dir)])


class StopRequest:
    """Ctrl-C as a request that the training loop honours between two steps, instead of a KeyboardInterrupt
    that could land half-way through an optimizer step. A second Ctrl-C quits at once."""

    def __init__(self, announce: Callable[[str], None]):
        self.requested = False
        self.announce = announce
        self.previous = signal.signal(signal.SIGINT, self.handle)

    def exit_if_requested(self, step: int, run_dir: Path) -> None:
        """Called once a checkpoint of ``step`` is safely written: say how to resume, then exit with 130."""
        if self.requested:
            self.restore()
            self.announce(f"interrupted at step {step}; checkpoint saved. Resume with:")
            self.announce(f"  {resume_command(run_dir)}")
            sys.exit(130)  # SystemExit: atexit still closes the run's writers

    def handle(self, signum, frame) -> None:
        if self.requested:
            sys.exit(130)
        self.requested = True
        self.announce("Ctrl-C: saving a checkpoint after this step (press again to quit without saving)")

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self.previous)
