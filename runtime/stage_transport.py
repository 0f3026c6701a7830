"""Tensor lists between pipeline ranks outside the schedule: what `Program.forward` sends.

Inference through a pipeline (`runtime.program.Program.forward` with several stages) runs the
stages in order with no autograd across them: the rank of stage s sends its outputs to the
rank of stage s + 1, and the last stage's rank broadcasts the model's outputs to every pp rank.
Shapes are not known in advance, so every message is preceded by a small int64 header (its
length) and metadata (count, then dtype code, rank and shape of each tensor). The training step
does not come here: `runtime.pipeline.PipelineExecutor` has its own channels.

`send(mesh, axis, tensors, dst_index)`, `recv(mesh, axis, src_index)` and
`broadcast(mesh, axis, tensors_or_None, src_index)` take pp indices (positions on `axis`), not
global ranks. Counts every transfer in `collectives.COUNTER`: ("send" | "recv" | "broadcast",
axis) with payload bytes, and the metadata as ("send_meta" | "recv_meta", axis). Reads and
writes no node.meta.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C
from .mesh import Mesh

__all__ = ["send", "recv", "broadcast"]

# dtype codes of the metadata (append only: both ends must agree)
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _peer(mesh: Mesh, axis: str, index: int) -> int:
    return mesh.axis_ranks(axis, dist.get_rank())[index]


def _meta(mesh: Mesh, tensors: list[torch.Tensor]) -> torch.Tensor:
    meta = [len(tensors)]
    for t in tensors:
        meta += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(meta, dtype=torch.int64, device=mesh.device)


def _read_meta(mesh: Mesh, v: list[int]) -> list[torch.Tensor]:
    n, k, out = v[0], 1, []
    for _ in range(n):
        code, nd = v[k], v[k + 1]
        out.append(torch.empty(v[k + 2:k + 2 + nd], dtype=_DTYPES[code], device=mesh.device))
        k += 2 + nd
    return out


def send(mesh: Mesh, axis: str, tensors: list[torch.Tensor], dst_index: int) -> None:
    """Send `tensors` (with their shapes) to the rank at position `dst_index` of `axis`."""
    dst, g = _peer(mesh, axis, dst_index), mesh.group(axis)
    meta = _meta(mesh, tensors)
    head = torch.tensor([meta.numel()], dtype=torch.int64, device=mesh.device)
    for t in (head, meta):
        dist.send(t, dst=dst, group=g)
        C.COUNTER.record("send_meta", axis, t.numel() * 8)
    for t in tensors:
        dist.send(t.contiguous(), dst=dst, group=g)
        C.COUNTER.record("send", axis, t.numel() * t.element_size())


def recv(mesh: Mesh, axis: str, src_index: int) -> list[torch.Tensor]:
    """The tensors the rank at position `src_index` of `axis` sent with `send`."""
    src, g = _peer(mesh, axis, src_index), mesh.group(axis)
    head = torch.empty(1, dtype=torch.int64, device=mesh.device)
    dist.recv(head, src=src, group=g)
    meta = torch.empty(int(head.item()), dtype=torch.int64, device=mesh.device)
    dist.recv(meta, src=src, group=g)
    C.COUNTER.record("recv_meta", axis, 8 + meta.numel() * 8)
    bufs = _read_meta(mesh, meta.tolist())
    for t in bufs:
        dist.recv(t, src=src, group=g)
        C.COUNTER.record("recv", axis, t.numel() * t.element_size())
    return bufs


def broadcast(mesh: Mesh, axis: str, tensors: list[torch.Tensor] | None, src_index: int) -> list[torch.Tensor]:
    """`tensors` from the rank at position `src_index` of `axis` on every rank of it (the
    others pass None)."""
    src, g = _peer(mesh, axis, src_index), mesh.group(axis)
    if tensors is not None:
        meta = _meta(mesh, tensors)
        head = torch.tensor([meta.numel()], dtype=torch.int64, device=mesh.device)
    else:
        head = torch.empty(1, dtype=torch.int64, device=mesh.device)
    dist.broadcast(head, src=src, group=g)
    if tensors is None:
        meta = torch.empty(int(head.item()), dtype=torch.int64, device=mesh.device)
    dist.broadcast(meta, src=src, group=g)
    bufs = [t.contiguous() for t in tensors] if tensors is not None else _read_meta(mesh, meta.tolist())
    for t in bufs:
        dist.broadcast(t, src=src, group=g)
        C.COUNTER.record("broadcast", axis, t.numel() * t.element_size())
    return bufs
