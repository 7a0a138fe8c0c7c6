"""GPT-2's Hugging Face format, both ways (common/hf_gpt2.py): scripts/export.py --format hf and --format
safetensors, and recipes/tiny_transformer.py --init-from DIR. Every model and tokenizer is built here, offline."""

import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    SMOKE_ARGS,
    assert_same_weights,
    load_recipe,
    load_weights,
    run_subprocess,
    run_torchrun,
    tiny_bpe_tokenizer,
    write_tiny_gpt2,
)
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer, GPT2LMHeadModel

from common import hf_gpt2, hf_tokens
from common.checkpoint import load_model_state
from common.cli import RecipeError, run_recipe
from scripts import export

RECIPE = "tiny_transformer"
tt = load_recipe(RECIPE)
TEXT = ("def forward(self, x):\n    return self.head(self.body(x))  # logits\n"
        "naïve café: 漢字 and 🙂, tabs\tand\r\nnewlines\n") * 30
SHAPE = ["--n-layer", 2, "--n-head", 2, "--n-embd", 32, "--block-size", 16]
RUN = ["--batch-size", 8, "--eval-batches", 2, "--sample-tokens", 12, "--peak-flops", 1e11, "--warmup-steps", 0,
       "--lr", 1e-2, "--precision", "fp32"]  # fp32: the comparisons are exact (auto is bf16 on some CPUs)
TOLERANCE = 1e-5  # fp32 logits, the recipe's against transformers'


def run(*args) -> int:
    """The recipe's CLI in this process (for module fixtures, where run_inprocess cannot be used)."""
    try:
        run_recipe(tt.main, [str(a) for a in args])
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return 0


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "input.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def recipe_model(checkpoint: Path) -> "tt.GPT":
    state = torch.load(checkpoint, weights_only=True)
    model = tt.GPT(tt.GPTConfig(**state["model_config"]))
    load_model_state(model, state["model"], checkpoint)
    return model.eval()


def hf_model(folder: Path) -> GPT2LMHeadModel:
    """transformers' GPT-2 from ``folder``, which must find every weight where it belongs."""
    model, loading = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not any(loading.values()), loading
    return model.eval()


def largest_difference(ours: "tt.GPT", theirs: GPT2LMHeadModel, windows: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return max((theirs(idx).logits - ours(idx)).abs().max().item() for idx in windows)


def windows(model: "tt.GPT", vocab, seed: int = 0) -> list[torch.Tensor]:
    """Random token windows: uniformly random ids, and windows of the text's tokens, full and short."""
    g = torch.Generator().manual_seed(seed)
    size, block = model.config.vocab_size, model.config.block_size
    tokens = tt.encode(TEXT.encode(), vocab).long()
    starts = torch.randint(len(tokens) - block, (6,), generator=g)
    return [torch.randint(size, (4, block), generator=g), torch.randint(size, (3, 5), generator=g),
            torch.randint(size, (1, 1), generator=g), torch.stack([tokens[s : s + block] for s in starts])]


# ------------------------------------------------------------------------------------------------------
# Export: a recipe model, trained a few steps, as a GPT-2 folder


@pytest.fixture(scope="module")
def trained(text_file, tmp_path_factory) -> dict[str, Path]:
    """vocab kind -> the last.pt of a few steps of the recipe (einsum attention for the characters)."""
    paths = {}
    for kind, extra in [("bytes", []), ("chars", ["--vocab", "chars", "--attention", "einsum"])]:
        run_dir = tmp_path_factory.mktemp(f"trained_{kind}") / "run"
        assert run("--text", text_file, *SHAPE, *RUN, *extra, "--steps", 4, "--eval-every", 4, "--run-dir",
                   run_dir) == 0
        paths[kind] = run_dir / "checkpoints" / "last.pt"
    return paths


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exported")
    for kind, checkpoint in trained.items():
        assert export.main([str(checkpoint), str(root / kind), "--format", "hf"]) == 0
    return {kind: root / kind for kind in trained}


@pytest.mark.parametrize("kind", ["bytes", "chars"])
def test_the_exported_folder_loads_without_a_warning_and_gives_the_recipes_logits(kind, trained, exported, capfd):
    folder = exported[kind]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]
    capfd.readouterr()
    theirs = hf_model(folder)
    said = capfd.readouterr()
    for word in ("missing", "unexpected", "newly initialized", "not used", "mismatch"):
        assert word not in (said.out + said.err).lower(), said
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {(folder / "config.json").stat().st_mode & 0o777}
    config = json.loads((folder / "config.json").read_text())
    assert config["activation_function"] == "gelu" and config["layer_norm_epsilon"] == 1e-5  # exact GELU, nn's eps
    assert config["n_positions"] == 16 and config["tie_word_embeddings"] is True and config["model_type"] == "gpt2"
    biases = {k: v for k, v in load_file(folder / "model.safetensors").items() if k.endswith(".bias")}
    assert len(biases) == 2 * 6 + 1 and all(not v.any() for v in biases.values())  # zeros where the recipe has none
    ours = recipe_model(trained[kind])
    vocab = torch.load(trained[kind], weights_only=True)["vocab"]
    difference = largest_difference(ours, theirs, windows(ours, vocab))
    print(f"{kind}: largest logit difference {difference:.2e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize("kind", ["bytes", "chars"])
def test_greedy_generation_in_transformers_gives_the_recipes_tokens(kind, trained, exported):
    ours, theirs = recipe_model(trained[kind]), hf_model(exported[kind])
    vocab = torch.load(trained[kind], weights_only=True)["vocab"]
    prompt = tt.encode(b"def ", vocab).long()[None]
    new = ours.config.block_size - prompt.size(1)  # up to a full block: both see the same context
    expected = ours.generate(prompt, new, top_k=1)
    got = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=0)
    assert got.tolist() == expected.tolist()


