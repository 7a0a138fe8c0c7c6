"""The log of a run: config.json, TensorBoard events, a line every few steps on the console (the same on a terminal
and in a log file), the evaluations, and at the end metrics.json and the ``done:`` line.

    log = RunLog(run, RECIPE, total_steps=..., every=..., steps_per_epoch=...)
    log.start(step, config, device)              # once a resumed run is restored: config.json, TensorBoard, header
    log.train(step, stats, lr=lr, items=n)       # after every step
    log.flush()                                  # before evaluating: the steps' time ends here (else the
    log.eval(step, val=validate(model))          # evaluation counts as training); then the evaluation's figures
    log.finish(step, {"test_acc": ...})          # metrics.json, the hyper-parameters, the done: line

Step losses stay on the device and are read back ``every`` steps at a time: one sync per window instead of one
per step. That read is also where a non-finite loss is caught, and a checkpoint reads first (``state_dict``),
so no checkpoint holds weights that a NaN step has already spoiled. Only rank 0 writes (``write``).
"""

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from tensorboard.plugins.hparams import summary_v2 as hparams
from torch.utils.tensorboard import SummaryWriter

from common.checkpoint import diverged
from common.cli import on_exit
from common.loop import StepStats
from common.rundir import RunFolder, last_file, write_json

MAX_SKIPPED_IN_A_ROW = 50  # fp16 steps the GradScaler may skip in a row before the run is called diverged


class Pending(NamedTuple):  # a step whose figures are still on the device
    step: int
    stats: StepStats
    lr: float
    items: int  # samples (or tokens) of the step, every process's together


