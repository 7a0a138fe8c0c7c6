"""The options every recipe shares, one line each (a bad value: a usage error), and a recipe's errors as one line."""

import atexit
import json
import multiprocessing.util
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import torch
import torch.distributed as dist
import typer


class RecipeError(Exception):
    """A failure the user can fix (missing file, bad checkpoint, absent device): shown as one line, exit 1."""


def checked(accepts: Callable[[float], bool], rule: str) -> Callable[[float | None], float | None]:
    """A Typer callback refusing, as "must be RULE", what ``accepts`` refuses (nan fails every comparison)."""
    def check(value: float | None) -> float | None:
        if value is not None and not accepts(value):
            raise typer.BadParameter(f"must be {rule}, got {value}")
        return value
    return check


# Optimizers hold rates in float32 tensors: near float32's 3.4e38 (Adam's lr / (1 - beta1) too) they overflow
positive_float = checked(lambda v: 0 < v <= 1e30, "a finite number > 0 (at most 1e30)")
finite_non_negative = checked(lambda v: 0 <= v <= 3.4e38, "a finite number >= 0 (at most float32's 3.4e38)")


def device_name(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", value):
        raise typer.BadParameter(f"{value!r} is not one of auto, cpu, cuda, cuda:N, mps")
    return value


def given_path(value: str | Path) -> Path:
    """A path option's value; an empty one (an unset shell variable, say) is refused rather than read as '.'."""
    if not isinstance(value, str | Path) or not str(value).strip():  # (a number or list from --config's JSON too)
        raise typer.BadParameter("is empty; give a path" if isinstance(value, str) else f"is {value!r}: give a path")
    return Path(value)


def folder(value: str | Path) -> Path:
    """A folder option's value: a given path, in UTF-8 (a name in another encoding arrives as lone surrogates)."""
    if str(value) != str(value).encode("utf-8", "replace").decode():  # which TensorBoard's writer fails on
        raise typer.BadParameter(f"{ascii(str(value))} is not a UTF-8 name (the run's records need one): rename it")
    return given_path(value)


Epochs = Annotated[int, typer.Option(min=1, help="Passes over the training set.")]
Steps = Annotated[int, typer.Option(min=1, help="Optimizer steps to train for.")]
MaxSteps = Annotated[int | None, typer.Option(min=1, help="Stop after this many optimizer steps.")]
BatchSize = Annotated[int, typer.Option(min=1, help="Samples per batch.")]
LearningRate = Annotated[float, typer.Option(callback=positive_float, help="Peak learning rate.")]
# Bitwise repeats on a CPU only: cuDNN's convolutions, SDPA's backward and atomic adds sum in any order on a GPU
Seed = Annotated[int, typer.Option(min=0, max=2**31 - 1, help="Seed for python and torch. Same seed, device and "
                                   "options: the same numbers on a CPU; close, not bitwise, on a GPU.")]
Device = Annotated[str, typer.Option(callback=device_name, help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N "
                                     "or mps.")]
Precision = Annotated[Literal["auto", "fp32", "bf16", "fp16"], typer.Option(
    help="Autocast dtype; fp16 adds a GradScaler; auto: bf16 where the device multiplies it natively, else fp32.")]
Compile = Annotated[bool, typer.Option("--compile/--no-compile", help="Wrap the model in torch.compile.")]
NumWorkers = Annotated[int, typer.Option(min=0, max=4 * (os.cpu_count() or 1), help="DataLoader worker processes "
                                         "(0: load in the main one; at most 4 per CPU core: each is a process).")]
DataDir = Annotated[Path, typer.Option(parser=folder, metavar="<path>", help="Where data sets are cached on download.")]
RunDir = Annotated[Path | None, typer.Option(parser=folder, metavar="<path>", help="Where this run writes "
                                             "everything [default: runs/RECIPE/YYYYmmdd-HHMMSS].")]
Resume = Annotated[str | None, typer.Option(callback=lambda v: v if v is None else given_path(v) and v, help="Continue "
                                            "from this checkpoint file, or 'auto': the newest one in --run-dir, else "
                                            "start fresh.")]
CheckpointEvery = Annotated[int | None, typer.Option(min=1, help="Also save checkpoints/last.pt every N steps.")]
LogEvery = Annotated[int | None, typer.Option(min=1, help="Print a line (and read the losses back) every N steps "
                                              "[default: a tenth of an epoch or evaluation interval, at most 50].")]
Profile = Annotated[int | None, typer.Option(min=1, help="Profile N training steps after a warm-up: a trace in "
                                             "--run-dir, a table of a step's time (and slower samples/s).")]
EMADecay = Annotated[float | None, typer.Option("--ema", callback=checked(lambda v: 0 < v < 1, "between 0 and 1 "
                                                "(e.g. 0.999)"), help="Also average the weights, decay e.g. 0.999: "
                                                "evaluated beside them, it chooses best.pt, which then holds it.")]
KeepBest = Annotated[int, typer.Option(min=1, help="Keep the K best checkpoints (best-stepN.pt); best.pt is the best.")]
Patience = Annotated[int | None, typer.Option(min=1, help="Stop after N evaluations without a better score.")]

# Settings a recipe derives from its options and the machine (MFU's denominator, say): free to differ on a resume
DERIVED_KEYS = {"precision_used", "precision_reason", "peak_flops_used", "peak_source", "attention_used",
                "num_embedding_used", "lr_used"}
# What config.json records beside the options: where and how the run ran, the fold of a cross-validation
RECORD_KEYS = DERIVED_KEYS | {"recipe", "torch_version", "device_used", "world_size", "tf32", "checkpoint_format",
                             "fold"}


def compiler_missing(err: Exception) -> BaseException | None:  # what torch.compile's backend lacks here: no bug
    cause = getattr(err, "inner_exception", None)  # a C++ compiler, say (PermissionError: one not executable)
    kinds = {kind.__name__ for kind in type(cause).__mro__}  # the error's kind, and the kinds it belongs to
    return cause if kinds & {"ImportError", "OSError", "InvalidCxxCompiler", "CppCompileError"} else None


def replay(ctx: typer.Context, path: Path | None) -> Path | None:
    """--config: a run's config.json as this command's defaults (options given win); a replay is a new run."""
    if path is None:
        return None
    try:
        saved = {**json.loads(path.read_text())}  # TypeError unless a JSON object
    except OSError as err:
        raise typer.BadParameter(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, TypeError):
        raise typer.BadParameter(f"{path} is not a run's config.json (a JSON object of settings)") from None
    if unknown := sorted(saved.keys() - (names := {param.name for param in ctx.command.params}) - RECORD_KEYS):
        raise typer.BadParameter(f"{path} has settings this recipe lacks ({', '.join(unknown[:6])}): another recipe's, "
                                 "or this one's before an edit or update? (remove them from it to replay the rest)")
    ctx.default_map = {k: v for k, v in saved.items() if k in names - {"run_dir", "resume", "config_file"}}
    per_process = "global_batch" not in names  # a batch per process, or a global batch kept at any process count
    if per_process and str(saved.get("world_size", 1)) != os.environ.get("WORLD_SIZE", "1") and launched_as_rank_0():
        print(f"warning: {path} ran as {saved['world_size']} processes, this run as {os.environ.get('WORLD_SIZE', 1)}:"
              " another global batch, so other numbers than its own", file=sys.stderr)
    return path


ConfigFile = Annotated[Path | None, typer.Option("--config", is_eager=True, callback=replay, help="Take the "
                                                 "options of a run's config.json (those given here win): a replay.")]


def as_config(options: dict) -> dict:
    """A command's options as a run records them (config.json, checkpoints): paths as text."""
    return {name: str(value) if isinstance(value, Path) else value for name, value in options.items()}


class Command(NamedTuple):  # the recipe command that runs now (run_recipe sets it, as click keeps its context)
    flags: dict[str, list[str]]  # parameter -> its flags: run_dir -> [--run-dir], a switch -> [--x, --no-x]
    cleanup: ExitStack  # what to release when the command ends, however it ends
    argv: list[str]  # its arguments


RUNNING: ContextVar[Command | None] = ContextVar("RUNNING", default=None)


def option_given(param: str) -> bool:
    """Whether ``param`` is on the running command's line (--no-X too), not a default or --config's; else True."""
    return (command := RUNNING.get()) is None or any(arg.split("=")[0] in command.flags[param] for arg in command.argv)


def option_name(param: str) -> str:
    """The option behind a parameter of the running command; a derived setting's name as words."""
    return command.flags[param][0] if (command := RUNNING.get()) and param in command.flags else param.replace("_", " ")


def on_exit(release: Callable[[], None]) -> None:
    """Call ``release`` when the recipe's command ends, however it ends (at exit if no command runs)."""
    (command.cleanup.callback if (command := RUNNING.get()) else atexit.register)(release)


def launched_as_rank_0() -> bool:
    """Rank 0 under torchrun, or a process alone (no WORLD_SIZE, or a RANK past it set by hand): the one to speak."""
    rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "")
    return rank == "0" or not (rank.isdecimal() and world_size.isdecimal() and int(rank) < int(world_size))


