"""What a resumed run may change, and what it may not.

A checkpoint's optimizer and scheduler state replace this run's settings wholesale on loading: resumed with
other options (more epochs, another batch size, learning rate, weight decay or optimizer), a run would go on
with the checkpoint's, or on a curve nobody asked for (a cosine that climbs back up). ``check_same_run``
refuses that with one line that names what differs. ``--max-steps`` only cuts a run short: it may change.
"""

import json
from pathlib import Path

import torch

from common.cli import RecipeError
from common.runtime import DistInfo

# What shapes a scheduler's curve (its progress, last_epoch and _last_lr, is not compared).
SCHEDULE_KEYS = ("T_max", "eta_min", "total_steps", "milestones", "_milestones", "total_iters", "start_factor",
                 "end_factor", "gamma", "base_lrs")

# Set by schedulers as they go (OneCycleLR drives momentum too), or by the device (fused kernels): free to differ.
NOT_SETTINGS = {"params", "lr", "initial_lr", "max_lr", "min_lr", "momentum", "base_momentum", "max_momentum",
                "betas", "foreach", "fused", "capturable", "differentiable"}


def optimizer_settings(state: dict) -> dict:
    """The hyper-parameters a run chose (weight decay, Nesterov, decoupled or not, ...) per parameter group."""
    return {f"group {i} {key}": value for i, group in enumerate(state["param_groups"])
            for key, value in group.items() if key not in NOT_SETTINGS}


def schedule_shape(state: dict, prefix: str = "") -> dict:
    """The numbers that define a scheduler's curve, not how far along it is (nested schedulers included)."""
    shape = {prefix + key: (dict(state[key]) if isinstance(state[key], dict) else state[key])
             for key in SCHEDULE_KEYS if key in state}
    for i, nested in enumerate(state.get("_schedulers", [])):
        shape |= schedule_shape(nested, f"{prefix}scheduler {i + 1} ")
    return shape


def check_same_run(state: dict, source: Path, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None, steps_per_epoch: int | None) -> None:
    """Raise a RecipeError if this run's optimizer, schedule or epoch length is not the checkpoint's."""
    saved, wanted = optimizer_settings(state["optimizer"]), optimizer_settings(optimizer.state_dict())
    if saved != wanted:
        changed = saved.keys() ^ wanted.keys() or {k for k in saved if saved[k] != wanted[k]}
        raise RecipeError(f"checkpoint {source} was saved with other optimizer settings or parameter groups "
                          f"({', '.join(sorted(changed))}): resume with the options it was started with")
    if steps_per_epoch is not None and state.get("steps_per_epoch") not in (None, steps_per_epoch):
        raise RecipeError(f"checkpoint {source} has {state['steps_per_epoch']} steps per epoch, this run "
                          f"{steps_per_epoch}: resume with the batch size, data and processes it was started with")
    if scheduler is not None and state["scheduler"] is not None:
        saved, wanted = schedule_shape(state["scheduler"]), schedule_shape(scheduler.state_dict())
        changed = [f"{key} {saved.get(key)} there, {wanted.get(key)} here"
                   for key in sorted(saved.keys() | wanted.keys()) if saved.get(key) != wanted.get(key)]
        if changed:
            raise RecipeError(f"checkpoint {source} follows another learning-rate schedule ({'; '.join(changed)}): "
                              "resume with the epochs/steps, batch size and learning rate it was started with")


def already_finished(step: int, total_steps: int, run_dir: Path, dist_info: DistInfo = DistInfo()) -> bool:
    """True, after saying so, when the run in ``run_dir`` completed at ``step``: relaunching a finished run (the
    same command on every restart) must neither train past --max-steps nor overwrite its results. A run whose
    last checkpoint is at the final step but that never wrote metrics.json (stopped during the last
    evaluation) is not finished: it goes on and finishes."""
    try:
        finished_at = json.loads((run_dir / "metrics.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):  # none yet, or not ours
        finished_at = None
    if step < total_steps or finished_at != step:
        return False
    if dist_info.is_main:
        print(f"already finished: step {step} of {total_steps}; nothing trained, {run_dir} left as it was "
              "(a run cut short by --max-steps goes on with a larger one)")
    return True


def resume_position(step: int, total_steps: int, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch, steps already done in it) to go on from ``step``. A run stopped at its last step but before its
    final evaluation goes back into its last epoch, where the loop stops at once and evaluates."""
    return divmod(min(step, total_steps - 1), steps_per_epoch)
