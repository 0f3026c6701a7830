"""Mixtral-style mixture-of-experts decoder: the reference MoE model.

The same decoder as `gpt.py` (attention, RoPE, RMSNorm are imported from there) with the
SwiGLU feed-forward of every block replaced by `MoEFeedForward`, named `moe`: a linear
router `gate`, softmax, top-k, top-k weights renormalised to sum to one (as Mixtral does),
and `experts`, a ModuleList of SwiGLU experts (`w1` gate, `w3` up, `w2` down).

Dispatch uses a static capacity so that `torch.export.export(model, (idx,), strict=False)`
captures it with no data-dependent shapes:
- N = B * T tokens, K = top_k, E = n_experts. Every (token n, choice k) is an assignment.
- Capacity C per expert: N when `capacity_factor is None` (dropless: a token picks an expert
  at most once, so N slots always suffice), else ceil(capacity_factor * N * K / E), capped at N.
- Queue order: an assignment's position in its expert's queue counts the earlier
  assignments to that expert in token-major order (token n first, then choice k), i.e.
  row-major over the (N, K) routing table. Assignments with position >= C are dropped:
  they contribute nothing and the token keeps only its residual for that choice.
- Tokens are scattered (index_add) into a zero buffer of E * C + 1 rows, the last a dummy
  row for drops; expert e runs on rows [e * C, (e + 1) * C); outputs are gathered back
  per assignment, scaled by routing weight and keep mask, and summed over k. Unused slots
  are zeros and SwiGLU without biases maps zeros to zeros, so they add nothing; dropless
  mode pays for that simplicity with E / K times the expert FLOPs of a sparse dispatch.

The load-balancing loss per layer is E * sum_e f_e * P_e (Switch / Mixtral), f_e the
fraction of tokens whose top-k includes e (before capacity drops), P_e the mean router
probability of e. `MoE.forward` returns (logits, aux_loss) with aux_loss the sum over
layers times `aux_loss_coef`. `MoE.dropped_assignments(idx)` reports which (token, k)
assignments a forward on idx drops, for comparison with a parallel run.

It reads and writes no `node.meta` keys (it is a model, not a pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import Attention, FeedForward, GPTConfig, init_weights, rope_tables


@dataclass
class MoEConfig:
    vocab_size: int  # tokens in the vocabulary (V)
    dim: int  # model width (C)
    n_layers: int  # transformer blocks
    n_heads: int  # query heads (H); head_dim = dim // n_heads
    n_kv_heads: int  # key/value heads (grouped-query attention); divides n_heads
    ffn_dim: int  # SwiGLU hidden width of each expert
    max_seq_len: int  # rows of the precomputed RoPE tables: the longest T forward accepts
    n_experts: int  # experts per MoE layer (E)
    top_k: int  # experts each token is sent to (K)
    rope_theta: float = 10000.0  # RoPE base; Mixtral uses 1e6
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # lm_head.weight is tok_emb.weight
    capacity_factor: float | None = None  # None: dropless; else C = ceil(cf * N * K / E)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in MoE.forward's aux_loss

    def __post_init__(self) -> None:
        GPTConfig.__post_init__(self)  # the same head / kv-head checks
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0, or None for dropless routing")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls, capacity_factor: float | None = None) -> MoEConfig:
        # the dims of GPTConfig.tiny() with 4 experts, top-2
        return cls(
            vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32,
            n_experts=4, top_k=2, capacity_factor=capacity_factor,
        )  # fmt: skip

    @classmethod
    def mixtral_8x7b(cls) -> MoEConfig:
        # mistralai/Mixtral-8x7B-v0.1: 46.7e9 parameters
        return cls(
            vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
            max_seq_len=32768, n_experts=8, top_k=2, rope_theta=1e6,
        )  # fmt: skip


class Routing(NamedTuple):
    """Where each (token n, choice k) assignment of one MoE layer goes. N = B * T, n = b * T + t."""

    expert: torch.Tensor  # (N, K) int64: the chosen expert
    weight: torch.Tensor  # (N, K) fp32: renormalised routing weight
    position: torch.Tensor  # (N, K) int64: place in the expert's queue (token-major order)
    keep: torch.Tensor  # (N, K) bool: position < capacity; False means dropped
    probs: torch.Tensor  # (N, E) fp32: router softmax over all experts
    capacity: int  # C: slots per expert


class MoEFeedForward(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.capacity_factor = config.capacity_factor
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)  # the router
        self.experts = nn.ModuleList(FeedForward(config.dim, config.ffn_dim) for _ in range(config.n_experts))

    def capacity(self, n_tokens: int) -> int:
        """Slots per expert for a batch of n_tokens tokens (a Python int: shapes stay static)."""
        if self.capacity_factor is None:
            return n_tokens
        return min(n_tokens, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def route(self, x: torch.Tensor) -> Routing:
        """Route N tokens, x (N, D)."""
        N, E, K = x.shape[0], self.n_experts, self.top_k
        C = self.capacity(N)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        weight, expert = probs.topk(K, dim=-1)  # (N, K)
        weight = weight / weight.sum(dim=-1, keepdim=True)  # top-k weights sum to 1
        # rows in (n, k) row-major order, so the running count is token-major queue order
        onehot = (expert.reshape(N * K, 1) == torch.arange(E, device=x.device)).long()  # (N*K, E)
        seen = onehot.cumsum(dim=0) - 1  # (N*K, E): assignments to e so far, minus one
        position = seen.gather(1, expert.reshape(N * K, 1)).view(N, K)  # (N, K)
        return Routing(expert, weight, position, position < C, probs, C)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """x (B, T, D) -> (out (B, T, D), this layer's load-balancing loss (unscaled), routing)."""
        B, T, D = x.shape
        N, E, K = B * T, self.n_experts, self.top_k
        x = x.reshape(N, D)  # (N, D)
        r = self.route(x)
        C = r.capacity

        # dispatch: one row per slot; dropped assignments all land on the dummy slot E * C
        slot = torch.where(r.keep, r.expert * C + r.position, E * C).reshape(N * K)  # (N*K,)
        src = x[:, None, :].expand(N, K, D).reshape(N * K, D)  # (N*K, D): token n once per choice k
        buf = x.new_zeros(E * C + 1, D).index_add(0, slot, src)  # (E*C+1, D); a real slot gets <= 1 row
        buf = buf[: E * C].view(E, C, D)  # (E, C, D): dummy row dropped

        out = torch.stack([expert(buf[e]) for e, expert in enumerate(self.experts)])  # (E, C, D)

        # combine: gather each assignment's row (dummy row reads zeros), weight it, sum over k
        out = torch.cat([out.reshape(E * C, D), out.new_zeros(1, D)])  # (E*C+1, D)
        y = out.index_select(0, slot).view(N, K, D)  # (N, K, D)
        scale = (r.weight * r.keep).to(y.dtype)  # (N, K): zero for dropped assignments
        y = (y * scale[..., None]).sum(dim=1)  # (N, D)
        return y.view(B, T, D), load_balancing_loss(r), r


def load_balancing_loss(r: Routing) -> torch.Tensor:
    """E * sum_e f_e * P_e: f_e the fraction of tokens whose top-k includes e, P_e the mean
    router probability of e. Equals K when routing is perfectly uniform."""
    N, E = r.probs.shape
    routed = (r.expert[..., None] == torch.arange(E, device=r.expert.device)).float()  # (N, K, E)
    frac_tokens = routed.sum(dim=(0, 1)) / N  # (E,)
    mean_prob = r.probs.mean(dim=0)  # (E,)
    return E * (frac_tokens * mean_prob).sum()


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.moe = MoEFeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        y, aux, routing = self.moe(self.ffn_norm(x))
        return x + y, aux, routing  # (B, T, C), (), Routing


class MoE(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one Parameter, two uses
        # RoPE tables: derived, not state, so non-persistent; filled by reset_parameters
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

    def forward_with_routing(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[Routing]]:
        """idx (B, T) -> (logits (B, T, V), aux_loss (), one Routing per layer)."""
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}; raise max_seq_len in the config")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd)
        x = self.tok_emb(idx)  # (B, T, C)
        aux_losses, routings = [], []
        for layer in self.layers:
            x, aux, routing = layer(x, cos, sin)  # (B, T, C)
            aux_losses.append(aux)
            routings.append(routing)
        x = self.norm(x)  # (B, T, C)
        aux_loss = self.config.aux_loss_coef * torch.stack(aux_losses).sum()  # ()
        return self.lm_head(x), aux_loss, routings  # (B, T, V), (), [Routing] * n_layers

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, aux_loss, _ = self.forward_with_routing(idx)
        return logits, aux_loss  # (B, T, V), ()

    @torch.no_grad()
    def dropped_assignments(self, idx: torch.Tensor) -> torch.Tensor:
        """Which assignments a forward on idx drops: bool (n_layers, B * T, top_k), entry
        [l, b * T + t, k] True when token (b, t)'s k-th choice found its expert full in layer l.
        All False in dropless mode."""
        _, _, routings = self.forward_with_routing(idx)
        return torch.stack([~r.keep for r in routings])


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of out[0] (B, T, V) against targets (B, T), plus out[1],
    the already-scaled load-balancing loss."""
    logits, aux_loss = out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) + aux_loss
