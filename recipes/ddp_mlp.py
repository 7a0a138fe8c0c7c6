"""DistributedDataParallel under torchrun: an MLP on MNIST, from one CPU to many nodes.

What it teaches: one process per device, started by ``torchrun``, which tells each process its RANK,
LOCAL_RANK and WORLD_SIZE; DDP all-reducing (averaging) gradients during the backward pass; a
DistributedSampler that gives every rank its own shard and a new shuffle each epoch (``set_epoch``);
``--batch-size`` per process, so the global batch is world size x batch size; evaluation split across
ranks with the sums all-reduced, so every test digit counts exactly once; only rank 0 writing logs and
checkpoints while the others wait for it (``from_rank_0``: a broadcast of its outcome); every rank resuming
from the same checkpoint, which is what makes ``torchrun --max-restarts`` fault tolerant (with ``--resume auto
--run-dir DIR``: a restart runs the same command; without them the launch is refused).

    python recipes/ddp_mlp.py                                    # one process, no process group at all
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 recipes/ddp_mlp.py   # two processes, one CPU thread each

OMP_NUM_THREADS is each process's CPU threads (the header line shows them). Unset, torchrun with more than
one process per node sets it to 1 and prints a banner saying so, in its own process before any recipe starts:
set it yourself to silence it (on a CPU, cores / processes uses every core).

On two machines, run this on each (node rank 0 on HOST0, 1 on the other; both see the same --run-dir,
e.g. on a shared file system, so that every rank can resume from the same checkpoint):

    torchrun --nnodes=2 --nproc_per_node=1 --node-rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \\
        --rdzv-id=mnist-ddp recipes/ddp_mlp.py --run-dir /shared/runs/ddp --resume auto

A good result: about 98% test accuracy after 5 epochs. Two processes on a 2-core CPU, a thread each, trained
1.65x as many digits per second as one in fp32 (an AMD EPYC), but 1.14x (an Intel Xeon) to 1.40x (an AMD EPYC)
in bf16 (``--precision auto`` on a CPU with AVX-512 BF16), where each step's compute shrinks and the all-reduce
does not (docs/benchmarks.md, item 7); the bigger the per-process batch, the better the communication, which is
fixed per step, is amortised.
"""

import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import torch
import torch.distributed as dist
import typer
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from common import cli
from common.best import BestScore
from common.checkpoint import Checkpointer, load_checkpoint, load_model_state, resume_checkpoint
from common.data import checksum, load_mnist, make_loader
from common.loop import batches_left, epochs_left, sum_dtype, to_device, train_step
from common.profile import StepProfiler
from common.rundir import already_finished, open_run_dir
from common.runlog import RunLog, log_interval
from common.runtime import autocast, from_rank_0, resolve_device, resolve_precision, seed_everything, unwrap
from common.stop import StopRequest
from common.torchrun import gpu_of, torchrun_env

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


def init_distributed(device_name: str, backend: str) -> tuple[int, int, torch.device]:
    """Join the process group that torchrun describes in the environment: (rank, world size, device).

    torchrun starts one process per device and gives each its RANK (0 .. WORLD_SIZE-1 across all machines) and
    LOCAL_RANK (its index on this machine, which picks its GPU). Started with plain ``python``, there is no
    group at all: rank 0 of 1.
    """
    device = resolve_device(device_name)
    if backend == "nccl" and device.type != "cuda":
        raise cli.RecipeError(f"--backend nccl runs on CUDA devices only, not {device.type}: use --backend gloo "
                              "or auto")
    launched = torchrun_env()  # (rank, local rank, world size), checked; None: plain python
    if launched is None:
        return 0, 1, device
    rank, local_rank, world_size = launched
    if device.type == "cuda":
        device = gpu_of(local_rank)  # one GPU per process: LOCAL_RANK picks it
        torch.cuda.set_device(device)
    if backend == "auto":  # nccl moves tensors GPU to GPU; gloo is the CPU backend
        backend = "nccl" if device.type == "cuda" else "gloo"
    # torchrun keeps one key-value store across restarts, and the process groups of every attempt would use the
    # same keys: a restarted group could read a dead worker's address and fail to connect
    # (pytorch/pytorch#167288). A prefix per attempt gives each its own keys.
    store, _, _ = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None)
    return rank, world_size, device


def leave_process_group() -> None:
    """End a torchrun worker that has finished: every rank reaches the barrier (its files written), then the
    group is destroyed, so that no rank waits on one that is gone."""
    dist.barrier()
    dist.destroy_process_group()