def test_the_tokenizers_output_is_the_models_input(trained, exported):
    """model(**tokenizer(text)), as transformers' examples write it: transformers 4.x's PreTrainedTokenizerFast also
    returns token_type_ids unless the folder names the model's inputs, and GPT-2 adds their embedding to every
    position (logits 0.03 off, another greedy token)."""
    folder = exported["bytes"]
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_input_names"] == ["input_ids",
                                                                                            "attention_mask"]
    encoded = AutoTokenizer.from_pretrained(folder)("def forward(self", return_tensors="pt")
    assert sorted(encoded.keys()) == ["attention_mask", "input_ids"]
    with torch.no_grad():
        theirs = hf_model(folder)(**encoded).logits
        ours = recipe_model(trained["bytes"])(encoded["input_ids"])
    assert (theirs - ours).abs().max() <= TOLERANCE


@pytest.mark.parametrize("kind", ["bytes", "chars"])
def test_the_exported_tokenizer_round_trips_text_as_the_recipe_tokenizes_it(kind, trained, exported):
    tokenizer = AutoTokenizer.from_pretrained(exported[kind])
    vocab = torch.load(trained[kind], weights_only=True)["vocab"]
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == tt.encode(TEXT.encode(), vocab).tolist()
    assert tokenizer.decode(ids) == TEXT == tt.decode(ids, vocab)
    # and read back here, the folder is the recipe's own tokens again, and its exact weights
    folder = hf_gpt2.read_folder(exported[kind])
    assert (folder.vocab_kind, folder.vocab) == (kind, vocab)
    assert folder.shape["bias"] is False and folder.shape["activation"] == "gelu"
    assert_same_weights(folder.weights, load_weights(trained[kind]))


# ------------------------------------------------------------------------------------------------------
# Import: a tiny random GPT-2 (biases, gelu_new) with a BPE tokenizer trained here


def bpe_tokenizer() -> Tokenizer:
    return tiny_bpe_tokenizer(TEXT)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    write_tiny_gpt2(folder, TEXT)
    return folder


