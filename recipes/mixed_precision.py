"""Mixed precision: the same training in fp32, bf16 and fp16 autocast, and what each one buys.

What it teaches: ``torch.autocast`` runs matmuls in a 16-bit type while weights, optimizer state and
reductions stay fp32. fp16 has 5 exponent bits: small gradients underflow to zero, so it needs a
``GradScaler`` (scale the loss up, unscale the gradients before clipping, skip a step whose gradients
overflowed, then lower the scale). bf16 keeps fp32's 8 exponent bits and only shortens the mantissa, so
its gradients do not underflow and it needs no scaler.

The model is a wide MLP (784 -> 1024 -> 1024 -> 1024 -> 10) at batch 512: nearly all its time is in
matrix multiplies, which is the only place 16-bit arithmetic is faster; element-wise work and the fp32
optimizer step gain nothing. The data is synthetic (see common/data.py), so this runs anywhere.

    python recipes/mixed_precision.py --precision bf16
    python recipes/mixed_precision.py --compare          # fp32, bf16, fp16: same seed, same steps

What to expect: on GPUs with tensor cores (V100 and later) and CPUs with AVX-512 BF16 or AMX, bf16 runs
1.5-3x faster than fp32 and ends within a percent of its loss. A CPU without native 16-bit matmuls (AVX2
only) emulates them and is far slower; --compare measures that and says so instead of running for hours.
"""

import math
import sys
import time
from pathlib import Path
from typing import Annotated

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import torch
import typer
from torch import nn

from common.checkpoint import load_checkpoint, restore_training_state, training_state
from common.cli import (
    BatchSize,
    CheckpointEvery,
    Compile,
    DataDir,
    Device,
    Epochs,
    LearningRate,
    MaxSteps,
    NumWorkers,
    Precision,
    Progress,
    RecipeError,
    Resume,
    RunDir,
    Seed,
    run_recipe,
)
from common.data import make_loader, synthetic_classification
from common.loop import evaluate, train_step
from common.resume import already_finished, resume_position
from common.rundir import plain_config, prepare_run_dir, write_json
from common.runtime import make_grad_scaler, prepare_model, resolve_device, seed_everything, synchronize
from common.tracking import Run

RECIPE = "mixed_precision"
PRECISIONS = ["fp32", "bf16", "fp16"]


