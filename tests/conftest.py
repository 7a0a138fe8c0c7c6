"""Shared fixtures: small data sets in the real formats, and ways to run a recipe's CLI.

Recipes run in-process where that is enough (fast: torch is imported once) and as real subprocesses
where the process itself is under test (signals, exit codes seen by a shell, torchrun).
"""

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The measured peak FLOP/s is cached per machine under ~/.cache: the tests' own cache, for every process they start
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="torch-recipes-test-cache-")

from benchmarks.mnist_files import write_mnist  # noqa: E402

RECIPES = sorted(path.stem for path in (ROOT / "recipes").glob("*.py"))

# A few-second run of each recipe on small data; "{name}" stands for the value of the fixture `name`.
# Tests that run every recipe (README commands, eject, the bad-input matrix) take their arguments from here,
# so a new recipe fails them until it has an entry.
SMOKE_ARGS = {
    "mnist_onecycle": ["--data-dir", "{mnist_dir}", "--max-steps", "4", "--batch-size", "32"],
    "tabular_mlp": ["--csv", "{table_csv}", "--target", "label", "--epochs", "1", "--batch-size", "32"],
    "tiny_transformer": ["--text", "{corpus_txt}", "--steps", "4", "--eval-every", "4", "--n-layer", "2",
                         "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
                         "--eval-batches", "2", "--sample-tokens", "20", "--peak-flops", "1e11"],
    "mixed_precision": ["--epochs", "1", "--max-steps", "3", "--samples", "256", "--batch-size", "64",
                        "--width", "32", "--depth", "2"],
    "compiled_model": ["--epochs", "1", "--max-steps", "3", "--samples", "512", "--batch-size", "128",
                       "--width", "16", "--depth", "2"],
    "ddp_mlp": ["--data-dir", "{mnist_dir}", "--epochs", "1", "--max-steps", "3", "--batch-size", "32",
                "--hidden", "64"],
}


def smoke_args(name: str, request) -> list[str]:
    """SMOKE_ARGS[name] with its fixture placeholders filled in."""
    if name not in SMOKE_ARGS:
        pytest.fail(f"recipes/{name}.py has no entry in SMOKE_ARGS of tests/conftest.py: add the arguments of a "
                    "few-second run of it there")
    placeholder = re.compile(r"\{(\w+)\}")
    return [str(request.getfixturevalue(m[1])) if (m := placeholder.fullmatch(arg)) else arg
            for arg in SMOKE_ARGS[name]]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def done_line(self) -> str:
        lines = self.stdout.strip().splitlines()
        return lines[-1] if lines else ""


def load_recipe(name: str):
    """Import recipes/NAME.py as a module (recipes are scripts, not a package)."""
    module_name = f"recipe_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@functools.cache
def recipe_options(name: str) -> frozenset[str]:
    """Every flag of recipes/NAME.py's command (--x and --no-x both)."""
    import typer

    app = typer.Typer()
    app.command()(load_recipe(name).main)
    params = typer.main.get_command(app).params
    return frozenset(opt for param in params for opt in [*param.opts, *param.secondary_opts])


@pytest.fixture
def run_inprocess(capsys):
    """Run a recipe's CLI in this process; returns its exit code and captured output."""
    from common.cli import run_recipe

    def run(name: str, *args) -> Result:
        capsys.readouterr()
        try:
            run_recipe(load_recipe(name).main, [str(a) for a in args])
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def run_subprocess(args: list, timeout: float = 300, env: dict | None = None, cwd: Path = ROOT,
                   max_file_bytes: int | None = None) -> Result:
    """Run a command (e.g. ["recipes/x.py", ...] is run with this Python) as a separate process. ``max_file_bytes``:
    no file it writes may grow past this (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write fails as on a full disk)."""
    command = [str(a) for a in args]
    if command[0].endswith(".py"):
        command = [sys.executable, *command]

    def limit_file_size():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})}, preexec_fn=limit_file_size if max_file_bytes else None)
    return Result(proc.returncode, proc.stdout, proc.stderr)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def worker_died_of_a_signal(output: str) -> bool:
    """torchrun's report of a worker killed by a signal, e.g. "Signal 6 (SIGABRT) received by PID 25440"."""
    return re.search(r"Signal \d+ \(SIG\w+\) received by PID", output) is not None


