"""A tiny GPT: a decoder-only transformer trained from scratch as a byte- or character-level language model.

What it teaches: causal self-attention whose mask is a registered buffer, with the scores written as an
einsum (``bhid,bhjd->bhij``) or computed by ``F.scaled_dot_product_attention``; pre-norm blocks, tied
input/output embeddings and GPT-2's scaled initialisation; AdamW with weight decay on matrices only (beta2
0.99 by default: small batches give noisy gradients, and a slower second-moment average suits them); linear
warmup then cosine decay (``SequentialLR`` of ``LinearLR`` and ``CosineAnnealingLR``) stepped every
optimizer step; gradient clipping and accumulation; an ``IterableDataset`` of random windows that stays
correct with worker processes; validation in bits per byte (per character with ``--vocab chars``, per token with
GPT-2's: not comparable across them); sampling with temperature and top-k; tokens/s
and model FLOP utilisation (MFU).

Scaling it out under ``torchrun`` (docs/scaling.md's "Scaling the transformer" has the commands): ``--parallel
ddp`` replicates the model and averages gradients (``no_sync`` on all micro-batches but the last);
``--parallel fsdp`` shards parameters, gradients and optimizer state with FSDP2's ``fully_shard`` per block
over a device mesh, in bf16 with fp32 gradient reduction under ``--precision bf16``, and checkpoints with
torch.distributed.checkpoint (every rank writes its shard; resumable at another world size). Each step's
global batch is drawn once and every rank takes its slice, so 1 x 32, 2 x 16 and 4 x 8 processes train on
the same tokens and end with the same weights (within float rounding). ``--activation-checkpointing``
recomputes each block in the backward pass.

``--init-from DIR`` fine-tunes GPT-2: a folder in Hugging Face's format (``hf download gpt2 --local-dir gpt2``, or
one scripts/export.py --format hf wrote) gives the model's shape, weights and tokenizer; the model is the same
GPT, with GPT-2's biases and its GELU (``GPTConfig.bias``, ``activation``) where the folder has them.
common/hf_gpt2.py converts names and layouts, common/hf_tokens.py tokenizers, both ways.

    python recipes/tiny_transformer.py                       # corpus: this Python's standard library
    python recipes/tiny_transformer.py --text input.txt --vocab chars
    python recipes/tiny_transformer.py --init-from gpt2 --text input.txt --lr 3e-5 --warmup-steps 0 \
        --min-lr-ratio 1 --batch-size 8 --steps 200 --eval-every 50 --eval-batches 4   # docs/deploy.md
    python recipes/tiny_transformer.py --sample-only --resume runs/tiny_transformer/.../checkpoints/last.pt
    torchrun --nproc_per_node=2 recipes/tiny_transformer.py --parallel fsdp --batch-size 16

A good result with the defaults (under 5 minutes on a 2-core CPU): validation about 2.1 bits per byte, and
samples that look like Python (indentation, ``def``, ``self.``, plausible identifiers).
"""

import math
import os
import stat
import sys
import sysconfig
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import torch
import torch.distributed as dist
import torch.nn.functional as F
import typer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common import cli, hf_gpt2, hf_tokens
from common.best import BestScore
from common.checkpoint import Checkpointer, check_same_run, load_model_state, resume_checkpoint
from common.data import checksum, ignore_stop_signals, same_file
from common.loop import StepStats, evaluate
from common.peak_flops import device_peak_flops
from common.profile import StepProfiler
from common.resources import format_account, memory_account, reset_peak_memory, with_peaks
from common.rundir import already_finished, last_file, open_run_dir
from common.runlog import RunLog, log_interval
from common.runtime import (
    PRECISION_DTYPES,
    autocast,
    from_rank_0,
    resolve_device,
    resolve_precision,
    seed_everything,
    unwrap,
)
from common.sharded import ShardedCheckpointer, last_sharded, load_sharded, load_trainer_state
from common.stop import StopRequest
from common.torchrun import gpu_of, torchrun_env

RECIPE = "tiny_transformer"

