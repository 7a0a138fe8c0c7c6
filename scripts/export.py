"""Turn a recipe's checkpoint into files a deployment can use without this repository.

    python scripts/export.py runs/mnist_onecycle/.../checkpoints/best.pt exported/mnist

writes into OUT_DIR:

- ``model.pt2``: a ``torch.export`` program (graph and weights) with a dynamic batch dimension, which
  ``torch.export.load`` runs in any process that has torch, without common/ or the recipe;
- ``model.onnx``: the same graph as ONNX (``torch.onnx.export(..., dynamo=True)``), for onnxruntime and
  other runtimes;
- ``model.json``: what a caller needs besides the graph: the inputs (names, shapes, dtypes), how to prepare
  them (MNIST's size and normalisation, a table's preprocessing, the vocabulary), what the output means,
  and the agreement check below.

Before anything is kept, one batch runs through the eager model, the exported program and onnxruntime; the
largest difference must be at most 1e-4, else the export fails. Everything is written into a temporary
folder next to OUT_DIR and renamed at the end: a failed export leaves nothing behind.

Exit status 0 on success, 2 on a usage error, 1 on any other problem; every error is one line
``error: ...`` on stderr.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # common/ from a clone, without installing

import torch
from torch import nn
from torch.export import Dim

from common.checkpoint import load_model_state
from common.cli import RecipeError
from common.data import MNIST_MEAN, MNIST_STD

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


def load_recipe(name: str):
    """A recipe's module: recipes are scripts, so import it by path (only to rebuild its model class)."""
    module_name = f"recipe_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


# ------------------------------------------------------------------------------------------------------
# One builder per recipe: the model from the checkpoint's own extras, and what its inputs are


BATCH = Dim("batch", min=1, max=65536)


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
                      "centring": "MNIST centres each digit's 20x20 bounding box in the 28x28 frame"},
    "output": {"logits": {"shape": ["batch", 10], "dtype": "float32",
                          "meaning": "scores of the digits 0-9; softmax gives probabilities"}},
    "classes": list(range(10)),
}


def mnist_onecycle(state: dict, path: Path) -> Exportable:
    model = load_recipe("mnist_onecycle").DigitNet(state["config"]["width"])
    load_model_state(model, state["model"], path)
    example, check = mnist_inputs(0)
    return Exportable(model, example, {"images": {0: BATCH}}, check, MNIST_INFO)


def ddp_mlp(state: dict, path: Path) -> Exportable:
    model = load_recipe("ddp_mlp").MLP(state["config"]["hidden"])
    load_model_state(model, state["model"], path)
    example, check = mnist_inputs(0)
    return Exportable(model, example, {"images": {0: BATCH}}, check, MNIST_INFO)


def tabular_mlp(state: dict, path: Path) -> Exportable:
    recipe = load_recipe("tabular_mlp")
    spec, config = state["features"], state["config"]
    model = recipe.build_model(spec, config["hidden"], config["depth"], config["dropout"])
    load_model_state(model, state["model"], path)
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
            "numeric": "(value - mean) / std per column, in the order of 'columns'; a missing value is 0",
            "categorical": "the value's index in the column's vocabulary; 0 a value never seen in training, "
                           "1 a missing one",
            "missing_values": sorted(recipe.MISSING.to_pylist()),  # compared lower-case
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


def tiny_transformer(state: dict, path: Path) -> Exportable:
    recipe = load_recipe("tiny_transformer")
    config = recipe.GPTConfig(**state["model_config"])
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
    info = {
        "input": {"idx": {"shape": ["batch", "tokens"], "dtype": "int64", "max_tokens": config.block_size}},
        # None: byte-level, token t is the byte t (0-255); else token t is the character vocab[t]
        "vocab": state["vocab"],
        "vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "model_config": state["model_config"],
        "exported_attention": "sdpa",
        "output": {"logits": {"shape": ["batch", "tokens", config.vocab_size], "dtype": "float32",
                              "meaning": "scores of the next token at every position; sample from the last"}},
    }
    return Exportable(model, example, {"idx": {0: BATCH, 1: tokens}}, check, info, reference)


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


def mixed_precision(state: dict, path: Path) -> Exportable:
    config = state["config"]
    model = load_recipe("mixed_precision").MLP(width=config["width"], depth=config["depth"])
    load_model_state(model, state["model"], path)
    example, check = mlp_inputs(784)
    return Exportable(model, example, {"x": {0: BATCH}}, check, synthetic_mlp(784))


