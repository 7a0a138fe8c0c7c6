"""What each recipe and the core cost, measured side by side in one run.

    python benchmarks/run.py --mnist-dir DIR --adult-csv FILE --out benchmark.json  # about 25 minutes
    python benchmarks/run.py --only 1,2,3,4,5,6,7,8,9,10,11 ...  # without item 12: about 5 minutes
    python benchmarks/run.py --quick --out quick.json  # every item, tiny sizes: checks the script runs
    python benchmarks/run.py --device cuda ...         # the recipes on a GPU (default: cpu, even there)

Prints a markdown table and writes the same figures as JSON. This machine (like most) is shared and noisy:
every speed figure is a ratio of two things measured in the same run, interleaved, repeated, and reported as
the median with the min-max range. Real data is used when given: ``--mnist-dir``, a folder with the official
MNIST test set (``t10k-images-idx3-ubyte.gz`` and ``t10k-labels-idx1-ubyte.gz``, as torchvision leaves them
in ``data/MNIST/raw``, the default) and ``--adult-csv``, the Adult census table as one CSV with a header row;
without them those items are skipped (or run on synthetic data) with a note. Nothing here is a test: tests never time.

Every recipe run, in a subprocess or in this process, gets --device explicitly: left to `auto`, a recipe
would pick CUDA where there is one, and the DDP item would start two ranks on one GPU. Items 1 and 2 measure
the core's own (CPU-side) cost and always run on the CPU. An item that fails is recorded with its error and
the others still run; the exit status is then 1.
"""

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # common/ and benchmarks/ from a clone, without installing

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from benchmarks.mnist_files import read_idx, split_test_set, write_mnist
from common.data import make_loader, synthetic_classification
from common.loop import train_step
from common.runtime import device_peak_flops, measure_matmul_flops
from common.tracking import Run

CPU = torch.device("cpu")
DEVICE = CPU  # where the recipes run: --device, set by main() and passed to every recipe run


def device_args() -> list[str]:
    """The recipes' --device option for DEVICE: always given, never left to the recipe's `auto`."""
    return ["--device", str(DEVICE)]


def load_recipe(name: str):
    """A recipe's module (recipes are scripts; the benchmark measures their models and commands)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summarise(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved(repeats: int, **measure: Callable[[], float]) -> dict[str, list[float]]:
    """Run each measurement ``repeats`` times in turn (A B A B ...), so drifting machine load hits all alike."""
    results = {name: [] for name in measure}
    for _ in range(repeats):
        for name, fn in measure.items():
            results[name].append(fn())
    return results


def run_command(args: list, env: dict | None = None, cwd: Path = ROOT) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args[:3]))} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - started, proc.stdout


# ------------------------------------------------------------------------------------------------------
# 1. Core overhead: train_step + the run logger against the four-line loop


def core_overhead(quick: bool) -> dict:
    mnist = load_recipe("mnist_onecycle")
    steps, repeats = (10, 2) if quick else (40, 9)  # many short pairs: the median shrugs off load spikes
    data = synthetic_classification(64 * steps, 784, 10, seed=0)
    batches = [(x.view(-1, 1, 28, 28), y) for x, y in zip(data.tensors[0].split(64), data.tensors[1].split(64),
                                                           strict=True)]
    loss_fn = nn.CrossEntropyLoss()

    def setup():
        torch.manual_seed(0)
        model = mnist.DigitNet()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def hand_written() -> tuple[float, nn.Module]:
        model, optimizer = setup()
        started = time.perf_counter()
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        return time.perf_counter() - started, model

    def shared() -> tuple[float, nn.Module]:
        model, optimizer = setup()
        with tempfile.TemporaryDirectory() as run_dir:
            run = Run("bench", {"run_dir": Path(run_dir), "progress": False})
            run.start(model=model, optimizer=optimizer, steps=steps)
            started = time.perf_counter()
            for batch in batches:
                stats = train_step(model, optimizer, loss_fn, [batch], device=CPU)
                run.log_train(stats, lr=0.05, items=64)
            run.flush()
            seconds = time.perf_counter() - started
            run.close()
        return seconds, model

    models = {}

    def timed(name, fn):
        def measure():
            seconds, models[name] = fn()
            return seconds
        return measure

    hand_written()  # warm-up: first-call allocations
    times = interleaved(repeats, hand=timed("hand", hand_written), core=timed("core", shared))
    ratios = [c / h for c, h in zip(times["core"], times["hand"], strict=True)]
    same = all(torch.equal(a, b) for a, b in zip(models["hand"].state_dict().values(),
                                                  models["core"].state_dict().values(), strict=True))
    overhead = summarise([100 * (r - 1) for r in ratios])
    return {"item": "Core overhead: train_step + Run logging vs a hand-written loop (MNIST CNN, batch 64)",
            "result": f"{overhead['median']:+.1f}% ({overhead['min']:+.1f} to {overhead['max']:+.1f}); "
                      f"equal weights: {'yes' if same else 'NO'}",
            "target": "<= +3%, equal weights", "met": overhead["median"] <= 3 and same,
            "overhead_percent": overhead, "equal_weights": same}


# ------------------------------------------------------------------------------------------------------
# 2. Input pipeline: time the MNIST loop waits for data with its default loader


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


# ------------------------------------------------------------------------------------------------------
# 3. MNIST on small data: our recipe against pytorch/examples', 5,000 / 5,000 real digits


class ExamplesNet(nn.Module):
    """pytorch/examples' mnist Net: two convolutions at full resolution, dropout, a 9216 -> 128 layer."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def examples_recipe(data_dir: Path, epochs: int) -> tuple[float, float]:
    """pytorch/examples' mnist/main.py as it runs on a CPU: per-image ToTensor + Normalize transforms,
    batch 64 without shuffling (it only shuffles with an accelerator), Adadelta lr 1.0, StepLR gamma 0.7,
    test batch 1000. Returns (seconds, test accuracy)."""
    from torchvision import datasets, transforms

    started = time.perf_counter()
    torch.manual_seed(1)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train = datasets.MNIST(str(data_dir), train=True, download=False, transform=transform)
    test = datasets.MNIST(str(data_dir), train=False, download=False, transform=transform)
    train_loader = torch.utils.data.DataLoader(train, batch_size=64)
    test_loader = torch.utils.data.DataLoader(test, batch_size=1000)
    model = ExamplesNet()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    for _ in range(epochs):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for data, target in test_loader:
                correct += (model(data).argmax(1) == target).sum().item()
        scheduler.step()
    return time.perf_counter() - started, correct / len(test)


