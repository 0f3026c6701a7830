"""Communication cost: bytes on the wire and time of each collective, per mesh axis.

Payload convention (the same as `autopar.runtime.collectives.COUNTER`): `nbytes` is the tensor
handed to the collective on one rank — the input of all-reduce, reduce-scatter and
all-to-all, the local shard of all-gather, the tensor of broadcast and send.

Payload of a graph collective (`payload_bytes`, what COUNTER records for a call with a tensor
of a given shape): uneven dims follow torch.chunk and the runtime pads every rank's piece to
cpad = ceil(N/n) rows of the sharded dim (N its global size), so
  all_reduce, all_to_all, broadcast, send_recv   the tensor's bytes
  all_gather      cpad rows of the local piece (N = full_size, or local rows * n when even)
  reduce_scatter  n * cpad rows of the input (N = the input's rows along dim)
Both padded payloads are the same on every rank of the group.

Bytes each rank sends (`bytes_sent`), for a group of n ranks:
  ring    all_reduce      2(n-1)/n * B    (reduce-scatter then all-gather, chunks of B/n)
          reduce_scatter  (n-1)/n * B
          all_gather      (n-1) * B       (B = the local shard)
          all_to_all      (n-1)/n * B     (every rank keeps its own 1/n)
          broadcast       B on every rank but the last of the chain (pipelined chain)
          send_recv       B on the sender
  tree    all_reduce      2B on every rank but the root (double binary tree: each rank is an
                          inner node of one tree and a leaf of the other, each tree carries B/2)
          broadcast       2B on inner nodes, 0 on leaves (binary tree)
Time (alpha-beta): steps * alpha + bytes_sent / (bandwidth * efficiency), with
  ring: all_reduce 2(n-1) steps, the others n-1; tree: 2*ceil(log2 n) for all_reduce,
  ceil(log2 n) for broadcast; send_recv 1.

Links per mesh axis (`axis_links`): ranks are laid out row-major over the mesh axes (the last
axis varies fastest, as `runtime.mesh.Mesh`), `gpus_per_node` consecutive ranks share a node;
an axis whose groups stay inside a node uses the intra-node link (NVLink/NVSwitch), one
whose groups span nodes the inter-node link (InfiniBand/RoCE, per-GPU bandwidth). Each
AxisLink carries the profile's `contention` for its kind of link: how much slower compute
runs while a collective on this axis overlaps it (`cost.overlap`).

It reads no `node.meta`. Guarantees: every (op, algorithm) pair either has a formula here or
raises ValueError naming the supported ones; a group of one rank costs nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .hardware import Hardware, Link

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = {"all_reduce": ("ring", "tree"), "broadcast": ("ring", "tree"), "reduce_scatter": ("ring",),
              "all_gather": ("ring",), "all_to_all": ("ring",), "send_recv": ("ring",)}


def _check(op: str, algorithm: str, n: int) -> None:
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")
    if algorithm not in ALGORITHMS[op]:
        raise ValueError(f"{op} has no {algorithm!r} algorithm here; use one of {ALGORITHMS[op]}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"group size must be a positive integer, got {n!r}")


def padded_payload(op: str, rows: int, row_bytes: int, n: int) -> int:
    """Payload of an all-gather or reduce-scatter whose sharded dim has `rows` rows globally,
    `row_bytes` bytes each, over n ranks (torch.chunk pieces padded to ceil(rows/n) rows):
    all_gather ceil(rows/n) * row_bytes, reduce_scatter n * ceil(rows/n) * row_bytes."""
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"padded_payload is for all_gather and reduce_scatter, got {op!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"group size must be a positive integer, got {n!r}")
    cpad = -(-int(rows) // n)
    return int(cpad * row_bytes * (n if op == "reduce_scatter" else 1))


def payload_bytes(op: str, shape: Sequence[int], itemsize: int, n: int, *, dim: int = 0,
                  full_size: int = -1) -> int:
    """Bytes `runtime.collectives.COUNTER` records for graph collective `op` called on this rank
    with a tensor of `shape` over a group of n ranks (see the module docstring). `dim`: the
    gathered / scattered dim; `full_size`: all_gather's global size of it (-1: even)."""
    shape = [int(d) for d in shape]
    numel = math.prod(shape)
    if op in ("all_reduce", "all_to_all", "broadcast", "send_recv", "send", "recv"):
        return numel * itemsize
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")
    if not shape:
        raise ValueError(f"{op} needs a tensor with at least one dim, got shape {shape}")
    d = dim % len(shape)
    row_bytes = math.prod(shape[:d] + shape[d + 1:]) * itemsize
    if op == "all_gather":
        rows = full_size if full_size >= 0 else shape[d] * n
    else:
        rows = shape[d]
    return padded_payload(op, rows, row_bytes, n)


