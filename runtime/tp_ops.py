"""Local implementations that tensor-parallel rewrites call in place of an ATen op.

A sharding rule sometimes needs more than the op itself run on local shards:

    to_partial(x, axis)            R -> P(sum) along `axis` without communication: rank index 0
                                   keeps x, the others hold zeros. Backward: identity (the
                                   gradient of every summand of a partial sum is the gradient
                                   of the sum, which is replicated).
    vocab_parallel_embedding(w, ids, axis, vocab, padding_idx)
                                   embedding with the table sharded by rows (the vocabulary,
                                   `torch.chunk` convention) over `axis`: each rank looks up the
                                   ids in its range and writes zeros for the others, so the
                                   output is P(sum) (Megatron's VocabParallelEmbedding).

They are plain torch code (autograd derives their backward) or `torch.library` custom ops
with fake kernels, so rewritten graphs run, print and propagate shapes like any other.
Reads and writes no node.meta keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import axis_index, axis_size, chunk_range


@torch.library.custom_op("autopar::to_partial", mutates_args=())
def to_partial(x: torch.Tensor, axis: str) -> torch.Tensor:
    """R -> P(sum): index 0 of `axis` keeps `x`, the other ranks hold zeros."""
    if axis_index(axis) == 0:
        return x.clone()
    return torch.zeros_like(x)


@to_partial.register_fake
def _(x, axis):
    return torch.empty_like(x)


def _to_partial_bwd(ctx, grad):
    return grad, None


to_partial.register_autograd(_to_partial_bwd)


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, axis: str, vocab: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """`F.embedding(full_weight, ids)` as a partial sum over `axis`, `weight` being this rank's
    rows of the `vocab`-row table."""
    start, end = chunk_range(vocab, axis_size(axis), axis_index(axis))
    if weight.size(0) != end - start:
        raise ValueError(f"vocab_parallel_embedding on axis {axis!r}: this rank holds {weight.size(0)} rows "
                         f"but rows [{start}, {end}) of a {vocab}-row table are its share")
    outside = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill(outside, 0)
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
    out = F.embedding(local, weight, padding_idx=pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


__all__ = ["to_partial", "vocab_parallel_embedding"]
