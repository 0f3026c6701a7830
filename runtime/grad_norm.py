"""Gradient norms over a mesh, for clipping: every rank's share, then the mesh's total.

A gradient's square sum (or max, for the inf norm) is counted once: a part that tensor
parallelism shards is summed over the axes that shard it, a replicated one is not; ZeRO rows
are summed over the data axis. Used by the ZeRO engines and the pipeline program's
`clip_grad_norm_`. Reads and writes no node.meta keys.
"""
from __future__ import annotations

from typing import Mapping

import torch

from . import collectives as C


def local_norm_parts(parts: Mapping[tuple[str, ...], list[torch.Tensor]], keys: list[tuple[str, ...]],
                     norm_type: float, acc: torch.dtype, device) -> torch.Tensor:
    """One entry per key of `keys`: sum of |g|^p (max |g| for p = inf) over this rank's
    gradients whose model-parallel axes are that key."""
    inf = norm_type == float("inf")
    zero = torch.zeros((), device=device, dtype=acc)
    if inf:
        return torch.stack([max((g.detach().abs().max().to(device, acc) for g in parts.get(k, []) if g.numel()),
                                default=zero) for k in keys])
    return torch.stack([sum((g.detach().to(acc).abs().pow(norm_type).sum().to(device) for g in parts.get(k, [])),
                            zero) for k in keys])


def reduce_norm_parts(t: torch.Tensor, keys: list[tuple[str, ...]], inf: bool,
                      sharded_axis: str | None = None) -> torch.Tensor:
    """`local_norm_parts` of every rank combined: each part reduced over `sharded_axis` (ZeRO
    rows) and over the axes that shard it, then the parts summed (the max for p = inf): the
    norm to the power p, or the max norm."""
    op = "max" if inf else "sum"
    if sharded_axis is not None:
        C.all_reduce_(t, sharded_axis, op)
    out = [t[0]]
    for i, key in enumerate(keys[1:], start=1):
        part = t[i:i + 1].clone()
        for a in key:
            C.all_reduce_(part, a, op)
        out.append(part[0])
    s = torch.stack(out)
    return s.max() if inf else s.sum()
