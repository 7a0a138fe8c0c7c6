"""What a resumed run may change, and recognising a run that has already finished.

A checkpoint's optimizer and scheduler state replace this run's settings wholesale on loading: resumed with
other options (more epochs, another batch size, learning rate or optimizer), a run would go on with the
checkpoint's, or on a curve nobody asked for (a cosine that climbs back up). So a resume compares the saved
options with this run's and refuses, in one line, any difference but in the options that may change: those
that only say where and how fast to run (``MAY_CHANGE``, plus what a recipe adds, such as sampling options).
``--max-steps`` only cuts a run short: it may change too.
"""

import json
from pathlib import Path

from common.cli import OPTION_NAMES, RecipeError

MAY_CHANGE = {"max_steps", "run_dir", "resume", "checkpoint_every", "progress", "num_workers", "device", "compile",
              "data_dir", "keep_best", "patience"}


def check_same_run(state: dict, source: Path, config: dict, steps_per_epoch: int | None,
                   may_change: set[str]) -> None:
    """Raise a RecipeError if this run's options or epoch length are not the checkpoint's."""
    saved = state.get("config", {})
    changed = [f"{OPTION_NAMES.get(key, '--' + key.replace('_', '-'))} {saved.get(key)} there, {config.get(key)} here"
               for key in sorted(saved.keys() | config.keys())
               if key not in MAY_CHANGE | may_change and saved.get(key) != config.get(key)]
    if changed:
        raise RecipeError(f"checkpoint {source} was started with other options ({'; '.join(changed)}): resume "
                          "with the options it was started with, or start afresh in another --run-dir")
    if steps_per_epoch is not None and state.get("steps_per_epoch") not in (None, steps_per_epoch):
        raise RecipeError(f"checkpoint {source} has {state['steps_per_epoch']} steps per epoch, this run "
                          f"{steps_per_epoch}: resume with the data and processes it was started with")


def already_finished(run_dir: Path, step: int, total_steps: int) -> bool:
    """Whether metrics.json says the run finished at ``step``: at its last step, or stopped early."""
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        return metrics["steps"] == step and (step >= total_steps or metrics.get("stopped_early") is True)
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not ours
        return False

