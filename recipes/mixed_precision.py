"""Mixed precision: the same training in fp32, bf16 and fp16 autocast, and what each one buys.

What it teaches: ``torch.autocast`` runs matmuls in a 16-bit type while weights and optimizer state stay
fp32. fp16 has 5 exponent bits: small gradients underflow to zero, so it needs a ``GradScaler`` (scale the
loss up, unscale the gradients before clipping, skip a step whose gradients overflowed, then lower the
scale). bf16 keeps fp32's 8 exponent bits and only shortens the mantissa, so its gradients do not underflow
and it needs no scaler.

The model is a wide MLP (784 -> 1024 -> 1024 -> 1024 -> 10) at batch 512: nearly all its time is in
matrix multiplies, where 16-bit arithmetic gains most (native units do twice the work or more); element-wise
work gains less, from moving half the bytes, and the fp32 optimizer step gains nothing. The data is synthetic
(see common/data.py), so this runs anywhere.

    python recipes/mixed_precision.py --precision bf16
    python recipes/mixed_precision.py --compare          # fp32, bf16, fp16: same seed, same steps

What to expect: on GPUs with bf16 tensor cores (Ampere and later: A100, H100, RTX 30/40) and CPUs with
AVX-512 BF16 or AMX, bf16 runs 1.5-3x faster than fp32 and ends within a percent of its loss; V100 and T4
have fp16 tensor cores only (use --precision fp16, with its GradScaler). A CPU without native 16-bit matmuls
(AVX2 only) emulates them and is far slower; --compare measures that and says so instead of running for hours.
"""

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import torch
import typer
from torch import nn

from common import cli
from common.best import BestScore
from common.checkpoint import Checkpointer, resume_checkpoint
from common.data import make_loader, synthetic_classification
from common.loop import StepStats, batches_left, epochs_left, evaluate, to_device
from common.profile import StepProfiler
from common.rundir import already_finished, open_run_dir, write_json
from common.runlog import RunLog, log_interval
from common.runtime import PRECISION_DTYPES, resolve_device, resolve_precision, seed_everything, synchronize
from common.stop import StopRequest

RECIPE = "mixed_precision"
PRECISIONS = ["fp32", "bf16", "fp16"]


class MLP(nn.Module):
    """Linear -> GELU, ``depth`` times, then a linear head: its matmuls (784x1024, then 1024x1024) carry the cost."""

    def __init__(self, n_in: int = 784, width: int = 1024, depth: int = 3, n_out: int = 10):
        super().__init__()
        layers = []
        for i in range(depth):
            layers += [nn.Linear(n_in if i == 0 else width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def amp_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, batch,
             device: torch.device, precision: str, max_grad_norm: float = 1.0) -> StepStats:
    """One optimizer step in ``precision``: the whole recipe of automatic mixed precision.

    With ``enabled=False`` (fp32 autocast, bf16 scaler) each call below does nothing or passes its input
    through, so one step serves all three precisions.
    """
    inputs, targets = to_device(batch, device)
    optimizer.zero_grad(set_to_none=True)
    # Inside autocast, matmuls run in the 16-bit type. Which ops it keeps in fp32 is a list per device: on CUDA
    # softmax, norms and losses; on a CPU fewer (the loss, but not softmax or layer norm). The weights stay fp32:
    # autocast casts a copy per op, so the optimizer updates full-precision values.
    with torch.autocast(device.type, dtype=PRECISION_DTYPES[precision], enabled=precision != "fp32"):
        loss = nn.functional.cross_entropy(model(inputs), targets)
    # fp16 only: multiply the loss by the scale (65,536 at first) so that small gradients do not underflow to 0
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # divide the gradients by the scale again, in place, before anything reads them
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)  # clips the true gradients
    # A scaled gradient can overflow fp16 (inf/nan): step() then skips the update, and update() halves the
    # scale; after 2,000 clean steps in a row it doubles it again. The norm is inf/nan exactly then, which is how
    # the step's stats say it was skipped (step() itself reads the overflow flag: fp16 waits for the device here).
    scaler.step(optimizer)
    scaler.update()
    skipped = ~torch.isfinite(grad_norm) if scaler.is_enabled() else None
    return StepStats(loss.detach().float(), grad_norm, skipped)


