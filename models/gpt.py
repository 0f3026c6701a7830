"""Llama-style decoder-only transformer: the reference dense model.

One plain file, read top to bottom (nanoGPT style). Pre-norm blocks with RMSNorm,
grouped-query attention with rotary position embeddings (RoPE), a SwiGLU feed-forward,
and an untied (or optionally tied) output head.

What it guarantees:
- Submodule and parameter names are stable and Llama-like (`tok_emb`, `layers.{i}.attn.wq`,
  `layers.{i}.ffn.w1`, `norm`, `lm_head`, ...); Plans key on them.
- Captures with `torch.export.export(model, (idx,), strict=False)`: no complex numbers,
  no data-dependent shapes; the training IR keeps `aten.embedding`, `aten.linear`,
  `aten.rms_norm`, `aten.silu` and `aten.scaled_dot_product_attention` whole.
- Builds under `torch.device("meta")` without touching data; `reset_parameters()` re-draws
  every weight from the current RNG and recomputes the RoPE tables, so a meta model is
  materialised with `model.to_empty(device=...)` followed by `model.reset_parameters()`.
- RoPE is the rotate-half form (the layout Hugging Face's Llama uses), so HF Llama
  checkpoints load by renaming keys alone, with no permutation of `wq`/`wk` rows.

It reads and writes no `node.meta` keys (it is a model, not a pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int  # tokens in the vocabulary (V)
    dim: int  # model width (C)
    n_layers: int  # transformer blocks
    n_heads: int  # query heads (H); head_dim = dim // n_heads
    n_kv_heads: int  # key/value heads (grouped-query attention); divides n_heads
    ffn_dim: int  # SwiGLU hidden width
    max_seq_len: int  # rows of the precomputed RoPE tables: the longest T forward accepts
    rope_theta: float = 10000.0  # RoPE base; Llama 3 uses 500000
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # lm_head.weight is tok_emb.weight
    dropout: float = 0.0  # nanoGPT's: embeddings, attention probabilities, each residual branch; 0 adds no op

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; pick n_heads dividing dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention needs n_kv_heads to divide n_heads"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} is odd; RoPE rotates pairs, so make dim // n_heads even")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls) -> GPTConfig:
        # small enough for gloo parity tests to run in well under a second per step
        return cls(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)

    @classmethod
    def llama2_7b(cls) -> GPTConfig:
        # meta-llama/Llama-2-7b-hf: 6.74e9 parameters
        return cls(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_seq_len=4096)

    @classmethod
    def llama3_8b(cls) -> GPTConfig:
        # meta-llama/Meta-Llama-3-8B: 8.03e9 parameters
        return cls(
            vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
            max_seq_len=8192, rope_theta=500000.0,
        )  # fmt: skip

    @classmethod
    def llama3_70b(cls) -> GPTConfig:
        # meta-llama/Meta-Llama-3-70B: 70.6e9 parameters
        return cls(
            vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
            max_seq_len=8192, rope_theta=500000.0,
        )  # fmt: skip

    @classmethod
    def llama3_405b(cls) -> GPTConfig:
        # meta-llama/Llama-3.1-405B: 405.9e9 parameters. Its 128K context uses Llama 3.1's
        # rope frequency scaling, which this model does not implement; the sizes are exact.
        return cls(
            vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
            max_seq_len=131072, rope_theta=500000.0,
        )  # fmt: skip


# ----------------------------------------------------------------------------- RoPE


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim), fp32, in rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # (hd/2,)
    pos = torch.arange(max_seq_len, dtype=torch.float32, device=device)  # (S,)
    angles = torch.outer(pos, inv_freq)  # (S, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, hd): pair i is (i, i + hd/2)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., hd/2) each
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, H, hd); cos, sin: (T, hd). Real arithmetic only: complex ops export badly.
    cos = cos[:, None, :].to(x.dtype)  # (T, 1, hd)
    sin = sin[:, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, KV, hd) -> (B, T, KV * n_rep, hd); each kv head serves n_rep query heads."""
    if n_rep == 1:
        return x
    B, T, KV, hd = x.shape
    return x[:, :, :, None, :].expand(B, T, KV, n_rep, hd).reshape(B, T, KV * n_rep, hd)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # no op at all when p == 0, so a model without dropout captures the same graph as before
    return F.dropout(x, p, training) if p > 0 else x


# ----------------------------------------------------------------------------- blocks


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.dropout = getattr(config, "dropout", 0.0)  # the MoE model shares this class

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, KV, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, KV, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = repeat_kv(k, self.n_heads // self.n_kv_heads)  # (B, T, H, hd)
        v = repeat_kv(v, self.n_heads // self.n_kv_heads)  # (B, T, H, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        if self.dropout > 0 and self.training:  # dropout on the attention probabilities
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)  # (B, H, T, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, C)
        return _dropout(self.wo(y), self.dropout, self.training)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). w1 is the gate, w3 the up projection, w2 the down."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.dropout, self.training)  # (..., dim)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn = FeedForward(config.dim, config.ffn_dim, config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        x = x + self.ffn(self.ffn_norm(x))  # (B, T, C)
        return x


# ----------------------------------------------------------------------------- model


def init_weights(model: nn.Module) -> None:
    """Normal(0, 0.02) for every Linear and Embedding weight, zeros for biases, ones for
    RMSNorm weights; modules in `model.modules()` order, so the result depends only on the
    RNG state. Meta tensors are left as they are (init on meta draws nothing)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one Parameter, two uses
        # RoPE tables: derived, not state, so non-persistent (absent from state_dict);
        # filled by reset_parameters on whatever device the model lives on.
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw every weight from the current RNG and recompute the RoPE tables."""
        init_weights(self)
        cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta, self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}; raise max_seq_len in the config")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd)
        x = _dropout(self.tok_emb(idx), self.config.dropout, self.training)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, C)
        x = self.norm(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all B * T tokens. logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
