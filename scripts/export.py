"""Turn a recipe's checkpoint into files a deployment can use without this repository.

    python scripts/export.py runs/mnist_onecycle/.../checkpoints/best.pt exported/mnist
    python scripts/export.py runs/tiny_transformer/.../checkpoints/best.pt exported/gpt --format hf
    python scripts/export.py runs/tiny_transformer/.../checkpoints/dcp/step-000600 exported/gpt --format hf
    python scripts/export.py runs/my_run/.../checkpoints/best.pt exported/mine --recipe my_train.py  # your copy's

CHECKPOINT is a checkpoint file (last.pt, best.pt) or a sharded checkpoint folder (FSDP's ``dcp/step-NNNNNN``, read
into one whole model with common/sharded.py). Its model is rebuilt from ``recipes/NAME.py``'s classes, or from the
script given as ``--recipe`` (a copy of a recipe that you changed, or an ejected one).

``--format graph`` (the default) writes into OUT_DIR:

- ``model.pt2``: a ``torch.export`` program (graph and weights) with a dynamic batch dimension, which
  ``torch.export.load`` runs in any process that has torch, without common/ or the recipe;
- ``model.onnx``: the same graph as ONNX (``torch.onnx.export(..., dynamo=True)``), for onnxruntime and
  other runtimes;
- ``model.json``: what a caller needs besides the graph: the inputs (names, shapes, dtypes), how to prepare
  them (MNIST's size and normalisation, a table's preprocessing, the vocabulary), what the output means,
  ``averaged`` (whether the weights are an ``--ema`` run's moving average), and the agreement check below.

(and ``tokenizer.json`` for a transformer that has a Hugging Face tokenizer, from ``--init-from``).

``--format hf`` (tiny_transformer only) writes a GPT-2 folder in Hugging Face's format, which
``transformers.GPT2LMHeadModel.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load: config.json,
model.safetensors, generation_config.json, tokenizer.json and tokenizer_config.json (common/hf_gpt2.py does the
conversion). ``--format safetensors`` writes the model's state_dict as ``model.safetensors`` (tied weights stored
under each name, so ``model.load_state_dict(safetensors.torch.load_file(...))`` takes it as it is) and the
``model.json`` above.

Before anything is kept, one batch runs through the eager model and what was written (the exported program and
onnxruntime; transformers' GPT-2; the weights read back); the largest difference must be at most 1e-4, else
the export fails. Everything is written into a temporary
folder next to OUT_DIR and renamed at the end: a failed export leaves nothing behind. (Where OUT_DIR is a mount
point, or its parent is read-only, the folder is made inside it, and its files moved in one by one.) One that
``kill -9`` left is removed by the next export to OUT_DIR.

Exit status 0 on success, 2 on a usage error, 1 on any other problem; every error is one line
``error: ...`` on stderr.
"""

import argparse
import contextlib
import glob
import importlib.util
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # common/ from a clone, without installing

import torch
from torch import nn
from torch.export import Dim

from common import hf_gpt2, hf_tokens
from common.checkpoint import load_model_state
from common.cli import RecipeError
from common.data import MNIST_MEAN, MNIST_STD
from scripts import find_lr
from scripts.eject import running

TOLERANCE = 1e-4  # largest difference allowed between eager, torch.export and onnxruntime outputs
EXAMPLE_BATCH, CHECK_BATCH = 3, 5  # two sizes (neither 0 nor 1, which export would specialise): batch stays dynamic


class ExportError(Exception):
    """A problem the user can fix (a foreign checkpoint, an unwritable folder): one line, exit 1."""


@dataclass
class Exportable:
    """What exporting one recipe's model needs: the eager model, named example inputs with their dynamic
    dimensions, a differently shaped batch to check the export on, and the caller's notes for model.json."""

    model: nn.Module
    example: dict[str, torch.Tensor]
    dynamic: dict[str, dict[int, Dim]]
    check: dict[str, torch.Tensor]
    info: dict
    reference: nn.Module | None = None  # the eager model the check compares against, if not ``model`` itself
    files: dict[str, str] = field(default_factory=dict)  # more files to write beside the model: name -> text