def train(epochs: int, max_steps: int | None, batch_size: int, lr: float, samples: int, width: int, depth: int,
          compare_precisions: bool, max_slowdown: float, seed: int, device: str, precision: str, compile: bool,
          num_workers: int, run_dir: Path | None, resume: str | None, config_file: Path | None,
          checkpoint_every: int | None, log_every: int | None, profile: int | None) -> dict:
    """One training run in ``precision``; returns its metrics and the loss of every step."""
    # every option: config.json, and what a resume must match (a run of a --compare replays as one run)
    config = cli.as_config({k: v for k, v in locals().items() if k != "compare_precisions"})
    run = open_run_dir(RECIPE, run_dir, resume)  # never over another run's checkpoints; one run at a time in it
    checkpoint = resume_checkpoint(run, RECIPE, config, may_change={"max_slowdown"})
    if already_finished(run, checkpoint, epochs=epochs, max_steps=max_steps):
        return {}
    seed_everything(seed)
    device = resolve_device(device)
    chosen = resolve_precision(precision, device, checkpoint)  # --precision auto: bf16 where native
    config |= chosen._asdict() | ({"precision_reason": "one of --compare's"} if compare_precisions else {})
    precision = chosen.precision_used
    train_set = synthetic_classification(samples, 784, 10, seed=seed)
    val_set = synthetic_classification(4096, 784, 10, seed=seed + 1_000_000)  # same task, new inputs
    train_loader = make_loader(train_set, batch_size, train=True, seed=seed,
                               num_workers=num_workers, device=device)
    val_loader = make_loader(val_set, 1024, train=False, device=device)

    model = MLP(width=width, depth=depth).to(device)
    if compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(train_loader))
    # Loss scaling is for fp16 alone: its 5 exponent bits flush small gradients to zero. bf16 has fp32's 8
    # exponent bits (only a shorter mantissa), so its gradients do not underflow and it needs no scaler.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    steps_per_epoch = len(train_loader)
    total_steps = min(epochs * steps_per_epoch, max_steps or math.inf)
    log = RunLog(run, RECIPE, total_steps=total_steps, every=log_interval(steps_per_epoch, log_every),
                 steps_per_epoch=steps_per_epoch)
    best = BestScore("val_loss", higher_is_better=False)
    checkpoints = Checkpointer(run, RECIPE, config, model=model, optimizer=optimizer, scheduler=scheduler,
                               scaler=scaler, loader_generator=train_loader.generator, steps_per_epoch=steps_per_epoch,
                               parts={"log": log, "best": best})
    step = checkpoints.restore(checkpoint) if checkpoint else 0
    log.start(step, config, device)
    if checkpoint and best.step == step:  # a kill may have come between this step's last.pt and best.pt
        checkpoints.save(step, "best.pt")
    stop = StopRequest()  # Ctrl-C and SIGTERM: save and exit at the end of the step
    resume_dir = None if compare_precisions else run.path  # a --compare starts afresh: nothing to resume
    profiler = StepProfiler(run.path, profile, device)  # --profile N

    losses = []  # one device tensor per step; read back once at the end
    for epoch in epochs_left(step, steps_per_epoch, total_steps, log.evaluated_at):
        train_loader.sampler.set_epoch(epoch)
        for batch in batches_left(train_loader, step, total_steps):
            current_lr = scheduler.get_last_lr()[0]
            stats = amp_step(model, optimizer, scaler, batch, device, precision)
            scheduler.step()  # a skipped fp16 step counts too, as in the step number (torch warns if it is the first)
            losses.append(stats.loss)
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
        val = evaluate(model, val_loader, nn.CrossEntropyLoss(), device=device, precision=precision)
        log.eval(step, val=val, note=precision)
        improved = best.improved(val["loss"], step)
        checkpoints.save(step)  # first: if the step is the best, last.pt says so (and a resume here writes best.pt)
        if improved:
            checkpoints.save(step, "best.pt")
        if stop.requested:
            stop.exit(step, resume_dir)
    stop.loop_ended(step, resume_dir)  # from here a signal exits at once: the run's last step is saved
    summary = log.finish(step, best.metrics() | ({"scale": scaler.get_scale()} if scaler.is_enabled() else {}))
    return summary | {"losses": torch.stack(losses).tolist() if losses else []}


