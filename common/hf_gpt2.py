"""GPT-2 in Hugging Face's format, both ways, for recipes/tiny_transformer.py: ``--init-from DIR`` reads a GPT-2
folder (the real ``gpt2``, or one exported here) and ``scripts/export.py --format hf`` writes one.

The recipe's GPT is GPT-2's architecture (learned positions, pre-norm blocks, a tied head, 1/sqrt(d) attention,
LayerNorm eps 1e-5). A model started from scratch has no biases and exact GELU; a folder's model has biases and
GPT-2's ``gelu_new`` (the tanh approximation), which the recipe's ``GPTConfig(bias=True, activation="gelu_new")``
adds. The weights differ only in names and layout: GPT-2's ``Conv1D`` stores (in, out), the recipe's
``nn.Linear`` (out, in), so every matrix of a block is transposed; the fused query-key-value projection is
``c_attn`` both ways. GPT-2 always has biases: an export writes zeros where the recipe has none (they add
nothing), and an import whose biases are all zero (an export of a model without them) gives the recipe's model
without biases, exactly as it was.

Tokens: ``common/hf_tokens.py``. transformers, tokenizers and safetensors are imported inside the functions that
use them: a recipe run that neither reads nor writes a folder never loads them.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from common.cli import RecipeError
from common.hf_tokens import END_OF_TEXT, describe, read_tokenizer, recipe_vocab, tokenizer_for

# GPT-2's activation_function -> the recipe's GPTConfig.activation: exact GELU, or the tanh approximation
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new"}
# A block's modules: the recipe's name -> GPT-2's. The four matrices are Conv1D there, (in, out): transposed.
BLOCK = {"ln_1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "ln_2": "ln_2", "mlp.fc": "mlp.c_fc",
         "mlp.proj": "mlp.c_proj"}
CONV1D = {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}
BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")  # older GPT-2 files also store the causal mask


@dataclass
class Folder:
    """A GPT-2 folder as the recipe uses it: ``shape``, the GPTConfig fields it fixes; ``weights``, a state dict
    of the recipe's GPT; ``vocab``, the recipe's tokens (None: bytes; a string: its characters; else the folder's
    tokenizer, a ``tokenizers.Tokenizer``) and ``vocab_kind`` ("bytes", "chars" or "tokenizer")."""

    path: Path
    shape: dict
    weights: dict
    vocab: object
    vocab_kind: str


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecipeError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    if not isinstance(value, dict):
        raise RecipeError(f"{path} is not a JSON object")
    return value


def read_shape(path: Path) -> dict:
    """The recipe's GPTConfig fields from a folder's config.json; refuses what the recipe's model cannot compute."""
    if not path.is_dir():
        raise RecipeError(f"--init-from {path}: {'is a file, not a folder' if path.exists() else 'no such folder'}")
    if not (path / "config.json").is_file():
        raise RecipeError(f"{path} has no config.json: not a Hugging Face model folder (get one with "
                          "`hf download gpt2 --local-dir gpt2`)")
    config = read_json(path / "config.json")
    named = config.get("architectures")
    architectures = [a for a in named if isinstance(a, str)] if isinstance(named, list) else []
    model_type = config.get("model_type") or ("gpt2" if "GPT2LMHeadModel" in architectures else None)  # or untyped
    if model_type != "gpt2":
        kind = config.get("model_type") or ", ".join(architectures) or "no model_type"
        raise RecipeError(f"{path} holds a model of another kind ({kind}), not GPT-2: --init-from takes GPT-2 folders "
                          "(model_type gpt2)")
    sizes = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")  # whole numbers: int() made 2.5 layers 2
    if unfit := [f"{key} {json.dumps(config[key]) if key in config else 'missing'}" for key in sizes
                 if type(config.get(key)) is not int]:
        raise RecipeError(f"{path / 'config.json'} lacks a GPT-2 setting or holds it in another form: "
                          f"{'; '.join(unfit)} (each must be a whole number)")
    n_layer, n_head, n_embd, n_positions, vocab_size = (config[key] for key in sizes)
    activation = config.get("activation_function", "gelu_new")
    checks = [  # (setting, its value, whether the recipe's GPT computes it, what it computes)
        ("activation_function", activation, isinstance(activation, str) and activation in ACTIVATIONS,
         "one of " + ", ".join(ACTIVATIONS)),
        ("layer_norm_epsilon", eps := config.get("layer_norm_epsilon", 1e-5), eps == 1e-5, "1e-05"),
        ("n_inner", inner := config.get("n_inner"), inner in (None, 4 * n_embd), f"null or {4 * n_embd}"),
        *((key, value := config.get(key, default), value is default, json.dumps(default)) for key, default in (
            ("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
            ("tie_word_embeddings", True)))]
    if unfit := [f"{key} {json.dumps(value)} (it computes {needs})" for key, value, ok, needs in checks if not ok]:
        raise RecipeError(f"{path / 'config.json'} sets what the recipe's GPT does not compute: {'; '.join(unfit)}")
    if min(n_layer, n_head, n_embd, vocab_size) < 1 or n_positions < 2 or n_embd % n_head:
        raise RecipeError(f"{path / 'config.json'}: n_embd {n_embd}, n_head {n_head}, n_layer {n_layer}, n_positions "
                          f"{n_positions}, vocab_size {vocab_size} is no model (n_head must divide n_embd)")
    return {"vocab_size": vocab_size, "block_size": n_positions, "n_layer": n_layer, "n_head": n_head,
            "n_embd": n_embd, "bias": True, "activation": ACTIVATIONS[activation]}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors (or of the files its index names), keys as stored."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise RecipeError(f"{index} has no weight_map (weight names -> file names)")
        files = [path / name for name in sorted(set(weight_map.values()))]
        if missing := [file.name for file in files if not file.exists()]:  # an interrupted download
            raise RecipeError(f"{index} names {missing[0]}, which is missing: download it again")
    else:
        other = sorted(p.name for p in path.glob("*.bin")) or sorted(p.name for p in path.glob("*.h5"))
        raise RecipeError(f"{path} has no model.safetensors{f' (only {other[0]})' if other else ''}: download the "
                          "safetensors weights (`hf download gpt2 --local-dir gpt2` does)")
    tensors = {}
    for file in files:
        try:
            tensors |= load_file(file)
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            reason = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise RecipeError(f"{file} is damaged or not a safetensors file ({reason}); download it again") from None
    return tensors


def recipe_names(n_layer: int):
    """(the recipe's module, GPT-2's, whether its weight is transposed) for every module with a weight and a bias."""
    for i in range(n_layer):
        for ours, theirs in BLOCK.items():
            yield f"blocks.{i}.{ours}", f"transformer.h.{i}.{theirs}", ours in CONV1D
    yield "ln_f", "transformer.ln_f", False


def from_hf(tensors: dict[str, torch.Tensor], shape: dict, source: Path) -> tuple[dict, bool]:
    """GPT-2's tensors (GPT2LMHeadModel's names, with or without ``transformer.``) -> (the recipe's state dict,
    fp32, and whether it needs biases: not when every bias is zero)."""
    named = {key if key.startswith("transformer.") or key == "lm_head.weight" else f"transformer.{key}": key
             for key in tensors if not BUFFER.fullmatch(key.removeprefix("transformer."))}  # ours -> the file's
    given = {name: tensors[key] for name, key in named.items()}
    head = given.pop("lm_head.weight", None)
    state = {name: given.pop(f"transformer.{name}", None) for name in ("wte.weight", "wpe.weight")}
    missing = [f"transformer.{name}" for name, value in state.items() if value is None]
    biases = []
    for ours, theirs, transposed in recipe_names(shape["n_layer"]):
        weight, bias = given.pop(f"{theirs}.weight", None), given.pop(f"{theirs}.bias", None)
        missing += [f"{theirs}.{kind}" for kind, value in (("weight", weight), ("bias", bias)) if value is None]
        if weight is not None and bias is not None:
            state[f"{ours}.weight"] = weight.t() if transposed and weight.dim() == 2 else weight
            state[f"{ours}.bias"] = bias
            biases.append(bias)
    if missing or given:
        unexpected = sorted(named[name] for name in given)  # as the file names them
        problems = [f"{label} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                    for label, keys in (("lacks", missing), ("holds unexpected", unexpected)) if keys]
        raise RecipeError(f"{source}'s weights are not those of its config.json's GPT-2: it {'; '.join(problems)}")
    if head is not None and not (head.shape == state["wte.weight"].shape and torch.equal(head, state["wte.weight"])):
        raise RecipeError(f"{source}'s lm_head.weight differs from wte.weight: the recipe's GPT ties them")
    if spoiled := [k for k, v in tensors.items() if v.is_floating_point() and not v.float().isfinite().all()]:
        raise RecipeError(f"{source} holds inf or nan weights ({', '.join(spoiled[:4])}): a damaged or diverged model")
    state["lm_head.weight"] = state["wte.weight"]
    bias = any(b.any() for b in biases)
    if not bias:  # all zero: the recipe's model without biases, exactly (an export of one)
        state = {k: v for k, v in state.items() if not k.endswith(".bias")}
    return {k: v.float().contiguous() for k, v in state.items()}, bool(bias)


def read_folder(path: Path) -> Folder:
    """A GPT-2 folder, checked and converted (shape, weights, tokens); any problem is one RecipeError saying what."""
    shape = read_shape(path)
    tokenizer = read_tokenizer(path)
    if (top := max(tokenizer.get_vocab().values(), default=0)) >= shape["vocab_size"]:  # ids index wte's rows
        raise RecipeError(f"{path}'s tokenizer has token ids up to {top}, past config.json's vocab_size "
                          f"{shape['vocab_size']}")
    kind, vocab = recipe_vocab(tokenizer)
    weights, shape["bias"] = from_hf(read_tensors(path), shape, path)
    rows = {"wte.weight": shape["vocab_size"], "wpe.weight": shape["block_size"]}  # before a model of that size
    if wrong := [name for name, n in rows.items() if tuple(weights[name].shape) != (n, shape["n_embd"])]:
        raise RecipeError(f"GPT-2 folder {path} does not fit this model (wrong shape: {wrong[0]})")
    return Folder(path, shape, weights, vocab, kind)


def check_options(folder: Folder, **given) -> None:
    """Refuse, as a usage error naming both, an option given explicitly (not None) that contradicts the folder:
    ``vocab``, ``n_layer``, ``n_head``, ``n_embd``, ``block_size``."""
    theirs = {"n_layer": ("n_layer", folder.shape["n_layer"]), "n_head": ("n_head", folder.shape["n_head"]),
              "n_embd": ("n_embd", folder.shape["n_embd"]), "block_size": ("n_positions", folder.shape["block_size"]),
              "vocab": (describe(folder.vocab_kind, folder.vocab), folder.vocab_kind)}
    for name, value in given.items():
        setting, their_value = theirs[name]
        if value is not None and value != their_value:
            option = "--" + name.replace("_", "-")
            raise click.UsageError(f"{option} {value} contradicts {folder.path}'s "
                                   f"{setting if name == 'vocab' else f'{setting} {their_value}'}: leave {option} out "
                                   "(the folder sets it)")


# ------------------------------------------------------------------------------------------------------
# Writing a folder (scripts/export.py --format hf)


def to_hf(state: dict, n_layer: int) -> dict[str, torch.Tensor]:
    """The recipe's state dict -> GPT2LMHeadModel's, Conv1D matrices transposed, zeros for biases the recipe has
    not; lm_head.weight is left out, as save_pretrained leaves out a tied head."""
    tensors = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"]}
    for ours, theirs, transposed in recipe_names(n_layer):
        weight = state[f"{ours}.weight"]
        tensors[f"{theirs}.weight"] = weight.t() if transposed else weight
        tensors[f"{theirs}.bias"] = state.get(f"{ours}.bias", torch.zeros(weight.size(0), dtype=weight.dtype))
    return {key: value.detach().cpu().contiguous() for key, value in tensors.items()}


def hf_config(model_config: dict, tokenizer):
    """The GPT2Config that computes what the recipe's GPTConfig does."""
    from transformers import GPT2Config

    end = tokenizer.token_to_id(END_OF_TEXT)  # GPT-2's <|endoftext|>, if the tokens are GPT-2's
    dropout = model_config.get("dropout", 0.0)
    return GPT2Config(
        vocab_size=model_config["vocab_size"], n_positions=model_config["block_size"], n_embd=model_config["n_embd"],
        n_layer=model_config["n_layer"], n_head=model_config["n_head"], n_inner=None,
        activation_function={"gelu": "gelu", "gelu_new": "gelu_new"}[model_config.get("activation", "gelu")],
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, layer_norm_epsilon=1e-5,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        tie_word_embeddings=True, bos_token_id=end, eos_token_id=end, architectures=["GPT2LMHeadModel"])


def save_folder(out: Path, state: dict, model_config: dict, vocab: object) -> None:
    """Write a GPT-2 folder into ``out`` (an empty folder): config.json, model.safetensors, generation_config.json,
    tokenizer.json and tokenizer_config.json. ``GPT2LMHeadModel.from_pretrained(out)`` and
    ``AutoTokenizer.from_pretrained(out)`` load it."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tokenizer = tokenizer_for(vocab)
    config = hf_config(model_config, tokenizer)
    config.save_pretrained(out)
    save_file(to_hf(state, model_config["n_layer"]), out / "model.safetensors", metadata={"format": "pt"})
    GenerationConfig.from_model_config(config).save_pretrained(out)
    special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT} \
        if tokenizer.token_to_id(END_OF_TEXT) is not None else {}
    # decode gives the text back as it was (no " ." -> "."); no token_type_ids (4.x gives them; GPT-2 would add them)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_config["block_size"],
                            clean_up_tokenization_spaces=False, model_input_names=["input_ids", "attention_mask"],
                            **special).save_pretrained(out)
    # transformers 5 names the class TokenizersBackend, which 4.x does not know; both load PreTrainedTokenizerFast
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
