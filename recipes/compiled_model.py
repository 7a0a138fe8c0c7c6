"""torch.compile on a model where kernel fusion matters, with its costs and traps measured.

What it teaches: compiling a model with ``torch.compile`` (mode, backend, dynamic shapes); that the compile
cost is paid in the first steps (and again at the first evaluation: a graph traced with gradients on is not
reused under ``no_grad``, nor for a shorter last batch) and must be measured apart from the steady-state step
time; the two traps the documentation warns about, counted: a new input shape triggers a recompilation unless
the graph was compiled with dynamic shapes (sizes 0 and 1 always), and code that Dynamo will not trace breaks the
graph, and may recompile it at every step, unless it is fenced off with ``torch.compiler.disable``, which makes it
one deliberate break; and that a compiled model's checkpoint loads into a plain model.

Why this model: a narrow (64-wide) residual MLP with a hand-written RMSNorm, GELU and sigmoid gating, at
batch 16384. Its 64x64 matmuls are cheap, while each block makes about a dozen element-wise passes over a
(16384, 64) activation, larger than the CPU's fastest caches. Eager PyTorch runs every one of those as its
own kernel that reads and writes the whole tensor through memory; Inductor fuses them into a few loops that
keep the data in cache. A wide, matmul-bound model gains much less: its matmuls already run in tuned
library kernels either way.

    python recipes/compiled_model.py --compile
    python recipes/compiled_model.py --compare     # eager vs compiled: same seed, same steps
    python recipes/compiled_model.py --traps       # recompilations and graph breaks, counted

A good result on a CPU: compiled steps about 1.2-1.5x faster than eager, after about 12 s of compiling the first
time on a machine and about 1 s once Inductor's on-disk cache holds the kernels.
"""

import copy
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import torch
import torch._dynamo
import torch.nn.functional as F
import typer
from torch import nn

from common import cli
from common.best import BestScore
from common.checkpoint import Checkpointer, resume_checkpoint
from common.data import make_loader, synthetic_classification
from common.loop import batches_left, epochs_left, evaluate, train_step
from common.profile import StepProfiler
from common.rundir import already_finished, open_run_dir, write_json
from common.runlog import RunLog, log_interval
from common.runtime import resolve_device, resolve_precision, seed_everything, synchronize
from common.stop import StopRequest

RECIPE = "compiled_model"
N_FEATURES, N_CLASSES = 32, 10