def mnist_vs_examples(quick: bool, mnist_dir: Path | None, work: Path) -> dict:
    """Small data: the first 5,000 of the official test digits train, the last 5,000 test (the harder half;
    the recipe holds 416 of its 5,000 out to choose best.pt, pytorch/examples trains on all 5,000). Each recipe
    in a process of its own, 3 epochs, interleaved (ours, theirs, ours, theirs): seconds are wall time from
    process start to exit, both paying the interpreter's and torch's start-up and the data loading. Ours runs
    with --seed 0, 1, ...; pytorch/examples fixes its seed (1), so its accuracy repeats."""
    n_train, epochs, repeats = (1000, 1, 1) if quick else (5000, 3, 2)
    item = (f"MNIST small data: our recipe vs pytorch/examples' ({epochs} epochs, {n_train:,} train / "
            f"{10_000 - n_train:,} test real digits)")
    target = "test accuracy >= 98.3% and above pytorch/examples', in less time"
    if mnist_dir is None:
        return {"item": item, "result": "skipped: the MNIST test files are not here (--mnist-dir)",
                "target": target, "met": None}
    split = work / "mnist_split"
    split_test_set(mnist_dir, split, n_train)
    runs = iter(range(repeats))

    def ours() -> tuple[float, float]:
        i = next(runs)
        seconds, out = run_command([sys.executable, "recipes/mnist_onecycle.py", "--epochs", epochs, "--seed", i,
                                    "--data-dir", split, "--run-dir", work / f"mnist_run{i}", "--no-progress",
                                    *device_args()])
        return seconds, float(re.search(r"test_acc=([\d.]+)", out)[1])

    # a process of its own, like ours: both pay the interpreter's and torch's start-up
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.run import examples_recipe; "
            f"print(examples_recipe(__import__('pathlib').Path({str(split)!r}), {epochs})[1])")

    def theirs() -> tuple[float, float]:
        seconds, out = run_command([sys.executable, "-c", code])
        return seconds, float(out.strip().splitlines()[-1])

    pairs = interleaved(repeats, ours=ours, examples=theirs)
    figures = {name: {"seconds": summarise([t for t, _ in runs_]), "acc": summarise([a for _, a in runs_])}
               for name, runs_ in pairs.items()}
    time_ratio = summarise([o[0] / e[0] for o, e in zip(pairs["ours"], pairs["examples"], strict=True)])
    o, e = figures["ours"], figures["examples"]
    met = o["acc"]["min"] >= 0.983 and o["acc"]["min"] > e["acc"]["max"] and time_ratio["max"] < 1
    return {"item": item,
            "result": f"ours {o['acc']['median']:.2%} ({o['acc']['min']:.2%}-{o['acc']['max']:.2%}) in "
                      f"{o['seconds']['median']:.0f} s ({o['seconds']['min']:.0f}-{o['seconds']['max']:.0f}); "
                      f"pytorch/examples {e['acc']['median']:.2%} in {e['seconds']['median']:.0f} s "
                      f"({e['seconds']['min']:.0f}-{e['seconds']['max']:.0f}); time ratio {time_ratio['median']:.2f}x "
                      f"({time_ratio['min']:.2f}-{time_ratio['max']:.2f}), {repeats} interleaved pairs",
            "target": target, "met": met, "n_train": n_train, "repeats": repeats,
            "ours": figures["ours"], "examples": figures["examples"], "time_ratio": time_ratio}


# ------------------------------------------------------------------------------------------------------
# 4. Tiny transformer: tokens/s and MFU, ours against nanoGPT's model, fp32/bf16, eager/compiled


class NanoGPTBlock(nn.Module):
    """nanoGPT's model.py block, rebuilt for the comparison (nanoGPT is not a package): fused qkv Linear,
    SDPA with is_causal, LayerNorm, GELU MLP, dropout 0. ``bias``: in every Linear and LayerNorm; nanoGPT's
    train.py defaults to False (its GPTConfig to True, GPT-2's layout)."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = False):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=bias), nn.LayerNorm(n_embd, bias=bias)
        self.c_attn, self.attn_proj = nn.Linear(n_embd, 3 * n_embd, bias=bias), nn.Linear(n_embd, n_embd, bias=bias)
        self.c_fc, self.mlp_proj = nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT with its initialisation: normal(0, 0.02) weights, zero biases, the residual projections
    (c_proj there) at 0.02 / sqrt(2 * n_layer); tied embeddings."""

    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int, bias: bool = False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(NanoGPTBlock(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * n_layer) ** 0.5)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def tokens_per_second(model: nn.Module, precision: str, steps: int, fused: bool, batch: int = 32,
                      block: int = 128) -> float:
    """Training throughput of one setup (model and optimizer) with the same step: AdamW with weight decay on
    matrices (both projects' grouping), clipping 1.0, random tokens; ``fused``: torch's fused AdamW kernel
    (one kernel for every tensor) or its default (foreach) implementation."""
    tt = load_recipe("tiny_transformer")
    optimizer = torch.optim.AdamW(tt.parameter_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), fused=fused)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(256, (batch, block), generator=g), torch.randint(256, (batch, block), generator=g)
    for _ in range(2):  # warm-up (and compilation, when compiled)
        train_step(model, optimizer, tt.lm_loss, [(x, y)], device=DEVICE, precision=precision, max_grad_norm=1.0)
    started = time.perf_counter()
    for _ in range(steps):
        stats = train_step(model, optimizer, tt.lm_loss, [(x, y)], device=DEVICE, precision=precision,
                           max_grad_norm=1.0)
    stats.loss.item()
    return steps * batch * block / (time.perf_counter() - started)


