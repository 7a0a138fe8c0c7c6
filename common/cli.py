"""The options every recipe shares, declared once, and the error handling around a recipe's command.

A recipe declares each common option in one line, e.g. ``epochs: cli.Epochs = 3`` after ``from common import
cli``. Bad values are usage errors (exit 2, a message naming the option and what it accepts); problems a user
can cause at run time raise ``RecipeError`` and end as one line ``error: ...`` on stderr with exit 1. No
traceback either way.
"""

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import torch.distributed as dist
import typer


class RecipeError(Exception):
    """A failure the user can fix (missing file, bad checkpoint, absent device): shown as one line, exit 1."""


def checked(accepts: Callable[[float], bool], rule: str) -> Callable[[float | None], float | None]:
    """A Typer callback: a value that ``accepts`` refuses is a usage error, "must be RULE"; None passes.

    Each rule below is a chain of comparisons, which also rejects nan (every comparison with nan is false).
    """

    def check(value: float | None) -> float | None:
        if value is not None and not accepts(value):
            raise typer.BadParameter(f"must be {rule}, got {value}")
        return value

    return check


positive_float = checked(lambda v: 0 < v < math.inf, "a finite number > 0")
clip_norm = checked(lambda v: v > 0, "> 0 (inf: no clipping)")
finite_non_negative = checked(lambda v: 0 <= v < math.inf, "a finite number >= 0")
ema_decay = checked(lambda v: 0 < v < 1, "between 0 and 1 (e.g. 0.999)")
decay_rate = checked(lambda v: 0 <= v < 1, "in [0, 1)")


def device_name(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", value):
        raise typer.BadParameter(f"{value!r} is not one of auto, cpu, cuda, cuda:N, mps")
    return value


def resume_target(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise typer.BadParameter("give a checkpoint file, or auto")
    return value


Epochs = Annotated[int, typer.Option(min=1, help="Passes over the training set.")]
Steps = Annotated[int, typer.Option(min=1, help="Optimizer steps to train for.")]
MaxSteps = Annotated[int | None, typer.Option(
    min=1, help="Stop after this many optimizer steps, whatever --epochs says.")]
BatchSize = Annotated[int, typer.Option(min=1, help="Samples per batch (per process under DDP).")]
LearningRate = Annotated[float, typer.Option(callback=positive_float, help="Peak learning rate.")]
# What a seed promises: bitwise repeats on a CPU only. On a GPU, cuDNN's convolutions, SDPA's backward and
# atomic-add reductions may sum in a different order each run, so numbers agree closely, not bit for bit.
Seed = Annotated[int, typer.Option(
    min=0, max=2**31 - 1,
    help="Seed for python and torch. Same seed, device and options: the same numbers on a CPU; on a GPU "
         "close but not bitwise (cuDNN, SDPA backward) unless deterministic algorithms are enabled.")]
Device = Annotated[str, typer.Option(callback=device_name,
                                     help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps.")]
Precision = Annotated[Literal["fp32", "bf16", "fp16"], typer.Option(help="Autocast dtype; fp16 adds a GradScaler.")]
Compile = Annotated[bool, typer.Option("--compile/--no-compile", help="Wrap the model in torch.compile.")]
NumWorkers = Annotated[int, typer.Option(min=0, help="DataLoader worker processes (0: load in the main one).")]
DataDir = Annotated[Path, typer.Option(help="Where data sets are downloaded and cached.")]
RunDir = Annotated[Path | None, typer.Option(
    help="Where this run writes everything [default: runs/RECIPE/YYYYmmdd-HHMMSS].")]
Resume = Annotated[str | None, typer.Option(
    callback=resume_target,
    help="Continue from this checkpoint file, or 'auto': the newest one in --run-dir, else start fresh.")]
CheckpointEvery = Annotated[int | None, typer.Option(
    min=1, help="Also write checkpoints/last.pt every N optimizer steps.")]
EMA = Annotated[float | None, typer.Option(
    "--ema", callback=ema_decay,
    help="Also keep an exponential moving average of the weights with this decay (e.g. 0.999): evaluated beside "
         "them (ema_val_*), its score chooses best.pt, which then holds the averaged weights.")]
KeepBest = Annotated[int, typer.Option(min=1, help="Keep the K best checkpoints (best-stepN.pt); best.pt is the best.")]
Patience = Annotated[int | None, typer.Option(min=1, help="Stop after N evaluations without a better score.")]
Progress = Annotated[bool | None, typer.Option(
    "--progress/--no-progress", help="Console progress bar [default: on when stdout is a terminal].")]


OPTION_NAMES: dict[str, str] = {}  # parameter -> option, e.g. csv_path -> --csv: for messages about options


def run_recipe(main: Callable[..., object], argv: list[str] | None = None) -> None:
    """Run ``main`` as a one-command Typer CLI: exit 0 on success, 2 on usage errors, 1 on RecipeError.

    The process group (if any) is destroyed on every way out, so no rank is left waiting on a dead one.
    """
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command()(main)
    OPTION_NAMES.update({param.name: param.opts[0] for param in typer.main.get_command(app).params})
    try:
        app(args=argv)
    except RecipeError as err:
        message = " ".join(str(err).split())  # one line, however the message was built
        print(f"error: {message}", file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