class RMSNorm(nn.Module):
    """x / rms(x) * gain, written out as research code often is: in eager mode each of these operations is
    a separate kernel and a separate pass over memory; compiled, they become one loop."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # broadcasting: (B, C) * (B, 1) * (C,) -> (B, C); keepdim=True keeps the 1 that makes it line up
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GatedBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = RMSNorm(width)
        self.fc = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.sigmoid(self.gate(h)) * F.gelu(self.fc(h))  # element-wise: what fusion speeds up


class GatedMLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 8):
        super().__init__()
        self.embed = nn.Linear(N_FEATURES, width)
        self.blocks = nn.Sequential(*(GatedBlock(width) for _ in range(depth)))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(x))))


# ----------------------------------------------------------------------------------------------------
# Training, with every step timed: the first steps carry the compilation


def train(epochs: int, max_steps: int | None, batch_size: int, lr: float, samples: int, width: int, depth: int,
          compare_compiled: bool, compile: bool, mode: str, dynamic: bool | None, fullgraph: bool, backend: str,
          seed: int, device: str, precision: str, num_workers: int, run_dir: Path | None, resume: str | None,
          config_file: Path | None, checkpoint_every: int | None, log_every: int | None, profile: int | None) -> dict:
    """One training run, eager or compiled, every step timed: the first steps carry the compilation."""
    # every option: config.json, and what a resume must match (a run of a --compare replays as one run)
    config = cli.as_config({k: v for k, v in locals().items() if k != "compare_compiled"})
    run = open_run_dir(RECIPE, run_dir, resume)  # never over another run's checkpoints; one run at a time in it
    # how it compiles (or whether) changes the speed, and the training only by float rounding (fused kernels round
    # otherwise): a resume may change it, and compiled as the run started it is exact (to ~1e-8 on several threads)
    checkpoint = resume_checkpoint(run, RECIPE, config, may_change={"mode", "dynamic", "fullgraph", "backend"})
    if already_finished(run, checkpoint, epochs=epochs, max_steps=max_steps):
        return {}
    seed_everything(seed)
    device = resolve_device(device)
    chosen = resolve_precision(precision, device, checkpoint)  # --precision auto: bf16 where native
    config |= chosen._asdict()  # the option as given, the precision it runs in, and why
    precision = chosen.precision_used
    train_set = synthetic_classification(samples, N_FEATURES, N_CLASSES, seed=seed)
    val_set = synthetic_classification(16384, N_FEATURES, N_CLASSES, seed=seed + 1_000_000)
    # drop_last (make_loader's default for training) matters twice here: a smaller last batch would be
    # a new input shape, and so a recompilation.
    train_loader = make_loader(train_set, batch_size, train=True, seed=seed, num_workers=num_workers, device=device)
    val_loader = make_loader(val_set, batch_size, train=False, device=device)

    model = GatedMLP(width, depth).to(device)
    if compile:
        # Nothing is compiled yet: Dynamo traces forward at the first call, and AOTAutograd compiles the
        # backward at the first backward. mode picks how hard Inductor works (reduce-overhead adds CUDA graphs);
        # dynamic=None compiles for the shapes seen, then once more with a symbolic batch size if it changes;
        # fullgraph=True makes a graph break an error instead of a silent split into several graphs.
        model = torch.compile(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    loss_fn = nn.CrossEntropyLoss()

    steps_per_epoch = len(train_loader)
    total_steps = min(epochs * steps_per_epoch, max_steps or math.inf)
    log = RunLog(run, RECIPE, total_steps=total_steps, every=log_interval(steps_per_epoch, log_every),
                 steps_per_epoch=steps_per_epoch)
    best = BestScore("val_loss", higher_is_better=False)
    # the checkpoint holds the unwrapped module: no "_orig_mod." prefixes, so it loads into a plain model
    checkpoints = Checkpointer(run, RECIPE, config, model=model, optimizer=optimizer, scheduler=scheduler,
                               scaler=scaler, loader_generator=train_loader.generator, steps_per_epoch=steps_per_epoch,
                               parts={"log": log, "best": best})
    step = checkpoints.restore(checkpoint) if checkpoint else 0
    log.start(step, config, device)
    if checkpoint and best.step == step:  # a kill may have come between this step's last.pt and best.pt
        checkpoints.save(step, "best.pt")
    stop = StopRequest()  # Ctrl-C and SIGTERM: save and exit at the end of the step
    resume_dir = None if compare_compiled else run.path  # a --compare starts afresh: nothing to resume
    profiler = StepProfiler(run.path, profile, device)  # --profile N

    step_seconds, eval_seconds = [], []
    for epoch in epochs_left(step, steps_per_epoch, total_steps, log.evaluated_at):
        train_loader.sampler.set_epoch(epoch)
        for batch in batches_left(train_loader, step, total_steps):
            current_lr = scheduler.get_last_lr()[0]
            started = time.perf_counter()
            stats = train_step(model, optimizer, loss_fn, [batch], device=device, precision=precision,
                               scaler=scaler)
            scheduler.step()  # every batch: the schedule counts optimizer steps
            synchronize(device)  # GPU work is asynchronous: wait for it, or the timing means nothing
            step_seconds.append(time.perf_counter() - started)
            step += 1
            log.train(step, stats, lr=current_lr, items=len(batch[-1]))
            profiler.step()
            # mid-epoch checkpoints (an epoch's last step, and the run's, are saved after the evaluation)
            mid_epoch = step % steps_per_epoch and step < total_steps
            if mid_epoch and (stop.requested or checkpoint_every and step % checkpoint_every == 0):
                checkpoints.save(step)
                if stop.requested:
                    stop.exit(step, resume_dir)
        log.flush()  # the training steps' time ends here: evaluating is not training
        started = time.perf_counter()  # the first evaluation compiles again: no_grad is another graph
        val = evaluate(model, val_loader, loss_fn, device=device, precision=precision)
        eval_seconds.append(time.perf_counter() - started)
        log.eval(step, val=val, note="compiled" if compile else "eager")
        improved = best.improved(val["loss"], step)
        checkpoints.save(step)  # first: if the step is the best, last.pt says so (and a resume here writes best.pt)
        if improved:
            checkpoints.save(step, "best.pt")
        if stop.requested:
            stop.exit(step, resume_dir)
    stop.loop_ended(step, resume_dir)  # from here a signal exits at once: the run's last step is saved

    metrics = timing(step_seconds, compiled=compile) | ({"first_eval_s": eval_seconds[0]} if eval_seconds else {})
    if step_seconds:  # none when resumed at the last step, only to finish
        log.print(f"first step {metrics['first_step_s']:.2f} s, first evaluation {metrics['first_eval_s']:.2f} s, "
                  "then " + (f"{metrics['step_ms']:.1f} ms per step" if "step_ms" in metrics else
                             "too few steps to time a steady step"))
    return log.finish(step, best.metrics() | metrics)


def timing(step_seconds: list[float], compiled: bool = True, warmup: int = 3) -> dict[str, float]:
    """Steady state: the median step after ``warmup`` steps. Compilation happens in the first step (a backward
    graph is compiled at the first backward), so the cost is the ``warmup`` steps' excess over as many steady ones;
    an eager run (``compiled`` False) has none."""
    if len(step_seconds) <= warmup:  # no steady step to compare with: only the first is known
        return {"first_step_s": step_seconds[0]} if step_seconds else {}
    step_s = statistics.median(step_seconds[warmup:])
    compile_s = max(0.0, sum(step_seconds[:warmup]) - warmup * step_s)
    return {"step_ms": 1000 * step_s, "first_step_s": step_seconds[0]} | ({"compile_s": compile_s} if compiled else {})


def measure_speed(device: torch.device, width: int, depth: int, batch_size: int, repeats: int = 5,
                  block: int = 10, precision: str = "fp32", **compile_options) -> dict:
    """Steady-state seconds per step, eager against compiled: two copies of one model fed the same batches;
    after the compiled one's first (compiling) step, blocks of ``block`` steps interleaved ``repeats`` times, every
    other round in reverse (eager, compiled, compiled, eager, ...), so that a machine whose load drifts slows both
    alike and neither always runs first. Compile time, apart:
    the first compiled step less a steady one. ``timed_loss_diff``: the two models' last losses apart."""
    torch.manual_seed(0)
    models = {"eager": GatedMLP(width, depth).to(device)}
    models["compiled"] = torch.compile(copy.deepcopy(models["eager"]), **compile_options)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for k, m in models.items()}
    scalers = {k: torch.amp.GradScaler(device.type, enabled=precision == "fp16") for k in models}
    data = synthetic_classification(batch_size * 4, N_FEATURES, N_CLASSES, seed=0)
    batches = list(zip(data.tensors[0].split(batch_size), data.tensors[1].split(batch_size), strict=True))
    done, losses = {"eager": 0, "compiled": 0}, {}

    def seconds_per_step(name: str, n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            stats = train_step(models[name], optimizers[name], nn.CrossEntropyLoss(),
                               [batches[done[name] % len(batches)]], device=device, precision=precision,
                               scaler=scalers[name])
            done[name] += 1
        losses[name] = stats.loss.item()  # waits for the device: the block's work is done
        return (time.perf_counter() - started) / n

    first = {name: seconds_per_step(name, 1) for name in models}  # compiled: Dynamo + Inductor, both passes
    seconds = {"eager": [], "compiled": []}
    for round_ in range(repeats):
        for name in ["compiled", "eager"] if round_ % 2 else ["eager", "compiled"]:
            seconds[name].append(seconds_per_step(name, block))
    return {"seconds": seconds, "compile_s": max(0.0, first["compiled"] - statistics.median(seconds["compiled"])),
            "timed_loss_diff": abs(losses["eager"] - losses["compiled"])}


def compare(options: dict, run_dir: Path, repeats: int = 5, block: int = 10) -> None:
    """Speed from ``measure_speed`` (interleaved, repeated); then eager and compiled each train the same seeded
    run, whose curves and final losses show that compiling changes the speed, not the training."""
    device = resolve_device(options["device"])
    precision = resolve_precision(options["precision"], device).precision_used  # the training runs': both timed in it
    speed = measure_speed(device, options["width"], options["depth"], options["batch_size"], repeats, block, precision,
                          mode=options["mode"], dynamic=options["dynamic"], fullgraph=options["fullgraph"],
                          backend=options["backend"])
    torch._dynamo.reset()  # the timing compiled this model's code: the compiled run compiles it anew, as a user's would
    runs = {name: train(**options | {"compile": compiled, "run_dir": run_dir / name})
            for name, compiled in [("eager", False), ("compiled", True)]}
    eager = speed["seconds"]["eager"]
    print("| | ms per step | samples/s | speed-up over eager | compile time | final train loss |\n"
          "|---|---|---|---|---|---|")
    for name, seconds in speed["seconds"].items():
        ms, speedup = [1000 * s for s in seconds], [e / s for e, s in zip(eager, seconds, strict=True)]
        compile_s = f"{speed['compile_s']:.1f} s" if name == "compiled" else "-"
        print(f"| {name} | {spread(ms)} | {options['batch_size'] / statistics.median(seconds):,.0f} | "
              f"{spread(speedup)}x | {compile_s} | {runs[name].get('train_loss', math.nan):.5f} |")
    wide = [name for name, v in speed["seconds"].items() if max(v) > 1.25 * min(v)]
    print(f"speed in {precision}: median (min-max) of {repeats} interleaved blocks of {block} steps after the "
          "compiling step"
          + (f"; warning: {', '.join(wide)} varied by over 25% between blocks: the machine is busy, so compare "
             "with care or rerun" if wide else ""))
    speedup = statistics.median([e / c for e, c in zip(eager, speed["seconds"]["compiled"], strict=True)])
    loss_diff = abs(runs["eager"]["train_loss"] - runs["compiled"]["train_loss"])
    write_json(run_dir / "metrics.json", {"recipe": RECIPE, "precision": precision, "speedup": speedup, **speed,
                                          "loss_diff": loss_diff, "repeats": repeats, "block": block,
                                          "eager": runs["eager"], "compiled": runs["compiled"]})
    print(f"done: speedup={speedup:.2f} compile_s={speed['compile_s']:.1f} loss_diff={loss_diff:.2e} "
          f"run_dir={run_dir}")


def spread(values: list[float]) -> str:
    """The median with its range, as the benchmark reports figures: 1.31 (1.19-1.61)."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


# ----------------------------------------------------------------------------------------------------
# The two traps, counted


class ActivationProbe(nn.Module):
    """Records the mean activation size for logging. ``.item()`` pulls a value out to Python, where Dynamo breaks
    the graph (by default); and the list it appends to grows, which Dynamo checks (``len(self.history)``) before it
    reuses a graph, so every call compiles anew."""

    def __init__(self):
        super().__init__()
        self.history: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.append(x.detach().abs().mean().item())
        return x


class FencedActivationProbe(ActivationProbe):
    # The fence: Dynamo does not even try to trace this; it runs eagerly between two graphs compiled once. Still a
    # graph break (an error under fullgraph=True): one graph needs the bookkeeping out of forward.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class ProbedMLP(nn.Module):
    def __init__(self, probe: nn.Module):
        super().__init__()
        self.body, self.probe, self.head = GatedMLP(16, 2), probe, nn.Linear(N_CLASSES, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.probe(self.body(x)))


def count_graphs(model: nn.Module, batch_sizes: list[int], **compile_options) -> tuple[int, int, float]:
    """Graphs compiled (first compilation plus recompilations) and graph breaks over a run of input shapes, and
    the time: each count starts from nothing (Inductor's caches of earlier runs off, as on a new machine)."""
    torch._dynamo.reset()  # forget earlier compilations
    torch._dynamo.utils.counters.clear()  # internal counters: there is no public API for these numbers yet
    compiled = torch.compile(model, **compile_options)
    started = time.perf_counter()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for batch_size in batch_sizes:
            compiled(torch.randn(batch_size, N_FEATURES)).sum().backward()
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), time.perf_counter() - started


def show_traps(seed: int, backend: str) -> dict:
    seed_everything(seed)
    count_graphs(GatedMLP(16, 2), [8], backend=backend)  # the compiler's one-off start-up, apart from the counts
    sizes = [256, 256, 192, 128, 256, 64, 1]
    print(f"Trap 1: the batch size changes along {sizes} (e.g. a last, smaller batch).")
    print("| dynamic | forward graphs compiled | seconds |\n|---|---|---|")
    graphs = {}
    for dynamic in (False, None, True):
        count, _, seconds = count_graphs(GatedMLP(16, 2), sizes, dynamic=dynamic, backend=backend)
        graphs[str(dynamic)] = count
        print(f"| {dynamic} | {count} | {seconds:.1f} |")
    print("False recompiles for every new shape; None (the default) recompiles once, then marks the batch "
          "dimension dynamic; True compiles one graph for any size from 2 up. Sizes 0 and 1 always get their own "
          "graph: a last batch of 1 recompiles even then (drop_last=True avoids it).\n")

    steps = 10
    print(f"Trap 2: a probe that calls .item() inside forward, over {steps} training steps.")
    print("| probe | graphs compiled | graph breaks |\n|---|---|---|")
    breaks = {}
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)  # the unfenced probe makes Dynamo print long warnings
    for name, probe in [("traced", ActivationProbe), ("fenced", FencedActivationProbe)]:
        count, broken, _ = count_graphs(ProbedMLP(probe()), [64] * steps, backend=backend)
        breaks[name] = {"graphs": count, "breaks": broken}
        print(f"| {name} | {count} | {broken} |")
    dynamo_log.setLevel(level)
    print("Traced, Dynamo splits the graph at .item(), and checks the probe's growing list before reusing a graph: "
          "every step recompiles, until after 8 recompiles it gives up and runs that code eagerly. Fenced with "
          "@torch.compiler.disable, the probe runs eagerly between two graphs compiled once: one deliberate break "
          "(an error under --fullgraph).")
    return {"graphs": graphs, "graph_breaks": breaks}


