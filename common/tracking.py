"""One training run's plumbing, in one object: the run directory and what it holds (config.json, TensorBoard
events, checkpoints, metrics.json), resuming, where the loop is, the progress bar and the ``done:`` line.
Only rank 0 writes files; every rank keeps the same bookkeeping.

    run = Run(RECIPE, locals())                  # first line of main: run directory, checkpoint to resume from
    ...                                          # data, model, optimizer, schedule: the recipe's own
    run.start(model=model, optimizer=optimizer, scheduler=scheduler, loader=train_loader, epochs=epochs)
    for epoch in run.epochs():                   # from where a resumed run stopped; none if it had finished
        train_loader.sampler.set_epoch(epoch)
        for batch in run.batches(train_loader):  # skips what a resumed epoch already trained; stops at the end
            run.log_train(train_step(...), lr=..., items=...)
        run.log_eval(validate, score=...)        # validate(model) -> metrics; best.pt on a best score, then last.pt
    run.finish()

Step losses stay on the device and are read back ``log_every`` steps at a time: one sync per window instead
of one per step. That read is also where a non-finite loss is caught, and every save reads first, so a
checkpoint never holds weights that a NaN step has already spoiled.
"""

import atexit
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.tensorboard import SummaryWriter

from common.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from common.cli import RecipeError
from common.loop import StepStats
from common.resources import format_account, memory_account, reset_peak_memory, with_peaks
from common.resume import already_finished, check_same_run
from common.rundir import StopRequest, prepare_run_dir, write_json
from common.runtime import unwrap

MAX_SKIPPED_IN_A_ROW = 50  # fp16 steps the GradScaler may skip in a row before the run is called diverged