def log_interval(steps_per_epoch: int, every: int | None) -> int:
    """``--log-every``, else a tenth of an epoch, at most 50 steps: often enough that a log tells slow from hung."""
    return every or max(1, min(50, steps_per_epoch // 10))


class RunLog:
    def __init__(self, run: RunFolder, recipe: str, *, total_steps: int, every: int, steps_per_epoch: int | None = None,
                 eval_every: int | None = None, unit: str = "samples",
                 last_checkpoint: Callable[[Path], Path | None] = last_file, write: bool = True):
        self.run, self.recipe, self.total_steps, self.every, self.steps_per_epoch = run, recipe, total_steps, every, \
            steps_per_epoch
        # the training loss shown is the mean over the evaluation period (an epoch, or eval_every steps) so far: the
        # same whether the run was cut short (--max-steps, which evaluates where it stops) and resumed, or not
        self.period = eval_every or steps_per_epoch or total_steps
        self.unit, self.last_checkpoint, self.write = unit, last_checkpoint, write
        self.writer: SummaryWriter | None = None
        self.pending: list[Pending] = []
        self.loss_sum, self.loss_steps, self.train_loss = 0.0, 0, math.nan  # over the evaluation period so far
        self.skipped_steps = self.skipped_in_a_row = 0  # fp16 steps the GradScaler skipped for overflowing
        self.evals: dict[str, dict[str, float]] = {}  # the last evaluation: {"val": {"loss": ..., "acc": ...}}
        self.evaluated_at: int | None = 0  # its step (0: none yet): a checkpoint saved there is not evaluated again
        self.items, self.seconds, self.first_window = 0, 0.0, None  # throughput leaves the first window out
        self.seconds_per_step = 0.0  # the last timed window's, for the eta
        self.earlier_wall_s = 0.0  # earlier launches', up to their last checkpoint: wall_s is the whole run's

    def start(self, step: int, config: dict, device: torch.device, world_size: int = 1) -> None:
        """Write config.json (the options, and where the run ran), open TensorBoard, print the header line."""
        tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32  # what fp32 means on a GPU
        self.config = {**config, "recipe": self.recipe, "run_dir": str(self.run.path), "device_used": str(device),
                       "world_size": world_size, "tf32": tf32, "torch_version": torch.__version__}
        if self.write:
            write_json(self.run.path / "config.json", self.config)
            # purge_step hides the events a killed run logged past its checkpoint's step (all of them, when it
            # saved none and this run starts afresh in its folder), so that curves stay single
            self.writer = SummaryWriter(str(self.run.path), purge_step=step + 1 if step else 0)
            on_exit(self.writer.close)  # an error that ends the run still flushes what was logged
        self.started = self.window_start = time.perf_counter()
        resumed = f" | resumed at step {step}" if step else ""
        precision = f" | precision {config['precision_used']} ({config['precision_reason']})" if "precision_reason" in \
            config else ""
        threads = f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""  # each process's
        self.print(f"run_dir {self.run.path.resolve()} | device {device}{threads}{precision} | {world_size} process(es)"
                   f"{resumed}")

    def print(self, message: str) -> None:
        if self.write:
            print(message, flush=True)

    def position(self, step: int) -> str:
        if self.steps_per_epoch is None:
            return f"step {step}/{self.total_steps}"
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        return f"epoch {min(math.ceil(step / self.steps_per_epoch), epochs)}/{epochs}  step {step}/{self.total_steps}"

    def train(self, step: int, stats: StepStats, *, lr: float, items: int) -> None:
        if self.window_start is None:  # the first step after an evaluation or a save, of unknown start:
            self.window_start, items = time.perf_counter(), 0  # it counts for the loss, not for the speed
        self.pending.append(Pending(step, stats, lr, items))
        if step % self.every == 0 or step >= self.total_steps:
            self.flush(window_ends=True)

    def flush(self, window_ends: bool = False) -> None:
        """Read the pending steps' figures back in one transfer and log them; a non-finite loss is a divergence.
        ``window_ends``: a step just ended, print the window's line."""
        if not self.pending:
            return
        nan = torch.tensor(math.nan, device=self.pending[0].stats.loss.device)
        rows = torch.stack([torch.stack([nan if x is None else x.float() for x in p.stats])
                            for p in self.pending]).tolist()  # (loss, grad norm, skipped) per step
        seconds = max(time.perf_counter() - self.window_start, 1e-9)
        bad = next((i for i, (loss, _, skip) in enumerate(rows) if not math.isfinite(loss) and skip != 1), None)
        pending, rows = self.pending[:bad], rows[:bad]  # [:None] is everything
        items = sum(p.items for p in pending)
        self.items, self.seconds = self.items + items, self.seconds + seconds
        self.first_window = self.first_window or (items, seconds)  # start-up and compilation live here
        for p, (loss, grad_norm, skip) in zip(pending, rows, strict=True):
            if (p.step - 1) % self.period == 0:  # a period's first step: its mean starts afresh
                self.loss_sum, self.loss_steps = 0.0, 0
            skipped = skip == 1  # fp16: the scaler skipped the step, whose loss counts for nothing
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
            self.skipped_steps += skipped
            if not skipped:
                self.loss_sum, self.loss_steps, self.train_loss = self.loss_sum + loss, self.loss_steps + 1, loss
            if self.writer:  # the steps before a divergence are logged too: the curve shows it coming
                self.writer.add_scalar("train/lr", p.lr, p.step)
                if not skipped:
                    self.writer.add_scalar("train/loss", loss, p.step)
                if math.isfinite(grad_norm):
                    self.writer.add_scalar("train/grad_norm", grad_norm, p.step)
        if self.writer and items:  # none: only a step of unknown start (after an evaluation), not timed
            self.writer.add_scalar(f"perf/{self.unit}_per_s", items / seconds, pending[-1].step)
        last = self.pending[-1]
        if bad is not None:
            what = f"the loss is {self.pending[bad].stats.loss.item()} at step {self.pending[bad].step}"
            raise diverged(what, self.last_good())
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise diverged(f"the loss overflows fp16: the GradScaler skipped {self.skipped_in_a_row} steps in a row "
                           f"up to step {last.step}; try --precision bf16", self.last_good())
        if window_ends:
            timed = sum(1 for p in self.pending if p.items)  # not a step of unknown start: it took no time here
            self.seconds_per_step = seconds / timed if timed else self.seconds_per_step
            eta = (self.total_steps - last.step) * self.seconds_per_step
            speed = f"{items / seconds:,.0f} {self.unit}/s  " if items else ""
            skipped = sum(skip == 1 for _, _, skip in rows)  # the loss shown is the last step's that counted
            loss = "n/a" if skipped == len(rows) else f"{self.train_loss:.4f}"  # none did: no earlier one as if new
            skips = f" ({skipped} of {len(rows)} steps skipped: fp16 overflow)" if skipped else ""
            self.print(f"{self.position(last.step)}  loss {loss}{skips}  lr {last.lr:.2e}  {speed}"
                       f"eta {eta // 60:.0f}m{eta % 60:02.0f}s")
        self.pending.clear()
        self.window_start = time.perf_counter()

    def last_good(self) -> Path | None:
        return self.last_checkpoint(self.run.path) or self.run.resume_from

    @property
    def throughput(self) -> float:
        """Items per second of training, without the first window (start-up, compiling) when others timed some, else
        with it (a short run; one whose later steps each followed an evaluation, untimed); 0 when none was timed."""
        items, seconds = self.items, self.seconds
        if self.first_window and items > self.first_window[0]:
            items, seconds = items - self.first_window[0], seconds - self.first_window[1]
        return items / seconds if seconds else 0.0

    def eval(self, step: int, note: str = "", **results: dict[str, float]) -> None:
        """Log an evaluation, ``val={"loss": ..., "acc": ...}`` (a keyword per set); a non-finite loss is a divergence.
        With several processes the figures must be the whole group's, so that every rank decides alike."""
        self.flush()
        self.window_start = None  # what follows an evaluation (saving, say) is not training time either
        if self.loss_steps:  # the training loss shown: the mean over the evaluation period so far
            self.train_loss = self.loss_sum / self.loss_steps
        self.evals, self.evaluated_at = results, step
        for prefix, metrics in results.items():
            for name, value in metrics.items():
                if self.writer:
                    self.writer.add_scalar(f"{prefix}/{name}", value, step)
        shown = "  ".join(f"{prefix}_{k} {v:.4f}" for prefix, m in results.items() for k, v in m.items())
        speed = f"  {self.throughput:,.0f} {self.unit}/s" if self.throughput else ""
        self.print(f"{self.position(step)}  train_loss {self.train_loss:.4f}  {shown}{speed}"
                   f"{'  ' + note if note else ''}")
        for prefix, metrics in results.items():  # finite weights can still overflow in a forward pass
            if not math.isfinite(metrics.get("loss", 0.0)):
                what = prefix.replace("_", " ").replace("val", "validation")  # val_x: "validation x"
                raise diverged(f"the {what} loss is {metrics['loss']} at step {step}", self.last_good())

    def state_dict(self) -> dict:
        """What a resumed run needs to log on as if it had never stopped; reads the pending steps back first."""
        self.flush()
        self.window_start = None  # a checkpoint is being saved: not training time
        return {"loss_sum": self.loss_sum, "loss_steps": self.loss_steps, "train_loss": self.train_loss,
                "skipped_steps": self.skipped_steps, "skipped_in_a_row": self.skipped_in_a_row, "evals": self.evals,
                "evaluated_at": self.evaluated_at,
                "items": self.items, "seconds": self.seconds, "first_window": self.first_window, "wall_s": self.wall_s}

    def load_state_dict(self, state: dict) -> None:
        self.loss_sum, self.loss_steps, self.train_loss = state["loss_sum"], state["loss_steps"], state["train_loss"]
        self.skipped_steps, self.evals = state["skipped_steps"], state["evals"]
        self.evaluated_at = state.get("evaluated_at")  # (None, unknown, in checkpoints from before it was kept)
        self.skipped_in_a_row = state.get("skipped_in_a_row", 0)  # (not in checkpoints before it was kept, nor these:)
        items, seconds, first = state.get("items", 0), state.get("seconds", 0.0), state.get("first_window")
        if first and items > first[0]:  # the earlier launches' start-up left out now: this launch's own first window
            items, seconds = items - first[0], seconds - first[1]  # (start-up, compiling) is left out in its turn
        self.items, self.seconds, self.earlier_wall_s = items, seconds, state.get("wall_s", 0.0)

    @property
    def wall_s(self) -> float:
        return self.earlier_wall_s + time.perf_counter() - self.started

    def finish(self, step: int, metrics: dict | None = None) -> dict:
        """Write metrics.json (the last evaluation, ``metrics``, speed) and the hyper-parameters with their final
        figures (TensorBoard's HParams tab), close the events, print the ``done:`` line; returns the summary."""
        self.flush()
        if self.loss_steps:
            self.train_loss = self.loss_sum / self.loss_steps
        metrics = metrics or {}
        evals = {f"{prefix}_{name}": value for prefix, m in self.evals.items() for name, value in m.items()}
        summary = {"recipe": self.recipe, "steps": step, "train_loss": self.train_loss, **evals, **metrics,
                   "wall_s": self.wall_s}
        if self.throughput:  # none for a run that timed no step
            summary[f"{self.unit}_per_s"] = self.throughput
        if self.skipped_steps:
            summary["skipped_steps"] = self.skipped_steps
        if self.writer:
            write_json(self.run.path / "metrics.json", summary)
            tags = [f"{prefix}/{name}" for prefix, m in self.evals.items() for name in m]
            for name, value in metrics.items():  # the test set's figures, once: test/acc, ...
                if name.startswith("test_") and isinstance(value, float):
                    tags.append(name.replace("_", "/", 1))
                    self.writer.add_scalar(tags[-1], value, step)
            values = {k: v if isinstance(v, bool | int | float) else str(v).encode(errors="backslashreplace").decode()
                      for k, v in self.config.items() if v is not None}  # a name not UTF-8: as \udcff, say
            self.writer.file_writer.add_summary(hparams.hparams_config_pb(
                hparams=[hparams.HParam(k) for k in values], metrics=[hparams.Metric(tag) for tag in tags]))
            self.writer.file_writer.add_summary(hparams.hparams_pb(values, start_time_secs=time.time()))
            self.writer.close()
        shown = " ".join(f"{k}={format_number(v)}" for k, v in summary.items() if k not in ("recipe", "memory"))
        self.print(f"done: {shown} run_dir={self.run.path}")
        return summary


def format_number(value) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