def transformer(quick: bool) -> dict:
    """Tokens/s of the recipe's GPT against nanoGPT's (train.py's defaults: bias=False), 4x128, block 128,
    batch 32, fp32, interleaved (ours, nanoGPT, nanoGPT as shipped, ...). The headline ratio gives both the
    same optimizer implementation (fused AdamW); the second line is each project as it sets itself up: the
    recipe fuses AdamW on a CPU, nanoGPT only on CUDA. MFU: model FLOPs per token (6 per parameter plus
    attention) x tokens/s, over the datasheet peak where one is known (GPUs), and over measured matmul
    FLOP/s (named as such: an achievable peak, so that MFU reads higher)."""
    tt = load_recipe("tiny_transformer")
    shape = {"block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}

    def ours():
        torch.manual_seed(0)
        return tt.GPT(tt.GPTConfig(vocab_size=256, **shape)).to(DEVICE)

    def nanogpt():
        torch.manual_seed(0)
        return NanoGPT(256, **shape).to(DEVICE)

    steps, repeats = (2, 1) if quick else (15, 5)
    nanogpt_fuses = DEVICE.type == "cuda"  # nanoGPT's configure_optimizers: fused only on CUDA
    side_by_side = interleaved(repeats, ours=lambda: tokens_per_second(ours(), "fp32", steps, fused=True),
                               nanogpt=lambda: tokens_per_second(nanogpt(), "fp32", steps, fused=True),
                               nanogpt_own=lambda: tokens_per_second(nanogpt(), "fp32", steps, fused=nanogpt_fuses))
    same = summarise([a / b for a, b in zip(side_by_side["ours"], side_by_side["nanogpt"], strict=True)])
    own = summarise([a / b for a, b in zip(side_by_side["ours"], side_by_side["nanogpt_own"], strict=True)])
    flops_per_token = ours().flops_per_token()
    peaks_and_sources = {name: device_peak_flops(DEVICE, dtype)
                         for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]}
    datasheet = {name: figure for name, (figure, source) in peaks_and_sources.items() if source.startswith("datasheet")}
    measured = {name: (figure if name not in datasheet else measure_matmul_flops(DEVICE, dtype))
                for (name, (figure, _)), dtype in zip(peaks_and_sources.items(), (torch.float32, torch.bfloat16),
                                                      strict=True)}
    variants = {"fp32 eager": statistics.median(side_by_side["ours"])}
    bf16_steps = 1 if measured["bf16"] < 0.2 * measured["fp32"] else steps  # emulated bf16 is very slow: one step
    variants["bf16 eager"] = tokens_per_second(ours(), "bf16", bf16_steps, fused=True)
    # quick mode only checks the path: Dynamo without Inductor's (slow) code generation
    variants["fp32 compiled"] = tokens_per_second(torch.compile(ours(), backend="eager" if quick else "inductor"),
                                                  "fp32", steps, fused=True)
    precision_of = {"fp32 eager": "fp32", "bf16 eager": "bf16", "fp32 compiled": "fp32"}
    # datasheet: each variant against its precision's peak, as MFU is usually quoted; measured: against the
    # fastest matmul measured here in either precision (emulated bf16, without native units, is slower than fp32)
    mfu_datasheet = {name: flops_per_token * tps / datasheet[precision_of[name]]
                     for name, tps in variants.items() if precision_of[name] in datasheet}
    mfu_measured = {name: flops_per_token * tps / max(measured.values()) for name, tps in variants.items()}

    def shown_mfu(name):
        parts = [f"{mfu_datasheet[name]:.0%} of datasheet"] if name in mfu_datasheet else []
        return ", ".join([*parts, f"{mfu_measured[name]:.0%} of measured matmul"])

    shown = ", ".join(f"{name} {tps:,.0f} tok/s (MFU {shown_mfu(name)})" for name, tps in variants.items())
    own_line = ("the same setup on CUDA (nanoGPT fuses there too)" if nanogpt_fuses else
                f"{own['median']:.2f}x ({own['min']:.2f}-{own['max']:.2f}) against nanoGPT as it sets itself up "
                f"(unfused AdamW on a CPU, {statistics.median(side_by_side['nanogpt_own']):,.0f} tok/s)")
    return {"item": "Tiny transformer (4x128, block 128, batch 32, fp32): ours vs nanoGPT's model (bias=False, its "
                    "train.py default), same optimizer (fused AdamW)",
            "result": f"same optimizer: {same['median']:.2f}x nanoGPT ({same['min']:.2f}-{same['max']:.2f}; "
                      f"{statistics.median(side_by_side['ours']):,.0f} vs "
                      f"{statistics.median(side_by_side['nanogpt']):,.0f} tok/s, {repeats} interleaved runs); "
                      f"recipe's own setup: {own_line}; {shown}",
            "target": ">= 1.00x nanoGPT, same optimizer", "met": same["median"] >= 1.0, "ratio_vs_nanogpt": same,
            "ratio_vs_nanogpt_own_setup": own, "tokens_per_s": variants,
            "nanogpt_tokens_per_s": {"same_optimizer": statistics.median(side_by_side["nanogpt"]),
                                     "own_setup": statistics.median(side_by_side["nanogpt_own"])},
            "mfu": mfu_datasheet or mfu_measured, "mfu_datasheet": mfu_datasheet, "mfu_measured_matmul": mfu_measured,
            "peak_flops": {"datasheet": datasheet, "measured_matmul": measured},
            "peak_flops_source": {name: source for name, (_, source) in peaks_and_sources.items()}}


# ------------------------------------------------------------------------------------------------------
# 5. Mixed precision, 6. torch.compile: the recipes' own models


