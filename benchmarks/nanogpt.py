"""nanoGPT's model, rebuilt as the reference the tiny transformer is measured against (items 4 and 12)."""

import torch
import torch.nn.functional as F
from torch import nn


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