def stop_agreed(stop: StopRequest, device: torch.device) -> bool:
    """Whether any rank was asked to stop (Ctrl-C, SIGTERM): every rank must stop, and save, at the same step,
    so they agree on it with one all-reduce (a MAX of the flags)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:  # (torchrun's one process: no one to agree with)
        return stop.requested
    flag = torch.tensor([float(stop.requested)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
@torch.profiler.record_function("evaluate")  # --profile leaves it out of the step it falls in
def evaluate(model: nn.Module, loader, device: torch.device, precision: str) -> dict[str, float]:
    """Loss and accuracy over the whole test set, in the precision the model trains in: each rank scores its own
    shard, then one all-reduce adds the sums of every rank, so every digit counts exactly once and every rank gets
    the same figures. It runs the plain module that DDP wraps (``unwrap``), not DDP's forward, which broadcasts
    buffers (BatchNorm's) from rank 0: a collective that hangs when the shards hold unequal numbers of batches."""
    model = unwrap(model)
    model.eval()
    totals = torch.zeros(3, dtype=sum_dtype(device), device=device)  # loss sum, correct, digits
    for batch in loader:
        images, labels = to_device(batch, device)
        with autocast(device, precision):
            logits = model(images).float()
        totals += torch.stack([nn.functional.cross_entropy(logits, labels, reduction="sum"),
                               (logits.argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)])
    if dist.is_initialized():
        dist.all_reduce(totals)  # SUM by default
    model.train()
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "acc": correct / count}