def mixed_precision(quick: bool) -> dict:
    """Seconds per training step of the recipe's MLP (784-1024x3-10, AdamW, batch 512) in fp32, bf16 and fp16
    autocast, each a fresh model timed over a few steps after a warm-up step (mixed_precision.seconds_per_step:
    the median step), interleaved fp32, bf16, fp16, fp32, ...; the speed-up is fp32's seconds over the other's,
    per round."""
    mp = load_recipe("mixed_precision")
    sizes = {"width": 128 if quick else 1024, "depth": 3, "batch_size": 64 if quick else 512}
    repeats = 1 if quick else 3
    # emulated bf16 (no native units) is slow: 2 timed steps of each low precision, 5 of fp32
    runs = interleaved(repeats, **{precision: lambda p=precision: mp.seconds_per_step(
        torch.device(DEVICE), p, **sizes, steps=5 if p == "fp32" else 2)[0] for precision in ("fp32", "bf16", "fp16")})
    rows = {p: summarise([f / x for f, x in zip(runs["fp32"], runs[p], strict=True)]) for p in runs}
    return {"item": "Mixed precision: speed-up over fp32, the recipe's MLP (784-1024x3-10, batch 512), "
                    f"{repeats} interleaved rounds",
            "result": ", ".join(f"{p} {rows[p]['median']:.2f}x ({rows[p]['min']:.2f}-{rows[p]['max']:.2f})"
                                for p in ("bf16", "fp16")),
            "target": "bf16 >= 1.5x (needs native bf16 matmul: AVX-512 BF16/AMX or a GPU)",
            "met": rows["bf16"]["median"] >= 1.5, "speedup": {p: r["median"] for p, r in rows.items()},
            "speedup_range": rows, "seconds_per_step": runs}


def compiled(quick: bool, work: Path) -> dict:
    """The compiled_model recipe's gated MLP (64 wide, 8 blocks, batch 16384), eager and torch.compile'd from
    the same initial weights, fed the same batches: after the compiled one's first (compiling) step, blocks of
    steps interleaved (eager, compiled, eager, ...), each block's seconds per step. Compile time is the first
    compiled step less a steady one; the loss difference is the two models' last losses after the same steps."""
    import copy

    cm = load_recipe("compiled_model")
    width, batch, block, repeats = (32, 1024, 3, 1) if quick else (64, 16384, 10, 5)
    torch.manual_seed(0)
    models = {"eager": cm.GatedMLP(width, 8).to(DEVICE)}
    models["compiled"] = torch.compile(copy.deepcopy(models["eager"]), backend="eager" if quick else "inductor")
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for k, m in models.items()}
    data = synthetic_classification(batch * 4, cm.N_FEATURES, cm.N_CLASSES, seed=0)
    batches = list(zip(data.tensors[0].split(batch), data.tensors[1].split(batch), strict=True))
    loss_fn = nn.CrossEntropyLoss()
    position = {"eager": 0, "compiled": 0}
    losses = {}

    def steps(name: str, n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            b = batches[position[name] % len(batches)]
            position[name] += 1
            stats = train_step(models[name], optimizers[name], loss_fn, [b], device=DEVICE)
        losses[name] = stats.loss.item()  # waits for the device
        return (time.perf_counter() - started) / n

    first = {name: steps(name, 1) for name in models}  # compiled: Dynamo + Inductor, forward and backward
    runs = interleaved(repeats, eager=lambda: steps("eager", block), compiled=lambda: steps("compiled", block))
    speedup = summarise([e / c for e, c in zip(runs["eager"], runs["compiled"], strict=True)])
    compile_s = max(0.0, first["compiled"] - statistics.median(runs["compiled"]))
    loss_diff = abs(losses["eager"] - losses["compiled"])
    return {"item": f"torch.compile: the recipe's gated MLP ({width} wide, 8 blocks, batch {batch}), steady state, "
                    f"{repeats} interleaved blocks of {block} steps",
            "result": f"{speedup['median']:.2f}x eager ({speedup['min']:.2f}-{speedup['max']:.2f}) after "
                      f"{compile_s:.1f} s of compiling; loss difference {loss_diff:.1e}",
            "target": ">= 1.2x", "met": speedup["median"] >= 1.2, "speedup": speedup["median"],
            "speedup_range": speedup, "compile_s": compile_s, "loss_diff": loss_diff,
            "step_ms": {k: 1000 * statistics.median(v) for k, v in runs.items()}}


# ------------------------------------------------------------------------------------------------------
# 7. DDP: two processes against one, one thread each


def ddp(quick: bool, work: Path) -> dict:
    item = "DDP: 2 processes over 1 (one thread each, MLP 784-512-512-10)"
    if DEVICE.type == "cuda" and torch.cuda.device_count() < 2:
        # two ranks on one GPU would share it and measure nothing about scaling
        return {"item": item, "result": f"skipped: --device {DEVICE} with {torch.cuda.device_count()} GPU; "
                                        "DDP needs 2", "target": ">= 1.6x", "met": None}
    if DEVICE.type == "mps":
        return {"item": item, "result": "skipped: DDP does not run on MPS", "target": ">= 1.6x", "met": None}
    root = work / "ddp_mnist"
    n = 2048 if quick else 32768
    data = synthetic_classification(n + 512, 784, 10, seed=0)
    images = (data.tensors[0].view(-1, 28, 28).clamp(-2, 2) * 60 + 128).to(torch.uint8).numpy()
    labels = data.tensors[1].to(torch.uint8).numpy()
    write_mnist(root, (images[:n], labels[:n]), (images[n:], labels[n:]))
    batch = 256 if quick else 2048
    # under torchrun each rank takes cuda:LOCAL_RANK for --device cuda (a cuda:N index would be overridden)
    device = ["--device", DEVICE.type]
    common = ["recipes/ddp_mlp.py", "--data-dir", root, "--epochs", 2 if quick else 3, "--batch-size", batch,
              "--no-progress", *device]
    one_thread = {"OMP_NUM_THREADS": "1"}

    all_threads = {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}

    def throughput(world: int, tag: str, env: dict = one_thread) -> float:
        launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        f"--nproc_per_node={world}"]
        _, out = run_command([*launcher, *common, "--run-dir", work / f"ddp_{tag}"], env=env)
        return float(re.search(r"samples_per_s=([\d.]+)", out)[1])

    runs = {"one": [], "two": [], "one_process_all_threads": []}
    for i in range(1 if quick else 2):  # interleaved: one, two, all threads, one, two, ...
        runs["one"].append(throughput(1, f"one{i}"))
        runs["two"].append(throughput(2, f"two{i}"))
        if DEVICE.type == "cpu":  # on GPUs each process drives its own device: threads are beside the point
            runs["one_process_all_threads"].append(throughput(1, f"all{i}", all_threads))
    ratio = summarise([b / a for a, b in zip(runs["one"], runs["two"], strict=True)])
    backend = "nccl" if DEVICE.type == "cuda" else "gloo"
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


