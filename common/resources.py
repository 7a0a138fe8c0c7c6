"""What a run holds in memory, measured from the real tensors after the first optimizer step.

The usual estimate for fp32 AdamW is 16 bytes per parameter: 4 for the weight, 4 for its gradient and 8 for
the optimizer's two moment estimates, before any activation. This module counts instead of estimating, so
the figure is right for any optimizer, any dtype, tied weights (counted once) and frozen parameters (no
gradient, no state). The optimizers' scalar step counters (a few bytes per tensor, not per parameter) are
reported apart as bookkeeping.
"""

import sys

import torch
from torch import nn


def memory_account(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    """Parameters and the bytes held by weights, gradients and optimizer state; call after a step."""
    params = list(model.parameters())  # each shared (tied) parameter once
    # Bytes this process holds: of a DTensor (FSDP2's sharded parameters, their gradients and optimizer
    # state) only the local shard, so under FSDP the account is per rank.
    size = lambda t: local(t).numel() * t.element_size()  # noqa: E731
    state = [(key, value, p) for p in params for key, value in optimizer.state.get(p, {}).items()
             if isinstance(value, torch.Tensor)]
    per_parameter = sum(size(v) for key, v, p in state if key != "step" and v.shape == p.shape)  # exp_avg, momentum
    account = {
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "weight_bytes": sum(size(p) for p in params),
        "gradient_bytes": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer_state_bytes": per_parameter,
        "optimizer_bookkeeping_bytes": sum(size(v) for _, v, _ in state) - per_parameter,
    }
    account["model_state_bytes"] = account["weight_bytes"] + account["gradient_bytes"] + per_parameter
    return with_peaks(account, device)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def with_peaks(account: dict[str, int], device: torch.device) -> dict[str, int]:
    """The account plus the peaks so far: the process's resident memory, and ``device``'s if it is a GPU
    (what the allocator held beyond the model state: activations saved for backward, workspaces)."""
    account = {**account, "peak_rss_bytes": peak_rss_bytes()}
    if torch.device(device).type == "cuda":
        peak = account["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        account["activation_and_workspace_bytes"] = peak - account.get("model_state_bytes", 0)
    return account


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux from /proc (VmHWM): getrusage's ru_maxrss survives exec,
    so a process started by a large one (a benchmark holding gigabytes) would report its parent's size."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource  # Unix only: imported where it is used, so that Windows can import this module

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KB elsewhere


def reset_peak_memory(device: torch.device) -> None:
    """Start the GPU's peak-memory figure here, once setup (model on the device, compile, a FLOP probe) is
    done, so that the peak is the training's own. (A process's peak RSS cannot be reset.)"""
    if torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_account(account: dict[str, int], optimizer_name: str) -> str:
    """A small table: bytes in total and per parameter for each part of the model state, and the peaks."""
    n = max(account["parameters"], 1)
    rows = [("weights", account["weight_bytes"]), ("gradients", account["gradient_bytes"]),
            (f"optimizer state ({optimizer_name})", account["optimizer_state_bytes"]),
            ("total before activations", account["model_state_bytes"])]
    lines = [f"memory after the first step: {account['parameters']:,} parameters "
             f"({account['trainable_parameters']:,} trainable)", f"  {'':32} {'bytes':>10} {'per parameter':>14}"]
    lines += [f"  {name:32} {format_bytes(b):>10} {b / n:>12.2f} B" for name, b in rows]
    if "peak_allocated_bytes" in account:
        lines.append(f"  {'peak allocated on the GPU':32} {format_bytes(account['peak_allocated_bytes']):>10}"
                     f"   (activations and workspace: {format_bytes(account['activation_and_workspace_bytes'])})")
    lines.append(f"  {'peak process memory (RSS)':32} {format_bytes(account['peak_rss_bytes']):>10}")
    return "\n".join(lines)
