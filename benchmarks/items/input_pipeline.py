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
    if mnist_dir:
        images, labels = (torch.from_numpy(read_idx(mnist_dir / f"t10k-{k}-ubyte.gz").copy())
                          for k in ("images-idx3", "labels-idx1"))
        dataset = TensorDataset((images.unsqueeze(1).float() / 255 - 0.1307) / 0.3081, labels.long())
    else:
        data = synthetic_classification(4096, 784, 10, seed=0)
        dataset = TensorDataset(data.tensors[0].view(-1, 1, 28, 28), data.tensors[1])
    loader = make_loader(dataset, 32, train=True, seed=0)  # the recipe's defaults: batch 32, 0 workers
    torch.manual_seed(0)
    model = mnist.DigitNet().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = 15 if quick else 150
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
    return {"item": "Input pipeline: share of MNIST step time spent waiting for data (default loader)",
            "result": f"{share:.2f}% ({1000 * waited / (steps - 3):.2f} ms of {1000 * total / (steps - 3):.1f} ms)",
            "target": "< 5%", "met": share < 5, "wait_percent": share}

