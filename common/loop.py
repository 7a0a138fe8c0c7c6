"""One optimizer step, and evaluation over a whole data set. Recipes write their own loops around these.

``train_step`` reads nothing back from the device (no ``.item()``): on a GPU that would stall the CPU until
the step finished, and it could no longer queue the next step's kernels ahead. (fp16's GradScaler is the
exception: its step checks for overflow on the CPU.) Losses stay tensors until the run logger reads a window
of them at once (see common/tracking.py), which is also where a non-finite loss is caught. ``evaluate``
reads its totals back once, at the end.
"""

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common.runtime import autocast

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StepStats(NamedTuple):
    loss: torch.Tensor  # mean loss over the step's micro-batches (detached)
    grad_norm: torch.Tensor | None  # total gradient norm before clipping; None when it was not computed
    skipped: torch.Tensor | None  # True when the GradScaler skipped the step for inf/nan gradients (fp16)


def to_device(batch: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    # non_blocking only overlaps the copy with compute when the loader pinned the memory (CUDA)
    return [t.to(device, non_blocking=True) for t in batch]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    micro_batches: Sequence[Sequence[torch.Tensor]],
    *,
    device: torch.device,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    max_grad_norm: float | None = None,
) -> StepStats:
    """One optimizer step over one or more micro-batches, each ``(*inputs, target)``.

    Gradients of several micro-batches are accumulated (each loss divided by their number, so the step
    equals one over the concatenated batch); under DDP only the last backward all-reduces. Pass
    ``scheduler`` only for schedules that step every optimizer step (OneCycle, warmup + cosine).
    """
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=device)
    ddp = getattr(model, "_orig_mod", model)  # compiled after DDP-wrapping: the DDP module is inside
    for i, batch in enumerate(micro_batches):
        *inputs, target = to_device(batch, device)
        last = i == len(micro_batches) - 1
        sync = nullcontext() if last or not isinstance(ddp, DistributedDataParallel) else ddp.no_sync()
        with sync:
            with autocast(device, precision):
                loss = loss_fn(model(*inputs), target) / len(micro_batches)
            (scaler.scale(loss) if scaler else loss).backward()
        total_loss += loss.detach().float()

    grad_norm = None
    if scaler:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    if max_grad_norm is not None or scaler:
        # With a scaler the norm is also the overflow test: it is inf/nan exactly when a gradient is.
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)

    skipped = None
    if scaler:
        scaler.step(optimizer)  # skips the update when the unscaled gradients hold inf/nan
        scaler.update()  # ...and then halves the scale
        skipped = ~torch.isfinite(grad_norm)
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return StepStats(total_loss, grad_norm, skipped)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: torch.utils.data.DataLoader,
    loss_fn: LossFn,
    *,
    device: torch.device,
    precision: str = "fp32",
    accuracy: bool = True,
) -> dict[str, float]:
    """Mean loss (and accuracy) over every sample of ``loader``, in eval mode; restores the caller's mode.

    Each sample is weighted by its number of targets, so a short last batch counts for what it holds.
    Under DDP each rank evaluates its own shard and the sums are all-reduced: every sample counts once.
    """
    was_training = model.training
    model.eval()  # dropout off, batch norm uses its running statistics
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, targets
    for batch in loader:
        *inputs, target = to_device(batch, device)
        with autocast(device, precision):
            output = model(*inputs)
            loss = loss_fn(output, target)
        totals[0] += loss.double() * target.numel()
        if accuracy:
            totals[1] += (output.argmax(-1) == target).sum()
        totals[2] += target.numel()
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    metrics = {"loss": loss_sum / count}
    if accuracy:
        metrics["acc"] = correct / count
    return metrics