def run_torchrun(args: list, timeout: float = 180) -> Result:
    """``torchrun ARGS`` as a subprocess, with one more try if a worker died of a signal.

    Once in CI a gloo worker aborted (SIGABRT) in a run that otherwise works; it was never reproduced in a
    hundred runs here, loaded or not. One more try (with its ``--run-dir`` emptied, unless it resumes) keeps
    such a rare crash in the transport from failing the suite, and the warning shows its output (Python's
    faulthandler adds the stacks). A run that fails twice, or fails in any other way, still fails the test.
    """
    env = {"PYTHONFAULTHANDLER": "1"}
    result = run_subprocess([*TORCHRUN, *args], timeout=timeout, env=env)
    if result.code != 0 and worker_died_of_a_signal(result.stdout + result.stderr):
        warnings.warn(f"a torchrun worker died of a signal; trying once more:\n{result.stderr[-4000:]}",
                      stacklevel=2)
        words = [str(arg) for arg in args]
        if "--run-dir" in words and "--resume" not in words:  # a resumed run goes on from its last checkpoint
            shutil.rmtree(words[words.index("--run-dir") + 1], ignore_errors=True)
        result = run_subprocess([*TORCHRUN, *args], timeout=timeout, env=env)
    return result


def worker_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (torchrun's workers), from /proc."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{parent}\n" in status.read_text():
                pids.append(int(status.parent.name))
        except OSError:
            pass
    return pids


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run directory's TensorBoard event files, as {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def read_hparams(run_dir: Path) -> tuple[dict, list[str]]:
    """TensorBoard's HParams tab of a run: its hyper-parameters (values with their own types) and metric tags."""
    from google.protobuf.json_format import MessageToDict
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    content = accumulator.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    values = {k: MessageToDict(v) for k, v in start.hparams.items()}  # a protobuf Value: its Python value
    return values, [info.name.tag for info in experiment.metric_infos]


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


# ------------------------------------------------------------------------------------------------------
# Data in the real formats


def synthetic_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learnable fake digits: class k is a bright 8x8 square at a class-specific place, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
    for i, k in enumerate(labels):
        row, col = 2 + (k // 5) * 12, 2 + (k % 5) * 5
        images[i, row : row + 8, col : col + 8] = 255
    return images, labels


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory) -> Path:
    """A --data-dir holding a tiny MNIST (512 train, 200 test digits) as uncompressed IDX files."""
    root = tmp_path_factory.mktemp("mnist")
    write_mnist(root, synthetic_digits(512, seed=1), synthetic_digits(200, seed=2))
    return root


def write_table(path: Path, n: int = 300, seed: int = 0, *, target: bool = True) -> Path:
    """A CSV with numeric, categorical and missing values; the label depends on both kinds of column."""
    rng = np.random.default_rng(seed)
    colours = ["red", "green", "blue", "black"]
    lines = ["age,income,colour,city,label" if target else "age,income,colour,city"]
    for i in range(n):
        age = rng.integers(18, 80)
        income = rng.normal(50, 15)
        colour = colours[rng.integers(0, 4)]
        city = ["Oslo", "Lima", "Pune"][rng.integers(0, 3)]
        label = "yes" if (age > 45) ^ (colour in ("red", "blue")) else "no"
        income_text = "" if i % 17 == 0 else f"{income:.2f}"  # missing numbers
        city = "?" if i % 23 == 0 else city  # missing categories
        lines.append(f"{age},{income_text},{colour},{city}" + (f",{label}" if target else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def table_csv(tmp_path_factory) -> Path:
    return write_table(tmp_path_factory.mktemp("table") / "table.csv")


@pytest.fixture(scope="session")
def corpus_txt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("def forward(self, x):\n    return self.head(self.body(x))  # logits\n" * 40, encoding="utf-8")
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a 256 KB tmpfs (root only; skipped elsewhere): writes there fail with ENOSPC once it fills."""
    disk = tmp_path / "small-disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("no tmpfs can be mounted here")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def tiny_bpe_tokenizer(text: str):
    """A byte-level BPE as GPT-2's, trained on ``text`` with the tokenizers library: the 256 byte characters,
    merges up to 300 tokens, and <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def write_tiny_gpt2(folder: Path, text: str, n_positions: int = 32) -> None:
    """A stand-in for the real gpt2 folder, offline: a tiny random GPT2LMHeadModel as save_pretrained writes it
    (biases and norms random: a fresh model's are 0 and 1; the vocabulary padded past the tokenizer's), and
    ``tiny_bpe_tokenizer(text)`` as its tokenizer.json."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tiny_bpe_tokenizer(text)
    end = tokenizer.token_to_id("<|endoftext|>")
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size() + 4, n_positions=n_positions, n_embd=32, n_layer=2,
                        n_head=4, bos_token_id=end, eos_token_id=end)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
