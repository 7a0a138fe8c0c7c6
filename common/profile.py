"""``--profile N``: where a training step's time goes, measured on N steps of the real run.

    profiler = StepProfiler(run.path, profile, device)   # does nothing without --profile
    ...
    profiler.step()                                      # after every training step

After a warm-up (caches filled, a compiled model compiled), N steps run under ``torch.profiler``; they train as
any other step does. Then the trace goes into the run directory (``*.pt.trace.json``: TensorBoard's profiler
plugin reads it there, Perfetto and chrome://tracing open it), and a table is printed: per step, milliseconds
waiting for data, in the forward pass, in the backward pass (with gradient clipping and unscaling), in the
optimizer, and the rest (Python, logging, host syncs), then the operators that took the most time themselves
in those steps (an evaluation, a sample of text or a checkpoint that falls in one is left out);
the same figures go into profile.json beside the trace.
"""

import os
import statistics
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

from common.cli import on_exit
from common.rundir import write_json

PHASES = ["data", "forward", "backward", "optimizer", "rest"]


class StepProfiler:
    def __init__(self, run_dir: Path, steps: int | None, device: torch.device, warmup: int = 3, write: bool = True):
        self.run_dir, self.steps, self.write, self.profiler = run_dir, steps, write, None
        self.on_gpu = device.type == "cuda"  # its operators are ranked by their kernels' time, not their launch
        self.table: dict[str, list[float]] = {}
        if steps:
            # libkineto (the profiler's C++ side) logs its start, stop and a failed GPU probe on stderr otherwise
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self.profiler = torch.profiler.profile(activities=activities, on_trace_ready=self.report,
                                                   schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1))
            self.profiler.start()
            on_exit(self.stop)

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is not None:
            # Steps still to profile: the open one would hold whatever followed the loop (an evaluation,
            # say). report() sees None and keeps none of them.
            profiler, self.profiler = self.profiler, None
            profiler.stop()
            if not self.table and self.write:
                print(f"profile: the run ended before {self.steps} steps could be profiled after the warm-up",
                      file=sys.stderr)  # after the done: line, which stays stdout's last

    def report(self, profiler: torch.profiler.profile) -> None:
        """The steps are done: the trace, and the table of phases and operators."""
        if self.profiler is None:  # the run ended first (see stop)
            return
        outermost = [e for e in profiler.events() if e.cpu_parent is None]
        steps = [e for e in outermost if e.name.startswith("ProfilerStep")]
        roots = [e for e in outermost if not e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU]
        self.table = {phase: [] for phase in PHASES}
        for step in steps:
            for phase, ms in phases(step, roots).items():
                self.table[phase].append(ms)
        if not self.write:
            return
        traces = set(self.run_dir.glob("*.pt.trace.json"))
        tensorboard_trace_handler(str(self.run_dir))(profiler)
        for unfinished in self.run_dir.glob("*.pt.trace.json.tmp"):  # its C++ writer fails silently (a full disk)
            unfinished.unlink(missing_ok=True)
        trace = f"trace in {self.run_dir}" if set(self.run_dir.glob("*.pt.trace.json")) - traces else \
            f"the trace could not be written in {self.run_dir}"
        medians = {phase: statistics.median(v) for phase, v in self.table.items()}
        clock = "self_device_time_total" if self.on_gpu else "self_cpu_time_total"
        lines = [f"profile of {len(steps)} steps ({trace}): milliseconds per step, median"
                 + (" (the CPU's time: the GPU runs behind it)" if self.on_gpu else ""),
                 "  " + "  ".join(f"{phase:>9}" for phase in PHASES) + f"  {'total':>9}",
                 "  " + "  ".join(f"{ms:9.2f}" for ms in medians.values()) + f"  {sum(medians.values()):9.2f}",
                 f"top operators by self {'GPU ' if self.on_gpu else ''}time:"]
        totals = {}
        for event in (e for step in steps for e in training_events(step, roots)):
            totals[event.key] = totals.get(event.key, 0.0) + getattr(event, clock)
        top = sorted(totals.items(), key=lambda item: item[1], reverse=True)[:8]
        operators = {name: us / 1000 / len(steps) for name, us in top}
        lines += [f"  {name[:60]:60} {ms:8.2f} ms per step" for name, ms in operators.items()]
        print("\n".join(lines), flush=True)
        write_json(self.run_dir / "profile.json", {"steps": len(steps), "ms_per_step": medians, "operators": operators})


NOT_TRAINING = ("evaluate", "checkpoint")  # record_function names of what may fall in a step and is left out of it


def elsewhere(step, roots: list) -> list:
    """Of ``roots`` (every thread's outermost events), those of other threads that start in ``step``, outside an
    evaluation or a checkpoint: on CUDA, autograd runs the backward pass on a thread of its own per device, whose
    events are no step's children (the step's thread waits in ``backward()`` meanwhile)."""
    left_out = [e.time_range for e in step.cpu_children if e.name in NOT_TRAINING]
    return [e for e in roots if e.thread != step.thread and not e.is_async and step.time_range.start <=
            e.time_range.start < step.time_range.end and not any(r.start <= e.time_range.start < r.end
                                                                for r in left_out)]


def training_events(step, roots: list = ()):
    """Every event inside a profiled step but an evaluation's or a checkpoint's (the operators' table ranked them
    with the training's, and the step markers themselves), the backward pass's on its own thread included."""
    below = [e for e in step.cpu_children if e.name not in NOT_TRAINING] + elsewhere(step, roots)
    while below:
        event = below.pop()
        yield event
        below += event.cpu_children


def phases(step, roots: list = ()) -> dict[str, float]:
    """One profiled step's milliseconds by phase, from the events directly inside it: the DataLoader's and the
    optimizer's own (named by torch), autograd's backward functions and what follows the last of them until the
    optimizer (clipping, unscaling), the other operators (the forward passes of every micro-batch, the losses), and
    the rest. An evaluation or a checkpoint that fell in the step (``record_function``'s "evaluate", "checkpoint")
    is left out: the figures are a training step's. Backward functions on autograd's own thread (CUDA) count in
    their place in time, while the step's thread waits for them."""
    ms = dict.fromkeys(PHASES, 0.0)
    left_out = [e for e in step.cpu_children if e.name in NOT_TRAINING]  # by name: events define no equality
    events = sorted([e for e in step.cpu_children if e.name not in NOT_TRAINING] +
                    [e for e in elsewhere(step, roots) if e.name.startswith("autograd::engine")],
                    key=lambda e: e.time_range.start)
    backward = [i for i, e in enumerate(events) if e.name.startswith("autograd::engine")]
    optimizer = [i for i, e in enumerate(events) if e.name.startswith("Optimizer.") and backward and i > backward[-1]]
    after_backward = range(backward[-1] + 1, optimizer[0] if optimizer else len(events)) if backward else range(0)
    for i, event in enumerate(events):
        if event.name.startswith("enumerate(DataLoader)"):
            phase = "data"
        elif event.name.startswith("Optimizer."):
            phase = "optimizer"
        elif event.name.startswith("autograd::engine") or i in after_backward:
            phase = "backward"
        else:
            phase = "forward"
        ms[phase] += (event.time_range.end - event.time_range.start) / 1000
    left_out_ms = sum(e.time_range.end - e.time_range.start for e in left_out) / 1000
    ms["rest"] = max(0.0, (step.time_range.end - step.time_range.start) / 1000 - left_out_ms - sum(ms.values()))
    return ms