def main(
    epochs: cli.Epochs = 5,
    max_steps: cli.MaxSteps = None,
    batch_size: Annotated[int, typer.Option(
        min=1, help="Digits per batch in each process: the global batch is this x the processes.")] = 1024,
    lr: cli.LearningRate = 0.2,
    hidden: Annotated[int, typer.Option(min=1, help="Width of the two hidden layers.")] = 512,
    val_size: Annotated[int | None, typer.Option(
        min=1, help="Training digits held out to choose best.pt [default: 5,000, or 1/12 of fewer].")] = None,
    backend: Annotated[
        Literal["auto", "gloo", "nccl"], typer.Option(help="Process-group backend under torchrun: auto is nccl on "
                                                      "CUDA, else gloo (plain python runs one process, no group).")
    ] = "auto",
    seed: cli.Seed = 0,
    device: cli.Device = "auto",
    precision: cli.Precision = "auto",
    compile: cli.Compile = False,
    num_workers: cli.NumWorkers = 0,
    data_dir: cli.DataDir = Path("data"),
    run_dir: cli.RunDir = None,
    resume: cli.Resume = None,
    config_file: cli.ConfigFile = None,
    checkpoint_every: cli.CheckpointEvery = None,
    log_every: cli.LogEvery = None,
    profile: cli.Profile = None,
):
    """Train an MLP on MNIST with DistributedDataParallel (launch with torchrun), or in one process."""
    config = cli.as_config(locals())  # every option: config.json, and what a resume must match
    rank, world_size, device = init_distributed(device, backend)
    config |= {"world_size": world_size}  # the batch is per process: another count would be another global batch
    # Rank 0 names, checks and locks the run directory (every rank must use that one) and finds the checkpoint;
    # every rank then reads the same checkpoint and resumes from it. Only rank 0 writes files.
    run = from_rank_0(lambda: open_run_dir(RECIPE, run_dir, resume))
    checkpoint = resume_checkpoint(run, RECIPE, config, may_change={"backend"})  # gloo or auto: the same numbers
    if already_finished(run, checkpoint, epochs=epochs, max_steps=max_steps):
        if dist.is_initialized():
            leave_process_group()
        return
    chosen = resolve_precision(precision, device, checkpoint)  # --precision auto: bf16 where native
    config |= chosen._asdict()  # the option as given, the precision it runs in, and why
    precision = chosen.precision_used
    # The same seed on every rank: every rank draws the same random numbers (each shards its data with the
    # sampler instead), so the random streams that rank 0 saves are every rank's to restore.
    seed_everything(seed)

    images, labels = load_mnist(data_dir, train=True)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))  # the same on every rank
    val_size = max(1, min(5000, len(labels) // 12)) if val_size is None else val_size  # 5,000 of 60,000; less of less
    if not 0 < val_size < len(labels):
        raise typer.BadParameter(f"must be below {len(labels)}, the number of training digits", param_hint="--val-size")
    train_set = TensorDataset(images[order[val_size:]], labels[order[val_size:]])
    val_set = TensorDataset(images[order[:val_size]], labels[order[:val_size]])
    test_set = TensorDataset(*load_mnist(data_dir, train=False))
    # Each rank trains on its own 1/world_size of every epoch: the sampler shuffles with seed + epoch (the same
    # permutation on every rank) and gives rank r every world_size-th index from r on.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    train_loader = make_loader(train_set, batch_size, train=True, sampler=sampler, num_workers=num_workers,
                               device=device)
    # Evaluation shards too, but not with DistributedSampler: it pads the last shard with repeated samples.
    val_loader, test_loader = (make_loader(split, 1000, train=False, sampler=range(rank, len(split), world_size),
                                           device=device) for split in (val_set, test_set))

    model = MLP(hidden).to(device)
    if dist.is_initialized():  # under torchrun, even as one process: DDP runs for real, as on a one-GPU machine
        # DDP broadcasts rank 0's weights at construction, then all-reduces (averages) the gradients during the
        # backward pass, bucket by bucket, overlapping communication with the rest of the backward. Not the older
        # nn.DataParallel(model): one process drives every GPU from threads, so the GIL and GPU 0 (which scatters
        # each batch and gathers the outputs) throttle it. A quick prototype at most; PyTorch recommends DDP even
        # on one machine.
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if compile:
        model = torch.compile(model)  # after DDP, so that Dynamo can split the graph at its gradient buckets
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    loss_fn = nn.CrossEntropyLoss()

    steps_per_epoch = len(train_loader)
    total_steps = min(epochs * steps_per_epoch, max_steps or math.inf)
    every = log_interval(steps_per_epoch, log_every)  # also how often the ranks agree on a stop
    log = RunLog(run, RECIPE, total_steps=total_steps, every=every, steps_per_epoch=steps_per_epoch,
                 write=rank == 0)
    best = BestScore("val_acc")
    checkpoints = Checkpointer(run, RECIPE, config, model=model, optimizer=optimizer, scheduler=scheduler,
                               scaler=scaler, loader_generator=train_loader.generator, steps_per_epoch=steps_per_epoch,
                               parts={"log": log, "best": best}, data_id=checksum(*train_set.tensors))
    step = checkpoints.restore(checkpoint) if checkpoint else 0
    log.start(step, config, device, world_size)
    if checkpoint and best.step == step:  # a kill may have come between this step's last.pt and best.pt
        from_rank_0(partial(checkpoints.save, step, "best.pt"))
    log.print(f"{len(train_set)} train / {len(val_set)} validation digits from {data_dir.resolve()} | global "
              f"batch {batch_size * world_size} ({world_size} x {batch_size}) | model "
              f"{type(getattr(model, '_orig_mod', model)).__name__}")
    stop = StopRequest()  # Ctrl-C and SIGTERM: save and exit at the end of the step
    profiler = StepProfiler(run.path, profile, device, write=rank == 0)  # --profile N

    for epoch in epochs_left(step, steps_per_epoch, total_steps, log.evaluated_at):
        # set_epoch reseeds the shuffle: without it every epoch would repeat the first one's order
        sampler.set_epoch(epoch)
        for batch in batches_left(train_loader, step, total_steps):
            current_lr = scheduler.get_last_lr()[0]
            stats = train_step(model, optimizer, loss_fn, [batch], device=device, precision=precision,
                               scaler=scaler)
            scheduler.step()  # every batch: the schedule counts optimizer steps
            if dist.is_initialized():  # the global batch's loss: the log's, and a divergence every rank sees at once
                dist.all_reduce(stats.loss)
                stats.loss.div_(world_size)
            step += 1
            log.train(step, stats, lr=current_lr, items=batch_size * world_size)
            profiler.step()
            # mid-epoch checkpoints, which rank 0 writes (an epoch's last step, and the run's, follow the evaluation)
            # Ctrl-C or SIGTERM: at once in one process; under torchrun the ranks agree on it every --log-every steps
            stopping = (step % every == 0 or world_size == 1) and stop_agreed(stop, device)
            mid_epoch = step % steps_per_epoch and step < total_steps
            if mid_epoch and (stopping or checkpoint_every and step % checkpoint_every == 0):
                from_rank_0(partial(checkpoints.save, step))  # every rank waits for it, and shares its error
                if stopping:
                    stop.exit(step, run.path)
        log.flush()  # the training steps' time ends here: evaluating is not training
        val = evaluate(model, val_loader, device, precision)  # every rank scores its shard; the sums are all-reduced
        log.eval(step, val=val)
        improved = best.improved(val["acc"], step)  # every rank decides alike: the figures are the whole group's
        from_rank_0(partial(checkpoints.save, step))  # first: if the step is the best, last.pt says so
        if improved:
            from_rank_0(partial(checkpoints.save, step, "best.pt"))
        if stop_agreed(stop, device):
            stop.exit(step, run.path)
    stop.loop_ended(step, run.path)  # from here a signal exits at once: the run's last step is saved

    # The test set, once, with the weights that best.pt holds: the model a user deploys is the one scored.
    best_path = run.path / "checkpoints" / "best.pt"
    load_model_state(model, load_checkpoint(best_path, RECIPE)["model"], best_path)
    test = evaluate(model, test_loader, device, precision)
    log.finish(step, best.metrics() | {"test_loss": test["loss"], "test_acc": test["acc"], "world_size": world_size})
    if dist.is_initialized():
        leave_process_group()


if __name__ == "__main__":
    cli.run_recipe(main)