def tell_torchrun(message: str) -> None:
    """Under torchrun, the error its report of the failure quotes (not a link to a log)."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        failure = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps({"message": failure}))


def run_recipe(main: Callable[..., object], argv: list[str] | None = None) -> None:
    """Run ``main`` as a one-command Typer CLI: exit 0, 2 on usage errors, 1 on RecipeError or OSError. Under torchrun
    every rank meets the same errors, rank 0 alone prints them, and no rank is left waiting on a dead one."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command()(main)
    flags = {param.name: [*param.opts, *param.secondary_opts] for param in typer.main.get_command(app).params}
    quiet = not launched_as_rank_0()
    if hasattr(sys.stdout, "reconfigure"):  # a file name in another encoding prints as \udce9, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    # SIGTERM before a StopRequest listens: exit 143 through the clean-ups (a new, unused run directory goes), as Ctrl-C
    sigterm = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # A background thread's OSError (TensorBoard's writer, disk full) reaches this thread too, reported below in a line
    excepthook = threading.excepthook
    threading.excepthook = lambda args: None if issubclass(args.exc_type, OSError) else excepthook(args)
    # A torchrun exit kills the DataLoader workers (below): their sockets go in this process's folder, removed there
    sockets = multiprocessing.util.get_temp_dir() if "TORCHELASTIC_RUN_ID" in os.environ else None
    try:
        with ExitStack() as cleanup:
            running = RUNNING.set(Command(flags, cleanup, sys.argv[1:] if argv is None else argv))
            try:
                status = app(args=argv, standalone_mode=False)
            except (RuntimeError, TypeError) as err:  # the machine's memory (a size past 2**63 too), a peer's end
                reason = re.sub(r"^\[[^]]*\]\s*", "", str(err).strip().split("\n")[0])
                lost = dist.is_available() and dist.is_initialized() and (  # a collective whose other end died
                    isinstance(err, dist.DistNetworkError) or re.search("by peer|Broken pipe", reason))
                stop = getattr(signal.getsignal(signal.SIGINT), "__self__", None)  # a StopRequest, once one listens
                if type(stop).__name__ == "StopRequest" and stop.signal and (stop.signal == signal.SIGINT or not lost):
                    quiet or print(f"interrupted: the step failed as the signal reached its helpers too ({reason}); "
                                   "nothing saved since the last checkpoint", flush=True)
                    sys.exit(128 + stop.signal)
                if cause := compiler_missing(err):  # (PermissionError: a compiler that is not executable)
                    raise RecipeError(f"torch.compile cannot compile the model here: {type(cause).__name__}: "
                                      + str(cause).split("\n")[0]) from None
                if re.search("out of memory|can't allocate|not enough memory|overflow when unpacking", reason, re.I):
                    if size := re.search(r"tried to allocate ([\d.]+) ?(\w+)", reason, re.I):  # N bytes (CPU), 2.00 GiB
                        size = f"{float(size[1]) / 2**30:,.1f} GiB" if size[2] == "bytes" else f"{size[1]} {size[2]}"
                    raise RecipeError(f"out of memory{f' (allocating {size} more)' if size else ''}; try a smaller "
                                      "--batch-size, model or data set") from None
                if reason.startswith("Symlink loop"):  # Path.resolve's, of a link that points at itself
                    raise RecipeError(reason) from None
                if not lost:
                    raise  # a timeout, say: ranks out of step, a bug whose traceback shows where
                raise RecipeError(f"another process of this run stopped ({reason.split('. ')[0]}): torchrun's report "
                                  "names it; with --max-restarts the group resumes from the last checkpoint") from None
            finally:
                RUNNING.reset(running)
        if type(status) is int and status:  # typer returns (not raises) an Exit's status, Ctrl-C's 130 among them
            sys.exit(status)
    except (RecipeError, OSError) as err:  # OSError: a full disk, say, where no piece of the run had more to say
        name = getattr(err, "filename", None)  # (TensorBoard's writer gives it in bytes)
        message = " ".join(str(err).split()) if isinstance(err, RecipeError) else f"{err.strerror or err}" \
            f"{f': {os.fsdecode(name)}' if isinstance(name, str | bytes) else ''} (any checkpoint written is intact)"
        message = re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda c: ascii(c[0])[1:-1], message)  # an ESC: shown, not obeyed
        quiet or print(f"error: {message}", file=sys.stderr, flush=True)
        tell_torchrun(message)
        sys.exit(1)
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C before training, where no StopRequest listens yet
        sys.exit(130)
    except Exception as err:
        if not callable(getattr(err, "show", None)):  # not a usage error but a bug: its traceback
            raise
        quiet or err.show()  # the usage line and what is wrong, as Typer prints it
        tell_torchrun(err.format_message())
        sys.exit(getattr(err, "exit_code", 2))
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        threading.excepthook = excepthook
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # a torchrun worker's exit (not a bug's traceback): shutdown with gloo's threads alive can abort it (SIGABRT)
        if "TORCHELASTIC_RUN_ID" in os.environ and isinstance(end := sys.exc_info()[1], SystemExit | None):
            for worker in torch.multiprocessing.active_children():  # a DataLoader's, that shutdown would have ended
                worker.kill()  # (SIGKILL: its SIGTERM is ignored, as the main process alone answers one)
            shutil.rmtree(sockets, ignore_errors=True)
            time.sleep(5 if quiet and getattr(end, "code", 0) in (1, 2) else 0)  # rank 0 prints, then torchrun ends all
            sys.stdout.flush(), sys.stderr.flush(), os._exit(getattr(end, "code", 0) or 0)  # (each exit: an int)