def bytes_sent(op: str, nbytes: float, n: int, algorithm: str = "ring", rank: int | None = None) -> float:
    """Bytes rank `rank` (index in the group) sends for one collective of payload `nbytes`;
    `rank=None` gives the largest over the group (what bounds the time)."""
    _check(op, algorithm, n)
    if n == 1:
        return 0.0
    if op == "all_reduce":
        if algorithm == "ring":
            return 2 * (n - 1) * nbytes / n
        return 0.0 if rank == 0 else 2.0 * nbytes
    if op in ("reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes / n
    if op == "all_gather":
        return float((n - 1) * nbytes)
    if op == "broadcast":
        if algorithm == "ring":  # chain 0 -> 1 -> ... -> n-1, pipelined
            return 0.0 if rank == n - 1 else float(nbytes)
        if rank is None:
            return 2.0 * nbytes if n > 2 else float(nbytes)
        children = sum(1 for c in (2 * rank + 1, 2 * rank + 2) if c < n)
        return float(children * nbytes)
    if op == "send_recv":
        return 0.0 if rank not in (None, 0) else float(nbytes)
    raise AssertionError(op)


def total_bytes_sent(op: str, nbytes: float, n: int, algorithm: str = "ring") -> float:
    """Sum over the group of `bytes_sent` (e.g. ring all-reduce: 2(n-1) * B)."""
    return sum(bytes_sent(op, nbytes, n, algorithm, r) for r in range(n))


def steps(op: str, n: int, algorithm: str = "ring") -> int:
    """Latency terms (alpha) of one collective."""
    _check(op, algorithm, n)
    if n == 1:
        return 0
    if op == "send_recv":
        return 1
    if algorithm == "tree":
        depth = math.ceil(math.log2(n))
        return 2 * depth if op == "all_reduce" else depth
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def collective_time(op: str, nbytes: float, n: int, link: Link, algorithm: str = "ring",
                    efficiency: float = 1.0) -> float:
    """Seconds for one collective of payload `nbytes` over a group of n ranks on `link`.
    algorithm="auto" takes the faster of ring and tree where both exist."""
    if algorithm == "auto":
        return min(collective_time(op, nbytes, n, link, a, efficiency) for a in ALGORITHMS.get(op, ("ring",)))
    if n == 1:
        _check(op, algorithm, n)
        return 0.0
    return steps(op, n, algorithm) * link.latency + bytes_sent(op, nbytes, n, algorithm) / (link.bandwidth * efficiency)


@dataclass(frozen=True)
class AxisLink:
    """How one mesh axis communicates: its group size, link and the efficiency factor."""

    axis: str
    size: int
    link: Link
    efficiency: float
    inter_node: bool
    contention: float = 0.0  # compute runs (1 + contention) times slower while a collective here overlaps it

    def algorithm(self, op: str, nbytes: float, algorithm: str = "auto") -> str:
        """`algorithm`, or for "auto" the faster of the ones `op` has (as NCCL's tuner picks)."""
        if algorithm != "auto":
            return algorithm
        return min(ALGORITHMS[op], key=lambda a: collective_time(op, nbytes, self.size, self.link, a, self.efficiency))

    def time(self, op: str, nbytes: float, algorithm: str = "ring") -> float:
        return collective_time(op, nbytes, self.size, self.link, self.algorithm(op, nbytes, algorithm),
                               self.efficiency)

    def bytes_sent(self, op: str, nbytes: float, algorithm: str = "ring") -> float:
        return bytes_sent(op, nbytes, self.size, self.algorithm(op, nbytes, algorithm))


def axis_spans_nodes(mesh: Mapping[str, int], axis: str, gpus_per_node: int) -> bool:
    """Whether some group along `axis` holds ranks of two different nodes."""
    names = list(mesh)
    stride = 1
    for a in reversed(names):
        if a == axis:
            break
        stride *= mesh[a]
    size = mesh[axis]
    if size == 1:
        return False
    world = math.prod(mesh.values())
    # ranks r, r + stride, ..., r + (size-1)*stride for every r with coordinate 0 on `axis`
    for r in range(world):
        if (r // stride) % size:
            continue
        if r // gpus_per_node != (r + (size - 1) * stride) // gpus_per_node:
            return True
    return False


def axis_links(hardware: Hardware, mesh: Mapping[str, int]) -> dict[str, AxisLink]:
    """The link each mesh axis uses on this hardware (see the module docstring)."""
    world = math.prod(mesh.values()) if mesh else 1
    if world > hardware.world_size:
        raise ValueError(f"the mesh {dict(mesh)} has {world} ranks but hardware {hardware.name!r} has "
                         f"{hardware.world_size} ({hardware.nodes} nodes x {hardware.gpus_per_node}); "
                         f"use a larger profile or hardware.with_nodes({math.ceil(world / hardware.gpus_per_node)})")
    out = {}
    for axis, size in mesh.items():
        inter = axis_spans_nodes(mesh, axis, hardware.gpus_per_node)
        link = hardware.inter_node if inter else hardware.intra_node
        eff = hardware.eff("inter_node" if inter else "intra_node")
        out[axis] = AxisLink(axis, size, link, eff, inter, hardware.contention_for(inter))
    return out


def joined_data_axis(hardware: Hardware, mesh: Mapping[str, int], dp_axis: str | None, cp_axis: str,
                     links: Mapping[str, AxisLink]) -> tuple[str, int, dict[str, AxisLink]]:
    """Context parallelism: ranks along dp and cp hold the same parameters, so gradients and ZeRO
    shards live on the joined axis "dp+cp" (runtime.mesh.Mesh.parts). Returns its name, size and
    `links` with its link: that of the mesh with dp and cp merged into one axis in dp's place
    (cp follows dp in the axis order, so the ranks are the same)."""
    names = [a for a in mesh if a in (dp_axis, cp_axis)]
    joined = "+".join(names)
    size = math.prod(mesh[a] for a in names)
    merged: dict[str, int] = {}
    for a, k in mesh.items():
        if a in names:
            merged.setdefault(joined, size)
        else:
            merged[a] = k
    return joined, size, {**links, joined: axis_links(hardware, merged)[joined]}
