"""What a run holds in memory, measured from the real tensors after the first optimizer step.

The usual estimate for fp32 AdamW is 16 bytes per parameter: 4 for the weight, 4 for its gradient and 8 for
the optimizer's two moment estimates, before any activation. This module counts instead of estimating, so
the figure is right for any optimizer, any dtype, tied weights (counted once) and frozen parameters (no
gradient, no state). The optimizers' scalar step counters (a few bytes per tensor, not per parameter) are
reported apart as bookkeeping.
"""

import resource
import sys

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_account(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    """Parameters and the bytes held by weights, gradients and optimizer state; call after a step."""
    params = list(model.parameters())  # each shared (tied) parameter once
    per_parameter_state, bookkeeping = 0, 0
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                if key != "step" and value.shape == p.shape:  # e.g. Adam's exp_avg, SGD's momentum_buffer
                    per_parameter_state += tensor_bytes(value)
                else:
                    bookkeeping += tensor_bytes(value)
    account = {
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "weight_bytes": sum(tensor_bytes(p) for p in params),
        "gradient_bytes": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state_bytes": per_parameter_state,
        "optimizer_bookkeeping_bytes": bookkeeping,
    }
    account["model_state_bytes"] = account["weight_bytes"] + account["gradient_bytes"] + per_parameter_state
    if device.type == "cuda":
        # everything else the allocator held at its peak: activations saved for backward, workspaces
        account["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        account["activation_and_workspace_bytes"] = account["peak_allocated_bytes"] - account["model_state_bytes"]
    account["peak_rss_bytes"] = peak_rss_bytes()
    return account


def peak_rss_bytes() -> int:
    """The process's peak resident memory (everything: Python, libraries, tensors on the CPU)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kilobytes


def reset_peak_memory(device: torch.device) -> None:
    """Start the GPU's peak-memory figure from here: call once setup (model on the device, compile, the FLOP
    probe's large matrices) is done, before the first training step, so the peak is the training's own.
    Without CUDA there is nothing to reset (the process's RSS peak cannot be reset)."""
    if torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def with_peaks(account: dict[str, int], device: torch.device | None = None) -> dict[str, int]:
    """The account plus the peaks at the end of a run: the process's memory, and ``device``'s when it is a
    GPU. Without ``device`` the figure is the current CUDA device's (``cuda:0`` unless set_device was called):
    wrong for ``--device cuda:1``, so pass it."""
    peaks = {"peak_rss_bytes": peak_rss_bytes()}
    if device is None:  # callers that do not say: the current device, as before
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peaks["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    elif torch.device(device).type == "cuda":
        peaks["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return {**account, **peaks}


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_account(account: dict[str, int], optimizer_name: str) -> str:
    """A small table: bytes in total and per parameter for each part of the model state."""
    n = max(account["parameters"], 1)
    rows = [("weights", account["weight_bytes"]), ("gradients", account["gradient_bytes"]),
            (f"optimizer state ({optimizer_name})", account["optimizer_state_bytes"]),
            ("total before activations", account["model_state_bytes"])]
    lines = [f"memory after the first step: {account['parameters']:,} parameters "
             f"({account['trainable_parameters']:,} trainable)",
             f"  {'':32} {'bytes':>10} {'per parameter':>14}"]
    lines += [f"  {name:32} {format_bytes(b):>10} {b / n:>12.2f} B" for name, b in rows]
    if "peak_allocated_bytes" in account:
        lines.append(f"  {'peak allocated on the GPU':32} {format_bytes(account['peak_allocated_bytes']):>10}"
                     f"   (activations and workspace: {format_bytes(account['activation_and_workspace_bytes'])})")
    lines.append(f"  {'peak process memory (RSS)':32} {format_bytes(account['peak_rss_bytes']):>10}")
    return "\n".join(lines)