def seconds_per_step(device: torch.device, precision: str, width: int, depth: int, batch_size: int,
                     steps: int = 3, compile: bool = False) -> tuple[float, str]:
    """Seconds per step of ``precision`` on ``device`` after a warm-up step (it compiles), or an error message."""
    model = MLP(width=width, depth=depth).to(device)
    model = torch.compile(model) if compile else model  # timed as it trains
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = synthetic_classification(batch_size, 784, 10, seed=0)[:]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    try:
        seconds = []
        for _ in range(steps + 1):
            synchronize(device)
            start = time.perf_counter()
            amp_step(model, optimizer, scaler, batch, device, precision)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
    except RuntimeError as err:  # e.g. an autocast dtype the device cannot run
        if precision == "fp32" and cli.compiler_missing(err):
            raise  # fp32, timed first, compiles nowhere: the command's one error line says so (bf16 alone: a row)
        return float("inf"), str(err).splitlines()[0]
    return statistics.median(seconds[1:]), ""


def measure_speed(device: torch.device, width: int, depth: int, batch_size: int, repeats: int = 3,
                  steps: int = 5, compile: bool = False) -> dict[str, list[float]]:
    """Seconds per step of each precision, interleaved and repeated, every other round in reverse (fp32, bf16,
    fp16, fp16, bf16, fp32, ...), so that a machine whose load drifts slows all alike and none always runs first:
    each round a fresh model per precision, its median step of
    ``steps`` after a warm-up. bf16 and fp16 get 3 steps each: where they are emulated (no native units), each
    is far slower, and 3 is the fewest whose median leaves out a step slowed by the machine."""
    seconds = {p: [] for p in PRECISIONS}
    for round_ in range(repeats):
        for precision in PRECISIONS[::-1] if round_ % 2 else PRECISIONS:
            seconds[precision].append(seconds_per_step(device, precision, width, depth, batch_size,
                                                       steps if precision == "fp32" else 3, compile=compile)[0])
    return seconds