def copy_of(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def test_init_from_starts_from_the_folders_logits(gpt2_dir, text_file, run_inprocess, tmp_path, monkeypatch):
    """The first forward pass of the run (its first micro-batch, before any step) is transformers' to 1e-5."""
    first = {}
    forward = tt.GPT.forward

    def recording(self, idx, caches=None):
        logits = forward(self, idx, caches)
        if not first:
            first.update(idx=idx.detach().clone(), logits=logits.detach().clone())
        return logits

    monkeypatch.setattr(tt.GPT, "forward", recording)
    result = run_inprocess(RECIPE, "--init-from", gpt2_dir, "--text", text_file, *RUN, "--steps", 1,
                           "--n-layer", 2, "--run-dir", tmp_path / "run")  # an option that agrees is fine
    assert result.code == 0, result.stderr
    with torch.no_grad():
        expected = hf_model(gpt2_dir)(first["idx"]).logits
    difference = (first["logits"] - expected).abs().max().item()
    print(f"largest logit difference before the first step {difference:.2e}")
    assert first["idx"].shape == (8, 32) and difference <= TOLERANCE
    assert "val_bits_per_token=" in result.done_line
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["model_config"] == {"vocab_size": bpe_tokenizer().get_vocab_size() + 4, "block_size": 32,
                                     "n_layer": 2, "n_head": 4, "n_embd": 32, "dropout": 0.0, "attention": "sdpa",
                                     "bias": True, "activation": "gelu_new"}
    assert state["vocab"] is None and Tokenizer.from_str(state["tokenizer"]).encode(TEXT).ids == \
        bpe_tokenizer().encode(TEXT).ids
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["init_from"] == str(gpt2_dir) and config["n_layer"] == 2 and config["n_embd"] is None


def test_init_from_trains_resumes_exactly_without_the_folder_and_exports_back(gpt2_dir, text_file, run_inprocess,
                                                                              tmp_path):
    folder = copy_of(gpt2_dir, tmp_path / "gpt2")
    args = ["--init-from", folder, "--text", text_file, *RUN, "--steps", 40, "--eval-every", 20, "--dropout", 0.1,
            "--checkpoint-every", 1]
    assert run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "full").code == 0
    # killed (SIGKILL: no clean-up at all) soon after its first checkpoint
    process = subprocess.Popen([sys.executable, f"recipes/{RECIPE}.py", *map(str, args), "--run-dir",
                                str(tmp_path / "cut")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (tmp_path / "cut" / "checkpoints" / "last.pt").exists() and time.time() < deadline:
        time.sleep(0.005)
    killed = process.poll() is None
    process.kill()
    process.wait()
    assert killed, "the run finished before it could be killed"
    shutil.rmtree(folder)  # the checkpoint holds the model's shape and the tokenizer: the folder is not needed
    resumed = run_inprocess(RECIPE, *args, "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0, resumed.stderr
    assert re.search(r"resumed at step ([1-9]|[1-3]\d)\b", resumed.stdout), resumed.stdout
    last = tmp_path / "cut" / "checkpoints" / "last.pt"
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"), load_weights(last))
    original = hf_model(gpt2_dir)
    assert not torch.equal(load_weights(last)["wte.weight"], original.transformer.wte.weight)  # it trained

    sample = run_inprocess(RECIPE, "--sample-only", "--resume", last, "--prompt", "def ", "--sample-tokens", 10)
    assert sample.code == 0 and sample.stdout.startswith("def "), sample.stderr
    # the run's options replayed: its --init-from (a folder now gone) gives way to the checkpoint given
    replayed = run_inprocess(RECIPE, "--sample-only", "--config", tmp_path / "cut" / "config.json", "--resume", last,
                             "--prompt", "def ", "--sample-tokens", 10)
    assert replayed.code == 0 and replayed.stdout == sample.stdout, replayed.stderr

    assert export.main([str(last), str(tmp_path / "out"), "--format", "hf"]) == 0
    ours, theirs = recipe_model(last), hf_model(tmp_path / "out")
    tokenizer = Tokenizer.from_str(torch.load(last, weights_only=True)["tokenizer"])
    difference = largest_difference(ours, theirs, windows(ours, tokenizer))
    print(f"exported after fine-tuning: largest logit difference {difference:.2e}")
    assert difference <= TOLERANCE
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    end = bpe_tokenizer().token_to_id("<|endoftext|>")
    assert config["activation_function"] == "gelu_new" and config["eos_token_id"] == config["bos_token_id"] == end
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(TEXT)["input_ids"] == bpe_tokenizer().encode(TEXT).ids


class Counted:
    """A tokenizer whose ``encode`` calls are counted (the library's own class takes no new attributes)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0
        self.pre_tokenizer, self.normalizer = tokenizer.pre_tokenizer, tokenizer.normalizer
        self.get_added_tokens_decoder = tokenizer.get_added_tokens_decoder

    def encode(self, text, **kwargs):
        self.calls += 1
        return self.tokenizer.encode(text, **kwargs)


def test_a_long_text_is_encoded_in_pieces_to_the_whole_texts_ids(gpt2_dir, monkeypatch):
    """One Encoding of a whole text kept some 300 bytes a token (1.1 GB for the 4.7 MB default corpus)."""
    tokenizer = Counted(hf_gpt2.read_folder(gpt2_dir).vocab)
    monkeypatch.setattr(hf_tokens, "PIECE", 100)
    ids = hf_tokens.encode_text(tokenizer, TEXT)
    assert ids.dtype == torch.int32 and ids.tolist() == tokenizer.tokenizer.encode(TEXT).ids
    assert tokenizer.calls >= len(TEXT) // 200  # in pieces, not whole
    # a tokenizer that reads a piece's start otherwise than the same text inside a line: whole (the ids differed)
    from tokenizers import AddedToken, pre_tokenizers

    prefixed = Tokenizer.from_str(tokenizer.tokenizer.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    stripping = Tokenizer.from_str(tokenizer.tokenizer.to_str())
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    spanning = Tokenizer.from_str(tokenizer.tokenizer.to_str())
    spanning.add_tokens([AddedToken("\nnaïve")])  # a token across the newline a cut would part
    for other, text in ((prefixed, TEXT), (stripping, TEXT.replace("naïve", "<mask> naïve")), (spanning, TEXT)):
        counted = Counted(other)
        assert hf_tokens.encode_text(counted, text).tolist() == other.encode(text, add_special_tokens=False).ids
        assert counted.calls == 1
    # "\n\n" and "\r\n" are one pre-token at a text's end, two inside it: no cut after whitespace (GPT-2 has "\n\n")
    blank_lines = tiny_bpe_tokenizer("class A:\n\n    def f(self):\r\n \r\n        return 1\n\n\nx = A()\n" * 50)
    monkeypatch.setattr(hf_tokens, "PIECE", 3)
    for text in ["x = A()\n\nprint(x)", "x = A()\r\nprint(x)", "x = A() \nprint(x)", "\n\n\nx = A()\n\nprint(x)"]:
        assert hf_tokens.encode_text(blank_lines, text).tolist() == blank_lines.encode(text).ids, text


def test_gpt2s_own_files_vocab_json_and_merges_txt_give_the_same_tokens(gpt2_dir, tmp_path):
    folder = copy_of(gpt2_dir, tmp_path / "gpt2")
    (folder / "tokenizer.json").unlink()
    bpe_tokenizer().model.save(str(folder))  # vocab.json and merges.txt, as in the gpt2 repository
    read = hf_gpt2.read_folder(folder)
    assert read.vocab_kind == "tokenizer"
    assert read.vocab.encode(TEXT).ids == bpe_tokenizer().encode(TEXT).ids
    assert read.vocab.decode(read.vocab.encode(TEXT).ids) == TEXT


def test_sampling_straight_from_a_folder(gpt2_dir, run_inprocess, monkeypatch):
    """Greedy, the folder's model gives transformers' own tokens: the prompt echoed back alone showed nothing."""
    sampled = []
    generate = tt.GPT.generate
    monkeypatch.setattr(tt.GPT, "generate", lambda self, *args, **kwargs: sampled.append(
        generate(self, *args, **kwargs)) or sampled[-1])
    result = run_inprocess(RECIPE, "--sample-only", "--init-from", gpt2_dir, "--prompt", "def ", "--sample-tokens", 8,
                           "--top-k", 1)
    assert result.code == 0 and result.stdout.startswith("def "), result.stderr
    prompt = torch.tensor([Tokenizer.from_file(str(gpt2_dir / "tokenizer.json")).encode("def ").ids])
    theirs = GPT2LMHeadModel.from_pretrained(gpt2_dir).generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8, min_new_tokens=8,
        pad_token_id=0)
    assert [s.tolist() for s in sampled] == [theirs.tolist()]
    both = run_inprocess(RECIPE, "--sample-only", "--init-from", gpt2_dir, "--resume", "x.pt")
    assert both.code == 2 and "--sample-only needs a checkpoint file, or else an --init-from folder" in both.stderr
    auto = run_inprocess(RECIPE, "--sample-only", "--init-from", gpt2_dir, "--resume", "auto")
    assert auto.code == 2 and "--sample-only needs a checkpoint file" in auto.stderr
    steps = run_inprocess(RECIPE, "--sample-only", "--init-from", gpt2_dir, "--steps", 5)  # it sampled, ignoring it
    assert steps.code == 2 and "Invalid value for --steps: does nothing with --sample-only, which samples from the " \
        "folder as it is" in steps.stderr, steps.stderr


def damage(case: str, folder: Path) -> str:
    """Spoil a copy of the folder as ``case`` says; returns what the error must say."""
    weights = folder / "model.safetensors"
    if case == "another architecture":
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="llama", architectures=["LlamaForCausalLM"])
        (folder / "config.json").write_text(json.dumps(config))
        return "holds a model of another kind (llama), not GPT-2"
    if case == "no config.json":
        (folder / "config.json").unlink()
        return "has no config.json"
    if case == "config.json not JSON":
        (folder / "config.json").write_text("{not json")
        return "config.json"
    if case == "no weights":
        weights.unlink()
        return "has no model.safetensors"
    if case == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return "model.safetensors is damaged or not a safetensors file"
    if case == "random bytes for safetensors":
        weights.write_bytes(random.Random(0).randbytes(5000))
        return "model.safetensors is damaged or not a safetensors file"
    if case == "a weight missing":
        tensors = load_file(weights)
        del tensors["transformer.h.1.mlp.c_fc.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
        return "lacks transformer.h.1.mlp.c_fc.weight"
    if case == "a config.json its weights disagree with":  # was called a "checkpoint"
        config = json.loads((folder / "config.json").read_text())
        config["n_positions"] += 8
        (folder / "config.json").write_text(json.dumps(config))
        return f"error: GPT-2 folder {folder} does not fit this model (wrong shape: wpe.weight)\n"
    if case == "a vocab_size its weights disagree with":  # "out of memory (allocating 119,209.3 GiB more)"
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"vocab_size": 10**12}))
        return f"error: GPT-2 folder {folder} does not fit this model (wrong shape: wte.weight)\n"
    if case == "no tokenizer":
        (folder / "tokenizer.json").unlink()
        return "has no tokenizer"
    if case == "an activation it does not compute":
        config = json.loads((folder / "config.json").read_text())
        config["activation_function"] = "relu"
        (folder / "config.json").write_text(json.dumps(config))
        return 'activation_function "relu"'
    if case in ("an activation in a list", "a size past float64"):  # were tracebacks (TypeError, OverflowError)
        config = json.loads((folder / "config.json").read_text())
        if case == "an activation in a list":
            config["activation_function"] = ["gelu"]
            (folder / "config.json").write_text(json.dumps(config))
            return 'activation_function ["gelu"]'
        (folder / "config.json").write_text(json.dumps(config | {"n_positions": "@"}).replace('"@"', "1e400"))
        return "lacks a GPT-2 setting or holds it in another form: n_positions Infinity"
    if case in ("a fractional size", "a size in a string"):  # int() read them as 2 layers: the folder loaded
        config = json.loads((folder / "config.json").read_text())
        value = config["n_layer"] + 0.5 if case == "a fractional size" else str(config["n_layer"])
        (folder / "config.json").write_text(json.dumps(config | {"n_layer": value}))
        return f"lacks a GPT-2 setting or holds it in another form: n_layer {json.dumps(value)} (each must be a whole"
    if case == "an inf weight":  # training said "diverged ... Try a lower --lr"; sampling was a traceback
        tensors = load_file(weights)
        tensors["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("inf")
        save_file(tensors, weights, metadata={"format": "pt"})
        return "holds inf or nan weights (transformer.h.0.mlp.c_fc.weight): a damaged or diverged model"
    if case == "token ids past vocab_size":  # fewer tokens than rows, one id past them: an IndexError traceback
        vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
        tokens = json.loads((folder / "tokenizer.json").read_text())
        end = tokens["added_tokens"][0]
        end["id"] = tokens["model"]["vocab"][end["content"]] = vocab_size + 10
        (folder / "tokenizer.json").write_text(json.dumps(tokens))
        return f"tokenizer has token ids up to {vocab_size + 10}, past config.json's vocab_size {vocab_size}"
    if case == "an index naming no file":  # sharded weights whose index maps a weight to a number
        tensors = load_file(weights)
        weights.unlink()
        save_file(tensors, folder / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
        weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors") | {"lm_head.weight": 5}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return "model.safetensors.index.json has no weight_map (weight names -> file names)"
    if case == "a shard missing":  # an interrupted download of sharded weights: was called "damaged"
        tensors = load_file(weights)
        weights.unlink()
        half = len(tensors) // 2
        for number, keys in enumerate((list(tensors)[:half], list(tensors)[half:]), 1):
            save_file({k: tensors[k] for k in keys}, folder / f"model-0000{number}-of-00002.safetensors")
        weight_map = {key: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, key in enumerate(tensors)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (folder / "model-00002-of-00002.safetensors").unlink()
        return "model.safetensors.index.json names model-00002-of-00002.safetensors, which is missing: download it"
    if case == "a classifier's head":  # named as the file names it, not with a "transformer." of ours
        tensors = load_file(weights)
        save_file(tensors | {"score.weight": torch.zeros(3, 32)}, weights, metadata={"format": "pt"})
        return "it holds unexpected score.weight"
    if case == "a file, not a folder":
        shutil.rmtree(folder)
        folder.write_text("not a folder")
        return "is a file, not a folder"
    if case == "no such folder":
        shutil.rmtree(folder)
        return "no such folder"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["another architecture", "no config.json", "config.json not JSON", "no weights",
                                  "truncated safetensors", "random bytes for safetensors", "a weight missing",
                                  "no tokenizer", "an activation it does not compute", "a file, not a folder",
                                  "no such folder", "an index naming no file", "a classifier's head",
                                  "a config.json its weights disagree with", "an activation in a list",
                                  "a size past float64", "a fractional size", "a size in a string", "an inf weight",
                                  "a shard missing", "token ids past vocab_size",
                                  "a vocab_size its weights disagree with"])
def test_a_folder_that_is_not_gpt2_is_one_line(case, gpt2_dir, text_file, run_inprocess, tmp_path):
    folder = copy_of(gpt2_dir, tmp_path / "gpt2")
    message = damage(case, folder)
    result = run_inprocess(RECIPE, "--init-from", folder, "--text", text_file, *RUN, "--steps", 1,
                           "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_a_weight_in_float8_is_read_as_float_like_every_other(gpt2_dir, tmp_path):
    """The inf/nan check called isfinite, which float8 lacks: a NotImplementedError traceback."""
    folder = copy_of(gpt2_dir, tmp_path / "gpt2")
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.0.ln_1.weight"] = tensors["transformer.h.0.ln_1.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    weights = hf_gpt2.read_folder(folder).weights
    assert weights["blocks.0.ln_1.weight"].dtype == torch.float32
    assert torch.equal(weights["blocks.0.ln_1.weight"], tensors["transformer.h.0.ln_1.weight"].float())


def test_a_tokenizer_saved_with_truncation_or_padding_encodes_the_whole_text(gpt2_dir, text_file, run_inprocess,
                                                                              tmp_path):
    """transformers saves truncation and padding in tokenizer.json once a call used them: the corpus was cut to
    the first max_length tokens, and a prompt padded with end-of-text tokens, without a word."""
    from tokenizers import Tokenizer

    folder = copy_of(gpt2_dir, tmp_path / "gpt2")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=16)
    tokenizer.enable_padding(length=12, pad_id=0, pad_token="<|endoftext|>")
    tokenizer.save(str(folder / "tokenizer.json"))
    result = run_inprocess(RECIPE, "--init-from", folder, "--text", text_file, *RUN, "--steps", 1,
                           "--run-dir", tmp_path / "run")
    plain = run_inprocess(RECIPE, "--init-from", gpt2_dir, "--text", text_file, *RUN, "--steps", 1,
                          "--run-dir", tmp_path / "plain")
    assert result.code == plain.code == 0, result.stderr
    counts = re.search(r"[\d,]+ train / [\d,]+ val tokens", plain.stdout)[0]
    assert counts in result.stdout  # the same tokens as from the folder as it was saved before
    sample = run_inprocess(RECIPE, "--sample-only", "--init-from", folder, "--prompt", "def ", "--sample-tokens", 4)
    assert sample.code == 0 and sample.stdout.startswith("def ") and "<|endoftext|>" not in sample.stdout[:20]


def test_a_text_too_short_for_the_folders_blocks_names_the_folder(gpt2_dir, tmp_path, run_inprocess):
    """--block-size, which the message asked to lower, contradicts the folder: the folder's size is named."""
    (tmp_path / "short.txt").write_text("def f():\n    return 1\n" * 3)
    result = run_inprocess(RECIPE, "--init-from", gpt2_dir, "--text", tmp_path / "short.txt", *RUN, "--steps", 1,
                           "--run-dir", tmp_path / "run")
    assert result.code == 1 and f"too short for {gpt2_dir}'s blocks (32 tokens)" in result.stderr, result.stderr


def test_a_config_without_model_type_but_gpt2s_architecture_is_read(gpt2_dir, text_file, run_inprocess, tmp_path):
    folder = copy_of(gpt2_dir, tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    result = run_inprocess(RECIPE, "--sample-only", "--init-from", folder, "--prompt", "def ", "--sample-tokens", 4)
    assert result.code == 0 and result.stdout.startswith("def "), result.stderr
    for odd in ({"model_type": None}, {"model_type": "gpt2", "architectures": 1}):  # null; not a list
        (folder / "config.json").write_text(json.dumps(config | odd))
        assert hf_gpt2.read_shape(folder)["n_layer"] == config["n_layer"]


@pytest.mark.parametrize(("option", "value", "theirs"), [("--n-layer", 4, "n_layer 2"), ("--n-head", 2, "n_head 4"),
                                                          ("--n-embd", 64, "n_embd 32"),
                                                          ("--block-size", 16, "n_positions 32"),
                                                          ("--vocab", "bytes", "tokenizer (BPE, ")])
def test_options_that_contradict_the_folder_are_usage_errors(option, value, theirs, gpt2_dir, text_file,
                                                             run_inprocess, tmp_path):
    result = run_inprocess(RECIPE, "--init-from", gpt2_dir, "--text", text_file, *RUN, "--steps", 1, option, value,
                           "--run-dir", tmp_path / "run")
    assert result.code == 2, result.stderr
    assert f"{option} {value} contradicts {gpt2_dir}'s {theirs}" in result.stderr
    assert not (tmp_path / "run").exists()
    # --sample-only too, which samples from the folder as it is (it printed a sample, ignoring the option)
    sample = run_inprocess(RECIPE, "--sample-only", "--init-from", gpt2_dir, "--sample-tokens", 2, option, value)
    assert sample.code == 2 and f"{option} {value} contradicts {gpt2_dir}'s {theirs}" in sample.stderr, sample.stdout


def test_a_resume_without_the_init_from_it_started_with_is_refused(gpt2_dir, text_file, run_inprocess, tmp_path):
    args = ["--text", text_file, *RUN, "--steps", 2, "--run-dir", tmp_path / "run"]
    assert run_inprocess(RECIPE, "--init-from", gpt2_dir, *args, "--max-steps", 1).code == 0
    result = run_inprocess(RECIPE, *args, "--resume", "auto")
    assert result.code == 1 and "--init-from" in result.stderr and "there, None here" in result.stderr


# ------------------------------------------------------------------------------------------------------
# More ways out: safetensors, a sharded checkpoint, several processes


@pytest.fixture(scope="module")
def other_recipe(tmp_path_factory) -> Path:
    """A checkpoint of another recipe (mixed_precision's MLP)."""
    run_dir = tmp_path_factory.mktemp("mixed") / "run"
    try:
        run_recipe(load_recipe("mixed_precision").main, [*SMOKE_ARGS["mixed_precision"], "--run-dir", str(run_dir)])
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    return run_dir / "checkpoints" / "last.pt"


def test_safetensors_holds_the_state_dict_as_load_state_dict_takes_it(trained, other_recipe, tmp_path):
    config = torch.load(trained["bytes"], weights_only=True)["model_config"]
    builds = [(trained["bytes"], lambda: tt.GPT(tt.GPTConfig(**config))),
              (other_recipe, lambda: load_recipe("mixed_precision").MLP(width=32, depth=2))]
    for i, (checkpoint, build) in enumerate(builds):
        out = tmp_path / f"out{i}"
        assert export.main([str(checkpoint), str(out), "--format", "safetensors"]) == 0
        assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.safetensors"]
        assert json.loads((out / "model.json").read_text())["format"] == "safetensors"
        weights = load_file(out / "model.safetensors")
        assert_same_weights(weights, load_weights(checkpoint))
        model = build()
        model.load_state_dict(weights)  # strict: every name, the tied head's too
        assert_same_weights(model.state_dict(), load_weights(checkpoint))
        if isinstance(model, tt.GPT):
            assert model.lm_head.weight is model.wte.weight  # still one tensor


def test_format_hf_is_for_the_transformer_only(other_recipe, tmp_path, capsys):
    assert export.main([str(other_recipe), str(tmp_path / "out"), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--format hf writes GPT-2 folders" in err
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_checkpoint_folder_exports_as_a_gpt2_folder(gpt2_dir, text_file, run_inprocess, tmp_path, capsys):
    """--parallel fsdp in one process writes DCP step folders; the export reads one into one whole model."""
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--init-from", gpt2_dir, "--text", text_file, *RUN, "--steps", 2, "--eval-every", 2,
                           "--parallel", "fsdp", "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    step = run_dir / "checkpoints" / "dcp" / "step-000002"
    assert (step / ".metadata").is_file()
    assert export.main([str(step), str(tmp_path / "out"), "--format", "hf"]) == 0
    ours, theirs = recipe_model(run_dir / "checkpoints" / "last.pt"), hf_model(tmp_path / "out")
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert largest_difference(ours, theirs, windows(ours, tokenizer)) <= TOLERANCE
    capsys.readouterr()
    assert export.main([str(step), str(tmp_path / "graph")]) == 0  # and as the graph, with the tokenizer beside it
    assert sorted(p.name for p in (tmp_path / "graph").iterdir()) == ["model.json", "model.onnx", "model.pt2",
                                                                     "tokenizer.json"]
    files = {"torch.export": "model.pt2", "onnx": "model.onnx", "tokenizer": "tokenizer.json"}  # it was left out
    assert json.loads((tmp_path / "graph" / "model.json").read_text())["files"] == files
    assert capsys.readouterr().out.strip().endswith("(model.pt2, model.onnx, tokenizer.json, model.json)")
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64] + b"\0" * 64)  # a damaged sharded checkpoint: one line, no export
    capsys.readouterr()
    assert export.main([str(step), str(tmp_path / "damaged")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read the sharded checkpoint {step}: ") and err.count("\n") == 1, err
    shard.unlink()  # one that is missing: named before DCP reads the folder
    assert export.main([str(step), str(tmp_path / "damaged")]) == 1
    assert capsys.readouterr().err == f"error: checkpoint {step} is incomplete: its __0_0.distcp is missing (a copy " \
                                      "in progress, or a lost file)\n"
    assert not (tmp_path / "damaged").exists()
    (step / ".metadata").write_bytes(b"")  # and without DCP's logged tracebacks (a process's stderr, not capsys's)
    result = run_subprocess(["scripts/export.py", step, tmp_path / "damaged"], timeout=120)
    assert result.code == 1 and result.stderr.startswith(f"error: {step / '.metadata'} is not DCP checkpoint "
                                                         "metadata (Ran out of input)"), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "damaged").exists(), result.stderr


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_fine_tune_to_the_weights_of_one_process(parallel, gpt2_dir, text_file, tmp_path):
    args = ["recipes/tiny_transformer.py", "--init-from", gpt2_dir, "--text", text_file, *RUN, "--steps", 3,
            "--eval-every", 3]
    one = run_subprocess([*args, "--batch-size", 8, "--run-dir", tmp_path / "one"])
    assert one.code == 0, one.stderr
    two = run_torchrun(["--nproc_per_node=2", *args, "--batch-size", 4, "--parallel", parallel,
                        "--run-dir", tmp_path / "two"])
    assert two.code == 0, two.stderr[-3000:]
    a, b = (load_weights(tmp_path / run / "checkpoints" / "last.pt") for run in ("one", "two"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_a_plain_run_never_imports_transformers_tokenizers_or_safetensors(text_file, tmp_path):
    """Imported, and then trained for a step, sampled and saved: only --init-from and exports need them."""
    args = ["--text", text_file, *RUN, "--steps", 1, "--n-layer", 1, "--n-embd", 16, "--n-head", 2, "--block-size", 16,
            "--run-dir", tmp_path / "run"]
    probe = ("import contextlib, importlib.util, sys; spec = importlib.util.spec_from_file_location('r', 'recipes/"
             "tiny_transformer.py'); module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
             "from common.cli import run_recipe\nwith contextlib.suppress(SystemExit): run_recipe(module.main, "
             f"{[str(a) for a in args]!r})\n"
             "print([m for m in ('transformers', 'tokenizers', 'safetensors') if m in sys.modules])")
    result = run_subprocess([sys.executable, "-c", probe], cwd=ROOT)
    assert result.code == 0 and result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()  # it trained and saved


def test_a_safetensors_error_without_a_message_is_still_one_line(tmp_path, monkeypatch):
    """safetensors may raise with an empty message: the one-line error names the error's type instead."""
    import safetensors.torch

    from common.hf_gpt2 import read_tensors

    (tmp_path / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(safetensors.torch, "load_file", lambda file: (_ for _ in ()).throw(ValueError("")))
    with pytest.raises(RecipeError, match=r"model.safetensors is damaged or not a safetensors file \(ValueError\)"):
        read_tensors(tmp_path)
