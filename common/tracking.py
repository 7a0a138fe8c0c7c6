"""The run directory and everything written to it: config.json, TensorBoard events, checkpoints,
metrics.json, the console progress bar and the final ``done:`` line. Only rank 0 writes.

Step losses arrive as device tensors and are read back ``log_every`` steps at a time: one device sync per
window instead of one per step. That read is also where a non-finite loss is caught, and every checkpoint
save reads first, so a checkpoint never holds weights that a NaN step has already spoiled.
"""

import atexit
import json
import math
import os
import shlex
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.utils.tensorboard import SummaryWriter

from common.checkpoint import latest_checkpoint, save_checkpoint
from common.cli import RecipeError
from common.loop import StepStats
from common.resources import format_account, memory_account, peak_rss_bytes
from common.runtime import DistInfo


def plain_config(options: dict) -> dict:
    """Options as JSON-, TensorBoard- and checkpoint-safe values (paths become strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}


def format_number(value) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


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


class Run:
    """Writes one run's outputs. Recipes call ``log_train`` every step, ``log_eval`` after evaluating,
    ``save_checkpoint`` when ``checkpoint_due`` says so, and ``finish`` at the end."""

    def __init__(
        self,
        recipe: str,
        config: dict,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int = 0,
        checkpoint_every: int | None = None,
        progress: bool | None = None,
        throughput_unit: str = "samples",
        log_every: int = 10,
        dist_info: DistInfo = DistInfo(),
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
        # CONVENTIONS.md: every resolved option, plus what the options alone do not say
        config = {**config, "run_dir": str(run_dir), "torch_version": torch.__version__,
                  "device_used": str(device), "world_size": dist_info.world_size}
        self.recipe, self.config, self.run_dir = recipe, config, run_dir
        self.total_steps, self.checkpoint_every, self.log_every = total_steps, checkpoint_every, log_every
        self.unit, self.is_main = throughput_unit, dist_info.is_main
        self.pending: list[tuple[int, StepStats, float, int]] = []  # steps not yet read back from the device
        self.interval_losses: list[float] = []  # since the last evaluation
        self.train_loss = math.nan
        self.skipped_steps = 0
        self.items, self.train_seconds = 0, 0.0
        self.window_start = self.last_step_time = time.perf_counter()
        self.started = time.perf_counter()
        self.last_checkpoint: Path | None = None
        self.interrupted = False
        self.model, self.optimizer = model, optimizer  # for the memory account after the first step
        self.memory: dict[str, int] = {}
        self.writer = None
        if self.is_main:
            write_json(run_dir / "config.json", config)
            # purge_step hides events a killed run logged after its checkpoint's step, so curves stay single
            self.writer = SummaryWriter(str(run_dir), purge_step=start_step + 1 if start_step else None)
        show = progress if progress is not None else sys.stdout.isatty()
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            disable=not (show and self.is_main),
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
        self.progress.start()
        if dist_info.world_size == 1:  # under torchrun the launcher owns Ctrl-C
            self.previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        atexit.register(self.close)  # an error that ends the run still flushes TensorBoard's events

    def print(self, message: str) -> None:
        if self.is_main:
            self.progress.console.print(message, highlight=False, markup=False, soft_wrap=True)

    # -- training steps -------------------------------------------------------------------------------
    def log_train(self, step: int, stats: StepStats, *, lr: float, items: int) -> None:
        """Record one optimizer step; ``items`` is samples (or tokens) in it, across all ranks."""
        self.pending.append((step, stats, lr, items))
        self.last_step_time = time.perf_counter()
        if not self.memory and self.model is not None:
            self.account_memory(stats.loss.device)
        if step % self.log_every == 0 or step >= self.total_steps:
            self.flush(ends_now=True)

    def account_memory(self, device: torch.device) -> None:
        """Measure what the model state holds now that gradients and optimizer state exist; print it,
        add it to config.json and TensorBoard."""
        self.memory = memory_account(self.model, self.optimizer, device)
        table = format_account(self.memory, type(self.optimizer).__name__)
        self.print(table)
        if self.writer:
            write_json(self.run_dir / "config.json", {**self.config, "memory": self.memory})
            self.writer.add_text("memory", "    " + table.replace("\n", "\n    "))

    def flush(self, ends_now: bool = False) -> None:
        """Read pending losses back from the device (one transfer for the whole window), log them, and stop
        the run at the first non-finite one. ``ends_now``: called right after a step, so the moment the
        read-back returns (the device has finished the window's work) ends the window's training time;
        otherwise (after an evaluation) the window ended at the last step."""
        if not self.pending:
            return
        device = self.pending[0][1].loss.device
        missing = torch.tensor(math.nan, device=device)
        rows = torch.stack([torch.stack([stats.loss.float(),
                                         missing if stats.grad_norm is None else stats.grad_norm.float(),
                                         missing if stats.skipped is None else stats.skipped.float()])
                            for _, stats, _, _ in self.pending]).tolist()
        end = time.perf_counter() if ends_now else self.last_step_time
        bad = next((i for i, (loss, _, skipped) in enumerate(rows) if not math.isfinite(loss) and skipped != 1.0),
                   None)
        pending, rows = (self.pending, rows) if bad is None else (self.pending[:bad], rows[:bad])
        seconds = max(end - self.window_start, 1e-9)
        items = sum(n for *_, n in pending)
        self.items, self.train_seconds = self.items + items, self.train_seconds + seconds
        good = [loss for loss, _, skipped in rows if skipped != 1.0]  # fp16 steps the scaler skipped: no loss
        self.skipped_steps += len(rows) - len(good)
        self.interval_losses += good
        if good:
            self.train_loss = good[-1]
        if self.writer:  # the steps before a divergence are logged too: the curve shows it coming
            for (step, _, lr, _), (loss, grad_norm, skipped) in zip(pending, rows, strict=True):
                if skipped != 1.0:
                    self.writer.add_scalar("train/loss", loss, step)
                if math.isfinite(grad_norm):
                    self.writer.add_scalar("train/grad_norm", grad_norm, step)
                self.writer.add_scalar("train/lr", lr, step)
            if pending:
                self.writer.add_scalar(f"perf/{self.unit}_per_s", items / seconds, pending[-1][0])
        if bad is not None:
            raise self.diverged(f"the loss is {self.pending[bad][1].loss.item()} at step {self.pending[bad][0]}")
        last_step, _, last_lr, _ = self.pending[-1]
        status = f"loss {self.train_loss:.4f}  lr {last_lr:.2e}  {items / seconds:,.0f} {self.unit}/s"
        self.progress.update(self.task, completed=last_step, status=status)
        self.pending.clear()
        self.window_start = time.perf_counter()

    def diverged(self, what: str) -> RecipeError:
        self.close()  # keep what was logged: the writer flushes its events on close
        kept = (f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                else "no checkpoint was written yet")
        return RecipeError(f"training diverged: {what}; {kept}. Try a lower --lr")

    # -- evaluation -----------------------------------------------------------------------------------
    def log_eval(self, step: int, metrics: dict[str, float], *, prefix: str = "val", note: str = "") -> None:
        """Log evaluation metrics (``{"loss": ..., "acc": ...}``) and print one line for the interval."""
        self.flush()
        if self.interval_losses:
            self.train_loss = sum(self.interval_losses) / len(self.interval_losses)
        self.interval_losses = []
        if self.writer:
            for name, value in metrics.items():
                self.writer.add_scalar(f"{prefix}/{name}", value, step)
        shown = "  ".join(f"{prefix}_{k} {v:.4f}" for k, v in metrics.items())
        self.print(f"{note}step {step}/{self.total_steps}  train_loss {self.train_loss:.4f}  {shown}  "
                   f"{self.throughput:,.0f} {self.unit}/s")
        self.window_start = time.perf_counter()  # evaluation time is not training time

    @property
    def throughput(self) -> float:
        return self.items / self.train_seconds if self.train_seconds else 0.0

    # -- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_due(self, step: int) -> bool:
        """True every ``--checkpoint-every`` steps, and after Ctrl-C (save, then exit with 130)."""
        return self.interrupted or bool(self.checkpoint_every and step % self.checkpoint_every == 0)

    def save_checkpoint(self, state: dict, name: str = "last.pt") -> None:
        """Atomically write checkpoints/NAME (rank 0; other ranks wait). Exits with 130 after Ctrl-C."""
        self.flush()  # raises on a non-finite loss before anything is written
        # A step can end with a finite loss yet inf/nan gradients, which spoil the weights it just updated.
        spoiled = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if spoiled:
            raise self.diverged(f"the weights hold inf/nan after step {state['step']} ({spoiled[0]})")
        if self.is_main:
            path = self.run_dir / "checkpoints" / name
            save_checkpoint(path, state)
            if name == "last.pt":
                self.last_checkpoint = path
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        self.window_start = time.perf_counter()  # saving is not training time
        if self.interrupted and name == "last.pt":
            self.close()
            self.print(f"interrupted at step {state['step']}; checkpoint saved. Resume with:")
            self.print(f"  {self.resume_command()}")
            sys.exit(130)

    def resume_command(self) -> str:
        args, skip = [], False
        for arg in sys.argv[1:]:
            if skip:
                skip = False
            elif arg in ("--resume", "--run-dir"):
                skip = True
            elif not arg.startswith(("--resume=", "--run-dir=")):
                args.append(arg)
        args += ["--resume", "auto", "--run-dir", str(self.run_dir)]
        return shlex.join(["python", sys.argv[0], *args])

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:  # a second Ctrl-C: stop at once
            sys.exit(130)
        self.interrupted = True
        self.print("Ctrl-C: saving a checkpoint after this step (press again to quit without saving)")

    # -- the end --------------------------------------------------------------------------------------
    def finish(self, step: int, metrics: dict[str, float]) -> dict:
        """Write metrics.json and the hparams summary, close everything, print the ``done:`` line."""
        self.flush()
        if self.interval_losses:
            self.train_loss = sum(self.interval_losses) / len(self.interval_losses)
        summary = {
            "recipe": self.recipe,
            "steps": step,
            "train_loss": self.train_loss,
            **metrics,
            f"{self.unit}_per_s": self.throughput,
            "wall_s": time.perf_counter() - self.started,
        }
        if self.skipped_steps:
            summary["skipped_steps"] = self.skipped_steps
        if self.memory:
            summary["memory"] = self.memory
            summary["memory"]["peak_rss_bytes"] = peak_rss_bytes()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                summary["memory"]["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        if self.is_main:
            write_json(self.run_dir / "metrics.json", summary)
            hparams = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in self.config.items()}
            finals = {f"hparam/{k}": v for k, v in summary.items() if isinstance(v, int | float)}
            self.writer.add_hparams(hparams, finals, run_name=".")
        self.close()
        shown = " ".join(f"{k}={format_number(v)}" for k, v in summary.items() if k != "recipe" and k != "memory")
        self.print(f"done: {shown} run_dir={self.run_dir}")
        return summary

    def close(self) -> None:
        atexit.unregister(self.close)
        self.progress.stop()
        if self.writer:
            self.writer.close()
        if hasattr(self, "previous_sigint"):
            signal.signal(signal.SIGINT, self.previous_sigint)
            del self.previous_sigint