def transformer_parallel(quick: bool, work: Path) -> dict:
    """tiny_transformer at 2 ranks (DDP, FSDP2) against 1 process, the same global batch: tokens/s, peak RSS
    per rank, and FSDP's model state per rank over one process's (issue: <= 0.55x at 2 ranks, default model)."""
    item = "Transformer: DDP and FSDP2 at 2 ranks vs 1 process (default model, one thread each)"
    if DEVICE.type != "cpu":
        return {"item": item, "result": f"skipped: CPU item (gloo), not --device {DEVICE}", "target": "<= 0.55x",
                "met": None}
    steps = 4 if quick else 30
    common = ["recipes/tiny_transformer.py", "--steps", steps, "--eval-every", steps, "--eval-batches", 2,
              "--sample-tokens", 8, "--peak-flops", 1e11, "--global-batch", 32, "--no-progress", "--device", "cpu"]
    if quick:
        common += ["--n-layer", 2, "--n-embd", 32, "--block-size", 16]
    figures = {}
    for label, launcher, parallel in [("one", [sys.executable], "none"),
                                      ("ddp", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"],
                                       "ddp"),
                                      ("fsdp", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"],
                                       "fsdp")]:
        run_dir = work / f"tt_{label}"
        run_command([*launcher, *common, "--parallel", parallel, "--run-dir", run_dir], env={"OMP_NUM_THREADS": "1"})
        metrics = json.loads((run_dir / "metrics.json").read_text())
        memory = metrics["memory"]  # rank 0's: per rank
        figures[label] = {"tokens_per_s": metrics["tokens_per_s"], "peak_rss_bytes": memory["peak_rss_bytes"],
                          "model_state_bytes": memory["model_state_bytes"]}
    ratio = figures["fsdp"]["model_state_bytes"] / figures["one"]["model_state_bytes"]
    speed = "; ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s, RSS {v['peak_rss_bytes'] / 2**20:,.0f} MB/rank"
                      for k, v in figures.items())
    return {"item": item, "result": f"FSDP model state per rank {ratio:.3f}x of one process; {speed}",
            "target": "<= 0.55x", "met": ratio <= 0.55, "memory_ratio": ratio, "runs": figures}


# ------------------------------------------------------------------------------------------------------
# 8. Tabular: the Adult census table


def tabular(quick: bool, adult_csv: Path | None, work: Path) -> dict:
    item = "Tabular MLP: validation accuracy on Adult (--target income, default options)"
    if adult_csv is None:
        return {"item": item, "result": "skipped: the Adult CSV is not here (--adult-csv)", "target": ">= 0.85",
                "met": None}
    extra = ["--epochs", 1] if quick else []
    _, out = run_command([sys.executable, "recipes/tabular_mlp.py", "--csv", adult_csv, "--target", "income",
                          *extra, "--run-dir", work / "adult_run", "--no-progress", *device_args()])
    acc = float(re.search(r"val_acc=([\d.]+)", out)[1])
    return {"item": item, "result": f"{acc:.4f}", "target": ">= 0.85", "met": acc >= 0.85, "val_acc": acc}


# ------------------------------------------------------------------------------------------------------
# The machine: does this CPU multiply bf16 natively? Item 5's bf16 target depends on it.


def cpu_hardware() -> dict:
    """The CPU's model name, its bf16 instruction flags (Linux /proc/cpuinfo), and bf16 against fp32 matmul
    GFLOP/s measured here. Without AVX-512 BF16 or AMX, bf16 is emulated: an Intel AVX-512F CPU without BF16
    ran it at 0.2x fp32; an AMD EPYC with avx512_bf16 runs it faster than fp32."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # one block per core: the first says it
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: no flags; the measurement below still says how bf16 runs
        pass
    model = model or platform.processor() or platform.machine()
    fp32, bf16 = measure_matmul_flops(CPU, torch.float32), measure_matmul_flops(CPU, torch.bfloat16)
    native = {flag: flag in flags for flag in ("avx512f", "avx512_bf16", "amx_bf16")} if flags else {}
    return {"cpu_model": model, "cpu_flags": native, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_native": (native["avx512_bf16"] or native["amx_bf16"]) if native else None,
            "fp32_gflops": fp32 / 1e9, "bf16_gflops": bf16 / 1e9, "bf16_over_fp32": bf16 / fp32}


def describe_hardware(hardware: dict) -> str:
    native = {True: "native bf16 (" + ", ".join(f for f in ("avx512_bf16", "amx_bf16") if hardware["cpu_flags"][f])
                    + ")",
              False: "no native bf16 (neither avx512_bf16 nor amx_bf16: emulated)",
              None: "bf16 flags unknown (no /proc/cpuinfo)"}[hardware["bf16_native"]]
    return (f"CPU {hardware['cpu_model']}: {native}; matmul bf16 {hardware['bf16_gflops']:.0f} vs fp32 "
            f"{hardware['fp32_gflops']:.0f} GFLOP/s ({hardware['bf16_over_fp32']:.2f}x)")


def device_name(value: str) -> torch.device:
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not one of cpu, cuda, cuda:N, mps")
    return torch.device(value)


def check_device(device: torch.device) -> str | None:
    """Why ``device`` cannot be used here, or None."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {device}: CUDA is not available on this machine; use --device cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return f"--device {device}: MPS is not available on this machine; use --device cpu"
    return None


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def run_items(items: dict[int, Callable[[], dict]], chosen: list[int]) -> dict[int, dict]:
    """Each chosen item in turn; one that raises becomes a result that says why, and the rest still run."""
    results = {}
    for number in chosen:
        started = time.perf_counter()
        try:
            result = items[number]()
        except Exception as err:  # noqa: BLE001 - any failure of one item must not lose the others' figures
            result = {"item": f"item {number}", "result": f"failed: {one_line(err)}", "target": "-", "met": None,
                      "error": one_line(err)}
        results[number] = result | {"seconds": time.perf_counter() - started}
        print(f"[{number}] {results[number]['result']}  ({results[number]['seconds']:.0f} s)", file=sys.stderr)
    return results


