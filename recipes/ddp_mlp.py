"""DistributedDataParallel under torchrun: an MLP on MNIST, from one CPU to many nodes.

What it teaches: one process per device, started by ``torchrun``, which tells each process its RANK,
LOCAL_RANK and WORLD_SIZE; DDP all-reducing (averaging) gradients during the backward pass; a
DistributedSampler that gives every rank its own shard and a new shuffle each epoch (``set_epoch``);
``--batch-size`` per process, so the global batch is world size x batch size; evaluation split across
ranks with the sums all-reduced, so every test digit counts exactly once; only rank 0 writing logs and
checkpoints while the others wait at a barrier; every rank resuming from the same checkpoint, which is
what makes ``torchrun --max-restarts`` fault tolerant.

    python recipes/ddp_mlp.py                                    # one process, no process group at all
    torchrun --nproc_per_node=2 recipes/ddp_mlp.py               # two processes on this machine

On two machines, run this on each (node rank 0 on HOST0, 1 on the other; both see the same --run-dir,
e.g. on a shared file system, so that every rank can resume from the same checkpoint):

    torchrun --nnodes=2 --nproc_per_node=1 --node-rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \\
        --rdzv-id=mnist-ddp recipes/ddp_mlp.py --run-dir /shared/runs/ddp --resume auto

A good result: about 98% test accuracy after 5 epochs. Two processes on a 2-core CPU train 1.6-1.8x as
many digits per second as one (see the README's Performance table); the bigger the per-process batch, the
better the communication, which is fixed per step, is amortised.
"""

import sys
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import torch
import typer
from torch import nn
from torch.utils.data import TensorDataset

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
from common.data import load_mnist, make_loader
from common.loop import evaluate, train_step
from common.resume import already_finished, resume_position
from common.rundir import plain_config, prepare_run_dir
from common.runtime import make_grad_scaler, prepare_model, seed_everything, setup_distributed
from common.tracking import Run

RECIPE = "ddp_mlp"


class MLP(nn.Module):
    def __init__(self, hidden: int = 512):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),  # (B, 1, 28, 28) -> (B, 784)
            nn.Linear(784, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


def main(
    epochs: Epochs = 5,
    max_steps: MaxSteps = None,
    batch_size: BatchSize = 1024,
    lr: LearningRate = 0.2,
    hidden: Annotated[int, typer.Option(min=1, help="Width of the two hidden layers.")] = 512,
    backend: Annotated[
        Literal["auto", "gloo", "nccl"], typer.Option(help="Process-group backend: auto is nccl on CUDA, else gloo.")
    ] = "auto",
    seed: Seed = 0,
    device: Device = "auto",
    precision: Precision = "fp32",
    compile: Compile = False,
    num_workers: NumWorkers = 0,
    data_dir: DataDir = Path("data"),
    run_dir: RunDir = None,
    resume: Resume = None,
    checkpoint_every: CheckpointEvery = None,
    progress: Progress = None,
):
    """Train an MLP on MNIST with DistributedDataParallel (launch with torchrun), or in one process."""
    config = plain_config(locals())
    dist_info, device = setup_distributed(device, backend)  # under torchrun: join the group; else alone
    run_dir, resume_path = prepare_run_dir(RECIPE, run_dir, resume, dist_info)
    # Every rank reads the same checkpoint, so every rank resumes in the same state.
    checkpoint = load_checkpoint(resume_path, RECIPE) if resume_path else None
    seed_everything(seed + dist_info.rank)  # own random streams per rank; DDP broadcasts rank 0's weights

    images, labels = load_mnist(data_dir, train=True)
    train_set = TensorDataset(images, labels)
    test_set = TensorDataset(*load_mnist(data_dir, train=False))
    # make_loader shards across ranks: each rank trains on its own 1/world of every epoch's shuffle
    train_loader = make_loader(train_set, batch_size, train=True, seed=seed, num_workers=num_workers, device=device)
    test_loader = make_loader(test_set, 1000, train=False, num_workers=num_workers, device=device)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise RecipeError(f"--batch-size {batch_size} is larger than one rank's share of the training set")

    model = MLP(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    schedule_steps = epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=schedule_steps)
    scaler = make_grad_scaler(device, precision)
    loss_fn = nn.CrossEntropyLoss()
    model = prepare_model(model, device, compile=compile)  # to device, then DDP (if in a group), then compile
    step, best_acc = 0, 0.0
    if checkpoint:  # after the move to the device: optimizer state loads onto the parameters' device
        restore_training_state(checkpoint, resume_path, model=model, optimizer=optimizer, scheduler=scheduler,
                               scaler=scaler, loader_generator=train_loader.generator, steps_per_epoch=steps_per_epoch)
        step, best_acc = checkpoint["step"], checkpoint["best_acc"]

    total_steps = min(schedule_steps, max_steps or schedule_steps)
    if already_finished(step, total_steps, run_dir, dist_info):
        return
    run = Run(RECIPE, config, run_dir, total_steps=total_steps, start_step=step, checkpoint_every=checkpoint_every,
              progress=progress, model=model, optimizer=optimizer, dist_info=dist_info)
    global_batch = batch_size * dist_info.world_size
    resumed = f" | resumed at step {step}" if checkpoint else ""
    run.print(f"run_dir {run_dir} | {dist_info.world_size} process(es) on {device.type} | global batch "
              f"{global_batch} ({dist_info.world_size} x {batch_size}){resumed}")

    def state() -> dict:
        return training_state(RECIPE, config, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                              step=step, epoch=step // steps_per_epoch, loader_generator=train_loader.generator,
                              steps_per_epoch=steps_per_epoch, best_acc=best_acc, hidden=hidden)

    metrics = {}
    start_epoch, done_in_epoch = resume_position(step, total_steps, steps_per_epoch)
    for epoch in range(start_epoch, epochs):
        # set_epoch reseeds the shuffle: without it every epoch would repeat the first one's order
        train_loader.sampler.set_epoch(epoch, skip=done_in_epoch * batch_size if epoch == start_epoch else 0)
        for batch in train_loader:
            if step >= total_steps:  # --max-steps, or resumed at the last step: on to evaluation
                break
            lr_now = scheduler.get_last_lr()[0]
            stats = train_step(model, optimizer, loss_fn, [batch], device=device, precision=precision,
                               scaler=scaler, scheduler=scheduler)
            step += 1
            run.log_train(step, stats, lr=lr_now, items=global_batch)
            if run.checkpoint_due(step) and step % steps_per_epoch:  # an epoch's end: saved after its evaluation
                run.save_checkpoint(state())
        val = evaluate(model, test_loader, loss_fn, device=device, precision=precision)  # all ranks, all-reduced
        metrics = {"val_loss": val["loss"], "val_acc": val["acc"]}
        run.log_eval(step, val, note=f"epoch {epoch + 1}/{epochs}  ")
        if val["acc"] > best_acc:
            best_acc = val["acc"]
            run.save_checkpoint(state(), "best.pt")
        run.save_checkpoint(state())
        if step >= total_steps:
            break
    run.finish(step, metrics | {"best_val_acc": best_acc, "world_size": dist_info.world_size})


if __name__ == "__main__":
    run_recipe(main)