# ----------------------------------------------------------------------------------------------------
# Model


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 128  # longest context the model sees
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    attention: str = "sdpa"  # or "einsum": the same attention written out
    # GPT-2's own, for a model from a Hugging Face folder (--init-from): biases in every linear layer and norm, and
    # "gelu_new", GELU's tanh approximation. A model of its own has neither: no biases, exact GELU.
    bias: bool = False
    activation: str = "gelu"  # or "gelu_new"


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.attention, self.dropout = config.n_head, config.attention, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # query, key, value in one matmul
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        # The causal mask is a buffer: not learned, but it moves with .to(device) like the parameters.
        # persistent=False keeps it out of the state_dict: it follows from block_size alone, so storing it
        # would only add block_size^2 bytes to every checkpoint.
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)  # True where position i may see j

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        """``cache``: only while generating, this layer's keys and values of the earlier positions (``{"k", "v",
        "length"}``, empty at first: buffers for a whole block, of which the first ``length`` positions hold
        values); the new ones are written after them, in place (so no backward through it), and ``x`` may hold
        only new tokens."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs): each head attends over its own slice of the channels
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            # A token's key and value depend only on it and the tokens before it, so those of earlier
            # positions are exactly what a full recompute would give again: keep them, compute only the new.
            # The cache is allocated for a whole block at once, so a token costs a copy of its own key and
            # value, not (as with torch.cat) a new copy of all the earlier ones.
            if not cache:
                shape = (B, self.n_head, self.causal_mask.size(0), C // self.n_head)
                cache |= {"k": k.new_empty(shape), "v": v.new_empty(shape), "length": 0}
            start, end = cache["length"], cache["length"] + T
            cache["k"][:, :, start:end], cache["v"][:, :, start:end], cache["length"] = k, v, end
            k, v = cache["k"][:, :, :end], cache["v"][:, :, :end]
        S = k.size(2)  # positions attended to: T, or with a cache the earlier ones too; the queries are the last T
        if self.attention == "einsum":
            scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.size(-1))  # (B, nh, T, S)
            scores = scores.masked_fill(~self.causal_mask[S - T : S, :S], float("-inf"))  # no peeking ahead
            weights = self.attn_dropout(scores.softmax(dim=-1))
            y = torch.einsum("bhij,bhjd->bhid", weights, v)  # (B, nh, T, hs)
        else:
            # The same computation in one fused kernel. is_causal=True applies exactly causal_mask's
            # pattern without materialising it, which lets GPUs use FlashAttention. is_causal aligns the
            # mask to the top left, so queries that are only the last T of S positions (after a KV cache)
            # need the mask's rows; a single new token may see every position and needs no mask at all.
            if S == T:
                mask, causal = None, True
            else:
                mask, causal = (None if T == 1 else self.causal_mask[S - T : S, :S]), False
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                               dropout_p=self.dropout if self.training else 0.0)
        # (B, nh, T, hs) -> (B, T, C). After a transpose a tensor is usually non-contiguous (the einsum path's
        # is), where .view fails; reshape copies only then (SDPA's kernels tend to lay y out as (B, T, nh, hs)).
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = "tanh" if config.activation == "gelu_new" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-norm: normalise the input of each branch, add its output to an untouched residual stream."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embeddings
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: reading a token in and writing it out share one matrix (fewer parameters, and
        # it trains better at small scale).
        self.lm_head.weight = self.wte.weight
        self.checkpoint_blocks = False  # --activation-checkpointing
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2: residual branches scaled by 1/sqrt(2 * n_layer)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:  # GPT-2's biases start at zero
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, caches: list[dict] | None = None) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab_size) logits for the next token at every position.

        ``caches`` (generation only): one dict per block holding the keys and values of the positions before
        ``idx``, which then continues them (its first token is at position cache["length"]), see ``generate``."""
        start = caches[0]["length"] if caches and caches[0] else 0
        positions = torch.arange(start, start + idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            if self.checkpoint_blocks and self.training and caches is None:
                # Activation checkpointing: keep only the block's input for the backward pass and run its
                # forward again there, trading a second forward for the memory of its activations.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, caches[i] if caches is not None else None)
        return self.lm_head(self.ln_f(x))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's matmuls,
        as in the PaLM paper's appendix B. Position embeddings are a lookup, not a matmul."""
        c = self.config
        n_params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6 * n_params + 12 * c.n_layer * c.n_embd * c.block_size

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, use_cache: bool = True) -> torch.Tensor:
        """Append ``new_tokens`` sampled tokens to ``idx`` (B, T); top_k=1 is greedy decoding.

        With the KV cache (the default) each step feeds only the newest token through the model, attending
        to the keys and values kept from earlier steps. The model never saw positions past block_size, and
        its position embeddings are absolute, so a full cache cannot simply drop its oldest entry (every
        kept key would then sit at the wrong position). When the context is full it jumps instead: the
        cache is recomputed from the last block_size // 2 tokens, and filled again from there. So the
        context slides in jumps and always holds between block_size // 2 and block_size tokens.

        use_cache=False is the plain version: every step recomputes that same context from scratch, so both give
        the same tokens (FSDP, which samples without the cache, writes the samples one process writes).
        """
        if not use_cache:
            start = max(0, idx.size(1) - self.config.block_size)  # the model never saw positions past block_size
            for _ in range(new_tokens):
                if idx.size(1) - start > self.config.block_size:  # full: jump, as the cache refills
                    start = idx.size(1) - self.config.block_size // 2
                logits = self(idx[:, start:])[:, -1, :]
                idx = torch.cat([idx, self.sample_next(logits, temperature, top_k, generator)], dim=1)
            return idx
        caches, fed = None, 0  # fed: tokens of idx the cache holds (a new cache starts at position 0)
        for _ in range(new_tokens):
            if caches is None or caches[0]["length"] == self.config.block_size:  # none yet, or full: refill
                keep = self.config.block_size if caches is None else self.config.block_size // 2
                caches, fed = [{} for _ in self.blocks], max(0, idx.size(1) - keep)
            logits = self(idx[:, fed:], caches)[:, -1, :]  # all of the context at a refill, else the newest token
            fed = idx.size(1)
            idx = torch.cat([idx, self.sample_next(logits, temperature, top_k, generator)], dim=1)
        return idx

    @staticmethod
    def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                    generator: torch.Generator | None) -> torch.Tensor:
        """(B, vocab) logits of the next token -> (B, 1) tokens drawn from them; top_k=1: the most likely, 0 or
        None: any token."""
        if top_k == 1:  # greedy: nothing to draw (and the generator is left as it was)
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k:  # 0 or None: from every token. The k best alone, even where others tie with the k-th
            best, tokens = torch.topk(logits, min(top_k, logits.size(-1)))
            return tokens.gather(-1, torch.multinomial(best.softmax(dim=-1), 1, generator=generator))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


# ----------------------------------------------------------------------------------------------------
# Data


def stdlib_corpus() -> bytes:
    """The running Python's standard library, top-level modules in sorted order: always available
    offline, and the same on every machine with the same Python version."""
    files = sorted((stdlib := Path(sysconfig.get_paths()["stdlib"])).glob("*.py"))
    if not files:  # only compiled, or zipped (Windows' embeddable Python)
        raise cli.RecipeError(f"{stdlib} holds no .py files (this Python's standard library) to train on: give --text")
    return b"\n".join(f.read_bytes() for f in files)