# 9. Generation: the tiny transformer's KV cache against recomputing the whole context every token


def kv_cache(quick: bool) -> dict:
    tt = load_recipe("tiny_transformer")
    torch.manual_seed(0)
    model = tt.GPT(tt.GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)).eval()
    prompt = torch.randint(256, (1, 64), generator=torch.Generator().manual_seed(0))
    new_tokens, repeats = (40, 1) if quick else (500, 3)  # 64 + 500 > 128: the cache is refilled on the way

    def tokens_per_s(use_cache: bool) -> float:
        started = time.perf_counter()
        model.generate(prompt, new_tokens, top_k=1, use_cache=use_cache)
        return new_tokens / (time.perf_counter() - started)

    tokens_per_s(True)  # warm-up
    runs = interleaved(repeats, cache=lambda: tokens_per_s(True), recompute=lambda: tokens_per_s(False))
    speedup = summarise([a / b for a, b in zip(runs["cache"], runs["recompute"], strict=True)])
    same = torch.equal(model.generate(prompt, 64, top_k=1), model.generate(prompt, 64, top_k=1, use_cache=False))
    return {"item": f"Generation: KV cache vs full recompute, {new_tokens} greedy tokens from a 64-token prompt "
                    "(4x128, block 128, batch 1)",
            "result": f"{speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f}; "
                      f"{statistics.median(runs['cache']):,.0f} vs {statistics.median(runs['recompute']):,.0f} "
                      f"tok/s); same greedy tokens within the block: {'yes' if same else 'NO'}",
            "target": ">= 3x, same tokens", "met": speedup["median"] >= 3 and same, "kv_cache_speedup": speedup,
            "tokens_per_s": {k: statistics.median(v) for k, v in runs.items()}, "same_tokens": same}


# 10. Tabular at scale: from a large CSV file to training


