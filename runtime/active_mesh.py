"""The active mesh: the one whose axis names collectives refer to, and torch.chunk arithmetic.

Graph collectives name a mesh axis (`"tp"`), not a process group; the program makes its mesh
the active one (`set_active_mesh`) before it runs, and every collective resolves its axis
against it (`group_of`, `axis_size`, `axis_index`). Fake-tensor shape propagation of one
rank's program while planning has no process group: `set_active_mesh(mesh, rank=r)` then
stands in for `dist.get_rank()`.

Uneven dims follow `torch.chunk`: with n rows over k ranks every rank but the last non-empty
one holds ceil(n/k) rows (`chunk_sizes`, `chunk_range`).

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import torch.distributed as dist

_ACTIVE_MESH = None
_ACTIVE_RANK: int | None = None


def set_active_mesh(mesh, rank: int | None = None) -> None:
    """Make `mesh` (a runtime.mesh.Mesh) the one whose axes collectives refer to.

    `rank` stands in for `dist.get_rank()` when there is no process group (fake-tensor
    shape propagation of one rank's program while planning); it matters only for uneven dims.
    """
    global _ACTIVE_MESH, _ACTIVE_RANK
    _ACTIVE_MESH, _ACTIVE_RANK = mesh, rank


def active_mesh():
    if _ACTIVE_MESH is None:
        raise RuntimeError("no active mesh: run the program through autopar (or call "
                           "autopar.runtime.collectives.set_active_mesh(mesh)) before using collectives")
    return _ACTIVE_MESH


def active_mesh_or_none():
    """The active mesh, or None when no program has set one."""
    return _ACTIVE_MESH


def group_of(axis: str):
    return active_mesh().group(axis)


def axis_size(axis: str) -> int:
    return active_mesh().size(axis)


def axis_index(axis: str) -> int:
    """This rank's index along `axis` of the active mesh."""
    mesh = active_mesh()
    if _ACTIVE_RANK is not None:
        return mesh.index(axis, _ACTIVE_RANK)
    if not dist.is_initialized():
        raise ValueError(f"axis {axis!r}: this rank's index is unknown without a process group; "
                         "pass rank= to set_active_mesh for shape propagation of uneven dims")
    return mesh.local_rank(axis)


def chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes of the k pieces of n items under torch.chunk's convention (ceil(n/k) each, the
    tail short or empty): chunk_sizes(5, 4) == [2, 2, 1, 0]."""
    c = -(-n // k) if k else 0
    return [max(0, min(n, (i + 1) * c) - min(n, i * c)) for i in range(k)]


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """[start, end) of piece i of n items over k ranks (torch.chunk convention)."""
    c = -(-n // k)
    start = min(n, i * c)
    return start, min(n, start + c)


__all__ = ["set_active_mesh", "active_mesh", "active_mesh_or_none", "group_of", "axis_size", "axis_index",
           "chunk_sizes", "chunk_range"]