class Run:
    def __init__(self, recipe: str, options: dict, *, may_change: Iterable[str] = (), unit: str = "samples",
                 log_every: int = 10):
        self.recipe, self.options, self.may_change = recipe, dict(options), set(may_change)
        self.unit, self.log_every = unit, log_every
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.is_main = self.rank == 0
        run_dir, resume = self.options.get("run_dir"), self.options.get("resume")
        if self.world_size > 1:  # rank 0 names a default directory; every rank must use that one
            run_dir = self.from_rank_0(lambda: prepare_run_dir(recipe, run_dir, resume)[0])
        self.run_dir, self.resume_path, self.checkpoint = self.open_run_dir(run_dir, resume)
        self.config = {k: str(v) if isinstance(v, Path) else v for k, v in self.options.items()}  # JSON-safe
        self.finished = self.stopped_early = False
        self.state, self.writer, self.stop, self.metrics, self.memory = None, None, None, {}, {}
        self.pending: list[tuple[int, StepStats, float, int]] = []  # steps not yet read back from the device
        self.items, self.train_seconds, self.first_window = 0, 0.0, None  # throughput leaves the first window out
        self.train_loss, self.interval_losses, self.skipped_steps, self.skipped_in_a_row = math.nan, [], 0, 0
        show = self.options.get("progress")
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), disable=not ((sys.stdout.isatty() if show is None else show) and self.is_main))

    def from_rank_0(self, work: Callable[[], object]) -> object:
        """``work()`` on rank 0 alone; its result, or its error, on every rank (none waits for a broadcast in vain)."""
        outcome = [None]
        if self.is_main:
            try:
                outcome = [work()]
            except (RecipeError, typer.BadParameter) as err:
                outcome = [err]
            except OSError as err:
                outcome = [RecipeError(f"{err.filename or 'a file'}: {err.strerror or err}")]
        if self.world_size > 1:
            dist.broadcast_object_list(outcome)
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    def open_run_dir(self, run_dir, resume: str | None) -> tuple:
        """(run directory, checkpoint to resume from or None, its contents); ShardedRun finds its DCP folders here."""
        run_dir, resume_path = prepare_run_dir(self.recipe, run_dir, resume, self.is_main)
        return run_dir, resume_path, load_checkpoint(resume_path, self.recipe) if resume_path else None

    @property
    def resuming(self) -> bool:
        return self.checkpoint is not None

    @property
    def step(self) -> int:
        return self.state.step if self.state else 0

    def print(self, message: str) -> None:
        if self.is_main:
            self.progress.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def start(self, *, model, optimizer, scheduler=None, scaler=None, loader=None, epochs: int | None = None,
              steps: int | None = None, eval_every: int | None = None, extra: dict | None = None) -> None:
        """Restore a resumed run, open its outputs, print its header. Epoch-based recipes pass ``epochs`` and
        their training ``loader``; step-based ones ``steps`` and ``eval_every`` (the steps of their "epoch")."""
        self.steps_per_epoch = len(loader) if epochs else eval_every or steps
        schedule_steps = epochs * self.steps_per_epoch if epochs else steps
        self.total_steps = min(schedule_steps, self.options.get("max_steps") or schedule_steps)
        self.n_epochs, self.per_epoch = math.ceil(schedule_steps / self.steps_per_epoch), bool(epochs)
        # --ema: the average follows the plain module (inside DDP's or torch.compile's wrapper); use_buffers
        # averages batch norm's running statistics too, so the averaged model evaluates like a trained one
        decay = self.options.get("ema")
        ema = decay and AveragedModel(unwrap(model), multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.state = TrainingState(self.recipe, self.config, model, optimizer, scheduler, scaler,
                                   getattr(loader, "generator", None), self.steps_per_epoch, extra or {}, ema)
        if self.checkpoint:
            check_same_run(self.checkpoint, self.resume_path, self.config, self.steps_per_epoch, self.may_change)
            self.state.load_state_dict(self.checkpoint, self.resume_path)
        # Relaunched once finished (the same command on every restart), a run must neither train past its end
        # nor overwrite its results. One stopped between its last checkpoint and metrics.json goes on.
        if already_finished(self.run_dir, self.step, self.total_steps):
            self.finished = True
            return self.print(f"already finished: step {self.step} of {self.total_steps}; nothing trained, "
                              f"{self.run_dir} left as it was (a run cut short by --max-steps goes on with a larger "
                              "one)")
        device = self.state.device
        self.started = self.window_start = self.last_step_time = time.perf_counter()
        self.last_saved = self.step if self.checkpoint else None
        self.config_json = {**self.config, "run_dir": str(self.run_dir), "torch_version": torch.__version__,
                            "device_used": str(device), "world_size": self.world_size}
        if self.is_main:
            write_json(self.run_dir / "config.json", self.config_json)
            # purge_step hides events a killed run logged after its checkpoint's step, so curves stay single
            self.writer = SummaryWriter(str(self.run_dir), purge_step=self.step + 1 if self.step else None)
        self.task = self.progress.add_task("train", total=self.total_steps, completed=self.step, status="")
        self.progress.start()
        self.stop = StopRequest(self.print)
        atexit.register(self.close)  # an error that ends the run still flushes TensorBoard's events
        reset_peak_memory(device)  # the peak of training, not of setting up
        resumed = f" | resumed at step {self.step}" if self.checkpoint else ""
        self.print(f"run_dir {self.run_dir} | device {device} | {self.world_size} process(es){resumed}")

    # ---- where the loop is

    def epochs(self) -> Iterator[int]:
        """The epochs still to train, from the one a resumed run stopped in; none if the run had finished."""
        if self.finished:
            return
        # stopped at its last step before the final evaluation: back into the last epoch, which evaluates at once
        first, self.done_in_epoch = divmod(min(self.step, self.total_steps - 1), self.steps_per_epoch)
        for epoch in range(first, self.n_epochs):
            self.epoch = epoch
            yield epoch
            self.done_in_epoch = 0
            if self.step >= self.total_steps or self.stopped_early:
                return

    def steps(self) -> Iterator[int]:
        """The numbers of this epoch's steps still to train, never past the run's last step."""
        end = min(self.total_steps, (self.epoch + 1) * self.steps_per_epoch)
        while self.step < end:
            yield self.step + 1

    def batches(self, loader: Iterable) -> Iterator:
        """This epoch's batches still to train: a resumed epoch skips those it already trained on."""
        loader.sampler.skip = self.done_in_epoch * loader.batch_size
        try:  # steps() first: no batch is loaded past the last step
            yield from (batch for _, batch in zip(self.steps(), loader, strict=False))
        finally:
            loader.sampler.skip = 0

    # ---- logging

    def log_train(self, stats: StepStats, *, lr: float, items: int) -> None:
        """Count and log one step; ``items``: its samples (or tokens) on all ranks. Saves every --checkpoint-every
        steps and on a stop, but not at an epoch's end: log_eval saves after evaluating, so no resume skips one."""
        self.state.step += 1
        if self.state.ema is not None:
            self.state.ema.update_parameters(unwrap(self.state.model))
        self.pending.append((self.step, stats, lr, items))
        self.last_step_time = time.perf_counter()
        if not self.memory:  # gradients and optimizer state exist from now on
            self.memory = memory_account(self.state.model, self.state.optimizer, stats.loss.device)
            table = format_account(self.memory, type(self.state.optimizer).__name__)
            self.print(table)
            if self.writer:
                write_json(self.run_dir / "config.json", {**self.config_json, "memory": self.memory})
                self.writer.add_text("memory", "    " + table.replace("\n", "\n    "))
        if self.step % self.log_every == 0 or self.step >= self.total_steps:
            self.flush(ends_now=True)
        every = self.options.get("checkpoint_every")
        if self.step % self.steps_per_epoch and self.step < self.total_steps and (
                self.stop_agreed() or (every and self.step % every == 0)):
            self.save()

    def flush(self, ends_now: bool = False) -> None:
        """Read the window's losses back in one transfer, log them, stop at the first non-finite one. ``ends_now``
        (right after a step): the window ends once the device is done with it, as the read-back returns; after
        an evaluation it ended with the last step."""
        if not self.pending:
            return
        nan = torch.tensor(math.nan, device=self.pending[0][1].loss.device)
        rows = torch.stack([torch.stack([nan if x is None else x.float() for x in stats])
                            for _, stats, _, _ in self.pending]).tolist()  # (loss, grad norm, skipped) per step
        seconds = max((time.perf_counter() if ends_now else self.last_step_time) - self.window_start, 1e-9)
        bad = next((i for i, (loss, _, skip) in enumerate(rows) if not math.isfinite(loss) and skip != 1), None)
        pending, rows = self.pending[:bad], rows[:bad]  # [:None] is everything
        items = sum(n for *_, n in pending)
        self.items, self.train_seconds = self.items + items, self.train_seconds + seconds
        self.first_window = self.first_window or (items, seconds)  # start-up and compilation live here
        for (step, _, lr, _), (loss, grad_norm, skip) in zip(pending, rows, strict=True):
            skipped = skip == 1  # fp16: the scaler skipped the step, whose loss counts for nothing
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
            self.skipped_steps += skipped
            if not skipped:
                self.interval_losses.append(loss)
                self.train_loss = loss
            if self.writer:  # the steps before a divergence are logged too: the curve shows it coming
                self.writer.add_scalar("train/lr", lr, step)
                if not skipped:
                    self.writer.add_scalar("train/loss", loss, step)
                if math.isfinite(grad_norm):
                    self.writer.add_scalar("train/grad_norm", grad_norm, step)
        if self.writer and pending:
            self.writer.add_scalar(f"perf/{self.unit}_per_s", items / seconds, pending[-1][0])
        if bad is not None:
            raise self.diverged(f"the loss is {self.pending[bad][1].loss.item()} at step {self.pending[bad][0]}")
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise self.diverged(f"the loss overflows fp16: the GradScaler skipped {self.skipped_in_a_row} steps in "
                                f"a row up to step {self.step}; try --precision bf16")
        status = f"loss {self.train_loss:.4f}  lr {self.pending[-1][2]:.2e}  {items / seconds:,.0f} {self.unit}/s"
        self.progress.update(self.task, completed=self.step, status=status)
        self.pending.clear()
        self.window_start = time.perf_counter()

    def diverged(self, what: str) -> RecipeError:
        self.close()  # keep what was logged: the writer flushes its events on close
        kept = "no checkpoint yet" if self.last_saved is None else f"the last good checkpoint is {self.last_checkpoint}"
        return RecipeError(f"training diverged: {what}; {kept}. Try a lower --lr")

    @property
    def last_checkpoint(self) -> Path:
        written = self.run_dir / "checkpoints" / "last.pt"
        return written if written.is_file() else self.resume_path  # resumed from elsewhere, nothing saved here yet

    @property
    def throughput(self) -> float:
        """Items per second of training, without the first window (start-up, compiling) when there are others."""
        items, seconds = self.items, self.train_seconds
        if self.first_window and seconds > self.first_window[1]:
            items, seconds = items - self.first_window[0], seconds - self.first_window[1]
        return items / seconds if seconds else 0.0

    def log_eval(self, validate: Callable[[nn.Module], dict[str, float]], *,
                 score: Callable[[dict[str, float]], float] | None = None, note: str = "") -> None:
        """Evaluate with ``validate(model) -> {"loss": ..., "acc": ...}`` (and the EMA with --ema), log, keep the
        best by ``score`` (higher is better: an accuracy, or minus a loss; the EMA's with --ema), save last.pt.
        With several processes ``validate`` must return the whole group's figures (reduced across the ranks), so
        that every rank decides alike on best.pt, early stopping and divergence."""
        self.flush()
        if self.interval_losses:
            self.train_loss = sum(self.interval_losses) / len(self.interval_losses)
        self.interval_losses = []
        results = {"val": validate(self.state.model)}
        if self.state.ema is not None:
            results["ema_val"] = validate(self.state.ema.module)
        for prefix, metrics in results.items():
            for name, value in metrics.items():
                self.metrics[f"{prefix}_{name}"] = value
                if self.writer:
                    self.writer.add_scalar(f"{prefix}/{name}", value, self.step)
        epoch = f"epoch {self.epoch + 1}/{self.n_epochs}  " if self.per_epoch else ""
        shown = "  ".join(f"{prefix}_{k} {v:.4f}" for prefix, m in results.items() for k, v in m.items())
        self.print(f"{epoch}{note}step {self.step}/{self.total_steps}  train_loss {self.train_loss:.4f}  {shown}  "
                   f"{self.throughput:,.0f} {self.unit}/s")
        if not math.isfinite(results["val"].get("loss", 0.0)):  # finite weights can still overflow in a forward pass
            raise self.diverged(f"the validation loss is {results['val']['loss']} at step {self.step}")
        if score is not None:
            self.keep_best(score(results.get("ema_val", results["val"])))
        self.save()

    def keep_best(self, score: float) -> None:
        """best.pt for a new best score, best-stepN.pt for each of the --keep-best K best; counts for --patience."""
        state, keep = self.state, self.options.get("keep_best") or 1
        if score > state.best_score:
            state.best_score, state.best_step, state.evals_since_best = score, self.step, 0
            self.save("best.pt")
        else:
            state.evals_since_best += 1
        ranked = sorted([*state.kept_best, [score, self.step]], key=lambda kept: -kept[0])
        state.kept_best, dropped = ranked[:keep], ranked[keep:]
        if keep > 1 and [score, self.step] in state.kept_best:
            self.save(f"best-step{self.step}.pt")
        for _, step in dropped if self.is_main and keep > 1 else []:
            (self.run_dir / "checkpoints" / f"best-step{step}.pt").unlink(missing_ok=True)
        patience = self.options.get("patience")
        self.stopped_early = bool(patience and state.evals_since_best >= patience and self.step < self.total_steps)
        if self.stopped_early:
            self.print(f"stopping early: no better score in {patience} evaluations (the best: step {state.best_step})")

    # ---- checkpoints

    def stop_agreed(self) -> bool:
        """Whether a stop was asked for (Ctrl-C, SIGTERM). Every rank must stop at the same step, so with
        several processes the ranks agree on it (one all-reduce) every ``log_every`` steps and at the end."""
        if self.world_size == 1:
            return self.stop.requested
        if self.step % self.log_every and self.step < self.total_steps:
            return False
        flag = torch.tensor([float(self.stop.requested)], device=self.state.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self, name: str = "last.pt") -> None:
        """Atomically write checkpoints/NAME (rank 0; the others wait). After last.pt, honours a stop request."""
        self.flush()  # raises on a non-finite loss before anything is written
        state = self.state.state_dict()
        if name.startswith("best") and self.state.ema is not None:  # the weights that scored: the average
            state["model"] = self.state.ema.module.state_dict()
        # A step can end with a finite loss yet inf/nan gradients, which spoil the weights it just updated.
        spoiled = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if spoiled:
            raise self.diverged(f"the weights hold inf/nan after step {self.step} ({spoiled[0]})")
        path = self.run_dir / "checkpoints" / name
        if self.is_main:
            try:
                save_checkpoint(path, state)
            except OSError as err:
                intact = "no earlier checkpoint" if self.last_saved is None else \
                    f"the previous checkpoint (step {self.last_saved}) is intact"
                raise RecipeError(f"could not write checkpoint {path}: {err.strerror or err}; {intact}") from None
        if self.world_size > 1:
            dist.barrier()
        self.last_saved = self.step if name == "last.pt" else self.last_saved
        self.window_start = time.perf_counter()  # evaluating and saving are not training time
        if name == "last.pt" and self.stop_agreed():
            self.close()
            self.stop.exit(self.step, self.run_dir)

    def finish(self, metrics: dict[str, float] | None = None) -> dict:
        """Write metrics.json and the hparams, close everything, print the ``done:`` line (not if already finished)."""
        if self.finished:
            return {}
        self.flush()
        if self.interval_losses:
            self.train_loss = sum(self.interval_losses) / len(self.interval_losses)
        summary = {"recipe": self.recipe, "steps": self.step, "train_loss": self.train_loss, **self.metrics,
                   **(metrics or {}), f"{self.unit}_per_s": self.throughput, "best_score": self.state.best_score,
                   "best_step": self.state.best_step, "stopped_early": self.stopped_early,
                   "wall_s": time.perf_counter() - self.started}
        if not self.items:  # resumed at its last step only to evaluate: no training figures of its own
            del summary["train_loss"], summary[f"{self.unit}_per_s"]
        if self.skipped_steps:
            summary["skipped_steps"] = self.skipped_steps
        if self.memory:
            summary["memory"] = with_peaks(self.memory, self.state.device)
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


def format_number(value) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
