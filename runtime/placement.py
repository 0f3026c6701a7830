"""Placements: how one tensor lies across one mesh axis.

`R` (replicated), `S(d)` (sharded along tensor dim d) and `P(op)` (partial: every rank holds
a summand, the value is the reduction over the axis). A tensor's layout on a mesh is a
`Layout`: one placement per mesh axis, printed `{tp: S(1), dp: R}`.

These are plain frozen dataclasses so that plans, rules and caches can hash, compare and
serialise them ("S(0)" round-trips through `parse_placement`). `to_dtensor` converts to
DTensor's placement types for the places where we interoperate with PyTorch's reference
implementations.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Union


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    __repr__ = __str__


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True)
class Partial:
    op: str = "sum"  # "sum" | "avg" | "max" | "min"

    def __post_init__(self):
        if self.op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"Partial op must be one of sum/avg/max/min, got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"

    __repr__ = __str__


Placement = Union[Replicate, Shard, Partial]

R = Replicate()


def S(dim: int) -> Shard:
    return Shard(dim)


def P(op: str = "sum") -> Partial:
    return Partial(op)


_PAT = re.compile(r"^\s*(R|S\((-?\d+)\)|P\((sum|avg|max|min)\))\s*$")


def parse_placement(text: str) -> Placement:
    """Inverse of `str(placement)`: "R", "S(1)", "P(sum)"."""
    m = _PAT.match(text)
    if not m:
        raise ValueError(f"cannot parse placement {text!r}; expected R, S(<dim>) or P(sum|avg|max|min)")
    if m.group(1) == "R":
        return R
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return Partial(m.group(3))


@dataclass(frozen=True)
class Layout:
    """One placement per mesh axis, in mesh-axis order: `{tp: S(1), dp: R}`."""

    axes: tuple[tuple[str, Placement], ...]

    @staticmethod
    def of(mapping: Mapping[str, Placement]) -> "Layout":
        return Layout(tuple(mapping.items()))

    @staticmethod
    def replicated(axis_names: tuple[str, ...] | list[str]) -> "Layout":
        return Layout(tuple((a, R) for a in axis_names))

    def __getitem__(self, axis: str) -> Placement:
        for a, p in self.axes:
            if a == axis:
                return p
        raise KeyError(axis)

    def get(self, axis: str, default: Placement = R) -> Placement:
        for a, p in self.axes:
            if a == axis:
                return p
        return default

    def replace(self, axis: str, placement: Placement) -> "Layout":
        return Layout(tuple((a, placement if a == axis else p) for a, p in self.axes))

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for _, p in self.axes)

    def to_json(self) -> dict[str, str]:
        return {a: str(p) for a, p in self.axes}

    @staticmethod
    def from_json(d: Mapping[str, str]) -> "Layout":
        return Layout(tuple((a, parse_placement(p)) for a, p in d.items()))

    def __str__(self) -> str:
        return "{" + ", ".join(f"{a}: {p}" for a, p in self.axes) + "}"

    __repr__ = __str__


def local_shape(global_shape: tuple[int, ...], layout: Layout, mesh_sizes: Mapping[str, int],
                coords: Mapping[str, int] | None = None) -> tuple[int, ...]:
    """Shape of the local piece on one rank. Uneven shards follow `torch.chunk`
    (the first ranks get ceil(n/k) elements); `coords` gives this rank's index per axis
    and is needed only when a dim does not divide evenly."""
    shape = list(global_shape)
    for axis, p in layout.axes:
        if isinstance(p, Shard):
            k = mesh_sizes[axis]
            n = shape[p.dim]
            if n % k == 0:
                shape[p.dim] = n // k
            else:
                if coords is None:
                    raise ValueError(f"dim {p.dim} of size {n} does not divide by {axis}={k}; "
                                     "pass coords to get this rank's uneven shard size")
                chunk = -(-n // k)
                start = min(chunk * coords[axis], n)
                shape[p.dim] = max(0, min(n, start + chunk) - start)
    return tuple(shape)


def to_dtensor(p: Placement):
    """The DTensor placement equal to `p` (for the reference implementations)."""
    from torch.distributed.tensor import Partial as DPartial, Replicate as DReplicate, Shard as DShard

    if isinstance(p, Replicate):
        return DReplicate()
    if isinstance(p, Shard):
        return DShard(p.dim)
    return DPartial(p.op)