def spread(values: list[float]) -> str:
    """The median with its range, as the benchmark reports figures: 2.68 (2.23-2.71)."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def compare(options: dict, run_dir: Path, max_slowdown: float, repeats: int = 3) -> None:
    """Speed: every precision timed in interleaved, repeated rounds (``measure_speed``). Quality: the same seed
    trained for the same steps in each precision fast enough to train here; one table of both."""
    device = resolve_device(options["device"])
    seconds = measure_speed(device, options["width"], options["depth"], options["batch_size"], repeats,
                            compile=options["compile"])
    rows, fp32 = {}, None
    for precision in PRECISIONS:
        speedup = [f / s for f, s in zip(seconds["fp32"], seconds[precision], strict=True)]
        ms = [1000 * s for s in seconds[precision]]
        rows[precision] = {"ms_per_step": ms, "samples_per_s": [options["batch_size"] / s for s in seconds[precision]],
                           "speedup": speedup}
        if any(map(math.isinf, ms)):  # it failed: on any model (a tiny one says why), or at this size
            error = seconds_per_step(device, precision, 8, 1, 8, steps=1, compile=options["compile"])[1] or \
                "it fails at this --width and --batch-size (out of memory?)"
            rows[precision]["note"] = f"unsupported here: {error}"
            continue
        if statistics.median(speedup) < 1 / max_slowdown:
            slowdown = 1 / statistics.median(speedup)  # 1.3x, 45x: "1x" would say no slower
            rows[precision]["note"] = f"{slowdown:.{1 if slowdown < 10 else 0}f}x slower than fp32 here: not trained"
            continue
        try:
            result = train(**options | {"precision": precision, "run_dir": run_dir / precision})
        except cli.RecipeError as err:  # fp16 overflowing, say: a result of the comparison, not the end of it
            if not str(err).startswith("training diverged"):
                raise
            rows[precision]["note"] = str(err).split(";")[0]
            continue
        rows[precision] |= {k: result[k] for k in ("train_loss", "val_loss", "val_acc")}
        rows[precision]["skipped_steps"] = result.get("skipped_steps", 0)
        fp32 = result["losses"] if precision == "fp32" else fp32
        pairs = zip(result["losses"], fp32, strict=True) if fp32 else []  # none if fp32 diverged
        rows[precision]["max_loss_diff"] = max((abs(a - b) for a, b in pairs if math.isfinite(a)), default=math.nan)

    print("| precision | ms per step | samples/s | speed-up over fp32 | last epoch's mean train loss | val loss | max "
          "loss diff vs fp32 | overflow steps skipped |\n|---|---|---|---|---|---|---|---|")
    for precision, row in rows.items():  # (the train loss leaves skipped steps out: the val loss has every step's)
        quality = f"{row['note']} | | | |" if "note" in row else f"{row['train_loss']:.4f} | {row['val_loss']:.4f} | " \
            f"{row['max_loss_diff']:.4f} | {row['skipped_steps']} |"
        print(f"| {precision} | {spread(row['ms_per_step'])} | {statistics.median(row['samples_per_s']):,.0f} | "
              f"{spread(row['speedup'])}x | {quality}")
    wide = [p for p, row in rows.items() if max(row["ms_per_step"]) > 1.25 * min(row["ms_per_step"])]
    print(f"speed: median (min-max) of {repeats} interleaved rounds of a few steps each, fresh "
          f"{'compiled ' if options['compile'] else ''}models"
          + (f"; warning: {', '.join(wide)} varied by over 25% between rounds: the machine is busy, so compare "
             "with care or rerun" if wide else ""))
    # a failed precision's times (inf) and a diverged fp32's loss difference (nan) are null: JSON has neither
    rows = json.loads(json.dumps(rows), parse_constant=lambda _: None)
    write_json(run_dir / "metrics.json", {"recipe": RECIPE, "repeats": repeats, "compare": rows})
    print(f"done: compared {', '.join(rows)} run_dir={run_dir}")


def main(
    epochs: cli.Epochs = 3,
    max_steps: cli.MaxSteps = None,
    batch_size: cli.BatchSize = 512,
    lr: cli.LearningRate = 1e-3,
    samples: Annotated[int, typer.Option(min=1, help="Size of the synthetic training set.")] = 32768,
    width: Annotated[int, typer.Option(min=1, help="Width of the hidden layers.")] = 1024,
    depth: Annotated[int, typer.Option(min=1, max=1000, help="Hidden layers.")] = 3,
    compare_precisions: Annotated[
        bool, typer.Option("--compare", help="Train in fp32, bf16 and fp16 and print a comparison table.")
    ] = False,
    max_slowdown: Annotated[
        float, typer.Option(min=1.0, help="--compare skips a precision this many times slower than fp32.")
    ] = 4.0,
    seed: cli.Seed = 0,
    device: cli.Device = "auto",
    precision: cli.Precision = "fp32",
    compile: cli.Compile = False,
    num_workers: cli.NumWorkers = 0,
    run_dir: cli.RunDir = None,
    resume: cli.Resume = None,
    config_file: cli.ConfigFile = None,
    checkpoint_every: cli.CheckpointEvery = None,
    log_every: cli.LogEvery = None,
    profile: cli.Profile = None,
):
    """Train a matmul-bound MLP with autocast (fp32, bf16, fp16), or compare all three."""
    options = locals()
    if batch_size > samples:  # known now, not after a minute of --compare's timing
        raise typer.BadParameter(f"is larger than --samples ({samples}): every step takes a full batch",
                                 param_hint="--batch-size")
    if compare_precisions:
        if resume is not None:
            raise typer.BadParameter("--compare always starts fresh runs", param_hint="--resume")
        if cli.option_given("precision"):  # it would be ignored
            raise typer.BadParameter("--compare trains in each of fp32, bf16 and fp16: leave it out",
                                     param_hint="--precision")
        compare(options, open_run_dir(RECIPE, run_dir, None, resumable=False).path, max_slowdown)
        return
    if cli.option_given("max_slowdown") and resume is None:  # ignored (a resume of a --compare's run may keep it)
        raise typer.BadParameter("skips slow precisions in --compare: add --compare", param_hint="--max-slowdown")
    train(**options)


if __name__ == "__main__":
    cli.run_recipe(main)
