"""Ctrl-C and SIGTERM as a request to stop, which the training loop reads between two steps.

    stop = StopRequest()
    ...                                  # in the loop, after a step:
    if stop.requested:
        checkpoints.save(step)           # the run's state at this step
        stop.exit(step, run.path)        # says how to resume, exits 130 (Ctrl-C) or 143 (SIGTERM)
    stop.loop_ended(step, run.path)      # after the loop: a signal in the test evaluation exits at once
"""

import os
import shlex
import signal
import sys
from pathlib import Path

from common.cli import launched_as_rank_0, on_exit


class StopRequest:
    """Ctrl-C and SIGTERM (sent by schedulers and spot instances before a kill) as a flag, ``requested``, instead
    of an exception half-way through a step; the loop saves and calls ``exit``. A second signal quits at once, but
    under torchrun, which passes on the signal it gets, a rank signalled itself too (SLURM signals every process; a
    Ctrl-C, the terminal's whole group) hears the same one twice: torchrun's SIGKILL, after its grace period, is the
    quit. Exit status: 128 + signal. The previous handlers come back when the recipe's command ends."""

    def __init__(self):  # (a request after an earlier run of this command, a fold say, exited there)
        self.signal: int | None = None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        self.ended_at: tuple[int, Path | None] | None = None  # (step, run_dir) once the loop is over
        on_exit(self.restore)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def exit(self, step: int, run_dir: Path | None) -> None:
        """Once a checkpoint of ``step`` is saved: say how to resume ``run_dir`` (None: a command that always starts
        afresh, such as a comparison), and exit (SystemExit: clean-ups still run)."""
        if launched_as_rank_0():  # signalled or not: under torchrun, another node's ranks may have been
            print(f"interrupted at step {step}; checkpoint saved. Resume with:\n  {resume_command(run_dir)}"
                  if run_dir else f"interrupted at step {step}; this command always starts afresh: run it again "
                  "with another --run-dir", flush=True)
        sys.exit(128 + (self.signal or signal.SIGTERM))  # a rank not signalled itself: as if SIGTERMed

    def loop_ended(self, step: int, run_dir: Path | None) -> None:
        """The training loop is over and its last step saved: a signal from here on (in a test evaluation, say)
        exits at once, as ``exit`` does (it said it would save after a step that never came, and the run exited 0).
        Resumed, such a run finishes: a checkpoint at the end without metrics.json is a run killed as it finished.
        A signal already heard (in the step an early stop ended the loop at, say) exits now."""
        self.ended_at = (step, run_dir)
        if self.requested:
            self.exit(step, run_dir)

    def handle(self, signum, frame) -> None:
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        if self.requested:
            if not (torchrun and signum == self.signal):
                sys.exit(128 + signum)
            return
        self.signal = signum
        if self.ended_at is not None:  # nothing left to save: the loop's last checkpoint is the run's
            self.exit(*self.ended_at)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if launched_as_rank_0():
            print(f"{name}: saving a checkpoint after this step" + ("" if torchrun else
                  " (send it again to quit without saving)"), flush=True)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def resume_command(run_dir: Path) -> str:
    """This process's own command line, made to continue from ``run_dir``'s last checkpoint; under torchrun over
    several nodes, what to run on each."""
    args, given = [], iter(sys.argv[1:])
    for arg in given:  # --resume and --run-dir are left out, with their values
        if arg in ("--resume", "--run-dir"):
            next(given, None)
        elif not arg.startswith(("--resume=", "--run-dir=")):
            args.append(arg)
    command = shlex.join([sys.argv[0], *args, "--resume", "auto", "--run-dir", str(run_dir)])
    if "LOCAL_WORLD_SIZE" not in os.environ:  # plain python, or a group launched without torchrun (srun, by hand)
        processes = os.environ.get("WORLD_SIZE", "1") if "RANK" in os.environ else "1"  # (no group without a RANK)
        return f"python {command}" if processes in ("", "1") else \
            f"{processes} processes, launched as before: python {command}"
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])  # torchrun's options beyond the process counts are not known here
    nodes = int(os.environ["WORLD_SIZE"]) // per_node
    if nodes == 1:
        return f"torchrun --nproc_per_node={per_node} {command}"
    return (f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --node-rank=N RDZV {command}\n  (on each node: N "
            "its --node-rank, RDZV the --rdzv-* options it was launched with)")
