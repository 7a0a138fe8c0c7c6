"""Item 9. Generation: the tiny transformer's KV cache against recomputing the whole context every token."""

import statistics
import time

import torch

from benchmarks import harness
from benchmarks.harness import interleaved, load_recipe, summarise


def kv_cache(quick: bool) -> dict:
    tt = load_recipe("tiny_transformer")
    torch.manual_seed(0)
    # quick: a small model whose block the tokens outgrow twice, so that the refill is checked there too
    shape = dict(block_size=16, n_layer=2, n_embd=32) if quick else dict(block_size=128, n_layer=4, n_embd=128)
    model = tt.GPT(tt.GPTConfig(vocab_size=256, n_head=4, **shape)).to(harness.DEVICE).eval()
    prompt = torch.randint(256, (1, shape["block_size"] // 2), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(harness.DEVICE)
    new_tokens, repeats = (24, 1) if quick else (500, 3)  # 64 + 500 > 128: the cache is refilled on the way

    def tokens_per_s(use_cache: bool) -> float:
        started = time.perf_counter()
        with torch.inference_mode():  # both as the recipe's sample_text runs the cache
            model.generate(prompt, new_tokens, top_k=1, use_cache=use_cache).tolist()  # (a GPU's: waited for)
        return new_tokens / (time.perf_counter() - started)

    tokens_per_s(True), tokens_per_s(False)  # warm-up, both: neither side's first round runs cold
    runs = interleaved(repeats, alternate=True, cache=lambda: tokens_per_s(True), recompute=lambda: tokens_per_s(False))
    speedup = summarise([a / b for a, b in zip(runs["cache"], runs["recompute"], strict=True)])
    # every token, past the block too: the recompute takes the cache's contexts (it jumps where the cache refills)
    same = torch.equal(model.generate(prompt, new_tokens, top_k=1),
                       model.generate(prompt, new_tokens, top_k=1, use_cache=False))
    return {"item": f"Generation: KV cache vs full recompute, {new_tokens} greedy tokens from a "
                    f"{prompt.shape[1]}-token prompt ({shape['n_layer']}x{shape['n_embd']}, block "
                    f"{shape['block_size']}, batch 1)",
            "result": f"{speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f}; "
                      f"{statistics.median(runs['cache']):,.0f} vs {statistics.median(runs['recompute']):,.0f} "
                      f"tok/s); same greedy tokens: {'yes' if same else 'NO'}",
            "target": ">= 3x, same tokens", "met": speedup["median"] >= 3 and same, "kv_cache_speedup": speedup,
            "tokens_per_s": {k: statistics.median(v) for k, v in runs.items()}, "same_tokens": same}

