"""Item 2. Input pipeline: time the MNIST loop waits for data with its default loader."""

import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from benchmarks.harness import CPU, load_recipe
from benchmarks.mnist_files import read_idx
from common.data import make_loader, synthetic_classification
from common.loop import train_step


def input_pipeline(quick: bool, mnist_dir: Path | None) -> dict:
    mnist = load_recipe("mnist_onecycle")
    steps, batch_size = (15 if quick else 150), 32  # the recipe's default batch
    if mnist_dir:
        images, labels = (torch.from_numpy(read_idx(mnist_dir / f"t10k-{k}-ubyte.gz").copy())
                          for k in ("images-idx3", "labels-idx1"))
        dataset = TensorDataset((images.unsqueeze(1).float() / 255 - 0.1307) / 0.3081, labels.long())
    else:  # one epoch of stand-in digits lasts every step timed (4,096 were 128 batches, short of 150 steps)
        data = synthetic_classification(max(4096, batch_size * steps), 784, 10, seed=0)
        dataset = TensorDataset(data.tensors[0].view(-1, 1, 28, 28), data.tensors[1])
    loader = make_loader(dataset, batch_size, train=True, seed=0)  # the recipe's defaults: batch 32, 0 workers
    if len(loader) < steps:
        raise RuntimeError(f"{mnist_dir}: {len(dataset):,} digits are {len(loader)} batches of {batch_size}, "
                           f"fewer than the {steps} steps timed")
    torch.manual_seed(0)
    model = mnist.DigitNet().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    waited = total = 0.0
    loader.sampler.set_epoch(0)
    batches = iter(loader)
    for step in range(steps):
        started = time.perf_counter()
        batch = next(batches)
        fetched = time.perf_counter()
        train_step(model, optimizer, nn.CrossEntropyLoss(), [batch], device=CPU)
        if step >= 3:  # past the warm-up
            waited += fetched - started
            total += time.perf_counter() - started
    share = 100 * waited / total
    on = "" if mnist_dir else "; on stand-in digits (no --mnist-dir)"
    return {"item": "Input pipeline: share of MNIST step time spent waiting for data (default loader)",
            "result": f"{share:.2f}% ({1000 * waited / (steps - 3):.2f} ms of {1000 * total / (steps - 3):.1f} ms"
                      f"{on})", "target": "< 5%", "met": share < 5, "wait_percent": share,
            "real_mnist": bool(mnist_dir)}

