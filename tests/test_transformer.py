"""recipes/tiny_transformer.py: attention, the data stream, checkpoints and the CLI."""

import itertools
import json
import math
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, load_recipe, load_weights, read_metrics, read_scalars
from torch.utils.data import DataLoader

from common.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from common.loop import StepStats

RECIPE = "tiny_transformer"
tt = load_recipe(RECIPE)
SMALL = ["--n-layer", 2, "--n-head", 2, "--n-embd", 32, "--block-size", 16, "--batch-size", 8,
         "--eval-batches", 2, "--sample-tokens", 20]


def tiny_gpt(attention: str = "sdpa", seed: int = 0) -> "tt.GPT":
    torch.manual_seed(seed)
    return tt.GPT(tt.GPTConfig(vocab_size=50, block_size=12, n_layer=2, n_head=2, n_embd=16, attention=attention))


@pytest.fixture
def text_file(tmp_path):
    words = ["def ", "return ", "self", ".value", " = ", "(x)", ":\n    ", "\n", "import torch", "# note"]
    rng = torch.Generator().manual_seed(0)
    body = "".join(words[i] for i in torch.randint(len(words), (600,), generator=rng).tolist())
    path = tmp_path / "corpus.txt"
    path.write_text(body, encoding="utf-8")
    return path


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_future_tokens_change_no_earlier_logits(attention):
    model = tiny_gpt(attention).eval()
    idx = torch.randint(50, (2, 12))
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 50
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_gradient_from_position_t_never_reaches_later_inputs(attention):
    model = tiny_gpt(attention)
    embedded = {}
    model.wte.register_forward_hook(lambda module, inputs, out: embedded.setdefault("x", out))
    logits = model(torch.randint(50, (2, 12)))
    embedded["x"].retain_grad()
    logits[:, 5].sum().backward()
    grad = embedded["x"].grad.abs().sum(dim=(0, 2))  # per position
    assert torch.all(grad[6:] == 0)
    assert torch.all(grad[:6] > 0)


def test_einsum_and_sdpa_paths_agree(monkeypatch):
    einsum_model, sdpa_model = tiny_gpt("einsum"), tiny_gpt("sdpa")
    sdpa_model.load_state_dict(einsum_model.state_dict())
    idx = torch.randint(50, (3, 12))
    calls = []  # each path is the one it names: else this compares a path with itself
    for name in ("einsum", "scaled_dot_product_attention"):
        module = torch if name == "einsum" else torch.nn.functional
        monkeypatch.setattr(module, name, lambda *a, real=getattr(module, name), name=name, **k: calls.append(name)
                            or real(*a, **k))
    expected = sdpa_model(idx)
    assert calls == ["scaled_dot_product_attention"] * 2  # a call per block
    torch.testing.assert_close(einsum_model(idx), expected, rtol=1e-5, atol=1e-5)
    assert calls[2:] == ["einsum"] * 4  # scores and weighted values, per block
    torch.testing.assert_close(einsum_model(idx[:, :5]), sdpa_model(idx[:, :5]), rtol=1e-5, atol=1e-5)


def test_mask_is_a_buffer_that_follows_to_but_stays_out_of_the_state_dict():
    model = tiny_gpt()
    attention = model.blocks[0].attn
    assert "causal_mask" in dict(attention.named_buffers())
    assert not any("causal_mask" in key for key in model.state_dict())
    assert all(p is not attention.causal_mask for p in model.parameters())
    assert torch.equal(attention.causal_mask, torch.tril(torch.ones(12, 12, dtype=torch.bool)))
    model.to("meta")
    assert attention.causal_mask.device.type == "meta"


def test_weights_are_tied_and_residual_projections_scaled():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    for name, p in model.named_parameters():
        if p.dim() == 2 and "wpe" not in name:  # GPT-2: std 0.02, residual projections 0.02 / sqrt(2 * n_layer)
            expected = 0.02 / math.sqrt(2 * 2) if name.endswith("proj.weight") else 0.02
            assert p.std().item() == pytest.approx(expected, rel=0.2), name


def test_flops_per_token_matches_what_pytorch_counts_for_a_training_step():
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_gpt("einsum")  # plain matmuls, which the counter sees one by one
    tokens = torch.randint(50, (4, model.config.block_size))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    # the formula also counts norm gains and biases as if they were matmul weights: a percent or so here
    assert model.flops_per_token() == pytest.approx(counter.get_total_flops() / tokens.numel(), rel=0.03)


