"""The block math of ring attention (runtime/context_attention.py): one (query rows x key
columns) block's output with its log-sum-exp, and that block's share of the gradients.

Two ways to compute a block: a fused SDPA kernel that returns the log-sum-exp where torch has
one for the device and dtype (CPU flash; CUDA flash for fp16/bf16, through
runtime/_torch_compat.py), or plain torch math (always after `set_block_kernel("math")`, and for
every block that carries an arbitrary boolean mask, such as the document mask of packed
sequences: the fused kernels take only the causal triangle). The fused backward is fed the
merged output and lse of the whole row, so it returns exactly the block's share of the
gradients.

Layout: query blocks are grouped (B, Hkv, G, tq, D), query head h using kv head h // G (as
`enable_gqa`); key/value blocks are (B, Hkv, tk, D). A mask is boolean, True = visible, and
broadcasts against (B, Hkv, G, tq, tk): (tq, tk) for the causal triangle, (B, 1, 1, tq, tk) for
per-row document masks. A row that sees no column of a block gets lse = -inf and output 0
(never NaN), so the log-sum-exp merge leaves it untouched.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import torch

from ._torch_compat import sdpa_block_backward, sdpa_block_forward, sdpa_block_kernel

_BLOCK_KERNEL = "auto"


def set_block_kernel(name: str) -> None:
    """"auto": the fused SDPA-with-lse kernel where one fits the device and dtype (CPU flash;
    CUDA flash for fp16/bf16), plain torch math otherwise; "math": always plain torch math."""
    global _BLOCK_KERNEL
    if name not in ("auto", "math"):
        raise ValueError(f"block kernel {name!r}: use 'auto' or 'math'")
    _BLOCK_KERNEL = name


def fused_block(x: torch.Tensor) -> bool:
    """Whether unmasked or causal blocks of `x`'s device and dtype use a fused kernel."""
    return _BLOCK_KERNEL == "auto" and sdpa_block_kernel(x) is not None


def _heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv*g, T, D): each kv head once per query head of its group."""
    return x.repeat_interleave(g, dim=1) if g > 1 else x.contiguous()


def _tri(rows: int, cols: int, device) -> torch.Tensor:
    # local positions increase along the zigzag layout (chunk i < chunk 2cp-1-i), so the causal
    # mask of a rank's own block is the plain lower triangle over local indices
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril()


def _math_mask(masked: bool, mask: torch.Tensor | None, tq: int, tk: int, device) -> torch.Tensor | None:
    return mask if mask is not None else (_tri(tq, tk, device) if masked else None)


def block_forward(qb, kb, vb, sc: float, masked: bool, acc, mask: torch.Tensor | None = None):
    """One block: qb (B, Hkv, G, tq, D), kb and vb (B, Hkv, tk, D), all in the input dtype ->
    (out (B, Hkv, G, tq, D), lse (B, Hkv, G, tq)) in `acc`. `masked`: the causal triangle;
    `mask`: an explicit boolean mask instead (math path)."""
    B, hkv, G, tq, D = qb.shape
    if mask is None and fused_block(qb):
        o, lse = sdpa_block_forward(qb.reshape(B, hkv * G, tq, D), _heads(kb, G), _heads(vb, G), masked, sc)
        return o.reshape(qb.shape).to(acc), lse.reshape(B, hkv, G, tq).to(acc)
    # kv broadcasts over the G query heads of its group
    sco = torch.matmul(qb.to(acc), kb.to(acc).unsqueeze(2).transpose(-1, -2)) * sc  # (B, Hkv, G, tq, tk)
    m = _math_mask(masked, mask, tq, kb.size(2), qb.device)
    if m is not None:
        sco = sco.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(sco, dim=-1)  # -inf for a row that sees nothing here (doc masks only)
    p = torch.exp(sco - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))  # such a row: all 0
    return torch.matmul(p, vb.to(acc).unsqueeze(2)), lse


def block_backward(qb, kb, vb, ob, dob, lb, delta, sc: float, masked: bool, acc, fused: bool,
                   mask: torch.Tensor | None = None):
    """One block's share of the gradients, from the merged output `ob` and lse `lb` of its rows:
    (dq (B, Hkv, G, tq, D), dk, dv (B, Hkv, tk, D)) in `acc`. Flash-attention backward:
    P = exp(S*scale - lse), dV = P^T dO, dS = P * (dO V^T - delta), dQ = dS K scale,
    dK = dS^T Q scale, with delta = rowsum(dO * O) (less the lse's own gradient). `fused` needs
    mask None; the merged lse of a row is finite (a row always sees itself somewhere)."""
    B, hkv, G, tq, D = qb.shape
    tk = kb.size(2)
    if fused:
        assert mask is None, "the fused block backward takes no explicit mask"
        sh = (B, hkv * G, tq, D)
        dq, dk, dv = sdpa_block_backward(dob.reshape(sh), qb.reshape(sh), _heads(kb, G), _heads(vb, G),
                                         ob.reshape(sh), lb.reshape(B, hkv * G, tq).contiguous(), masked, sc)
        return (dq.reshape(qb.shape).to(acc), dk.reshape(B, hkv, G, tk, D).to(acc).sum(2),
                dv.reshape(B, hkv, G, tk, D).to(acc).sum(2))
    qa, ka, va, doa = qb.to(acc), kb.to(acc).unsqueeze(2), vb.to(acc).unsqueeze(2), dob.to(acc)
    p = torch.exp(torch.matmul(qa, ka.transpose(-1, -2)) * sc - lb.unsqueeze(-1))
    m = _math_mask(masked, mask, tq, tk, qb.device)
    if m is not None:
        p = p.masked_fill(~m, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), doa).sum(2)  # summed over the G query heads of a kv head
    ds = p * (torch.matmul(doa, va.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, ka) * sc, torch.matmul(ds.transpose(-1, -2), qa).sum(2) * sc, dv


__all__ = ["set_block_kernel", "fused_block", "block_forward", "block_backward"]