def read_text(path: Path) -> bytes:
    if path.is_dir() or not path.exists():
        raise cli.RecipeError(f"--text {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    if not path.is_file():  # a pipe, --text <(...), is read
        if not stat.S_ISFIFO(path.stat().st_mode):
            raise cli.RecipeError(f"--text {path} is neither a file nor a pipe")
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise cli.RecipeError(f"--text {path} is a pipe, which one process reads: under torchrun, give a file")
    data = path.read_bytes()
    if not data.strip():
        raise cli.RecipeError(f"--text {path} {'holds only whitespace' if data else 'is empty'}")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise cli.RecipeError(f"--text {path} is not UTF-8 text (byte {err.start}); re-save it as UTF-8") from None
    if b"\0" in data:  # valid UTF-8, yet no text holds NUL: a binary file, or UTF-16 (its ASCII is every other byte)
        raise cli.RecipeError(f"--text {path} holds NUL bytes (byte {data.index(0)}): a binary file, or UTF-16? "
                              "re-save it as UTF-8")
    return data


def encode(data: bytes, vocab: str | object | None) -> torch.Tensor:
    """Bytes -> token ids. ``vocab`` None means byte-level (ids 0-255); a string: ids index its characters; else
    it is the tokenizer of an --init-from folder (GPT-2's BPE, a ``tokenizers.Tokenizer``), which gives the ids."""
    if vocab is None:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # 1 byte per token: 8x less than int64
    if not isinstance(vocab, str):
        try:
            return hf_tokens.encode_text(vocab, data.decode("utf-8"))
        except Exception as err:  # a tokenizer without byte fallback meets a character it does not know
            raise cli.RecipeError(f"the folder's tokenizer cannot encode the text: {err}") from None
    index = {ch: i for i, ch in enumerate(vocab)}
    text = data.decode("utf-8")
    unknown = sorted(set(text) - index.keys())
    if unknown:
        raise cli.RecipeError(f"characters not in the model's vocabulary: {''.join(unknown[:20])!r}")
    return torch.tensor([index[ch] for ch in text], dtype=torch.int16 if len(vocab) < 2**15 else torch.int32)


def decode(tokens: list[int], vocab: str | object | None) -> str:
    """Token ids -> text. An id past the tokens (a folder's config.json may pad vocab_size) reads as U+FFFD; a
    tokenizer skips it."""
    if vocab is None:
        return bytes(min(t, 0xFF) for t in tokens).decode("utf-8", errors="replace")  # a lone 0xFF: U+FFFD
    if not isinstance(vocab, str):
        return vocab.decode(tokens, skip_special_tokens=False)
    return "".join(vocab[t] if t < len(vocab) else "\ufffd" for t in tokens)


class RandomWindows(IterableDataset):
    """An endless stream of (x, y) batches of random windows of ``tokens``; y is x shifted by one.

    Batch i is drawn from a generator seeded with (seed, i). So the stream is the same whatever the number
    of DataLoader workers (worker w of n yields batches w, w + n, ..., which the loader interleaves back
    in order), no two workers ever yield the same batches, and a resumed run starts exactly at batch
    ``start`` instead of replaying the stream.

    ``rows`` (several processes): batch i is still drawn whole (``batch_size`` is the global batch), and this
    process keeps only its slice of the windows, so the tokens of a step do not depend on how many processes
    share it. Only the slice's windows are gathered; the others cost a random number each.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, seed: int, start: int = 0,
                 rows: slice = slice(None)):
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.start, self.rows = seed, start, rows

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # crc32 mixes (seed, i) into the 32 bits that torch's CPU generator keeps of a seed
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{i}".encode()))
        starts = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=generator)
        starts = starts[self.rows]
        # broadcasting: (B, 1) + (T + 1,) -> (B, T + 1) positions; .long(): embeddings index with int64
        windows = self.tokens[starts[:, None] + torch.arange(self.block_size + 1)].long()
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self):
        worker = get_worker_info()
        i, stride = (self.start + worker.id, worker.num_workers) if worker else (self.start, 1)
        while True:
            yield self.batch(i)
            i += stride


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, V) against (B*T,)


# ----------------------------------------------------------------------------------------------------
# Training


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices (linear weights, embeddings); never gains or biases: they set scales, not patterns.
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Linear warmup from ~0 to the peak rate, then cosine decay to ``min_lr_ratio`` x peak."""
    peak_lr = optimizer.param_groups[0]["lr"]  # read before LinearLR scales it down for the first step
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup_steps + 1),
                                               total_iters=warmup_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps),
                                                        eta_min=peak_lr * min_lr_ratio)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])


def seed_dropout(seed: int, rank: int, step: int) -> None:
    """Seed dropout's masks for this rank's share of ``step``. Each rank draws its own: from one stream, every rank
    would drop the same units in its rows. And they follow from (seed, rank, step) alone, as the batches do, so a
    resumed run draws the masks it would have drawn without the interruption."""
    torch.manual_seed(zlib.crc32(f"{seed}:{rank}:{step}".encode()))


def utf8_text(value: str) -> str:
    """--prompt: text typed in another encoding than UTF-8 reaches Python as lone surrogates, which no vocabulary
    encodes: refused before training, not when the first sample is drawn."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise typer.BadParameter(f"{value!r} is not UTF-8 text (the terminal's encoding?)") from None
    return value


def prompt_tokens(prompt: str, vocab: str | object | None) -> torch.Tensor:
    """--prompt as token ids, checked before training (not at its first sample); no prompt: a newline, if the
    vocabulary has one (a tokenizer may encode it as nothing), else the first token."""
    try:
        ids = encode((prompt or ("\n" if not isinstance(vocab, str) or "\n" in vocab else "")).encode(), vocab).long()
    except cli.RecipeError as err:  # a character the vocabulary lacks
        if prompt:
            raise typer.BadParameter(str(err).replace("the text", "the prompt"), param_hint="--prompt") from None
        ids = torch.zeros(0, dtype=torch.long)  # the newline: a tokenizer without it, and without an unknown token
    if not len(ids) and prompt:
        raise typer.BadParameter(f"the tokenizer encodes {prompt!r} as no tokens at all", param_hint="--prompt")
    return ids if len(ids) else torch.zeros(1, dtype=torch.long)


@torch.profiler.record_function("evaluate")  # after an evaluation: --profile leaves it out of the step it falls in
def sample_text(model: GPT, vocab: str | object | None, prompt: str, tokens: int, temperature: float, top_k: int | None,
                seed: int, device: torch.device, use_cache: bool = True) -> str:
    model = unwrap(model)  # generation changes the sequence length every token: no compiled graph for it
    was_training = model.training
    model.eval()
    start = prompt_tokens(prompt, vocab)[None].to(device)  # all of it: generate reads its last block_size tokens
    # A generator of its own: sampling never shifts the training run's random numbers.
    generator = torch.Generator(device).manual_seed(seed)
    # inference_mode: no_grad, and no version counting of tensors either, which makes the KV cache's small per-token
    # steps a quarter faster. use_cache=False is for FSDP, whose gathering of shards fails under inference_mode.
    with torch.inference_mode() if use_cache else torch.no_grad():
        out = model.generate(start, tokens, temperature, top_k, generator, use_cache=use_cache)
    model.train(was_training)
    return decode(out[0].tolist(), vocab)


def saved_model_config(checkpoint: dict, path: Path) -> GPTConfig:
    """The checkpoint's model shape; a damaged one (or another version's) is one line, not an error deep in a layer."""
    try:
        config = GPTConfig(**checkpoint["model_config"])
    except (KeyError, TypeError) as err:  # none, not a dict, or a setting this GPTConfig lacks
        raise cli.RecipeError(f"checkpoint {path} holds no model shape this recipe builds ({err})") from None
    sizes = (config.vocab_size, config.block_size, config.n_layer, config.n_head, config.n_embd)
    if not all(type(size) is int and size >= 1 for size in sizes) or config.n_embd % config.n_head \
            or config.block_size < 2:  # generation refills its cache from the last block_size // 2 tokens
        raise cli.RecipeError(f"checkpoint {path} is damaged: its model's vocab_size, block_size, n_layer, n_head, "
                              f"n_embd {sizes} make no model (whole numbers, n_head dividing n_embd, block_size >= 2)")
    kinds = (config.attention, config.activation, config.bias)
    if not (type(config.dropout) in (int, float) and 0 <= config.dropout < 1) or kinds[0] not in ("sdpa", "einsum") \
            or kinds[1] not in ("gelu", "gelu_new") or type(config.bias) is not bool:
        raise cli.RecipeError(f"checkpoint {path} is damaged: its model's dropout {config.dropout!r}, attention, "
                              f"activation and bias {kinds} are not ones this recipe builds")
    vocab = checkpoint.get("vocab")  # None: the 256 bytes; a string: its characters
    tokens = len(vocab) if isinstance(vocab, str) else 256 if vocab is None and not checkpoint.get("tokenizer") else 0
    if tokens > config.vocab_size:  # ids past the embedding's rows: an IndexError at the first sample
        raise cli.RecipeError(f"checkpoint {path} is damaged: {tokens} tokens for a model of vocab_size "
                              f"{config.vocab_size}")
    return config


def not_for_sampling(ctx: typer.Context, from_folder: bool) -> str | None:
    """The first option given on the command line that --sample-only would ignore, or None. A folder's shape
    options are checked against it (hf_gpt2.check_options); a checkpoint's shape is its own."""
    sampling = {"sample_only", "resume", "init_from", "prompt", "sample_tokens", "temperature", "top_k", "seed",
                "device", "config_file"}
    if from_folder:
        sampling |= {"vocab_kind", "n_layer", "n_head", "n_embd", "block_size"}
    return next(("/".join(param.opts + param.secondary_opts) for param in ctx.command.params  # --compile/--no-compile
                 if param.name not in sampling and ctx.get_parameter_source(param.name).name == "COMMANDLINE"), None)


