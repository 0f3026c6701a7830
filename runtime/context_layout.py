"""The context-parallel layout: which tokens of the sequence each rank of a `cp` axis holds.

Under context parallelism the sequence dim (dim 1 of every batch tensor) is split over the cp
ranks in the load-balanced zigzag order (`context_attention.zigzag_positions`: the sequence
is cut into 2*cp chunks, rank i holds chunk i then chunk 2*cp-1-i, so that under a causal
mask every rank does the same attention work). Everything outside attention then runs on the
local tokens as it would on all of them; what depends on a token's *position* (RoPE tables,
position embeddings, the positions a model derives from `arange(T)`) is computed at the global
length and then taken at this rank's positions:

    cp_global_len(t_local, axis)                 T: the global sequence length, t_local * cp
    take_positions(x, dims, t_local, axis)       x at this rank's positions along `dims`
    shard_sequence(batch, axis, seq_len)         this rank's part of a (dp-local) batch
    cp_document_ids(position_ids, axis)          packed documents: the document index of each of
                                                 this rank's tokens, from its position ids

The graph pass `passes/context_positions.py` inserts the first two; `runtime.program.Program`
calls the third. Plain functions (not custom ops): autograd flows through `index_select`
(a learned position embedding gets its gradient at this rank's positions), and fake tensors
propagate through them with a symbolic `t_local`.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ._torch_compat import pytree
from .active_mesh import axis_index, axis_size
from .collective_calls import all_gather_into_
from .context_attention import doc_ids_from_positions, zigzag_positions, zigzag_shard, zigzag_unshard


def cp_global_len(t_local: int, axis: str) -> int:
    """The global sequence length of a local chunk of `t_local` tokens on `axis`."""
    return t_local * axis_size(axis)


def local_positions(t_local: int, axis: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (int64, (t_local,)) of this rank's tokens on `axis`, in local order."""
    k = axis_size(axis)
    return zigzag_positions(t_local * k, k, axis_index(axis)).to(device)


def take_positions(x: torch.Tensor, dims: Sequence[int], t_local: int, axis: str) -> torch.Tensor:
    """`x`, computed over the global sequence, at this rank's positions along each of `dims`."""
    pos = local_positions(t_local, axis, x.device)
    for d in dims:
        x = x.index_select(d, pos)
    return x


def shard_sequence(batch: Any, axis: str, seq_len: int, dim: int = 1) -> Any:
    """This rank's tokens of every tensor in `batch` whose dim `dim` is the sequence
    (`seq_len` long): inputs, targets, masks and position ids alike. Tensors without that
    dim (per-sequence values) are kept whole."""
    k, i = axis_size(axis), axis_index(axis)

    def take(t):
        if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == seq_len:
            return zigzag_shard(t, dim, k, i)
        return t

    return pytree.tree_map(take, batch)


@torch.library.custom_op("autopar::cp_document_ids", mutates_args=())
def cp_document_ids(position_ids: torch.Tensor, axis: str) -> torch.Tensor:
    """The document index of each of this rank's tokens, from this rank's position ids
    ((B, t), the zigzag chunks): the position ids of every cp rank are gathered (a few bytes
    per token), the documents read over the whole sequence, and this rank's part kept."""
    k, i = axis_size(axis), axis_index(axis)
    mine = position_ids.to(torch.int64).contiguous()
    parts = torch.empty((k * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    all_gather_into_(parts, mine, axis)
    full = zigzag_unshard(list(parts.view(k, *mine.shape).unbind(0)), 1)
    return zigzag_shard(doc_ids_from_positions(full), 1, k, i).contiguous()


@cp_document_ids.register_fake
def _(position_ids, axis):
    return torch.empty(position_ids.shape, dtype=torch.int64, device=position_ids.device)


__all__ = ["cp_global_len", "local_positions", "take_positions", "shard_sequence", "cp_document_ids"]