def load_recipe(name: str, script: Path | None = None):
    """The module of the script that trained a checkpoint of recipe ``name``, to rebuild its model class: ``script``
    (a copy the user changed, or an ejected one), else this repository's recipes/NAME.py. Recipes are scripts, so
    it is imported by path."""
    if script is None:
        module_name = f"recipe_{name}"
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(module_name, ROOT / "recipes" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        return sys.modules[module_name]
    if script.suffix != ".py":  # (find_lr takes a name too, recipes/NAME.py)
        raise ExportError(f"--recipe {script}: give the path of the Python script that trained the checkpoint")
    try:
        module = find_lr.load_recipe(str(script))
    except find_lr.FinderError as err:
        raise ExportError(f"--recipe {script}: {err}") from None
    if getattr(module, "RECIPE", None) != name:
        raise ExportError(f"--recipe {script} is no copy of {name}, the recipe that trained the checkpoint (its "
                          f"RECIPE is {getattr(module, 'RECIPE', None)!r})")
    return module


# ------------------------------------------------------------------------------------------------------
# One builder per recipe: the model from the checkpoint's own extras, and what its inputs are


BATCH = Dim("batch", min=1)  # any batch: a served model is sent as many rows as come


def mnist_inputs(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    example = {"images": torch.randn(EXAMPLE_BATCH, 1, 28, 28, generator=g)}
    check = {"images": torch.randn(CHECK_BATCH, 1, 28, 28, generator=g)}
    return example, check


MNIST_INFO = {
    "input": {"images": {"shape": ["batch", 1, 28, 28], "dtype": "float32"}},
    "preprocessing": {"size": [28, 28], "channels": 1, "scale": "pixel / 255", "mean": MNIST_MEAN, "std": MNIST_STD,
                      "normalise": "(pixel / 255 - mean) / std",
                      "polarity": "white digit on a black background (invert dark ink on white paper)",
                      "centring": "MNIST fits each digit in 20x20 and puts its centre of mass at the 28x28 frame's"},
    "output": {"logits": {"shape": ["batch", 10], "dtype": "float32",
                          "meaning": "scores of the digits 0-9; softmax gives probabilities"}},
    "classes": list(range(10)),
}


def mnist_onecycle(state: dict, path: Path, recipe) -> Exportable:
    model = recipe.DigitNet(state["config"]["width"])
    load_model_state(model, state["model"], path)
    example, check = mnist_inputs(0)
    return Exportable(model, example, {"images": {0: BATCH}}, check, MNIST_INFO)


def ddp_mlp(state: dict, path: Path, recipe) -> Exportable:
    model = recipe.MLP(state["config"]["hidden"])
    load_model_state(model, state["model"], path)
    example, check = mnist_inputs(0)
    return Exportable(model, example, {"images": {0: BATCH}}, check, MNIST_INFO)


def tabular_mlp(state: dict, path: Path, recipe) -> Exportable:
    spec = state["features"]
    model = recipe.model_from_checkpoint(state, path)  # the numeric embedding's bins are buffers: they travel
    cardinalities = torch.tensor([len(vocabulary) for vocabulary in spec["categorical"].values()], dtype=torch.long)
    g = torch.Generator().manual_seed(0)

    def batch(n: int) -> dict[str, torch.Tensor]:
        categorical = (torch.rand(n, len(cardinalities), generator=g) * cardinalities).long()  # valid indices
        return {"numeric": torch.randn(n, len(spec["numeric"]), generator=g), "categorical": categorical}

    classification = spec["task"] == "classification"
    n_num, n_cat = len(spec["numeric"]), len(spec["categorical"])
    info = {
        "input": {"numeric": {"shape": ["batch", n_num], "dtype": "float32", "columns": list(spec["numeric"])},
                  "categorical": {"shape": ["batch", n_cat], "dtype": "int64", "columns": list(spec["categorical"])}},
        # The preprocessing as data: enough to encode new rows in any language.
        "preprocessing": {
            "numeric": "(value - mean) / std per column, in the order of 'columns', clipped to "
                       f"+-{recipe.FAR}; a missing value is 0, and so is inf or a cell that is not a number",
            "categorical": "the value, stripped of surrounding whitespace, as its index in the column's "
                           "vocabulary; 0 a value never seen in training, 1 a missing one: empty, or one of "
                           "'missing_values' once lower-cased ('NA' and 'Null' too)",
            "missing_values": sorted(recipe.MISSING.to_pylist()),
            "features": spec,
        },
        "output": ({"logits": {"shape": ["batch", len(spec["classes"])], "dtype": "float32",
                               "meaning": "scores of 'classes'; softmax gives probabilities"}}
                   if classification else
                   {"prediction": {"shape": ["batch"], "dtype": "float32",
                                   "meaning": "standardised target: prediction * target_std + target_mean"}}),
    }
    if classification:
        info["classes"] = spec["classes"]
    else:
        info["target_mean"], info["target_std"] = spec["target_mean"], spec["target_std"]
    return Exportable(model, batch(EXAMPLE_BATCH), {"numeric": {0: BATCH}, "categorical": {0: BATCH}},
                      batch(CHECK_BATCH), info)


def tiny_transformer(state: dict, path: Path, recipe) -> Exportable:
    config = recipe.saved_model_config(state, path)  # a damaged shape or setting is one line
    reference = recipe.GPT(config)
    load_model_state(reference, state["model"], path)
    # The graph always uses SDPA: the einsum path is the same math written out (for the lesson), but its
    # slice of the mask buffer, causal_mask[:T, :T], cannot be traced with T dynamic up to block_size.
    # The check below compares the export with the checkpoint's own attention all the same.
    model = recipe.GPT(replace(config, attention="sdpa"))
    model.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(0)
    # The sequence length is dynamic too, from 1 to block_size (the model has no positions beyond it).
    # Example and check lengths differ, so neither gets baked into the graph.
    tokens = Dim("tokens", min=1, max=config.block_size)
    example = {"idx": torch.randint(config.vocab_size, (EXAMPLE_BATCH, max(2, config.block_size // 2)), generator=g)}
    check = {"idx": torch.randint(config.vocab_size, (CHECK_BATCH, config.block_size), generator=g)}
    tokenizer = state.get("tokenizer")  # a Hugging Face tokenizer's JSON (--init-from), written as tokenizer.json
    hf_tokens.checkpoint_vocab(state)  # a damaged tokenizer or vocabulary is refused, not copied
    info = {
        "input": {"idx": {"shape": ["batch", "tokens"], "dtype": "int64", "max_tokens": config.block_size}},
        # None: byte-level, token t is the byte t (0-255); else token t is the character vocab[t]; with a
        # "tokenizer" entry, that file's tokenizer (tokenizers.Tokenizer.from_file) gives the tokens
        "vocab": state["vocab"],
        **({"tokenizer": "tokenizer.json"} if tokenizer else {}),
        "vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "model_config": state["model_config"],
        "exported_attention": "sdpa",
        "output": {"logits": {"shape": ["batch", "tokens", config.vocab_size], "dtype": "float32",
                              "meaning": "scores of the next token at every position; sample from the last"}},
    }
    return Exportable(model, example, {"idx": {0: BATCH, 1: tokens}}, check, info, reference,
                      {"tokenizer.json": tokenizer} if tokenizer else {})


def synthetic_mlp(n_features: int) -> dict:
    return {
        "input": {"x": {"shape": ["batch", n_features], "dtype": "float32"}},
        "preprocessing": {"note": "the recipe's synthetic data: standard normal features "
                                  "(common/data.py::synthetic_classification)"},
        "output": {"logits": {"shape": ["batch", 10], "dtype": "float32", "meaning": "scores of the 10 classes"}},
        "classes": list(range(10)),
    }


def mlp_inputs(n_features: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    return ({"x": torch.randn(EXAMPLE_BATCH, n_features, generator=g)},
            {"x": torch.randn(CHECK_BATCH, n_features, generator=g)})


def mixed_precision(state: dict, path: Path, recipe) -> Exportable:
    config = state["config"]
    model = recipe.MLP(width=config["width"], depth=config["depth"])
    load_model_state(model, state["model"], path)
    example, check = mlp_inputs(784)
    return Exportable(model, example, {"x": {0: BATCH}}, check, synthetic_mlp(784))


def compiled_model(state: dict, path: Path, recipe) -> Exportable:
    config = state["config"]
    model = recipe.GatedMLP(config["width"], config["depth"])
    load_model_state(model, state["model"], path)
    example, check = mlp_inputs(recipe.N_FEATURES)
    return Exportable(model, example, {"x": {0: BATCH}}, check, synthetic_mlp(recipe.N_FEATURES))


BUILDERS = {f.__name__: f for f in (mnist_onecycle, ddp_mlp, tabular_mlp, tiny_transformer, mixed_precision,
                                    compiled_model)}


# ------------------------------------------------------------------------------------------------------
# Reading the checkpoint, exporting, checking


def read_checkpoint(path: Path) -> dict:
    """The checkpoint's dict, loaded safely (weights_only); any problem is one ExportError."""
    if path.is_dir() and (path / ".metadata").is_file() and (path / "trainer.pt").is_file():
        return read_sharded(path)
    if not path.is_file():
        raise ExportError(f"checkpoint {path} does not exist" if not path.exists() else
                          f"{path} is not a file (nor a sharded checkpoint folder with .metadata and trainer.pt)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        code = re.search(r"GLOBAL (\S+)", str(err))
        reason = (f"it refers to Python code ({code.group(1)}) that safe loading refuses to run" if code
                  else "it is corrupt, truncated, or not a PyTorch checkpoint")
        raise ExportError(f"cannot load checkpoint {path}: {reason}") from None
    if isinstance(state, dict) and "model" not in state and (path.parent / ".metadata").is_file():
        raise ExportError(f"{path} holds a sharded checkpoint's training state, not its weights: pass its folder, "
                          f"{path.parent}")
    if not isinstance(state, dict) or "model" not in state or not isinstance(state.get("recipe"), str) or \
            state["recipe"] not in BUILDERS:  # (a list for a name was a TypeError: unhashable)
        raise ExportError(f"{path} is not a checkpoint of a recipe of this project "
                          f"(one of {', '.join(sorted(BUILDERS))})")
    return state


def read_sharded(path: Path) -> dict:
    """A sharded (DCP) checkpoint folder as the single file's dict: common.sharded.to_single_file writes the whole
    model into a temporary file, which is read and removed again."""
    from common.sharded import raise_if_interrupted, to_single_file

    try:
        trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception:
        raise ExportError(f"cannot load {path / 'trainer.pt'}: it is corrupt or not a checkpoint") from None
    recipe = trainer.get("recipe") if isinstance(trainer, dict) else None
    if not isinstance(recipe, str) or recipe not in BUILDERS:
        raise ExportError(f"{path} is not a checkpoint of a recipe of this project (one of "
                          f"{', '.join(sorted(BUILDERS))})")
    with tempfile.TemporaryDirectory(prefix="export-dcp-") as tmp:
        try:
            with quiet():
                to_single_file(path, Path(tmp) / "checkpoint.pt", recipe)
        except RecipeError as err:
            raise ExportError(str(err)) from None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's error for a damaged shard (its CheckpointException is a BaseException)
            raise_if_interrupted(err)
            reason = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
            raise ExportError(f"cannot read the sharded checkpoint {path}: {reason}") from None
        return read_checkpoint(Path(tmp) / "checkpoint.pt")


@contextlib.contextmanager
def quiet():
    """torch.onnx.export reports its progress on stdout and warns about things that are fine here."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def export(exportable: Exportable, out: Path) -> dict[str, float]:
    """Write model.pt2 and model.onnx into ``out``; returns the largest differences from the eager model."""
    model, names = exportable.model.eval(), list(exportable.example)
    example = tuple(exportable.example.values())
    dynamic = tuple(exportable.dynamic[name] for name in names)
    with quiet():
        program = torch.export.export(model, example, dynamic_shapes=dynamic)
        # into memory first: a failed write (a full disk) inside torch.export.save aborts the process in C++
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        (out / "model.pt2").write_bytes(buffer.getvalue())
        # From the exported program: the ONNX graph is the same one, not a second trace of the model.
        # external_data=False: one self-contained file (these models are far below ONNX's 2 GB limit).
        torch.onnx.export(program, example, out / "model.onnx", dynamo=True, external_data=False,
                          input_names=names, output_names=list(exportable.info["output"]), verbose=False)

    check = tuple(exportable.check.values())
    with torch.no_grad():
        eager = (exportable.reference or model).eval()(*check)
        exported = torch.export.load(out / "model.pt2").module()(*check)  # the saved file, read back
    import onnxruntime

    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (onnx_out,) = session.run(None, {name: t.numpy() for name, t in zip(names, check, strict=True)})
    return {"torch.export": (exported - eager).abs().max().item(),
            "onnxruntime": (torch.from_numpy(onnx_out) - eager).abs().max().item()}


def export_hf(exportable: Exportable, state: dict, out: Path) -> dict[str, float]:
    """Write a GPT-2 folder into ``out``; returns the largest difference of transformers' logits from the eager
    model's. Loading must find every weight where it belongs: nothing missing, unexpected or of another shape."""
    import transformers

    model = (exportable.reference or exportable.model).eval()
    hf_gpt2.save_folder(out, model.state_dict(), state["model_config"], hf_tokens.checkpoint_vocab(state))
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # its notes and progress bars; what matters is in `loading`
    transformers.logging.disable_progress_bar()
    try:
        with quiet():
            hf, loading = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
    if wrong := {kind: sorted(keys)[:3] for kind, keys in loading.items() if keys}:
        raise ExportError(f"transformers does not load the written GPT-2 folder as it is: {wrong}")
    check = tuple(exportable.check.values())
    with torch.no_grad():
        difference = (hf.eval()(*check).logits - model(*check)).abs().max().item()
    return {"transformers": difference}


def export_safetensors(exportable: Exportable, out: Path, recipe: str) -> dict[str, float]:
    """Write the model's state_dict as model.safetensors; returns the largest difference of the file read back."""
    from safetensors.torch import load_file, save

    state = (exportable.reference or exportable.model).state_dict()
    # safetensors stores no tensor twice: a tied weight (the transformer's lm_head.weight is wte.weight) gets a copy
    # under each of its names, so the file is the state_dict as load_state_dict takes it (which ties them again)
    tensors = {key: value.detach().cpu().clone().contiguous() for key, value in state.items()}
    # written by Python, not by safetensors' Rust: a full disk is then an OSError, said as for the other formats
    (out / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt", "recipe": recipe}))
    read = load_file(out / "model.safetensors")
    if read.keys() != state.keys():
        return {"safetensors": math.inf}
    return {"safetensors": max((read[k].double() - state[k].double()).abs().max().item() for k in state)}


# every file an export writes: what --overwrite may replace; and its folder before it is put in place
TEMPORARY = re.compile(r"\..+\.tmp(\.old)?")
EXPORT_FILES = {"model.pt2", "model.onnx", "model.json", "model.safetensors", "tokenizer.json", "config.json",
                "generation_config.json", "tokenizer_config.json"}
FORMATS = {"graph": "model.pt2, model.onnx, model.json", "hf": "a GPT-2 folder for transformers",
           "safetensors": "model.safetensors, model.json"}


def export_checkpoint(checkpoint: Path, out_dir: Path, overwrite: bool = False, format: str = "graph",
                      script: Path | None = None) -> dict:
    """Export ``checkpoint`` into ``out_dir`` (written whole or not at all) in ``format`` (see FORMATS), its model
    rebuilt by ``script`` (see load_recipe); returns model.json's contents (for ``hf``, the same facts, not written)."""
    if out_dir.is_symlink():  # the folder it names is replaced; the link stays
        out_dir = Path(os.path.realpath(out_dir))
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"OUT_DIR {out_dir} is a file, not a folder")
    # --overwrite replaces an earlier export (only files an export writes), never a run, a checkpoint or a project
    foreign = out_dir.is_dir() and next((p for p in out_dir.iterdir() if not (  # (or an export's own folder)
        p.is_file() and p.name in EXPORT_FILES or p.is_dir() and TEMPORARY.fullmatch(p.name))), None)
    # (realpath, not resolve(): a link that names itself is a RuntimeError there, and an error below here)
    if foreign or (overwrite and Path(os.path.realpath(out_dir)) in Path(os.path.realpath(checkpoint)).parents):
        raise ExportError(f"OUT_DIR {out_dir} holds {foreign or checkpoint}, which no export writes: --overwrite "
                          "replaces an earlier export only; choose a new folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"OUT_DIR {out_dir} already holds an export; choose a new folder or add --overwrite")
    state = read_checkpoint(checkpoint)
    recipe = state["recipe"]
    if format == "hf" and recipe != "tiny_transformer":
        raise ExportError(f"--format hf writes GPT-2 folders, for tiny_transformer checkpoints; {checkpoint} is "
                          f"{recipe}'s: use --format graph or safetensors")
    module = load_recipe(recipe, script)
    try:
        exportable = BUILDERS[recipe](state, checkpoint, module)
    except (RecipeError, getattr(module, "RecipeError", RecipeError)) as err:  # load_model_state: weights that do
        raise ExportError(str(err)) from None  # not fit the model (an ejected copy has a RecipeError of its own)
    except (KeyError, TypeError, AttributeError) as err:  # (AttributeError: a config that is no dict, say)
        raise ExportError(f"{checkpoint} lacks what rebuilding its {recipe} model needs ({err})") from None
    except (ValueError, RuntimeError) as err:  # a negative width, say
        raise ExportError(f"{checkpoint} is damaged: its {recipe} model cannot be rebuilt ({err})") from None
    tensors = (exportable.reference or exportable.model).state_dict().items()  # batch norm's statistics too
    if unfinite := next((k for k, v in tensors if v.is_floating_point() and not v.isfinite().all()), None):
        raise ExportError(f"{checkpoint} is damaged: its model's {unfinite} holds NaN or inf; nothing was exported")

    remove_abandoned(out_dir.absolute())
    created = make_parents(out_dir)
    try:
        tmp = Path(tempfile_dir(out_dir.absolute()))  # beside it (for ".", in the folder above), or in it
    except OSError as err:
        remove_empty(created)
        raise ExportError(f"cannot write to {out_dir.absolute().parent}: {err.strerror}") from None
    try:
        try:
            for name, text in exportable.files.items():
                (tmp / name).write_text(text, encoding="utf-8")
            if format == "hf":
                differences = export_hf(exportable, state, tmp)
            elif format == "safetensors":
                differences = export_safetensors(exportable, tmp, recipe)
            else:
                differences = export(exportable, tmp)
        except ImportError as err:
            what = f"{err.name} is not installed" if err.name else (str(err).strip().splitlines() or  # a version check
                                                                    ["a library failed to import"])[0]
            raise ExportError(f"{what}: pip install -r requirements.txt") from None
        except OSError as err:
            raise ExportError(f"cannot write {out_dir}: {err.strerror or err}") from None
        except Exception as err:  # torch.export or the ONNX converter cannot handle the model
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ExportError(f"exporting the {recipe} model failed: {first}") from None
        worst = max(differences.values(), key=lambda d: math.inf if math.isnan(d) else d)  # (max() passes a nan by)
        if not worst <= TOLERANCE:  # also catches nan
            each = ", ".join(f"{name} {value:.3g}" for name, value in differences.items())
            raise ExportError(f"the exported {recipe} model disagrees with the checkpoint's: largest difference "
                              f"{worst:.3g} ({each}), tolerance {TOLERANCE:g}")
        files = {"graph": {"torch.export": "model.pt2", "onnx": "model.onnx"},
                 "safetensors": {"safetensors": "model.safetensors"}, "hf": {"transformers": "."}}[format]
        if format != "hf":  # the tokenizer of a transformer that has one, beside the model
            files |= {Path(name).stem: name for name in exportable.files}
        info = {"recipe": recipe, "source": str(checkpoint), "step": state.get("step"),
                "averaged": bool(state.get("averaged")),  # best.pt of an --ema run: the weights' moving average
                "torch_version": torch.__version__, "format": format, "files": files, **exportable.info,
                "check": {"batch": CHECK_BATCH, "tolerance": TOLERANCE, "max_abs_diff": differences}}
        try:
            text = json.dumps(info, indent=2) + "\n"
        except (TypeError, ValueError) as err:  # a damaged checkpoint's step or preprocessing: a tensor, say
            raise ExportError(f"{checkpoint} is damaged: what model.json would say of it is no JSON ({err})") from None
        try:
            if format != "hf":  # a GPT-2 folder holds Hugging Face's files only
                (tmp / "model.json").write_text(text)
            umask = os.umask(0)
            os.umask(umask)
            for path in tmp.iterdir():  # safetensors writes its files private; the export is ordinary files
                os.chmod(path, 0o666 & ~umask)
        except OSError as err:  # a full disk, say
            raise ExportError(f"cannot write {out_dir}: {err.strerror or err}") from None
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(created)
        raise
    return info


def make_parents(out_dir: Path) -> list[Path]:
    """Create the missing folders above ``out_dir``; returns them, so that a failed export removes them again."""
    missing = [p for p in out_dir.absolute().parents if not p.exists()][::-1]  # from the top down
    blocked = next((p for p in out_dir.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ExportError(f"cannot write {out_dir}: {blocked} is a file, not a folder")
    created = []
    try:
        for folder in missing:
            if not folder.exists():  # "new/../out": new/.. is there once new is
                folder.mkdir()
                created.append(folder)
    except OSError as err:
        remove_empty(created)
        raise ExportError(f"cannot write {out_dir}: {err.strerror}") from None
    return created


def remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()


def remove_abandoned(out_dir: Path) -> None:
    """Remove the temporary folders of exports to ``out_dir`` that were killed mid-way (SIGKILL, the OOM killer),
    named for their process (.NAME.PID.xxxxxxxx.tmp) and so known once it is gone. Never an .old folder: that holds
    an earlier export, set aside while it was being replaced."""
    name = out_dir.name[:40]
    for folder in (out_dir.parent, out_dir) if out_dir.is_dir() else (out_dir.parent,):
        for tmp in folder.glob(f".{glob.escape(name)}.*.tmp"):
            pid = tmp.name[len(name) + 2:].split(".")[0]
            if pid.isdecimal() and tmp.is_dir() and not tmp.is_symlink() and not running(int(pid)):
                shutil.rmtree(tmp, ignore_errors=True)


def tempfile_dir(out_dir: Path) -> str:
    """A fresh folder on ``out_dir``'s mount, so that putting the export in place is renames: beside it (one rename
    replaces the folder), or in it where it is a mount point of its own or its parent is not writable (a volume
    of a container, say; its files then move in one by one)."""
    prefix = f".{out_dir.name[:40]}.{os.getpid()}."  # the process's: a folder whose process is gone is abandoned
    try:
        beside = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=out_dir.parent))
    except OSError:
        if not out_dir.is_dir():
            raise
        beside = None  # a parent not writable
    if beside is not None and out_dir.is_dir():  # a mount point (a bind mount too) takes no rename from outside:
        try:  # tried while the folder is empty
            os.rename(beside, out_dir / beside.name)
            os.rename(out_dir / beside.name, beside)
        except OSError:
            for folder in (beside, out_dir / beside.name):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            beside = None
    path = beside or Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=out_dir))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary folder
    return str(path)


@contextlib.contextmanager
def stops_held_off():
    """Ctrl-C and SIGTERM are ignored while the export is put in place: between its renames a stop would leave
    OUT_DIR empty or half replaced. By the end the export is whole, or an error says why not."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    handlers = [signal.signal(signum, signal.SIG_IGN) for signum in stops]
    try:
        yield
    finally:
        for signum, handler in zip(stops, handlers, strict=True):
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def replace_dir(new: Path, out_dir: Path) -> None:
    """Put the finished folder ``new`` at ``out_dir``; an earlier export there is removed only afterwards."""
    with stops_held_off():
        replace_dir_now(new, out_dir)


def replace_dir_now(new: Path, out_dir: Path) -> None:
    try:
        if out_dir.is_dir() and any(out_dir.iterdir()):
            old = new.with_name(new.name + ".old")
            try:
                os.replace(out_dir, old)
            except OSError:  # "." cannot be renamed: its earlier export is replaced file by file
                return move_files(new, out_dir)
            try:
                os.replace(new, out_dir)
            except OSError:
                if new.exists():
                    os.replace(old, out_dir)  # the earlier export stays
                else:
                    shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(new, out_dir)  # a rename over an empty folder (or none) is one step
            except OSError:
                if not out_dir.is_dir():
                    raise
                move_files(new, out_dir)  # "." (an empty folder that cannot be renamed)
    except OSError as err:  # a mount point, say: a folder that cannot be renamed
        raise ExportError(f"cannot replace {out_dir}: {err.strerror or err}; choose a new folder") from None


def move_files(new: Path, out_dir: Path) -> None:
    """The files of ``new`` into ``out_dir``, a folder that cannot be renamed ("."): an earlier export's files move
    aside first, and come back if a move fails; anything else in the folder stays."""
    aside = new.with_name(new.name + ".old")
    aside.mkdir()
    earlier = [path.name for path in out_dir.iterdir() if path.name in EXPORT_FILES and path.is_file()]
    moved = []
    try:
        for name in earlier:
            os.replace(out_dir / name, aside / name)
        for path in new.iterdir():
            os.replace(path, out_dir / path.name)
            moved.append(path.name)
    except OSError:  # the earlier export as it was (if even that fails, it stays in ``aside``)
        for name in moved:
            os.replace(out_dir / name, new / name)
        for path in aside.iterdir():
            os.replace(path, out_dir / path.name)
        aside.rmdir()
        raise
    shutil.rmtree(aside)
    new.rmdir()


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's, ``timeout``'s) as Ctrl-C: the temporary folder goes on the way out, as it did not."""


def terminate(signum, frame) -> None:
    raise Terminated


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block; exit 2 like every usage error
        print(f"error: {message} (usage: python scripts/export.py CHECKPOINT OUT_DIR)", file=sys.stderr)
        sys.exit(2)


def given_path(value: str) -> Path:
    """A path argument; an empty one (an unset shell variable, say) is refused rather than read as '.'."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; give a path")
    return Path(value)


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # a path an ASCII-only terminal cannot show prints as \xfc, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = Parser(prog="scripts/export.py", description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=given_path, help="a checkpoint of any recipe, e.g. .../checkpoints/best.pt, "
                        "or a sharded checkpoint folder (.../checkpoints/dcp/step-NNNNNN)")
    parser.add_argument("out_dir", type=given_path, help="the folder to write the export into")
    parser.add_argument("--format", choices=list(FORMATS), default="graph",
                        help="graph: model.pt2 (torch.export), model.onnx and model.json (default); hf: a Hugging Face "
                             "GPT-2 folder (tiny_transformer); safetensors: the state_dict and model.json")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT_DIR")
    parser.add_argument("--recipe", type=given_path, metavar="SCRIPT.py", help="the script that trained CHECKPOINT, "
                        "if not this repository's recipes/NAME.py: your changed copy, or an ejected one (the model "
                        "is rebuilt from its classes)")
    args = parser.parse_args(argv)
    try:
        info = export_checkpoint(args.checkpoint, args.out_dir, args.overwrite, args.format, args.recipe)
    except ExportError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # the export's temporary folder is removed on the way out
        terminated = isinstance(err, Terminated)
        print(f"error: {'terminated' if terminated else 'interrupted'}; {args.out_dir} left as it was", file=sys.stderr)
        return 143 if terminated else 130
    diff = info["check"]["max_abs_diff"]
    built = args.recipe or Path("recipes") / f"{info['recipe']}.py"  # (a changed copy's is not: --recipe)
    print(f"{info['recipe']}, the model of {built}: eager vs "
          + ", vs ".join(f"{name} max difference {value:.2e}" for name, value in diff.items())
          + f" (batch {CHECK_BATCH}, tolerance {TOLERANCE:g})")
    written = FORMATS["hf"] if args.format == "hf" else ", ".join([*info["files"].values(), "model.json"])
    print(f"done: exported {args.checkpoint} to {args.out_dir} ({written})")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, terminate)
    sys.exit(main())