def trained_model(checkpoint_path: Path | None, folder: hf_gpt2.Folder | None,
                  device: torch.device) -> tuple[GPT, object]:
    """--sample-only: the model and its vocabulary from a checkpoint (a single file, last.pt, or a sharded folder,
    whose shards DCP reads into one whole model), or else straight from a GPT-2 folder (what does it say before
    any training?)."""
    if checkpoint_path is None:
        model = GPT(GPTConfig(**folder.shape)).to(device)
        load_model_state(model, folder.weights, folder.path, "GPT-2 folder")
        return model, folder.vocab
    checkpoint = load_trainer_state(checkpoint_path, RECIPE)
    model = GPT(saved_model_config(checkpoint, checkpoint_path)).to(device)
    if checkpoint.get("sharded"):
        load_sharded(checkpoint_path, model)
    else:
        load_model_state(model, checkpoint["model"], checkpoint_path)
    return model, hf_tokens.checkpoint_vocab(checkpoint)


# ----------------------------------------------------------------------------------------------------
# Scaling out: DDP and FSDP2 under torchrun


def resolve_attention(attention: str, device: torch.device, precision: str) -> str:
    """--attention auto: the fused kernel, except under 16-bit autocast on a CPU, where PyTorch's fused CPU attention
    runs its backward pass several times slower than the einsum written out (torch 2.14, AMD EPYC with AVX-512 BF16,
    the default model in bf16: 119 against 49 ms per step; in fp32 the fused one is the faster)."""
    if attention != "auto":
        return attention
    return "einsum" if device.type == "cpu" and precision != "fp32" else "sdpa"


