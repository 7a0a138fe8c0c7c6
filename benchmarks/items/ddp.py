"""Item 7. DDP: two processes against one, one thread each."""

import os
import re
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import run_command, summarise
from benchmarks.mnist_files import write_mnist
from common.data import synthetic_classification


def ddp(quick: bool, work: Path) -> dict:
    item = "DDP: 2 processes over 1 (one thread each, MLP 784-512-512-10)"
    if harness.DEVICE.type == "cuda" and torch.cuda.device_count() < 2:
        # two ranks on one GPU would share it and measure nothing about scaling
        return {"item": item, "result": f"skipped: --device {harness.DEVICE} with {torch.cuda.device_count()} GPU; "
                                        "DDP needs 2", "target": ">= 1.6x", "met": None}
    if harness.DEVICE.type == "mps":
        return {"item": item, "result": "skipped: DDP does not run on MPS", "target": ">= 1.6x", "met": None}
    root = work / "ddp_mnist"
    n = 2048 if quick else 32768
    data = synthetic_classification(n + 512, 784, 10, seed=0)
    images = (data.tensors[0].view(-1, 28, 28).clamp(-2, 2) * 60 + 128).to(torch.uint8).numpy()
    labels = data.tensors[1].to(torch.uint8).numpy()
    write_mnist(root, (images[:n], labels[:n]), (images[n:], labels[n:]))
    batch = 256 if quick else 2048
    # under torchrun each rank takes cuda:LOCAL_RANK for --device cuda (a cuda:N index would be overridden)
    device = ["--device", harness.DEVICE.type]
    common = ["recipes/ddp_mlp.py", "--data-dir", root, "--epochs", 2 if quick else 3, "--batch-size", batch,
              *device]
    one_thread = {"OMP_NUM_THREADS": "1"}

    all_threads = {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}

    def throughput(world: int, tag: str, env: dict = one_thread) -> float:
        launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        f"--nproc_per_node={world}"]
        _, out = run_command([*launcher, *common, "--run-dir", work / f"ddp_{tag}"], env=env)
        return float(re.search(r"samples_per_s=([\d.]+)", out)[1])

    runs = {"one": [], "two": [], "one_process_all_threads": []}
    setups = [("one", 1, one_thread), ("two", 2, one_thread)]
    if harness.DEVICE.type == "cpu":  # on GPUs each process drives its own device: threads are beside the point
        setups.append(("one_process_all_threads", 1, all_threads))
    for i in range(1 if quick else 2):  # interleaved, every other round in reverse: none always runs first
        for name, world, env in setups[::-1] if i % 2 else setups:
            runs[name].append(throughput(world, f"{name}{i}", env))
    ratio = summarise([b / a for a, b in zip(runs["one"], runs["two"], strict=True)])
    backend = "nccl" if harness.DEVICE.type == "cuda" else "gloo"
    result = f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
    threads = None
    if runs["one_process_all_threads"]:
        threads = summarise([b / a for a, b in zip(runs["one"], runs["one_process_all_threads"], strict=True)])
        two_over_all = summarise([b / a for a, b in zip(runs["one_process_all_threads"], runs["two"], strict=True)])
        result += (f"; 1 process x {all_threads['OMP_NUM_THREADS']} threads: {threads['median']:.2f}x "
                   f"({threads['min']:.2f}-{threads['max']:.2f}) over 1 x 1, so 2 x 1 is {two_over_all['median']:.2f}x "
                   f"({two_over_all['min']:.2f}-{two_over_all['max']:.2f}) of one process using every core")
    return {"item": f"DDP: 2 processes x 1 thread over 1 process x 1 thread ({backend}, MLP 784-512-512-10, {batch} "
                    "per process), and 1 process using every core",
            "result": result, "target": ">= 1.6x", "met": ratio["median"] >= 1.6, "scaling": ratio,
            "all_threads_scaling": threads, "cpu_count": os.cpu_count(),
            "samples_per_s": {k: statistics.median(v) for k, v in runs.items() if v}}

