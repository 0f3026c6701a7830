"""The GPT-3 models of Korthikanti et al. 2022 (Megatron-LM's GPT), as benchmarks/bench_published.py
builds them on meta for its Megatron rows: pre-LayerNorm blocks, a fused QKV with biases laid out
per head, a 4h GeLU (tanh) MLP, learned positions, the output layer tied to the embedding."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GPT3Block(nn.Module):
    """Megatron's GPT block: pre-LayerNorm, fused QKV with biases, 4h GeLU (tanh) MLP."""

    def __init__(self, h: int, a: int, p: float):
        super().__init__()
        self.a, self.p = a, p
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, H)
        B, S, H = x.shape
        # Megatron's fused QKV output is laid out per head, [a, 3, H/a] (ParallelAttention: "[sq, b, (np * 3 *
        # hn)] --> [sq, b, np, 3 * hn]", then split_tensor_along_last_dim), so a column shard of it on tp holds
        # whole heads' q, k and v; a [3, a, H/a] layout would cut across q | k | v and cost all-to-alls
        q, k, v = self.qkv(self.ln1(x)).view(B, S, self.a, 3, H // self.a).permute(3, 0, 2, 1, 4)  # (B, a, S, H/a)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + F.dropout(self.proj(o.transpose(1, 2).reshape(B, S, H)), self.p, self.training)
        z = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))  # (B, S, H)
        return x + F.dropout(z, self.p, self.training)


class GPT3(nn.Module):
    def __init__(self, h: int, a: int, layers: int, vocab: int = 51200, seq: int = 2048, p: float = 0.1):
        super().__init__()
        self.p = p
        self.tok_emb = nn.Embedding(vocab, h)
        self.pos_emb = nn.Embedding(seq, h)
        self.layers = nn.ModuleList(GPT3Block(h, a, p) for _ in range(layers))
        self.norm = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # Megatron ties the output layer to the embedding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, S)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(self.tok_emb(idx) + self.pos_emb(pos), self.p, self.training)  # (B, S, H)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # (B, S, V)