def init_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment: (rank, world size, device). With plain
    ``python`` there is none: rank 0 of 1. Under torchrun there is one even of a single process, so that its DDP and
    FSDP run for real (and are checked so on a one-GPU machine). CUDA uses nccl (GPU to GPU), the CPU gloo."""
    launched = torchrun_env()  # (rank, local rank, world size), checked; None: plain python
    if launched is None:
        return 0, 1, device
    rank, local_rank, world_size = launched
    if device.type == "cuda":
        device = gpu_of(local_rank)  # one GPU per process: LOCAL_RANK picks it
        torch.cuda.set_device(device)
    # torchrun keeps one key-value store across restarts, and the process groups of every attempt would use the
    # same keys: a restarted group could read a dead worker's address (pytorch/pytorch#167288). A prefix per
    # attempt gives each its own keys.
    store, _, _ = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, device_id=device if device.type == "cuda" else None)
    return rank, world_size, device


def shard_model(model: GPT, device: torch.device, world_size: int, precision: str) -> GPT:
    """FSDP2: each block's parameters become DTensors sharded across the ranks (dim 0), gathered whole just
    before the block runs and freed again after it, in forward and backward; gradients are reduce-scattered
    back to shards, so each rank holds 1/N of weights, gradients and AdamW's moments. The root call covers
    what no block owns (embeddings, final norm, the tied head)."""
    # An explicit mesh on the device's type: gloo for "cpu", nccl for "cuda" (pytorch/pytorch#132471: left
    # to itself, fully_shard assumes CUDA).
    mesh = init_device_mesh(device.type, (world_size,))
    # bf16: compute with bf16 copies of the weights, but reduce gradients in fp32 (sums of many small bf16
    # numbers lose their low bits) and keep fp32 master weights and optimizer state.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def mean_over_ranks(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each rank evaluated its equal slice of the validation batches: the mean of the means is the mean."""
    if not dist.is_initialized():
        return metrics
    values = torch.tensor(list(metrics.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return dict(zip(metrics, (values / dist.get_world_size()).tolist(), strict=True))


def stop_agreed(stop: StopRequest, device: torch.device) -> bool:
    """Whether any rank was asked to stop (Ctrl-C, SIGTERM): every rank must stop, and save, at the same step,
    so they agree on it with one all-reduce (a MAX of the flags)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:  # (torchrun's one process: no one to agree with)
        return stop.requested
    flag = torch.tensor([float(stop.requested)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def leave_process_group() -> None:
    """End a torchrun worker that has finished: every rank reaches the barrier (its files written), then the
    group is destroyed, so that no rank waits on one that is gone."""
    dist.barrier()
    dist.destroy_process_group()


def main(
    ctx: typer.Context,
    text: Annotated[Path | None, typer.Option(parser=cli.given_path, metavar="<path>",
                                              help="Train on this UTF-8 file [default: Python's stdlib].")] = None,
    vocab_kind: Annotated[Literal["bytes", "chars"] | None, typer.Option(
        "--vocab", help="Tokens: bytes (256) or the characters seen [default: bytes; --init-from: the folder's].")
    ] = None,
    init_from: Annotated[Path | None, typer.Option(
        parser=cli.given_path, metavar="<path>",
        help="Start from a GPT-2 folder in Hugging Face's format (gpt2 as `hf download` saves it, or an export): "
             "its shape, weights and tokenizer.")] = None,
    steps: cli.Steps = 1200,
    max_steps: cli.MaxSteps = None,
    batch_size: Annotated[int, typer.Option(
        min=1, help="Sequences per micro-batch in each process; a step is --grad-accum of them (--global-batch "
                    "sets it for you).")] = 32,
    grad_accum: Annotated[int, typer.Option(min=1, help="Micro-batches accumulated per optimizer step.")] = 1,
    lr: cli.LearningRate = 2e-3,
    min_lr_ratio: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="Rate the cosine reaches at the run's end, as a share of --lr.")] = 0.1,
    warmup_steps: Annotated[int | None, typer.Option(min=0, help="Steps of linear warmup [default: 100, or a tenth "
                                                     "of --steps if that is less].")] = None,
    weight_decay: Annotated[float, typer.Option(callback=cli.finite_non_negative,
                                                help="AdamW weight decay on matrices.")] = 0.1,
    beta1: Annotated[float, typer.Option(callback=cli.checked(lambda v: 0 <= v < 1, "in [0, 1)"),
                                         help="AdamW's first-moment decay, in [0, 1).")] = 0.9,
    beta2: Annotated[float, typer.Option(
        callback=cli.checked(lambda v: 0 <= v < 1, "in [0, 1)"),
        help="AdamW's second-moment decay, in [0, 1): 0.99 averages the squared gradients over ~100 steps, which "
             "suits the small, noisy batches of a CPU run; 0.95 (GPT-2/3's) reacts faster, for large batches."),
    ] = 0.99,
    max_grad_norm: Annotated[float, typer.Option(min=0.0, help="Gradient clipping norm (0: off).")] = 1.0,
    n_layer: Annotated[int | None, typer.Option(min=1, max=1000, help="Transformer blocks [default: 4; --init-from: "
                                                "the folder's].")] = None,
    n_head: Annotated[int | None, typer.Option(min=1, help="Attention heads, must divide --n-embd [default: 4; "
                                               "--init-from: the folder's].")] = None,
    n_embd: Annotated[int | None, typer.Option(min=1, help="Width of the residual stream [default: 128; --init-from: "
                                               "the folder's].")] = None,
    block_size: Annotated[int | None, typer.Option(min=2, help="Context length in tokens [default: 128; --init-from: "
                                                   "the folder's].")] = None,
    dropout: Annotated[float, typer.Option(min=0.0, max=0.9, help="Dropout (0 suits short runs).")] = 0.0,
    attention: Annotated[
        Literal["auto", "sdpa", "einsum"], typer.Option(help="sdpa: fused kernel; einsum: the same math written out; "
                                                              "auto: einsum under bf16 or fp16 on a CPU, else sdpa.")
    ] = "auto",
    eval_every: Annotated[int, typer.Option(min=1, help="Evaluate and sample every N steps.")] = 200,
    eval_batches: Annotated[int, typer.Option(min=1, help="Fixed validation batches per evaluation.")] = 20,
    sample_tokens: Annotated[int, typer.Option(min=1, help="Tokens per text sample.")] = 300,
    temperature: Annotated[float, typer.Option(callback=cli.checked(lambda v: 0.01 <= v < math.inf, "a finite "
                                               "number >= 0.01"), help="Sampling temperature (<1: safer).")] = 0.8,
    top_k: Annotated[int, typer.Option(min=0, help="Sample only from the k likeliest tokens (0: from all; 1: "
                                                   "greedy).")] = 50,
    prompt: Annotated[str, typer.Option(callback=utf8_text, help="Text the samples continue.")] = "",
    sample_only: Annotated[bool, typer.Option("--sample-only", help="Only generate, from --resume or --init-from; "
                                              "training options are refused.")] = False,
    peak_flops: Annotated[float | None, typer.Option(
        callback=cli.checked(lambda v: 1 <= v < math.inf, "a finite number >= 1"),
        help="Peak FLOP/s for MFU [default: a known GPU's datasheet figure, else measured].")] = None,
    seed: cli.Seed = 0,
    device: cli.Device = "auto",
    precision: cli.Precision = "auto",
    compile: cli.Compile = False,
    num_workers: cli.NumWorkers = 0,
    run_dir: cli.RunDir = None,
    resume: cli.Resume = None,
    config_file: cli.ConfigFile = None,
    checkpoint_every: cli.CheckpointEvery = None,
    log_every: cli.LogEvery = None,
    profile: cli.Profile = None,
    parallel: Annotated[Literal["auto", "none", "ddp", "fsdp"], typer.Option(
        help="Under torchrun: ddp replicates the model, fsdp shards it (FSDP2, sharded DCP checkpoints); auto "
        "is ddp there and none in one process. Without torchrun every choice trains one process.")] = "auto",
    global_batch: Annotated[int | None, typer.Option(
        min=1, help="Sequences per optimizer step across all processes; sets --batch-size to it / (processes x "
        "--grad-accum), so an elastic job keeps its batch when its world size changes [default: --batch-size x "
        "processes x --grad-accum].")] = None,
    activation_checkpointing: Annotated[bool, typer.Option(
        "--activation-checkpointing", help="Recompute each block in the backward pass: less memory, more time.")
    ] = False,
):
    """Train a tiny GPT on text (default: the Python standard library), or sample from a trained one."""
    options = {k: v for k, v in locals().items() if k != "ctx"}  # the run's config, as given (batch sizes below)
    if init_from is None:  # a model of its own: the defaults of what a --init-from folder sets (None: the folder's)
        vocab_kind, n_layer, n_head, n_embd, block_size = vocab_kind or "bytes", n_layer or 4, n_head or 4, \
            n_embd or 128, block_size or 128
        options.update(vocab_kind=vocab_kind, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)
    if n_embd and n_head and n_embd % n_head:
        raise typer.BadParameter(f"{n_embd} is not divisible by --n-head {n_head}", param_hint="--n-embd")
    if parallel == "fsdp" and precision == "fp16":
        raise typer.BadParameter("fp16 needs a GradScaler of sharded gradients: use bf16 with --parallel fsdp",
                                 param_hint="--precision")
    if global_batch is not None and ctx.get_parameter_source("batch_size").name == "COMMANDLINE":
        if ctx.get_parameter_source("global_batch").name == "DEFAULT_MAP":  # a --config replay's: the option given wins
            global_batch = None
        else:
            raise typer.BadParameter("--global-batch sets it for you (to the global batch / (processes x "
                                     "--grad-accum)): give one of the two", param_hint="--batch-size")
    if sample_only:
        if resume is not None and ctx.get_parameter_source("init_from").name == "DEFAULT_MAP":
            init_from = None  # a --config replay's folder, which the checkpoint given was trained from
        if resume == "auto" or (resume is None) == (init_from is None):
            raise typer.BadParameter("--sample-only needs a checkpoint file, or else an --init-from folder (one of "
                                     "them)", param_hint="--resume")
        if ignored := not_for_sampling(ctx, from_folder=init_from is not None):
            raise typer.BadParameter(f"does nothing with --sample-only, which samples from the "
                                     f"{'folder' if init_from else 'checkpoint'} as it is: leave it out",
                                     param_hint=ignored)
        folder = hf_gpt2.read_folder(init_from) if init_from else None
        if folder:  # it samples from the folder as it is: an option that contradicts it is refused, as in training
            hf_gpt2.check_options(folder, vocab=vocab_kind, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                  block_size=block_size)
        model, vocab = trained_model(Path(resume) if resume else None, folder, resolve_device(device))
        device = next(model.parameters()).device
        text = sample_text(model, vocab, prompt, sample_tokens, temperature, top_k, seed, device)
        if cli.launched_as_rank_0():  # under torchrun every process samples the same text: printed once
            print(text)
        return
    # A --config replay keeps its warm-up, unless that was the default for its --steps and other --steps are given:
    # then it is derived again, so that a short run still reaches its peak rate
    replayed = ctx.default_map or {}
    derived = type(old := replayed.get("steps")) is int and replayed.get("warmup_steps") == min(100, old // 10)
    if warmup_steps is None or ctx.get_parameter_source("warmup_steps").name == "DEFAULT_MAP" and derived and \
            steps != old:
        warmup_steps = options["warmup_steps"] = min(100, steps // 10)
    elif warmup_steps >= steps:
        raise typer.BadParameter(f"must be below --steps {steps}: the whole run would be warm-up, never at --lr",
                                 param_hint="--warmup-steps")
    rank, world_size, device = init_distributed(resolve_device(device))
    if parallel == "auto":
        parallel = "ddp" if dist.is_initialized() else "none"
    if parallel == "none" and world_size > 1:
        raise cli.RecipeError(f"--parallel none trains one process, but torchrun started {world_size}: use "
                              "--parallel ddp or fsdp, or plain python")
    # World-size-invariant batches: what must stay the same on a resume is the global batch, not the per-process
    # one (a run saved at 2 x 16 may go on at 1 x 32, or at 1 x 16 with --grad-accum 2).
    if global_batch is not None:
        if global_batch % (world_size * grad_accum):
            raise typer.BadParameter(f"{global_batch} does not split into {world_size} process(es) x --grad-accum "
                                     f"{grad_accum}", param_hint="--global-batch")
        batch_size = global_batch // (world_size * grad_accum)
    global_batch = batch_size * world_size * grad_accum
    # The parallelism may change on a resume (DDP at 2 to one process, FSDP at 4 to FSDP at 2), the checkpoint
    # format may not: sharded (FSDP, common/sharded.py) or the single file last.pt (one process, DDP).
    sharded = parallel == "fsdp"
    # (--parallel as given: auto, replayed by --config under torchrun, is DDP there; world_size says what it was)
    options.update(batch_size=batch_size, global_batch=global_batch,
                   checkpoint_format="sharded (--parallel fsdp)" if sharded else "single file")
    config = cli.as_config(options)  # every option as resolved: config.json, and what a resume must match
    config["text"] = same_file(text)  # the file, absolute: a resume from another folder compares that one
    last_checkpoint = last_sharded if sharded else last_file  # the last good checkpoint, which a divergence names
    # Rank 0 names, checks and locks the run directory (every rank must use that one) and finds the checkpoint;
    # every rank then reads the same checkpoint. Only rank 0 writes files, but under FSDP every rank its shards.
    # --resume auto looks for step folders in either format: a sharded run relaunched without --parallel fsdp is
    # then refused for its format (below), not started afresh over it
    run = from_rank_0(lambda: open_run_dir(RECIPE, run_dir, resume, partial(last_sharded, warn=sharded)))
    checkpoint = resume_checkpoint(run, RECIPE, config, load=load_trainer_state, may_change={
        "eval_batches", "sample_tokens", "temperature", "top_k", "prompt", "peak_flops", "batch_size", "grad_accum",
        "parallel", "activation_checkpointing", "attention", "text"})
    if checkpoint:  # --text as the file it is, however spelled: a relative path resumed by its absolute one goes on
        check_same_run({"config": {"text": same_file(checkpoint["config"].get("text"))}}, run.resume_from,
                       {"text": config["text"]})
    if already_finished(run, checkpoint, steps=steps, max_steps=max_steps):
        if dist.is_initialized():
            leave_process_group()
        return
    chosen = resolve_precision(precision, device, checkpoint)  # --precision auto: bf16 where native
    precision = chosen.precision_used
    attention = resolve_attention(attention, device, precision)
    config |= chosen._asdict() | {"attention_used": attention}  # the option as given, the precision used, and why
    # The same seed on every rank: every rank builds the same initial weights (FSDP shards them as they are;
    # DDP broadcasts rank 0's anyway), and draws the same validation batches. Dropout is seeded per rank (seed_dropout).
    seed_everything(seed)

    # --init-from: a GPT-2 folder in Hugging Face's format gives the model's shape, its weights and its tokens (a
    # resume takes them from its checkpoint instead, so the folder is read only at the start). common/hf_gpt2.py
    # converts its names and layout; options that contradict it are refused.
    folder = None
    if init_from is not None and not checkpoint:
        folder = hf_gpt2.read_folder(init_from)
        hf_gpt2.check_options(folder, vocab=vocab_kind, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                              block_size=block_size)

    # Data: the last 10% of the corpus is the validation split
    corpus = read_text(text) if text else stdlib_corpus()
    if checkpoint:  # the tokens the run started with
        vocab = hf_tokens.checkpoint_vocab(checkpoint)
    elif folder:
        vocab = folder.vocab
    else:
        vocab = None if vocab_kind == "bytes" else "".join(sorted(set(corpus.decode("utf-8"))))
    if init_from is None:
        model_config = GPTConfig(256 if vocab is None else len(vocab), block_size, n_layer, n_head, n_embd, dropout,
                                 attention)
    else:  # the folder's shape (a resume's checkpoint has it from there), with this run's dropout and attention
        model_config = GPTConfig(**{**asdict(saved_model_config(checkpoint, run.resume_from) if checkpoint else
                                             GPTConfig(**folder.shape)), "dropout": dropout, "attention": attention})
        block_size = model_config.block_size
    tokens = encode(corpus, vocab)
    prompt_tokens(prompt, vocab)  # a --prompt the tokens cannot spell: refused now, not after training
    split = int(0.9 * len(tokens))
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    if len(val_tokens) <= block_size:
        blocks = f"--block-size {block_size}" if init_from is None else f"{init_from}'s blocks ({block_size} tokens)"
        raise cli.RecipeError(f"the text has {len(tokens)} tokens: too short for {blocks} (its last 10%, the "
                              "validation split, needs more than one block)")
    # Validation batches of the global batch's size, each rank its slice: the same figures at any world size
    rows = slice(rank * batch_size * grad_accum, (rank + 1) * batch_size * grad_accum)  # this rank's sequences
    val_stream = RandomWindows(val_tokens, block_size, global_batch, seed + 1, rows=rows)
    val_batches = []  # the same batches at every evaluation, in micro-batches no larger than training's (memory)
    for i in range(eval_batches):
        inputs, targets = val_stream.batch(i)
        val_batches += zip(inputs.split(batch_size), targets.split(batch_size), strict=True)

    model = GPT(model_config).to(device)
    if folder:
        load_model_state(model, folder.weights, init_from, "GPT-2 folder")
    model.checkpoint_blocks = activation_checkpointing
    flops_per_token = model.flops_per_token()
    if parallel == "ddp" and dist.is_initialized():
        # DDP: every rank keeps the whole model; gradients are averaged (all-reduced) during the backward pass
        # The only buffers are the causal masks, constant: no need to send rank 0's before every forward, as
        # DDP does by default (12 MB a step for GPT-2's)
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        forward_sync_buffers=False)
    elif sharded and dist.is_initialized():
        # Sharded across the ranks; in one process (plain python) there is nothing to shard, and the model stays
        # as it is while its checkpoints stay sharded: a sharded run can be resumed or sampled on one machine.
        model = shard_model(model, device, world_size, precision)
    if compile:
        model = torch.compile(model)
    ddp = getattr(model, "_orig_mod", model)  # the DDP module, also inside torch.compile's wrapper
    # fused: one kernel for the whole update instead of a dozen per tensor (about 5x faster on a CPU)
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=(beta1, beta2),
                                  fused=device.type in ("cuda", "cpu"))
    scheduler = warmup_cosine(optimizer, warmup_steps, steps, min_lr_ratio)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")  # fp16 only, as in mixed_precision
    # MFU's yardstick: the device's peak for this precision (a datasheet figure for known GPUs, else measured)
    peak_flops, peak_source = (peak_flops, "--peak-flops") if peak_flops else \
        device_peak_flops(device, PRECISION_DTYPES[precision])
    config |= {"peak_flops_used": peak_flops, "peak_source": peak_source}  # MFU's denominator, on the record

    total_steps = min(steps, max_steps or steps)
    every = log_interval(eval_every, log_every)  # also how often the ranks agree on a stop
    log = RunLog(run, RECIPE, total_steps=total_steps, every=every, eval_every=eval_every, unit="tokens",
                 last_checkpoint=last_checkpoint, write=rank == 0)
    best = BestScore("val_loss", higher_is_better=False)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, parts={"log": log, "best": best},
                 data={**hf_tokens.vocab_state(vocab), "model_config": asdict(model_config)},
                 data_id=checksum(train_tokens))  # a resume on another text is refused
    checkpoints = ShardedCheckpointer(run, RECIPE, config, best=best, **state) if sharded else \
        Checkpointer(run, RECIPE, config, **state)
    step = checkpoints.restore(checkpoint) if checkpoint else 0
    if checkpoint and isinstance(ddp, DistributedDataParallel):
        # DDP buckets the gradients it all-reduces in parameter order, then, after the first backward, in the order
        # they came. One backward first, its gradients dropped, gives a resumed run the buckets of an unbroken one:
        # with three ranks or more, other buckets add the ranks' gradients in another order (another rounding).
        with autocast(device, precision):
            lm_loss(model(val_batches[0][0].to(device)), val_batches[0][1].to(device)).backward()
        optimizer.zero_grad(set_to_none=True)

    def save(name: str = "last.pt") -> None:
        # FSDP: every rank writes its shards; otherwise rank 0 writes the file while the others wait for it
        return checkpoints.save(step, name) if sharded else from_rank_0(lambda: checkpoints.save(step, name))

    def stop_saved() -> None:  # on Ctrl-C or SIGTERM, once this step is saved
        if sharded:
            checkpoints.finish()  # last.pt and best.pt of this step too, for sampling and export.py meanwhile
        stop.exit(step, run.path)

    # Batch i of the stream is step i's global batch, of which this rank takes its rows: the stream's position
    # follows from the step, so a resumed run draws the batches it had not reached, at any world size.
    train_stream = RandomWindows(train_tokens, block_size, global_batch, seed, start=step, rows=rows)
    # batch_size=None: the stream yields whole batches. The loader's own generator seeds its workers: the global
    # RNG's, drawn at every new iterator, would shift the dropout masks of a resumed run.
    batches = iter(DataLoader(train_stream, batch_size=None, num_workers=num_workers, pin_memory=device.type == "cuda",
                              generator=torch.Generator().manual_seed(seed),
                              worker_init_fn=ignore_stop_signals if num_workers else None))  # the main process saves
    log.start(step, config, device, world_size)
    if checkpoint and best.step == step and not sharded:  # a kill may have come between last.pt and best.pt
        save("best.pt")  # (sharded, both are one folder, and best.pt a file made from it at the end)
    source = text.resolve() if text else "the Python standard library"
    log.print(f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens of {source} | vocab "
              f"{model_config.vocab_size} | {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{model_config.attention} attention | peak "
              f"{peak_flops / 1e9:,.0f} GFLOP/s ({peak_source}) | parallel {parallel}: {type(ddp).__name__} | "
              f"global batch {global_batch} ({world_size} x {batch_size} x {grad_accum})")
    stop = StopRequest()  # Ctrl-C and SIGTERM: save and exit at the end of the step
    profiler = StepProfiler(run.path, profile, device, write=rank == 0)  # --profile N
    reset_peak_memory(device)  # the peak of training, not of setting up
    memory = {}
    unit = "byte" if vocab is None else "char" if isinstance(vocab, str) else "token"

    def validate(weights: nn.Module) -> dict[str, float]:
        val = mean_over_ranks(evaluate(weights, val_batches, lm_loss, device=device, precision=precision), device)
        return val | {f"bits_per_{unit}": val["loss"] / math.log(2)}

    def evaluate_and_save() -> None:  # evaluate, sample, keep the best, save
        log.flush()  # the training steps' time ends here: evaluating is not training
        # MFU: the model FLOPs of every rank's tokens over the peak of every rank's device
        mfu = flops_per_token * log.throughput / (peak_flops * world_size)
        val = validate(model)
        log.eval(step, val=val, note=f"mfu {mfu:.1%}")
        # Every rank samples (under FSDP each forward gathers the shards from all of them), the same tokens.
        # Not with the KV cache there: FSDP's pre-forward hooks copy a module's arguments (casting them to
        # bf16, moving them to the GPU), so the cache dicts the blocks fill in would be copies.
        sample = sample_text(model, vocab, prompt, sample_tokens, temperature, top_k, seed, device,
                             use_cache=not (sharded and dist.is_initialized()))
        log.print(f"--- sample at step {step} ---\n{sample}\n---")
        if log.writer:
            log.writer.add_scalar("perf/mfu", mfu, step)
            log.writer.add_text("sample", "    " + sample.replace("\n", "\n    "), step)  # indented: verbatim
        improved = best.improved(val["loss"], step)
        save()  # first: if the step is the best, last.pt says so (and a resume here writes best.pt)
        if improved:
            save("best.pt")

    # saved between evaluations and resumed with --max-steps there (None: a checkpoint from before evaluated_at)
    if step == total_steps and step % eval_every and log.evaluated_at not in (step, None):
        evaluate_and_save()
    while step < total_steps:
        current_lr = scheduler.get_last_lr()[0]
        # Gradient accumulation: grad_accum micro-batches, each loss divided by their number, add up to the
        # gradient of one batch grad_accum times larger, in the memory of one micro-batch.
        # Under DDP and FSDP each rank's mean loss is averaged across the ranks with the gradients, so the
        # step's gradient is that of the mean over the whole global batch.
        optimizer.zero_grad(set_to_none=True)  # here, not after the step: the memory account sees gradients
        if model_config.dropout:
            seed_dropout(seed, rank, step)
        step_loss = torch.zeros((), device=device)
        x, y = (t.to(device, non_blocking=True) for t in next(batches))  # this rank's rows of the step
        for i, (x_micro, y_micro) in enumerate(zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True)):
            # DDP all-reduces in every backward unless told not to: only the last micro-batch's needs to,
            # the others just add up in .grad. (FSDP reduce-scatters every micro-batch, so gradients stay
            # sharded in between: more messages, but 1/N of the gradient memory.)
            last = i == grad_accum - 1
            with ddp.no_sync() if isinstance(ddp, DistributedDataParallel) and not last else nullcontext():
                with autocast(device, precision):
                    loss = lm_loss(model(x_micro), y_micro) / grad_accum
                scaler.scale(loss).backward()  # gradients add up in .grad until zero_grad
            step_loss += loss.detach().float()
        if dist.is_initialized():  # the global batch's loss: the log's, and a divergence every rank sees at once
            dist.all_reduce(step_loss)
            step_loss /= world_size
        scaler.unscale_(optimizer)  # fp16: clip the true gradients, not the scaled ones
        # With FSDP each rank holds shards of the gradients: clip_grad_norm_ on DTensors sums the squares
        # over all ranks' shards, so the norm (and the clipping) is that of the whole gradient.
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        skipped = ~torch.isfinite(grad_norm) if scaler.is_enabled() else None
        step += 1
        log.train(step, StepStats(step_loss, grad_norm, skipped), lr=current_lr, items=global_batch * block_size)
        profiler.step()
        if not memory:  # after the first step: weights, gradients and AdamW's moments all exist now
            memory = memory_account(model, optimizer, device)
            log.print(format_account(memory, type(optimizer).__name__))

        if step % eval_every == 0 or step == total_steps:
            evaluate_and_save()
            if stop_agreed(stop, device):
                stop_saved()
        elif (step % every == 0 or world_size == 1) and stop_agreed(stop, device):  # Ctrl-C, SIGTERM
            save()  # at once in one process; torchrun's ranks agree on a stop every --log-every steps
            stop_saved()
        elif checkpoint_every and step % checkpoint_every == 0:  # or every --checkpoint-every steps
            save()

    stop.loop_ended(step, run.path)  # from here a signal exits at once: the run's last step is saved
    if sharded:
        checkpoints.finish()  # last.pt and best.pt as single files too, for one process (sampling, export)
    mfu = flops_per_token * log.throughput / (peak_flops * world_size)
    log.finish(step, best.metrics() | {"mfu": mfu, "peak_flops": peak_flops, "peak_source": peak_source,
                                       "world_size": world_size} | (
        {"memory": with_peaks(memory, device)} if memory else {}))
    if dist.is_initialized():
        leave_process_group()


if __name__ == "__main__":
    cli.run_recipe(main)