class MLP(nn.Module):
    """Linear -> GELU, ``depth`` times, then a linear head: three 1024x1024 matmuls carry the cost."""

    def __init__(self, n_in: int = 784, width: int = 1024, depth: int = 3, n_out: int = 10):
        super().__init__()
        layers = []
        for i in range(depth):
            layers += [nn.Linear(n_in if i == 0 else width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train(options: dict, precision: str, run_dir: Path, resume_path: Path | None, config: dict) -> dict:
    """One training run in ``precision``; returns its metrics and the loss of every step."""
    o = options
    checkpoint = load_checkpoint(resume_path, RECIPE) if resume_path else None
    seed_everything(o["seed"])
    device = resolve_device(o["device"])
    train_set = synthetic_classification(o["samples"], 784, 10, seed=o["seed"])
    val_set = synthetic_classification(4096, 784, 10, seed=o["seed"] + 1_000_000)  # same task, new inputs
    train_loader = make_loader(train_set, o["batch_size"], train=True, seed=o["seed"],
                               num_workers=o["num_workers"], device=device)
    val_loader = make_loader(val_set, 1024, train=False, device=device)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise RecipeError(f"--batch-size {o['batch_size']} is larger than --samples {o['samples']}")

    model = MLP(width=o["width"], depth=o["depth"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=o["lr"], weight_decay=0.01)
    schedule_steps = o["epochs"] * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=schedule_steps)
    scaler = make_grad_scaler(device, precision)  # fp16 only: see the module docstring
    loss_fn = nn.CrossEntropyLoss()
    model = prepare_model(model, device, compile=o["compile"])
    step, best_val_loss = 0, math.inf
    if checkpoint:  # after the move to the device: optimizer state loads onto the parameters' device
        restore_training_state(checkpoint, resume_path, model=model, optimizer=optimizer, scheduler=scheduler,
                               scaler=scaler, loader_generator=train_loader.generator, steps_per_epoch=steps_per_epoch)
        step, best_val_loss = checkpoint["step"], checkpoint["best_val_loss"]

    total_steps = min(schedule_steps, o["max_steps"] or schedule_steps)
    if already_finished(step, total_steps, run_dir):
        return {}
    run = Run(RECIPE, config, run_dir, total_steps=total_steps, start_step=step,
              checkpoint_every=o["checkpoint_every"], progress=o["progress"], model=model, optimizer=optimizer)
    run.print(f"{precision}: run_dir {run_dir} | device {device}{f' | resumed at step {step}' if checkpoint else ''}")

    def state() -> dict:
        return training_state(RECIPE, config, model=model, optimizer=optimizer, scheduler=scheduler,
                              scaler=scaler, step=step, epoch=step // steps_per_epoch,
                              loader_generator=train_loader.generator, steps_per_epoch=steps_per_epoch,
                              best_val_loss=best_val_loss)

    losses = []  # one device tensor per step; read back once at the end
    metrics = {}
    start_epoch, done_in_epoch = resume_position(step, total_steps, steps_per_epoch)
    for epoch in range(start_epoch, o["epochs"]):
        train_loader.sampler.set_epoch(epoch, skip=done_in_epoch * o["batch_size"] if epoch == start_epoch else 0)
        for batch in train_loader:
            if step >= total_steps:  # --max-steps, or resumed at the last step: on to evaluation
                break
            lr = scheduler.get_last_lr()[0]
            stats = train_step(model, optimizer, loss_fn, [batch], device=device, precision=precision,
                               scaler=scaler, scheduler=scheduler, max_grad_norm=1.0)
            step += 1
            losses.append(stats.loss)
            run.log_train(step, stats, lr=lr, items=len(batch[-1]))
            if run.checkpoint_due(step) and step % steps_per_epoch:  # an epoch's end: saved after its evaluation
                run.save_checkpoint(state())
        val = evaluate(model, val_loader, loss_fn, device=device, precision=precision)
        metrics = {"val_loss": val["loss"], "val_acc": val["acc"]}
        run.log_eval(step, val, note=f"{precision} epoch {epoch + 1}/{o['epochs']}  ")
        if val["loss"] < best_val_loss:
            best_val_loss = val["loss"]
            run.save_checkpoint(state(), "best.pt")
        run.save_checkpoint(state())
        if step >= total_steps:
            break
    extra = {"scale": scaler.get_scale()} if scaler else {}
    summary = run.finish(step, metrics | extra)
    return summary | {"losses": torch.stack(losses).tolist() if losses else []}


def seconds_per_step(options: dict, precision: str, steps: int = 3) -> tuple[float, str]:
    """Seconds per step of ``precision`` on this device after a warm-up step, or an error message."""
    device = resolve_device(options["device"])
    model = MLP(width=options["width"], depth=options["depth"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = synthetic_classification(options["batch_size"], 784, 10, seed=0)[:]
    scaler = make_grad_scaler(device, precision)
    loss_fn = nn.CrossEntropyLoss()
    try:
        seconds = []
        for _ in range(steps + 1):
            synchronize(device)
            start = time.perf_counter()
            train_step(model, optimizer, loss_fn, [batch], device=device, precision=precision, scaler=scaler)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
    except RuntimeError as err:  # e.g. an autocast dtype the device cannot run
        return float("inf"), str(err).splitlines()[0]
    return sorted(seconds[1:])[len(seconds[1:]) // 2], ""


def compare(options: dict, run_dir: Path, config: dict, max_slowdown: float) -> None:
    """Train the same seed for the same steps in each precision; print and save a table."""
    probes = {p: seconds_per_step(options, p) for p in PRECISIONS}
    rows, fp32 = {}, None
    for precision in PRECISIONS:
        seconds, error = probes[precision]
        slowdown = seconds / probes["fp32"][0]
        if error or slowdown > max_slowdown:
            note = f"unsupported here: {error}" if error else f"{slowdown:.0f}x slower than fp32 here: not trained"
            rows[precision] = {"samples_per_s": options["batch_size"] / seconds, "note": note}
            continue
        sub_dir, _ = prepare_run_dir(RECIPE, run_dir / precision, None)
        result = train(options, precision, sub_dir, None, config | {"precision": precision})
        rows[precision] = {k: result[k] for k in ("samples_per_s", "train_loss", "val_loss", "val_acc")}
        rows[precision]["skipped_steps"] = result.get("skipped_steps", 0)
        if precision == "fp32":
            fp32 = result["losses"]
        differences = [abs(a - b) for a, b in zip(result["losses"], fp32, strict=True) if math.isfinite(a)]
        rows[precision]["max_loss_diff"] = max(differences, default=math.nan)
    for row in rows.values():
        row["speedup"] = row["samples_per_s"] / rows["fp32"]["samples_per_s"]

    header = "| precision | samples/s | speed-up | final loss | max loss diff vs fp32 | overflow steps skipped |"
    lines = [header, "|---|---|---|---|---|---|"]
    for precision, row in rows.items():
        if "note" in row:
            lines.append(f"| {precision} | {row['samples_per_s']:,.0f} | {row['speedup']:.2f}x | {row['note']} | | |")
        else:
            lines.append(f"| {precision} | {row['samples_per_s']:,.0f} | {row['speedup']:.2f}x | "
                         f"{row['train_loss']:.4f} | {row['max_loss_diff']:.4f} | {row['skipped_steps']} |")
    print("\n".join(lines))
    write_json(run_dir / "metrics.json", {"recipe": RECIPE, "compare": rows})
    print(f"done: compared {', '.join(rows)} run_dir={run_dir}")


def main(
    epochs: Epochs = 3,
    max_steps: MaxSteps = None,
    batch_size: BatchSize = 512,
    lr: LearningRate = 1e-3,
    samples: Annotated[int, typer.Option(min=1, help="Size of the synthetic training set.")] = 32768,
    width: Annotated[int, typer.Option(min=1, help="Width of the hidden layers.")] = 1024,
    depth: Annotated[int, typer.Option(min=1, help="Hidden layers.")] = 3,
    compare_all: Annotated[
        bool, typer.Option("--compare", help="Train in fp32, bf16 and fp16 and print a comparison table.")
    ] = False,
    max_slowdown: Annotated[
        float, typer.Option(min=1.0, help="--compare skips a precision this many times slower than fp32.")
    ] = 4.0,
    seed: Seed = 0,
    device: Device = "auto",
    precision: Precision = "fp32",
    compile: Compile = False,
    num_workers: NumWorkers = 0,
    data_dir: DataDir = Path("data"),  # every recipe takes it; this one downloads nothing
    run_dir: RunDir = None,
    resume: Resume = None,
    checkpoint_every: CheckpointEvery = None,
    progress: Progress = None,
):
    """Train a matmul-bound MLP with autocast (fp32, bf16, fp16), or compare all three."""
    options = dict(locals())
    config = plain_config(options)
    if compare_all:
        if resume is not None:
            raise typer.BadParameter("--compare always starts fresh runs", param_hint="--resume")
        run_dir, _ = prepare_run_dir(RECIPE, run_dir, None)
        compare(options, run_dir, config, max_slowdown)
        return
    run_dir, resume_path = prepare_run_dir(RECIPE, run_dir, resume)
    train(options, precision, run_dir, resume_path, config)


if __name__ == "__main__":
    run_recipe(main)
