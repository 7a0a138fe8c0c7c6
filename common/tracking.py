"""A run's outputs while it trains: config.json, TensorBoard events, checkpoints, metrics.json, the console
progress bar and the final ``done:`` line. Only rank 0 writes.

Step losses arrive as device tensors and are read back ``log_every`` steps at a time: one device sync per
window instead of one per step. That read is also where a non-finite loss is caught, and every checkpoint
save reads first, so a checkpoint never holds weights that a NaN step has already spoiled.
"""

import atexit
import math
import sys
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.utils.tensorboard import SummaryWriter

from common.checkpoint import save_checkpoint
from common.cli import RecipeError
from common.loop import StepStats
from common.resources import format_account, memory_account, with_peaks
from common.rundir import StopRequest, write_json
from common.runtime import DistInfo


class Run:
    """Writes one run's outputs. Recipes call ``log_train`` every step, ``log_eval`` after evaluating,
    ``save_checkpoint`` when ``checkpoint_due`` says so, and ``finish`` at the end."""

    def __init__(self, recipe: str, config: dict, run_dir: Path, *, total_steps: int, start_step: int = 0,
                 checkpoint_every: int | None = None, progress: bool | None = None, throughput_unit: str = "samples",
                 log_every: int = 10, dist_info: DistInfo = DistInfo(), model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None):
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
        # CONVENTIONS.md: every resolved option, plus what the options alone do not say
        self.config = {**config, "run_dir": str(run_dir), "torch_version": torch.__version__,
                       "device_used": str(device), "world_size": dist_info.world_size}
        self.recipe, self.run_dir, self.is_main, self.unit = recipe, run_dir, dist_info.is_main, throughput_unit
        self.total_steps, self.checkpoint_every, self.log_every = total_steps, checkpoint_every, log_every
        self.model, self.optimizer, self.memory = model, optimizer, {}  # memory: accounted after the first step
        self.pending: list[tuple[int, StepStats, float, int]] = []  # steps not yet read back from the device
        self.interval_losses: list[float] = []  # since the last evaluation
        self.train_loss, self.skipped_steps, self.items, self.train_seconds = math.nan, 0, 0, 0.0
        self.started = self.window_start = self.last_step_time = time.perf_counter()
        self.last_checkpoint: Path | None = None
        self.writer = None
        if self.is_main:
            write_json(run_dir / "config.json", self.config)
            # purge_step hides events a killed run logged after its checkpoint's step, so curves stay single
            self.writer = SummaryWriter(str(run_dir), purge_step=start_step + 1 if start_step else None)
        show = progress if progress is not None else sys.stdout.isatty()
        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                 disable=not (show and self.is_main))
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
        self.progress.start()
        # under torchrun the launcher owns Ctrl-C
        self.stop = StopRequest(self.print) if dist_info.world_size == 1 else None
        atexit.register(self.close)  # an error that ends the run still flushes TensorBoard's events

    def print(self, message: str) -> None:
        if self.is_main:
            self.progress.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def log_train(self, step: int, stats: StepStats, *, lr: float, items: int) -> None:
        """Record one optimizer step; ``items`` is samples (or tokens) in it, across all ranks."""
        self.pending.append((step, stats, lr, items))
        self.last_step_time = time.perf_counter()
        if not self.memory and self.model is not None:  # gradients and optimizer state exist from now on
            self.memory = memory_account(self.model, self.optimizer, stats.loss.device)
            table = format_account(self.memory, type(self.optimizer).__name__)
            self.print(table)
            if self.writer:
                write_json(self.run_dir / "config.json", {**self.config, "memory": self.memory})
                self.writer.add_text("memory", "    " + table.replace("\n", "\n    "))
        if step % self.log_every == 0 or step >= self.total_steps:
            self.flush(ends_now=True)

    def flush(self, ends_now: bool = False) -> None:
        """Read pending losses back from the device (one transfer for the whole window), log them, and stop
        the run at the first non-finite one. ``ends_now``: called right after a step, so the moment the
        read-back returns (the device has finished the window's work) ends the window's training time;
        otherwise (after an evaluation) the window ended at the last step."""
        if not self.pending:
            return
        missing = torch.tensor(math.nan, device=self.pending[0][1].loss.device)
        rows = torch.stack([torch.stack([stats.loss.float(),
                                         missing if stats.grad_norm is None else stats.grad_norm.float(),
                                         missing if stats.skipped is None else stats.skipped.float()])
                            for _, stats, _, _ in self.pending]).tolist()
        end = time.perf_counter() if ends_now else self.last_step_time
        bad = next((i for i, (loss, _, skip) in enumerate(rows) if not math.isfinite(loss) and skip != 1), None)
        pending, rows = (self.pending, rows) if bad is None else (self.pending[:bad], rows[:bad])
        seconds = max(end - self.window_start, 1e-9)
        items = sum(n for *_, n in pending)
        self.items, self.train_seconds = self.items + items, self.train_seconds + seconds
        good = [loss for loss, _, skip in rows if skip != 1]  # fp16 steps the scaler skipped have no loss
        self.skipped_steps += len(rows) - len(good)
        self.interval_losses += good
        self.train_loss = good[-1] if good else self.train_loss
        if self.writer:  # the steps before a divergence are logged too: the curve shows it coming
            for (step, _, lr, _), (loss, grad_norm, skip) in zip(pending, rows, strict=True):
                if skip != 1:
                    self.writer.add_scalar("train/loss", loss, step)
                if math.isfinite(grad_norm):
                    self.writer.add_scalar("train/grad_norm", grad_norm, step)
                self.writer.add_scalar("train/lr", lr, step)
            if pending:
                self.writer.add_scalar(f"perf/{self.unit}_per_s", items / seconds, pending[-1][0])
        if bad is not None:
            raise self.diverged(f"the loss is {self.pending[bad][1].loss.item()} at step {self.pending[bad][0]}")
        status = f"loss {self.train_loss:.4f}  lr {self.pending[-1][2]:.2e}  {items / seconds:,.0f} {self.unit}/s"
        self.progress.update(self.task, completed=self.pending[-1][0], status=status)
        self.pending.clear()
        self.window_start = time.perf_counter()

    def diverged(self, what: str) -> RecipeError:
        self.close()  # keep what was logged: the writer flushes its events on close
        kept = f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint yet"
        return RecipeError(f"training diverged: {what}; {kept}. Try a lower --lr")

    def log_eval(self, step: int, metrics: dict[str, float], *, prefix: str = "val", note: str = "") -> None:
        """Log evaluation metrics (``{"loss": ..., "acc": ...}``) and print one line for the interval."""
        self.flush()
        if self.interval_losses:
            self.train_loss = sum(self.interval_losses) / len(self.interval_losses)
        self.interval_losses = []
        for name, value in metrics.items():
            if self.writer:
                self.writer.add_scalar(f"{prefix}/{name}", value, step)
        shown = "  ".join(f"{prefix}_{k} {v:.4f}" for k, v in metrics.items())
        self.print(f"{note}step {step}/{self.total_steps}  train_loss {self.train_loss:.4f}  {shown}  "
                   f"{self.throughput:,.0f} {self.unit}/s")
        self.window_start = time.perf_counter()  # evaluation time is not training time

    @property
    def throughput(self) -> float:
        return self.items / self.train_seconds if self.train_seconds else 0.0

    def checkpoint_due(self, step: int) -> bool:
        """True every ``--checkpoint-every`` steps, and after Ctrl-C (save, then exit with 130)."""
        stop_requested = self.stop is not None and self.stop.requested
        return stop_requested or bool(self.checkpoint_every and step % self.checkpoint_every == 0)

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
            self.last_checkpoint = path if name == "last.pt" else self.last_checkpoint
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        self.window_start = time.perf_counter()  # saving is not training time
        if name == "last.pt" and self.stop is not None:
            self.stop.exit_if_requested(state["step"], self.run_dir)

    def finish(self, step: int, metrics: dict[str, float]) -> dict:
        """Write metrics.json and the hparams summary, close everything, print the ``done:`` line."""
        self.flush()
        if self.interval_losses:
            self.train_loss = sum(self.interval_losses) / len(self.interval_losses)
        summary = {"recipe": self.recipe, "steps": step, "train_loss": self.train_loss, **metrics,
                   f"{self.unit}_per_s": self.throughput, "wall_s": time.perf_counter() - self.started}
        if not self.items:  # resumed at its last step only to evaluate: no training figures of its own
            del summary["train_loss"], summary[f"{self.unit}_per_s"]
        if self.skipped_steps:
            summary["skipped_steps"] = self.skipped_steps
        if self.memory:
            summary["memory"] = with_peaks(self.memory)
        if self.is_main:
            write_json(self.run_dir / "metrics.json", summary)
            hparams = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in self.config.items()}
            finals = {f"hparam/{k}": v for k, v in summary.items() if isinstance(v, int | float)}
            self.writer.add_hparams(hparams, finals, run_name=".")
        self.close()
        shown = " ".join(f"{k}={format_number(v)}" for k, v in summary.items() if k not in ("recipe", "memory"))
        self.print(f"done: {shown} run_dir={self.run_dir}")
        return summary

    def close(self) -> None:
        atexit.unregister(self.close)
        self.progress.stop()
        if self.writer:
            self.writer.close()
        if self.stop is not None:
            self.stop.restore()
            self.stop = None


def format_number(value) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