def main(
    epochs: cli.Epochs = 5,
    max_steps: cli.MaxSteps = None,
    batch_size: cli.BatchSize = 16384,
    lr: cli.LearningRate = 3e-3,
    samples: Annotated[int, typer.Option(min=1, help="Size of the synthetic training set.")] = 262144,
    width: Annotated[int, typer.Option(min=1, help="Width of the residual stream.")] = 64,
    depth: Annotated[int, typer.Option(min=1, max=1000, help="Gated blocks.")] = 8,
    compile: cli.Compile = False,
    mode: Annotated[
        Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        typer.Option(help="reduce-overhead: CUDA graphs (CUDA only); max-autotune: search kernels (slow to compile), "
                          "with CUDA graphs on CUDA; max-autotune-no-cudagraphs: search kernels only."),
    ] = "default",
    dynamic: Annotated[
        bool | None,
        typer.Option("--dynamic/--no-dynamic", help="Dynamic shapes [default: automatic, after a recompile]."),
    ] = None,
    fullgraph: Annotated[bool, typer.Option("--fullgraph", help="Fail on a graph break instead of splitting.")] = False,
    backend: Annotated[str, typer.Option(help="Compiler backend: inductor, aot_eager, eager, ...")] = "inductor",
    compare_compiled: Annotated[bool, typer.Option("--compare", help="Train eager and compiled; compare.")] = False,
    traps: Annotated[bool, typer.Option(
        "--traps", help="Count recompilations and graph breaks on the CPU, then exit.")] = False,
    seed: cli.Seed = 0,
    device: cli.Device = "auto",
    precision: cli.Precision = "fp32",
    num_workers: cli.NumWorkers = 0,
    run_dir: cli.RunDir = None,
    resume: cli.Resume = None,
    config_file: cli.ConfigFile = None,
    checkpoint_every: cli.CheckpointEvery = None,
    log_every: cli.LogEvery = None,
    profile: cli.Profile = None,
):
    """Train a fusion-bound gated MLP eager or compiled, compare the two, or count compile traps."""
    options = {name: value for name, value in locals().items() if name != "traps"}
    # torch's own debugging ladder (eager: Dynamo alone; aot_eager: and AOTAutograd), then the compilers registered
    if backend not in (choices := sorted({"eager", "aot_eager", *torch.compiler.list_backends()})):
        raise typer.BadParameter(f"{backend!r} is not one of {', '.join(choices)}", param_hint="--backend")
    if traps and compare_compiled:
        raise typer.BadParameter("--traps and --compare are two commands: give one of them", param_hint="--traps")
    if mode != "default" and backend != "inductor":  # other backends ignore it, with a warning
        raise typer.BadParameter(f"{mode} is Inductor's: it needs --backend inductor, not {backend}",
                                 param_hint="--mode")
    graphs = "--mode" if mode == "reduce-overhead" else "--backend" if backend == "cudagraphs" else None
    if graphs and (kind := resolve_device(device).type) != "cuda":  # nothing to capture elsewhere
        raise typer.BadParameter(f"captures CUDA graphs, which a {kind} has not: use " +
                                 ("default or max-autotune" if graphs == "--mode" else "inductor"), param_hint=graphs)
    if traps:  # a demonstration on the CPU: the other options would be silently ignored
        if unused := [name for name in options if name not in ("backend", "seed") and cli.option_given(name)]:
            raise typer.BadParameter(f"counts compilations on the CPU, with --backend and --seed only: not "
                                     f"{', '.join(map(cli.option_name, unused))}", param_hint="--traps")
        resolve_device("cpu")  # (which quiets the C++ toolchain's warning of a CUDA it will not use)
        show_traps(seed, backend)
    elif batch_size > samples:  # known now, not after a minute of --compare's timing
        raise typer.BadParameter(f"is larger than --samples ({samples}): every step takes a full batch",
                                 param_hint="--batch-size")
    elif compare_compiled:
        if resume is not None:
            raise typer.BadParameter("--compare always starts fresh runs", param_hint="--resume")
        if cli.option_given("compile"):  # it would be ignored
            raise typer.BadParameter("--compare trains both eager and compiled: leave it out", param_hint="--compile")
        compare(options, open_run_dir(RECIPE, run_dir, None, resumable=False).path)
    else:
        if not compile and (unused := [n for n in ("mode", "dynamic", "fullgraph", "backend")
                                       if cli.option_given(n)]):
            raise typer.BadParameter("sets how torch.compile compiles: add --compile (or --compare)",
                                     param_hint=cli.option_name(unused[0]))
        train(**options)


if __name__ == "__main__":
    cli.run_recipe(main)
