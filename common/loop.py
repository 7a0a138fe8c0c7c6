"""One optimizer step, evaluation over a whole data set, and where a (resumed) loop is. Recipes write their
own loops around these.

``train_step`` reads nothing back from the device (no ``.item()``): on a GPU that would stall the CPU until
the step finished, and it could no longer queue the next step's kernels ahead. (fp16's GradScaler is the
exception: its step checks for overflow on the CPU.) Losses stay tensors until the run's log reads a window
of them at once (``common.runlog.RunLog``), which is also where a non-finite loss is caught. ``evaluate``
reads its totals back once, at the end.
"""

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common.runtime import autocast

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StepStats(NamedTuple):
    loss: torch.Tensor  # mean loss over the step's targets (detached)
    grad_norm: torch.Tensor | None = None  # total gradient norm before clipping; None when it was not computed
    skipped: torch.Tensor | None = None  # True when the GradScaler skipped the step for inf/nan gradients (fp16)


def to_device(batch: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    # non_blocking only overlaps the copy with compute when the loader pinned the memory (CUDA)
    return [t.to(device, non_blocking=True) for t in batch]


def counted(loss_fn: LossFn, target: torch.Tensor) -> torch.Tensor:
    """Which targets a loss counts: all of them, except those equal to its ``ignore_index`` (cross-entropy's
    marker for an unknown label). A mean loss is a mean over these, so batches are weighted by their count."""
    ignore_index = getattr(loss_fn, "ignore_index", None)
    if ignore_index is None or target.is_floating_point():
        return torch.ones_like(target, dtype=torch.bool)
    return target != ignore_index


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
               micro_batches: Sequence[Sequence[torch.Tensor]], *, device: torch.device, precision: str = "fp32",
               scaler: torch.amp.GradScaler | None = None, max_grad_norm: float | None = None) -> StepStats:
    """One optimizer step over one or more micro-batches, each ``(*inputs, target)``. Their gradients add up,
    each mean loss weighted by its share of the step's counted targets, so the step equals one over the
    concatenated batch even when micro-batches differ in size; under DDP only the last backward all-reduces.
    ``scaler``: ``torch.amp.GradScaler(device.type, enabled=precision == "fp16")``, as every recipe builds it. The
    learning-rate schedule is the caller's to step, after this."""
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)  # disabled: its calls pass through
    optimizer.zero_grad(set_to_none=True)
    batches = [to_device(batch, device) for batch in micro_batches]
    counts = [counted(loss_fn, batch[-1]).sum() for batch in batches]
    total = torch.stack(counts).sum().clamp(min=1)
    total_loss = torch.zeros((), device=device)
    ddp = getattr(model, "_orig_mod", model)  # compiled after DDP-wrapping: the DDP module is inside
    for i, (*inputs, target) in enumerate(batches):
        last = i == len(batches) - 1
        # under DDP only the last micro-batch's backward all-reduces; the others accumulate locally
        sync = nullcontext() if last or not isinstance(ddp, DistributedDataParallel) else ddp.no_sync()
        with sync:
            with autocast(device, precision):
                loss = loss_fn(model(*inputs), target).float()
            # a micro-batch with nothing to count has a NaN mean loss and contributes nothing
            loss = torch.where(counts[i] > 0, loss, 0.0) * (counts[i] / total)
            scaler.scale(loss).backward()
        total_loss += loss.detach()

    scaler.unscale_(optimizer)  # fp16: clip (and measure) the true gradients, not the scaled ones
    grad_norm = None
    if max_grad_norm is not None or scaler.is_enabled():
        # With a scaler the norm is also the overflow test: it is inf/nan exactly when a gradient is.
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    scaler.step(optimizer)  # fp16: skips the update when the unscaled gradients hold inf/nan...
    scaler.update()  # ...and then halves the scale
    return StepStats(total_loss, grad_norm, ~torch.isfinite(grad_norm) if scaler.is_enabled() else None)


@torch.no_grad()
@torch.profiler.record_function("evaluate")  # --profile leaves it out of the step it falls in
def evaluate(model: nn.Module, batches: Iterable[Sequence[torch.Tensor]], loss_fn: LossFn, *, device: torch.device,
             precision: str = "fp32", accuracy: bool = True) -> dict[str, float]:
    """Mean loss (and accuracy) over every counted target of ``batches``, in eval mode; restores the mode.

    Each batch's mean loss is weighted by its number of counted targets, so a short last batch counts for
    what it holds and a target the loss ignores (``ignore_index``) counts nowhere, accuracy included."""
    was_training = model.training
    model.eval()  # dropout off, batch norm uses its running statistics
    totals = torch.zeros(3, dtype=sum_dtype(device), device=device)  # loss sum, correct, counted targets
    for batch in batches:
        *inputs, target = to_device(batch, device)
        with autocast(device, precision):
            output = model(*inputs)
            loss = loss_fn(output, target)
        valid = counted(loss_fn, target)
        n = valid.sum()
        totals[0] += torch.where(n > 0, loss.to(totals.dtype) * n, 0.0)
        if accuracy:
            totals[1] += ((output.argmax(-1) == target) & valid).sum()
        totals[2] += n
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    metrics = {"loss": loss_sum / count if count else math.nan}
    if accuracy:
        metrics["acc"] = correct / count if count else math.nan
    return metrics


def sum_dtype(device: torch.device) -> torch.dtype:
    """The dtype of sums over a whole data set: float64, but float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def epochs_left(step: int, steps_per_epoch: int, total_steps: int, evaluated_at: int | None) -> range:
    """The epochs still to train after ``step`` optimizer steps: from the one it stopped in (a resumed run
    goes on mid-epoch) to the one holding the last step; none once the last step is done and evaluated
    (``evaluated_at``: the step of the last evaluation; None, unknown, is taken as this one). A checkpoint saved
    mid-epoch, before its evaluation, and resumed with --max-steps at its step gets its epoch with no batch left:
    the evaluation of the cut."""
    evaluated = step % steps_per_epoch == 0 or evaluated_at in (step, None)
    return range(0) if step > total_steps or step == total_steps and evaluated else \
        range(step // steps_per_epoch, math.ceil(total_steps / steps_per_epoch))


def batches_left(loader: DataLoader, step: int, total_steps: int) -> Iterator:
    """The current epoch's batches still to train after ``step`` steps: a resumed epoch leaves out those it
    trained on (its sampler, a ``ResumableSampler``, skips them unloaded), and none is loaded past the last step."""
    steps_per_epoch = len(loader)  # before the skip, which shortens it
    done = step % steps_per_epoch
    loader.sampler.skip = done * loader.batch_size
    try:
        yield from itertools.islice(loader, min(steps_per_epoch - done, total_steps - step))
    finally:
        loader.sampler.skip = 0