def test_checkpoint_round_trip_restores_the_model_exactly(tmp_path):
    model = tiny_gpt(seed=1)
    path = tmp_path / "model.pt"
    save_checkpoint(path, {"recipe": RECIPE, "model": model.state_dict()})
    fresh = tiny_gpt(seed=2)
    load_model_state(fresh, load_checkpoint(path, RECIPE)["model"], path)
    assert_same_weights(model.state_dict(), fresh.state_dict())
    idx = torch.randint(50, (2, 12))
    assert torch.equal(model.eval()(idx), fresh.eval()(idx))


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_crops_the_context_to_block_size(use_cache):
    model = tiny_gpt().eval()
    seen = []
    model.wpe.register_forward_hook(lambda module, inputs, out: seen.append(inputs[0].tolist()))
    out = model.generate(torch.zeros((1, 10), dtype=torch.long), 6, top_k=5,
                         generator=torch.Generator().manual_seed(0), use_cache=use_cache)
    assert out.shape == (1, 16)
    assert max(max(positions) for positions in seen) == 11  # never a position past block_size
    if use_cache:  # the prompt, then one new token a step; full at 12: refilled from the last 6
        assert seen == [list(range(10)), [10], [11], list(range(6)), [6], [7]]
    else:  # the same contexts, each recomputed whole
        assert seen == [list(range(n)) for n in (10, 11, 12, 6, 7, 8)]


@pytest.mark.parametrize("use_cache", [True, False])
def test_sampling_runs_in_inference_mode_except_without_the_cache_as_under_fsdp(use_cache, monkeypatch):
    model, modes, real = tiny_gpt().train(), [], tt.GPT.generate
    monkeypatch.setattr(tt.GPT, "generate",
                        lambda *a, **k: modes.append(torch.is_inference_mode_enabled()) or real(*a, **k))
    vocab = "".join(chr(ord("A") + i) for i in range(50))  # a character per token id
    text = tt.sample_text(model, vocab, "AB", 5, 1.0, None, 0, torch.device("cpu"), use_cache=use_cache)
    assert len(text) == 7 and modes == [use_cache] and model.training  # the training mode is given back
    assert not torch.is_inference_mode_enabled()


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_greedy_generation_is_the_same_with_and_without_the_kv_cache(attention):
    model = tiny_gpt(attention).eval()
    prompt = torch.randint(50, (3, 4), generator=torch.Generator().manual_seed(1))
    # up to a full context (block_size 12) plus the token it predicts: both see exactly the same tokens
    cached = model.generate(prompt, 9, top_k=1, use_cache=True)
    plain = model.generate(prompt, 9, top_k=1, use_cache=False)
    assert cached.shape == (3, 13)
    assert torch.equal(cached, plain)


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_kv_cache_beyond_block_size_equals_recomputing_its_documented_context(attention):
    """Past block_size the cache jumps (refilled from the last block_size // 2 tokens when full): every
    greedy token must be the one a full recompute over that same context picks."""
    model = tiny_gpt(attention).eval()
    block = model.config.block_size
    prompt = torch.randint(50, (2, 15), generator=torch.Generator().manual_seed(2))  # longer than the block
    out = model.generate(prompt, 30, top_k=1)
    assert out.shape == (2, 45)
    # without the cache (FSDP samples so): the same tokens, so its samples are a single process's
    assert torch.equal(model.generate(prompt, 30, top_k=1, use_cache=False), out)
    drawn = [model.generate(prompt, 30, top_k=5, generator=torch.Generator().manual_seed(3), use_cache=cache)
             for cache in (True, False)]
    assert torch.equal(*drawn)
    start = prompt.size(1) - block
    for i in range(prompt.size(1), out.size(1)):
        if i - start > block:  # the context would not fit: the cache is refilled
            start = i - block // 2
        expected = model(out[:, start:i])[:, -1].argmax(-1)
        assert torch.equal(out[:, i], expected), f"token {i}"
        assert block // 2 <= i - start <= block