def compiled_model(state: dict, path: Path) -> Exportable:
    recipe = load_recipe("compiled_model")
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
    if not path.is_file():
        raise ExportError(f"checkpoint {path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        code = re.search(r"GLOBAL (\S+)", str(err))
        reason = (f"it refers to Python code ({code.group(1)}) that safe loading refuses to run" if code
                  else "it is corrupt, truncated, or not a PyTorch checkpoint")
        raise ExportError(f"cannot load checkpoint {path}: {reason}") from None
    if not isinstance(state, dict) or "model" not in state or state.get("recipe") not in BUILDERS:
        raise ExportError(f"{path} is not a checkpoint of a recipe of this project "
                          f"(one of {', '.join(sorted(BUILDERS))})")
    return state


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
        torch.export.save(program, out / "model.pt2")
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


def export_checkpoint(checkpoint: Path, out_dir: Path, overwrite: bool = False) -> dict:
    """Export ``checkpoint`` into ``out_dir`` (written whole or not at all); returns model.json's contents."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"OUT_DIR {out_dir} is a file, not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"OUT_DIR {out_dir} already holds files; choose a new folder or add --overwrite")
    state = read_checkpoint(checkpoint)
    recipe = state["recipe"]
    try:
        exportable = BUILDERS[recipe](state, checkpoint)
    except RecipeError as err:  # load_model_state: weights that do not fit the model
        raise ExportError(str(err)) from None
    except (KeyError, TypeError) as err:
        raise ExportError(f"{checkpoint} lacks what rebuilding its {recipe} model needs ({err})") from None

    created = make_parents(out_dir)
    try:
        tmp = Path(tempfile_dir(out_dir))
    except OSError as err:
        remove_empty(created)
        raise ExportError(f"cannot write to {out_dir.parent}: {err.strerror}") from None
    try:
        try:
            differences = export(exportable, tmp)
        except ImportError as err:
            raise ExportError(f"{err.name} is not installed: pip install -r requirements.txt") from None
        except OSError as err:
            raise ExportError(f"cannot write {out_dir}: {err.strerror or err}") from None
        except Exception as err:  # torch.export or the ONNX converter cannot handle the model
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ExportError(f"exporting the {recipe} model failed: {first}") from None
        worst = max(differences.values())
        if not worst <= TOLERANCE:  # also catches nan
            raise ExportError(f"the exported {recipe} model disagrees with the checkpoint's: largest difference "
                              f"{worst:.3g} (torch.export {differences['torch.export']:.3g}, onnxruntime "
                              f"{differences['onnxruntime']:.3g}), tolerance {TOLERANCE:g}")
        info = {"recipe": recipe, "source": str(checkpoint), "step": state.get("step"),
                "torch_version": torch.__version__, "files": {"torch.export": "model.pt2", "onnx": "model.onnx"},
                **exportable.info,
                "check": {"batch": CHECK_BATCH, "tolerance": TOLERANCE, "max_abs_diff": differences}}
        (tmp / "model.json").write_text(json.dumps(info, indent=2) + "\n")
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


def tempfile_dir(out_dir: Path) -> str:
    """A fresh folder next to ``out_dir``: on the same file system, so the final rename is atomic."""
    path = tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary folder
    return path


def replace_dir(new: Path, out_dir: Path) -> None:
    """Put the finished folder ``new`` at ``out_dir``; an earlier export there is removed only afterwards."""
    if out_dir.is_dir() and any(out_dir.iterdir()):
        old = new.with_name(new.name + ".old")
        os.replace(out_dir, old)
        os.replace(new, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out_dir)  # a rename over an empty folder (or none) is one step


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block; exit 2 like every usage error
        print(f"error: {message} (usage: python scripts/export.py CHECKPOINT OUT_DIR)", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="scripts/export.py", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint of any recipe, e.g. .../checkpoints/best.pt")
    parser.add_argument("out_dir", type=Path, help="the folder to write model.pt2, model.onnx and model.json into")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT_DIR")
    args = parser.parse_args(argv)
    try:
        info = export_checkpoint(args.checkpoint, args.out_dir, args.overwrite)
    except ExportError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    diff = info["check"]["max_abs_diff"]
    print(f"{info['recipe']}: eager vs torch.export max difference {diff['torch.export']:.2e}, "
          f"vs onnxruntime {diff['onnxruntime']:.2e} (batch {CHECK_BATCH}, tolerance {TOLERANCE:g})")
    print(f"done: exported {args.checkpoint} to {args.out_dir} (model.pt2, model.onnx, model.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