def adult_like_table(path: Path, rows: int, seed: int = 0) -> Path:
    """A CSV with Adult's column types (6 integer, 8 text columns and an income label that depends on
    both kinds), a few cells missing, written column-wise so that millions of rows take seconds."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(seed)
    numbers = {"age": (17, 90), "fnlwgt": (12_000, 1_500_000), "education_num": (1, 16), "capital_gain": (0, 99_999),
               "capital_loss": (0, 4_356), "hr_per_week": (1, 99)}
    texts = {"type_employer": 8, "education": 16, "marital": 7, "occupation": 14, "relationship": 6, "race": 5,
             "sex": 2, "country": 41}
    columns = {name: rng.integers(low, high, rows) for name, (low, high) in numbers.items()}
    codes = {name: rng.integers(0, k, rows) for name, k in texts.items()}
    score = (columns["age"] - 40) / 12 + (columns["education_num"] - 10) / 3 + (codes["marital"] == 1) * 1.5
    for name, k in texts.items():  # dictionary arrays: an index per cell, each word once
        words = pa.array([f"{name}-{i}" for i in range(k)] + ["?"])  # "?": Adult's missing value
        columns[name] = pa.DictionaryArray.from_arrays(np.where(rng.random(rows) < 0.01, k, codes[name]), words)
    income = (score + rng.normal(0, 1, rows) > 1).astype(np.int8)
    columns["income"] = pa.DictionaryArray.from_arrays(income, pa.array(["<=50K", ">50K"]))
    pacsv.write_csv(pa.table(columns), path, pacsv.WriteOptions(quoting_style="none"))
    return path


def first_step(recipe: Path, args: list, run_dir: Path) -> dict:
    """Run the recipe; seconds from process start to the end of its first step (the line it prints then),
    its peak RSS (from its metrics.json: the child's own VmHWM; the ru_maxrss that wait4 reports would start
    at this large process's size, which survives fork and exec), and its training throughput."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, recipe, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = None
    for line in proc.stdout:
        if seconds is None and line.startswith("memory after the first step"):
            seconds = time.perf_counter() - started
        done = line
    stderr = proc.stderr.read()
    if proc.wait() != 0 or seconds is None:
        raise RuntimeError(f"{recipe.name} failed: {stderr.strip().splitlines()[-1:]}")
    memory = json.loads((run_dir / "metrics.json").read_text())["memory"]
    return {"first_step_s": seconds, "peak_rss_gb": memory["peak_rss_bytes"] / 2**30,
            "samples_per_s": float(re.search(r"samples_per_s=([\d.]+)", done)[1])}


def tabular_scale(quick: bool, work: Path, recipe: Path = ROOT / "recipes" / "tabular_mlp.py") -> dict:
    import pandas as pd

    sizes = [2_000, 20_000] if quick else [100_000, 1_000_000, 3_000_000]
    figures = {}
    for rows in sizes:
        path = adult_like_table(work / f"table_{rows}.csv", rows)
        started = time.perf_counter()
        pd.read_csv(path)
        pandas_s = time.perf_counter() - started
        run_dir = work / f"table_run_{rows}"
        run = first_step(recipe, ["--csv", path, "--target", "income", "--max-steps", 20 if quick else 300,
                                  "--run-dir", run_dir, "--no-progress", "--device", DEVICE], run_dir)
        figures[rows] = run | {"pandas_read_csv_s": pandas_s}
        path.unlink()
    floor = torch_floor()
    shown = "; ".join(f"{rows:,} rows: {f['first_step_s']:.1f} s to the first step (pandas.read_csv "
                      f"{f['pandas_read_csv_s']:.1f} s), {f['peak_rss_gb']:.2f} GB, {f['samples_per_s']:,.0f} "
                      "samples/s" for rows, f in figures.items())
    shown += (f"; floor, a script that only imports torch and takes one AdamW step: {floor['seconds']:.1f} s, "
              f"{floor['peak_rss_gb']:.2f} GB")
    at_1m = figures.get(1_000_000)
    met = None if at_1m is None else at_1m["first_step_s"] <= 3 and at_1m["peak_rss_gb"] <= 1.5
    return {"item": "Tabular at scale: an Adult-like CSV to the first training step, default options",
            "result": shown, "target": "1M rows: <= 3 s to the first step, <= 1.5 GB peak RSS; linear in rows",
            "met": met, "sizes": figures, "torch_floor": floor}


def torch_floor() -> dict:
    """What any PyTorch training script pays before its first step, whatever its data: the interpreter,
    ``import torch``, and the first optimizer (whose construction imports torch._dynamo, about a second on
    this machine). Median of three fresh processes: seconds from start to exit, and peak RSS."""
    code = ("import torch; from torch import nn; m = nn.Linear(10, 2); o = torch.optim.AdamW(m.parameters()); "
            "m(torch.randn(4, 10)).sum().backward(); o.step(); "
            "from common.resources import peak_rss_bytes; print(peak_rss_bytes())")
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        runs.append((time.perf_counter() - started, int(out.stdout.split()[-1]) / 2**30))
    seconds, rss = sorted(runs)[1]
    return {"seconds": seconds, "peak_rss_gb": rss}


# ------------------------------------------------------------------------------------------------------
# 12. Language-model quality: the recipe against nanoGPT's model and training loop, same settings

TEXT_CHARS = 1_115_394  # the length of nanoGPT's shakespeare_char input.txt


def char_text(path: Path, chars: int = TEXT_CHARS) -> Path:
    """A character-level text of ``chars`` characters that exists offline everywhere: the start of this
    Python's standard library as the recipe reads it (top-level modules in sorted order), written to ``path``."""
    tt = load_recipe("tiny_transformer")
    path.write_text(tt.stdlib_corpus().decode("utf-8")[:chars], encoding="utf-8")
    return path


def char_split(path: Path) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(vocab, train, val) of a text as the recipe splits it with --vocab chars: the sorted characters
    seen, the first 90% of the tokens and the last 10%."""
    tt = load_recipe("tiny_transformer")
    data = path.read_bytes()
    vocab = "".join(sorted(set(data.decode("utf-8"))))
    tokens = tt.encode(data, vocab)
    split = int(0.9 * len(tokens))
    return vocab, tokens[:split], tokens[split:]


@torch.no_grad()
def score_windows(model: nn.Module, tokens: torch.Tensor, block: int, batch: int = 256) -> float:
    """Mean next-token loss (nats) over the whole of ``tokens``, cut into non-overlapping windows of
    ``block``: every token but the first is predicted once (a window's first from no context). The tail
    shorter than a window is left out. Unlike the recipes' few random validation batches, nothing is sampled."""
    was_training = model.training
    model.eval()
    n = (len(tokens) - 1) // block
    x = tokens[: n * block].long().view(n, block)
    y = tokens[1 : n * block + 1].long().view(n, block)
    total = 0.0
    for xb, yb in zip(x.split(batch), y.split(batch), strict=True):
        logits = model(xb.to(DEVICE))
        total += F.cross_entropy(logits.flatten(0, 1).float(), yb.to(DEVICE).flatten(), reduction="sum").item()
    model.train(was_training)
    return total / (n * block)


def recipe_val_loss(run_dir: Path, val: torch.Tensor) -> float:
    """score_windows of the model in a tiny_transformer run's last.pt."""
    tt = load_recipe("tiny_transformer")
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True, map_location=DEVICE)
    model = tt.GPT(tt.GPTConfig(**checkpoint["model_config"])).to(DEVICE)
    model.load_state_dict(checkpoint["model"])
    return score_windows(model, val, model.config.block_size)


def train_recipe_lm(text: Path, run_dir: Path, settings: dict, seed: int) -> tuple[float, float]:
    """Train recipes/tiny_transformer.py on ``text`` (--vocab chars) with ``settings`` (option -> value, e.g.
    {"--beta2": 0.99}); returns (seconds, loss on the whole validation split)."""
    options = [str(a) for k, v in settings.items() for a in (k, v)]
    seconds, _ = run_command([sys.executable, "recipes/tiny_transformer.py", "--text", text, "--vocab", "chars",
                              *options, "--eval-every", settings["--steps"], "--eval-batches", 1,
                              "--sample-tokens", 1, "--seed", seed, "--run-dir", run_dir, "--no-progress",
                              *device_args()])
    return seconds, recipe_val_loss(run_dir, char_split(text)[2])


# nanoGPT's data/shakespeare_char + config/train_shakespeare_char.py with its README's CPU overrides
NANOGPT_CPU = {"block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128, "lr": 1e-3,
               "min_lr": 1e-4, "warmup": 100, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "grad_clip": 1.0}


def nanogpt_train(train: torch.Tensor, vocab_size: int, steps: int, seed: int, c: dict = NANOGPT_CPU) -> nn.Module:
    """nanoGPT's train.py loop, rebuilt: random windows from the global RNG (get_batch), the rate set every
    iteration (linear warmup, cosine to min_lr at lr_decay_iters = max_iters), AdamW over its two groups (decay
    on tensors of 2+ dimensions), clipping, no gradient accumulation, dropout 0. AdamW is torch's fused kernel,
    the implementation the recipe uses (nanoGPT fuses on CUDA only; on a CPU it would run the foreach one)."""
    torch.manual_seed(1337 + seed)  # nanoGPT: 1337 + seed_offset
    model = NanoGPT(vocab_size, c["block_size"], c["n_layer"], c["n_head"], c["n_embd"]).to(DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=c["lr"], betas=(c["beta1"], c["beta2"]), fused=True)

    def get_lr(it: int) -> float:
        if it < c["warmup"]:
            return c["lr"] * (it + 1) / (c["warmup"] + 1)
        ratio = (it - c["warmup"]) / max(1, steps - c["warmup"])
        return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["lr"] - c["min_lr"])

    block, data = c["block_size"], train.long()
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        ix = torch.randint(len(data) - block, (c["batch_size"],))
        x = torch.stack([data[i : i + block] for i in ix]).to(DEVICE)
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix]).to(DEVICE)
        logits = model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def lm_quality(quick: bool, work: Path) -> dict:
    """Validation loss of the recipe against nanoGPT's model and loop, trained alike: the same character-level
    text (char_text: the first 1,115,394 characters of this Python's standard library, 90/10 split), the same
    shape (nanoGPT's CPU configuration: 4 layers, 128 wide, 4 heads, block 64, batch 12), steps and optimizer
    settings (lr 1e-3 to 1e-4 by cosine after 100 warmup steps, betas 0.9/0.99, weight decay 0.1, clipping 1.0),
    two seeds each; both scored by score_windows on the whole validation split."""
    c = NANOGPT_CPU
    text = char_text(work / "lm_text.txt", 20_000 if quick else TEXT_CHARS)
    steps, seeds = (5, [0]) if quick else (600, [0, 1])
    vocab, train, val = char_split(text)
    settings = {"--steps": steps, "--batch-size": c["batch_size"], "--block-size": c["block_size"],
                "--n-layer": c["n_layer"], "--n-head": c["n_head"], "--n-embd": c["n_embd"], "--lr": c["lr"],
                "--min-lr-ratio": c["min_lr"] / c["lr"], "--warmup-steps": min(c["warmup"], steps - 1),
                "--beta1": c["beta1"], "--beta2": c["beta2"], "--weight-decay": c["weight_decay"],
                "--max-grad-norm": c["grad_clip"]}
    config = c | {"warmup": min(c["warmup"], steps - 1)}
    losses = {"ours": [], "nanogpt": []}
    for seed in seeds:  # interleaved: ours, nanoGPT, ours, ...
        losses["ours"].append(train_recipe_lm(text, work / f"lm_run{seed}", settings, seed)[1])
        model = nanogpt_train(train, len(vocab), steps, seed, config)
        losses["nanogpt"].append(score_windows(model, val, c["block_size"]))
    figures = {k: summarise(v) for k, v in losses.items()}
    diff = statistics.mean(losses["ours"]) - statistics.mean(losses["nanogpt"])
    shown = "; ".join(f"{name} {', '.join(f'{v:.4f}' for v in values)}" for name, values in losses.items())
    return {"item": f"Language-model quality: ours vs nanoGPT's model and loop, same text, shape (4x128, block 64, "
                    f"batch 12), {steps} steps and optimizer; validation loss on the whole split, nats/char",
            "result": f"{shown} (seeds {', '.join(map(str, seeds))}); ours minus nanoGPT {diff:+.4f}",
            "target": "ours <= nanoGPT + 0.02 nats/char (the seed-to-seed spread)", "met": diff <= 0.02,
            "val_loss": figures, "val_loss_runs": losses, "difference": diff, "steps": steps,
            "text_chars": len(text.read_text(encoding="utf-8"))}


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every item runs")
    parser.add_argument("--mnist-dir", type=Path, default=ROOT / "data" / "MNIST" / "raw",
                        help="folder with the official MNIST test set, t10k-*-ubyte.gz (default: data/MNIST/raw)")
    parser.add_argument("--adult-csv", type=Path, help="the Adult census table as one CSV with a header row")
    parser.add_argument("--only", help="comma-separated item numbers, e.g. 1,4")
    parser.add_argument("--device", type=device_name, default=CPU,
                        help="where the recipes run: cpu (default, also on a GPU machine), cuda, cuda:N, mps")
    args = parser.parse_args()
    if problem := check_device(args.device):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(1)
    DEVICE = args.device
    mnist_dir = args.mnist_dir if (args.mnist_dir / "t10k-images-idx3-ubyte.gz").is_file() else None
    adult_csv = args.adult_csv if args.adult_csv and args.adult_csv.is_file() else None
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        items = {1: lambda: core_overhead(args.quick), 2: lambda: input_pipeline(args.quick, mnist_dir),
                 3: lambda: mnist_vs_examples(args.quick, mnist_dir, work), 4: lambda: transformer(args.quick),
                 5: lambda: mixed_precision(args.quick), 6: lambda: compiled(args.quick, work),
                 7: lambda: ddp(args.quick, work), 8: lambda: tabular(args.quick, adult_csv, work),
                 9: lambda: kv_cache(args.quick), 10: lambda: tabular_scale(args.quick, work),
                 11: lambda: transformer_parallel(args.quick, work), 12: lambda: lm_quality(args.quick, work)}
        chosen = [int(i) for i in args.only.split(",") if i.isdigit()] if args.only else list(items)
        unknown = sorted(set(args.only.split(",")) - {str(i) for i in items}) if args.only else []
        if unknown:
            parser.error(f"argument --only: no item {', '.join(unknown)} (items are {', '.join(map(str, items))})")
        hardware = cpu_hardware()
        if DEVICE.type == "cuda":
            hardware["gpu"] = torch.cuda.get_device_name(DEVICE)
        print(describe_hardware(hardware), file=sys.stderr)
        results = run_items(items, chosen)

    machine = (f"{hardware['cpu_model']} ({platform.machine()}), {os.cpu_count()} cores, torch {torch.__version__}, "
               f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    on_device = f"; recipes on {DEVICE}{' (' + hardware['gpu'] + ')' if 'gpu' in hardware else ''}"
    lines = [f"Measured on: {machine}{on_device}{' (quick mode)' if args.quick else ''}",
             describe_hardware(hardware), "",
             "| # | item | result | target | met |", "|---|---|---|---|---|"]
    for number, r in results.items():
        met = "FAILED" if "error" in r else {True: "yes", False: "no", None: "n/a"}[r["met"]]
        lines.append(f"| {number} | {r['item']} | {r['result']} | {r['target']} | {met} |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "quick": args.quick, "device": str(DEVICE),
                                        "hardware": hardware, "items": {str(k): v for k, v in results.items()}},
                                       indent=2, default=str))
    failed = [f"{number} ({r['error']})" for number, r in results.items() if "error" in r]
    if failed:
        print(f"error: {len(failed)} of {len(results)} items failed: {'; '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