def test_top_k_draws_from_k_tokens_even_where_others_tie_with_the_kth():
    """bf16 logits tie often: a mask of those below the k-th kept every token equal to it (4 of --top-k 2)."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]]).expand(2000, 5)
    drawn = tt.GPT.sample_next(logits, 1.0, 2, torch.Generator().manual_seed(0))
    assert drawn.unique().numel() == 2 and set(drawn.unique().tolist()) <= {0, 1, 2, 3}
    assert (drawn == 0).float().mean().item() == pytest.approx(math.e / (math.e + 1), abs=0.03)


@pytest.mark.parametrize("attention", ["einsum", "sdpa"])
def test_cached_attention_matches_the_full_attention_position_by_position(attention):
    model = tiny_gpt(attention).eval()
    idx = torch.randint(50, (2, 12))
    caches = [{} for _ in model.blocks]
    with torch.no_grad():
        parts = [model(idx[:, :5], caches), *(model(idx[:, t : t + 1], caches) for t in range(5, 12))]
        torch.testing.assert_close(torch.cat(parts, dim=1), model(idx), rtol=1e-5, atol=1e-5)
    block, heads, width = model.config.block_size, model.config.n_head, model.config.n_embd
    assert caches[0]["length"] == 12  # filled in place: allocated once for a whole block
    assert caches[0]["k"].shape == caches[0]["v"].shape == (2, heads, block, width // heads)
    torch.testing.assert_close(caches[0]["k"][:, :, :12], model.blocks[0].attn.qkv(model.blocks[0].ln_1(
        model.wte(idx) + model.wpe(torch.arange(12)))).split(width, dim=2)[1].view(2, 12, heads, -1).transpose(1, 2))


def test_greedy_sampling_takes_the_most_likely_token_and_draws_nothing():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert tt.GPT.sample_next(logits, 0.7, 1, generator).tolist() == [[1], [0]]
    assert torch.equal(generator.get_state(), state)
    assert tt.GPT.sample_next(logits, 1.0, 2, generator).shape == (2, 1)  # top-k 2 draws
    assert not torch.equal(generator.get_state(), state)


def test_top_k_draws_only_from_the_k_likeliest_and_0_from_every_token():
    """--top-k 0 turns the cut off (it was a usage error, so no run could sample from the whole distribution)."""
    logits = torch.linspace(0, 1, 10).expand(2000, 10)  # token 9 the likeliest, token 0 the least
    generator = torch.Generator().manual_seed(0)
    assert set(tt.GPT.sample_next(logits, 1.0, 3, generator).flatten().tolist()) == {7, 8, 9}
    assert set(tt.GPT.sample_next(logits, 1.0, 0, generator).flatten().tolist()) == set(range(10))


def test_random_windows_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(100, dtype=torch.int16)
    x, y = tt.RandomWindows(tokens, 8, 4, seed=0).batch(0)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)


def stream(num_workers: int, seed: int = 0, start: int = 0, n: int = 8):
    dataset = tt.RandomWindows(torch.arange(1000, dtype=torch.int16), 8, 4, seed=seed, start=start)
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)  # the recipe's, less its seeds and signals
    return [x for x, _ in itertools.islice(loader, n)]


def test_stream_is_reproducible_and_the_same_with_workers():
    single = stream(0)
    assert all(torch.equal(a, b) for a, b in zip(single, stream(0), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(single, stream(2), strict=True))  # workers: same stream
    assert not torch.equal(single[0], stream(0, seed=1)[0])


def test_workers_yield_disjoint_batches():
    batches = stream(2, n=12)
    assert len({tuple(b.flatten().tolist()) for b in batches}) == 12  # no batch yielded twice


def test_stream_resumes_at_any_batch():
    assert all(torch.equal(a, b) for a, b in zip(stream(0, n=10)[4:], stream(2, start=4, n=6), strict=True))


def test_warmup_then_cosine_schedule():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = tt.warmup_cosine(optimizer, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    lrs = []
    for _ in range(110):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-3 / 11)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11], strict=True))  # linear warmup
    assert lrs[10] == pytest.approx(1e-3)  # peak right after warmup
    assert lrs[60] == pytest.approx(1e-4 + (1e-3 - 1e-4) / 2)  # half-way down the cosine
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-4)  # ends at min_lr_ratio x peak


@pytest.mark.parametrize(("damage", "message"), [
    (lambda s: s.pop("model_config"), "holds no model shape this recipe builds ('model_config')"),
    (lambda s: s.update(model_config="gpt2"), "holds no model shape this recipe builds ("),
    (lambda s: s["model_config"].update(n_head=3), "is damaged: its model's vocab_size, block_size, n_layer, n_head, "
     "n_embd (256, 16, 2, 3, 32) make no model"),
    (lambda s: s["model_config"].update(vocab_size=-1), "make no model"),
    # was an IndexError in generate: a cache of one token refilled from block_size // 2 = 0 tokens
    (lambda s: s["model_config"].update(block_size=1),
     "make no model (whole numbers, n_head dividing n_embd, block_size >= 2)"),
    (lambda s: s["model_config"].update(dropout=2.0), "dropout 2.0, attention, activation and bias"),  # a ValueError
    # sampled without error, as exact GELU and SDPA: not what the checkpoint says it is (the attention named: auto's
    # is einsum where the CPU has native bf16)
    (lambda s: s["model_config"].update(activation="relu", attention="sdpa"),
     "('sdpa', 'relu', False) are not ones this recipe builds"),
    (lambda s: s["model_config"].update(attention="flash"), "('flash', 'gelu', False) are not ones"),
    (lambda s: s.update(vocab=7), "the checkpoint's vocabulary is damaged (a int, not None or a string"),
    # an IndexError in the embedding once a prompt held a character past the model's rows
    (lambda s: s.update(vocab="".join(map(chr, range(32, 332)))), "300 tokens for a model of vocab_size 256"),
    (lambda s: s["model_config"].update(vocab_size=100), "256 tokens for a model of vocab_size 100"),  # bytes
    (lambda s: s["model"].update({"wpe.weight": 5}), "does not fit this model (wrong shape: wpe.weight)"),
])
def test_a_damaged_checkpoint_is_one_line_when_sampled_from(damage, message, run_inprocess, text_file, tmp_path):
    """Each was a traceback (KeyError, TypeError, RuntimeError deep in a layer, AttributeError)."""
    run_dir = tmp_path / "run"
    assert run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 2, "--run-dir", run_dir).code == 0
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    damage(state)
    torch.save(state, tmp_path / "damaged.pt")
    result = run_inprocess(RECIPE, "--sample-only", "--resume", tmp_path / "damaged.pt", "--sample-tokens", 4)
    assert result.code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr, result.stderr


def test_smoke_run_and_sampling_from_the_checkpoint(run_inprocess, text_file, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 12, "--eval-every", 6,
                           "--warmup-steps", 2, "--peak-flops", 1e11, "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    assert result.done_line.startswith("done: ") and "val_bits_per_byte=" in result.done_line
    metrics = read_metrics(run_dir)
    assert {"recipe", "steps", "train_loss", "val_loss", "val_bits_per_byte", "tokens_per_s", "mfu",
            "wall_s"} <= metrics.keys()
    assert metrics["steps"] == 12 and metrics["val_bits_per_byte"] == pytest.approx(metrics["val_loss"] / math.log(2))
    assert metrics["val_loss"] < math.log(256)  # better than uniform over bytes
    scalars = read_scalars(run_dir)
    assert {"train/loss", "train/lr", "val/loss", "perf/tokens_per_s", "perf/mfu"} <= scalars.keys()
    assert [s for s, _ in scalars["val/loss"]] == [6, 12]
    model = tt.GPT(tt.GPTConfig(**torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model_config"]))
    assert metrics["mfu"] == pytest.approx(model.flops_per_token() * metrics["tokens_per_s"] / 1e11, rel=1e-3)
    groups = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # the tied embedding counted once
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # AdamW decays matrices only
    assert [len(g["params"]) for g in groups] == [len(matrices), len(list(model.parameters())) - len(matrices)]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["vocab"] is None and state["model_config"]["n_embd"] == 32

    sample = run_inprocess(RECIPE, "--sample-only", "--resume", run_dir / "checkpoints" / "last.pt",
                           "--prompt", "def ", "--sample-tokens", 30)
    assert sample.code == 0, sample.stderr
    assert sample.stdout.startswith("def ") and len(sample.stdout.encode()) >= 30
    prompt = "def " + "x" * 20  # longer than --block-size 16: printed whole, the model reads its last 16 tokens
    long = run_inprocess(RECIPE, "--sample-only", "--resume", run_dir / "checkpoints" / "last.pt", "--prompt", prompt,
                         "--sample-tokens", 5)
    assert long.code == 0 and long.stdout.startswith(prompt), long.stdout
    every = run_inprocess(RECIPE, "--sample-only", "--resume", run_dir / "checkpoints" / "last.pt", "--top-k", 0,
                          "--prompt", "def ", "--sample-tokens", 30)  # 0: from every token
    assert every.code == 0 and every.stdout.startswith("def ") and every.stdout != sample.stdout, every.stderr
    negative = run_inprocess(RECIPE, "--sample-only", "--resume", run_dir / "checkpoints" / "last.pt", "--top-k", -1)
    assert negative.code == 2 and "--top-k" in negative.stderr and "0" in negative.stderr
    for ignored, named in ((["--n-layer", 7], "--n-layer"), (["--vocab", "chars"], "--vocab"), (["--lr", 5], "--lr"),
                           (["--no-compile"], "--compile/--no-compile")):  # were ignored: it sampled as it was
        refused = run_inprocess(RECIPE, "--sample-only", "--resume", run_dir / "checkpoints" / "last.pt", *ignored)
        assert refused.code == 2 and f"Invalid value for {named}: does nothing with --sample-only, which " \
            "samples from the checkpoint as it is: leave it out" in refused.stderr, refused.stderr
    replayed = run_inprocess(RECIPE, "--sample-only", "--resume", run_dir / "checkpoints" / "last.pt", "--config",
                             run_dir / "config.json", "--prompt", "def ", "--sample-tokens", 30)  # its temperature...
    assert replayed.code == 0 and replayed.stdout == sample.stdout, replayed.stderr
    monkeypatch.setenv("RANK", "1")  # as torchrun starts the second process: the same text, not printed twice
    monkeypatch.setenv("WORLD_SIZE", "2")
    again = run_inprocess(RECIPE, "--sample-only", "--resume", run_dir / "checkpoints" / "last.pt",
                          "--prompt", "def ", "--sample-tokens", 30)
    assert again.code == 0 and again.stdout == "", again.stderr


def test_a_replay_with_another_batch_size_takes_it_over_the_recorded_global_batch(run_inprocess, text_file, tmp_path):
    """config.json records both batch sizes; a --config replay given --batch-size (only that) trains with it."""
    first = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 2, "--eval-every", 2, "--warmup-steps", 1,
                          "--peak-flops", 1e11, "--run-dir", tmp_path / "first")
    recorded = json.loads((tmp_path / "first" / "config.json").read_text())
    assert first.code == 0 and recorded["global_batch"] == 8
    # --parallel as given, auto: replayed under torchrun it is DDP there (a recorded "none" was refused)
    assert (recorded["parallel"], recorded["world_size"]) == ("auto", 1)
    replay = run_inprocess(RECIPE, "--config", tmp_path / "first" / "config.json", "--batch-size", 4, "--grad-accum", 2,
                           "--run-dir", tmp_path / "replay")
    assert replay.code == 0, replay.stderr
    config = json.loads((tmp_path / "replay" / "config.json").read_text())
    assert (config["batch_size"], config["grad_accum"], config["global_batch"]) == (4, 2, 8)
    assert config["warmup_steps"] == 1  # as replayed: it was given
    # a warm-up the first run derived from its --steps is derived again for the replay's
    derived = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 2, "--eval-every", 2, "--peak-flops",
                            1e11, "--run-dir", tmp_path / "derived")
    assert derived.code == 0 and json.loads((tmp_path / "derived" / "config.json").read_text())["warmup_steps"] == 0
    longer = run_inprocess(RECIPE, "--config", tmp_path / "derived" / "config.json", "--steps", 30, "--max-steps", 1,
                           "--run-dir", tmp_path / "longer")
    assert longer.code == 0 and json.loads((tmp_path / "longer" / "config.json").read_text())["warmup_steps"] == 3
    # a warm-up that was given is kept, for other --steps or the same typed again (it was derived anew: 3, 0)
    for name, steps in [("given_longer", 30), ("given_same", 2)]:
        kept = run_inprocess(RECIPE, "--config", tmp_path / "first" / "config.json", "--steps", steps, "--max-steps", 1,
                             "--run-dir", tmp_path / name)
        assert kept.code == 0 and json.loads((tmp_path / name / "config.json").read_text())["warmup_steps"] == 1
    both = run_inprocess(RECIPE, "--config", tmp_path / "first" / "config.json", "--batch-size", 4, "--global-batch",
                         8, "--run-dir", tmp_path / "both")
    assert both.code == 2 and "--global-batch sets it for you" in both.stderr
    # a run of two processes (4 each) replayed in one: the global batch it recorded is kept, so no warning
    saved = json.loads((tmp_path / "first" / "config.json").read_text()) | {"world_size": 2, "batch_size": 4}
    (tmp_path / "two.json").write_text(json.dumps(saved))
    alone = run_inprocess(RECIPE, "--config", tmp_path / "two.json", "--max-steps", 1, "--run-dir", tmp_path / "alone")
    assert alone.code == 0 and alone.stderr == "" and "global batch 8 (1 x 8 x 1)" in alone.stdout


def test_a_run_shorter_than_the_default_warmup_still_reaches_its_peak_rate(run_inprocess, text_file, tmp_path):
    """The default warm-up is 100 steps, or a tenth of --steps if less; a longer one given is a usage error."""
    result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 30, "--eval-every", 30, "--lr", 1e-3,
                           "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["warmup_steps"] == 3
    rates = dict(read_scalars(tmp_path / "run")["train/lr"])
    assert rates[4] == pytest.approx(1e-3) and rates[1] < rates[2] < rates[3] < rates[4] > rates[30]
    refused = run_inprocess(RECIPE, "--text", text_file, "--steps", 30, "--warmup-steps", 30)
    assert refused.code == 2 and "Invalid value for --warmup-steps: must be below --steps 30" in refused.stderr

def test_character_vocabulary_is_stored_in_the_checkpoint(run_inprocess, text_file, tmp_path):
    result = run_inprocess(RECIPE, "--text", text_file, "--vocab", "chars", *SMALL, "--steps", 3,
                           "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["vocab"] == "".join(sorted(set(text_file.read_text())))
    assert "val_bits_per_char" in read_metrics(tmp_path / "run")


def test_a_vocabulary_without_a_newline_samples_from_its_own_first_character(run_inprocess, tmp_path):
    """No --prompt means a newline, unless the text has none: then the vocabulary's first character."""
    text = tmp_path / "one_line.txt"
    text.write_text("abc cab bca " * 100, encoding="utf-8")
    result = run_inprocess(RECIPE, "--text", text, "--vocab", "chars", *SMALL, "--steps", 2, "--eval-every", 1,
                           "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert read_metrics(tmp_path / "run")["steps"] == 2
    assert "--- sample at step 2 ---\n " in result.stdout  # the vocabulary is " abc": it starts at " "


def test_a_prompt_outside_the_vocabulary_is_refused_before_training(run_inprocess, text_file, tmp_path):
    result = run_inprocess(RECIPE, "--text", text_file, "--vocab", "chars", *SMALL, "--steps", 2, "--prompt", "Zq!",
                           "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 2 and "--prompt" in result.stderr and "'!Zq'" in result.stderr
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_a_validation_loss_that_overflows_ends_the_run_as_diverged(run_inprocess, text_file, tmp_path):
    """Weights of ~1e30 are finite, so the step's checks pass, but the forward pass overflows: the validation
    loss is NaN. One line and exit 1, before a sample is drawn from NaN probabilities."""
    result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 4, "--eval-every", 1, "--lr", 1e30,
                           "--max-grad-norm", 0, "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: training diverged: the validation loss is nan at step 1; no checkpoint yet. Try a lower --lr"]


def test_resumed_run_ends_with_the_same_weights(run_inprocess, text_file, tmp_path, monkeypatch):
    # no --peak-flops: the start-up FLOP measurement must not disturb the random streams a resume restores
    common = [*SMALL, "--steps", 10, "--eval-every", 5, "--dropout", 0.1, "--grad-accum", 2]
    assert run_inprocess(RECIPE, "--text", text_file, *common, "--run-dir", tmp_path / "full").code == 0
    monkeypatch.chdir(text_file.parent)  # started with --text corpus.txt; resumed with its absolute path, as the
    assert run_inprocess(RECIPE, "--text", text_file.name, *common, "--max-steps", 3,  # first line shows it: the
                         "--run-dir", tmp_path / "cut").code == 0  # same file, so no other option (it was refused)
    copy = tmp_path / "copy.txt"  # another file is: its tokens' checksum covers the training split alone
    copy.write_bytes(text_file.read_bytes())
    other = run_inprocess(RECIPE, "--text", copy, *common, "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert other.code == 1 and f"was started with other options (--text {text_file} there, {copy} here)" in other.stderr
    resumed = run_inprocess(RECIPE, "--text", text_file, *common, "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0, resumed.stderr
    assert "resumed at step 3" in resumed.stdout
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))


def test_a_standard_library_without_sources_is_one_line(run_inprocess, tmp_path, monkeypatch):
    """The default corpus is the standard library's .py files; a Python with only compiled or zipped ones (Windows'
    embeddable one) gave an empty corpus and a ValueError traceback from torch.frombuffer."""
    import sysconfig

    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**paths, "stdlib": str(tmp_path)})
    result = run_inprocess(RECIPE, *SMALL, "--steps", 2, "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr == f"error: {tmp_path} holds no .py files (this Python's standard " \
        "library) to train on: give --text\n"
    assert not (tmp_path / "run").exists()


def test_each_rank_draws_its_own_dropout_masks_from_the_seed_and_the_step(run_inprocess, text_file, tmp_path,
                                                                           monkeypatch):
    """With one stream on every rank, each rank would drop the same units in its rows; drawn from (seed, rank,
    step), the masks differ between ranks and a resumed run draws those it would have drawn."""
    def mask(rank: int, step: int) -> torch.Tensor:
        tt.seed_dropout(0, rank, step)
        return torch.nn.functional.dropout(torch.ones(64), 0.5) > 0

    assert torch.equal(mask(0, 3), mask(0, 3))
    assert not torch.equal(mask(0, 3), mask(1, 3)) and not torch.equal(mask(0, 3), mask(0, 4))
    calls, seed_dropout = [], tt.seed_dropout
    monkeypatch.setattr(tt, "seed_dropout", lambda *args: calls.append(args) or seed_dropout(*args))
    for dropout in (0.1, 0.0):
        result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 3, "--eval-every", 3, "--seed", 7,
                               "--dropout", dropout, "--peak-flops", 1e11, "--run-dir", tmp_path / str(dropout))
        assert result.code == 0, result.stderr
    assert calls == [(7, 0, 0), (7, 0, 1), (7, 0, 2)]  # every step of the run with dropout, none without


def test_validation_runs_in_micro_batches_no_larger_than_training(run_inprocess, text_file, tmp_path, monkeypatch):
    """--grad-accum lowers a step's memory; evaluation must not then run grad_accum x the rows in one forward."""
    rows = []
    evaluate = tt.evaluate
    monkeypatch.setattr(tt, "evaluate", lambda model, batches, *args, **kwargs: evaluate(
        model, [rows.append(len(batch[0])) or batch for batch in batches], *args, **kwargs))
    result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--grad-accum", 4, "--steps", 2, "--eval-every", 2,
                           "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert rows == [8] * 8  # --eval-batches 2 of 4 x 8 rows each, in micro-batches of --batch-size 8


def test_ddp_leaves_the_constant_masks_unsent(run_inprocess, text_file, tmp_path, monkeypatch):
    """DDP broadcasts rank 0's buffers before every forward unless told not to; the causal masks never change."""
    import socket

    wrapped = []
    init = tt.DistributedDataParallel.__init__
    monkeypatch.setattr(tt.DistributedDataParallel, "__init__",
                        lambda self, *args, **kwargs: wrapped.append(self) or init(self, *args, **kwargs))
    with socket.socket() as free:  # torchrun's environment for one process
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, str(value))
    result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 2, "--eval-every", 2, "--parallel", "ddp",
                           "--peak-flops", 1e11, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert len(wrapped) == 1 and wrapped[0].forward_sync_buffers is False
    assert [name for name, _ in wrapped[0].module.named_buffers()] == [f"blocks.{i}.attn.causal_mask" for i in (0, 1)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"", "is empty"),
        (b" \n\t\r\n" * 100, "holds only whitespace"),  # was called "empty"
        (b"caf\xe9 au lait " * 40, "is not UTF-8 text"),
        (b"\0" * 400, "holds NUL bytes (byte 0): a binary file, or UTF-16? re-save it as UTF-8"),
        ("def forward(self, x):\n".encode("utf-16-le") * 40, "holds NUL bytes (byte 1)"),
        (b"short text", "too short for --block-size 16"),
    ],
)
def test_bad_text_is_a_one_line_error(run_inprocess, tmp_path, content, message):
    path = tmp_path / "bad.txt"
    if content is not None:
        path.write_bytes(content)
    result = run_inprocess(RECIPE, "--text", path, *SMALL, "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_a_text_whose_name_is_not_utf8_trains_and_is_recorded_escaped(run_inprocess, tmp_path, corpus_txt):
    """TensorBoard's HParams failed with a traceback, after training, on a --text named in another encoding."""
    import os

    path = tmp_path / os.fsdecode(b"caf\xe9.txt")  # Latin-1's e acute: a lone surrogate to Python
    path.write_bytes(corpus_txt.read_bytes())
    result = run_inprocess(RECIPE, "--text", path, *SMALL, "--max-steps", 2, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert read_metrics(tmp_path / "run")["steps"] == 2
    assert f"tokens of {tmp_path}/caf\\udce9.txt |" in result.stdout  # printed with the byte escaped
    assert json.loads((tmp_path / "run" / "config.json").read_text())["text"] == str(path)  # JSON escapes it


def test_heads_must_divide_the_width(run_inprocess, tmp_path):
    result = run_inprocess(RECIPE, "--n-embd", 30, "--n-head", 4)
    assert result.code == 2
    assert "--n-embd" in result.stderr and "not divisible by --n-head 4" in result.stderr


def test_auto_precision_is_recorded_and_a_resume_keeps_the_precision_it_started_with(run_inprocess, text_file,
                                                                                     tmp_path):
    from common.runtime import resolve_precision

    _, expected, why = resolve_precision("auto", torch.device("cpu"))  # bf16 here only if this CPU has native bf16
    args = ["--text", text_file, *SMALL, "--steps", 4, "--eval-every", 2, "--peak-flops", 1e11, "--run-dir",
            tmp_path / "run", "--resume", "auto"]
    first = run_inprocess(RECIPE, *args, "--max-steps", 2)  # the default: --precision auto
    assert first.code == 0, first.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["precision"], config["precision_used"], config["precision_reason"]) == ("auto", expected, why)
    assert f"| precision {expected} ({why}) |" in first.stdout

    fp32 = ["--text", text_file, *SMALL, "--steps", 4, "--eval-every", 2, "--peak-flops", 1e11, "--run-dir",
            tmp_path / "fp32", "--resume", "auto"]
    assert run_inprocess(RECIPE, *fp32, "--max-steps", 2, "--precision", "fp32").code == 0
    resumed = run_inprocess(RECIPE, *fp32)  # auto again: the run started in fp32 and goes on in fp32
    assert resumed.code == 0, resumed.stderr
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert (config["precision"], config["precision_used"]) == ("fp32", "fp32")  # as it started: a replay runs fp32
    assert "| precision fp32 (as its checkpoint ran) |" in resumed.stdout


def test_auto_attention_is_einsum_only_under_16_bit_autocast_on_a_cpu(run_inprocess, corpus_txt, tmp_path):
    resolve = tt.resolve_attention
    assert [resolve("auto", torch.device("cpu"), p) for p in ("fp32", "bf16", "fp16")] == ["sdpa", "einsum", "einsum"]
    assert resolve("auto", torch.device("cuda"), "bf16") == "sdpa" and resolve("sdpa", torch.device("cpu"), "bf16") \
        == "sdpa"
    args = ["--text", corpus_txt, "--steps", 2, "--n-layer", 1, "--n-head", 2, "--n-embd", 16, "--block-size", 16,
            "--batch-size", 4, "--eval-batches", 1, "--sample-tokens", 2, "--peak-flops", 1e11]
    for precision, expected in (("bf16", "einsum"), ("fp32", "sdpa")):
        result = run_inprocess("tiny_transformer", *args, "--precision", precision, "--run-dir", tmp_path / precision)
        assert result.code == 0, result.stderr
        assert f"parameters, {expected} attention | " in result.stdout
        state = torch.load(tmp_path / precision / "checkpoints" / "last.pt", weights_only=True)
        assert state["model_config"]["attention"] == expected and state["config"]["attention"] == "auto"


def test_one_process_stops_at_the_step_it_was_signalled_not_at_the_next_log_line(run_inprocess, text_file, tmp_path,
                                                                                  monkeypatch):
    """Only torchrun's ranks must agree on a stop (every --log-every steps); one process read its flag only there
    too, so with a long --log-every a SIGTERM was honoured minutes late."""
    made = []

    def stats_then_ctrl_c(*args):
        made.append(1)
        if len(made) == 3:
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C during the third step
        return StepStats(*args)

    monkeypatch.setattr(tt, "StepStats", stats_then_ctrl_c)
    result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 40, "--eval-every", 40, "--log-every", 40,
                           "--run-dir", tmp_path / "run")
    assert result.code == 130, result.stderr
    assert "interrupted at step 3; checkpoint saved" in result.stdout
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--prompt", "a\udcffb", "'a\\udcffb' is not UTF-8 text"),  # bytes of another encoding, as Python gets them
    ("--temperature", "inf", "must be a finite number >= 0.01, got inf"),
    ("--peak-flops", "inf", "must be a finite number >= 1, got inf")])
def test_a_prompt_not_in_utf8_and_infinite_sampling_settings_are_usage_errors(run_inprocess, text_file, tmp_path,
                                                                              option, value, message):
    """A --prompt of another encoding trained to the first sample, then failed in a traceback that removed the
    run; --temperature inf sampled uniformly, --peak-flops inf wrote Infinity (not JSON) and an MFU of 0."""
    result = run_inprocess(RECIPE, "--text", text_file, *SMALL, "--steps", 2, option, value, "--run-dir",
                           tmp_path / "run")
    assert result.code == 2 and f"Invalid value for '{option}': {message}" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_prompts_and_ids_the_tokens_cannot_spell():
    """A folder's tokenizer (words split on whitespace, no unknown token) and a config.json that pads vocab_size."""
    import tokenizers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1}))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tt.prompt_tokens("a b", words).tolist() == [0, 1]
    assert tt.prompt_tokens("", words).tolist() == [0]  # "\n" is no token here: the first token starts the sample
    assert tt.prompt_tokens("", tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1}))).tolist() == [0]  # nor here
    with pytest.raises(tt.typer.BadParameter, match="cannot encode the prompt"):
        tt.prompt_tokens("zebra", words)  # was a RecipeError blaming "the text", after training
    with pytest.raises(tt.typer.BadParameter, match="encodes '  ' as no tokens"):
        tt.prompt_tokens("  ", words)  # was an IndexError in generate
    assert tt.prompt_tokens("", None).tolist() == [10] and tt.prompt_tokens("", "ab").tolist() == [0]
    # ids past the tokens (a padded vocab_size) read as U+FFFD: they were an IndexError or a ValueError
    assert tt.decode([104, 300], None) == "h\ufffd" and tt.decode([0, 5], "ab") == "a\ufffd"
    assert tt.decode([0, 7], words) == "a"


def test_text_from_a_pipe_is_read(tmp_path, monkeypatch):
    """`--text <(zcat corpus.gz)`: it said "no such file"."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_bytes, args=(b"from a pipe\n",))
    writer.start()
    try:
        assert tt.read_text(pipe) == b"from a pipe\n"
    finally:
        if writer.is_alive():  # the read never opened the pipe: let the writer finish
            pipe.read_bytes()
        writer.join()
    with pytest.raises(tt.cli.RecipeError, match="is neither a file nor a pipe"):
        tt.read_text(Path("/dev/null"))  # a device (/dev/zero would be read until memory ran out)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun each process would read a part of what the pipe holds
    with pytest.raises(tt.cli.RecipeError, match="is a pipe, which one process reads: under torchrun, give a file"):
        tt.read_text(pipe)
