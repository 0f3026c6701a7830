"""What the cost model knows about one tensor value of a graph, and one op call.

`TensorMeta` is read from a node's `meta["val"]` (a FakeTensor): shape as ints or sympy
expressions (through `SymbolMap`), dtype, bytes, whether autograd will track it
(`rg`, propagated by the analysis), and its *storage key*: fake tensors keep the aliasing of
real ones (a view shares its base's storage), so the key tells which values are views of
which, and saved tensors can be deduplicated by storage as autograd's memory really is.

`Call` is one op application: its arguments with nodes replaced by `TensorMeta`, the
tensor inputs in argument order, and the outputs. Cost and saved-tensor rules take a `Call`.

It reads `node.meta["val"]`. Guarantees: a `TensorMeta` never holds a reference to a fake
tensor beyond the storage key (an int), so costs can outlive the graph.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .symbolic import Num, SymbolMap, is_symbolic, prod

DTYPE_NAMES = {
    torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.int8: "int8", torch.uint8: "int8",
}  # fmt: skip
for _n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _n):
        DTYPE_NAMES[getattr(torch, _n)] = "fp8"

_fresh = itertools.count(1)


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, "fp32")


class TensorMeta:
    """One tensor value: shape, dtype, bytes, storage key, requires-grad."""

    __slots__ = ("shape", "dtype", "itemsize", "numel", "nbytes", "key", "storage_nbytes",
                 "contiguous", "mergeable", "rows_mergeable", "rg", "is_state", "node")

    def __init__(self, shape: tuple[Num, ...], dtype: torch.dtype, key: Any, storage_nbytes: Num,
                 contiguous: bool = True, mergeable: bool = True, rg: bool = False,
                 is_state: bool = False, node: str = "", rows_mergeable: bool = True):
        self.shape = shape
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        self.numel = prod(shape)
        self.nbytes = self.numel * self.itemsize
        self.key = key  # storage identity: equal keys share memory
        self.storage_nbytes = storage_nbytes
        self.contiguous = contiguous
        self.mergeable = mergeable  # dims [:-2] (a bmm's batch) flatten into one without a copy
        self.rows_mergeable = rows_mergeable  # dims [:-1] (a linear's rows) flatten without a copy
        self.rg = rg
        self.is_state = is_state  # a parameter or buffer (not activation memory)
        self.node = node

    @property
    def dim(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def sig(self) -> tuple:
        return (self.shape, self.dtype, self.rg, self.contiguous, self.mergeable, self.rows_mergeable,
                self.is_state)

    def __repr__(self) -> str:
        return f"T({self.node}: {list(self.shape)} {dtype_name(self.dtype)}{' rg' if self.rg else ''})"


def _layout(shape: tuple[Num, ...], stride: tuple[Num, ...]) -> tuple[bool, bool]:
    """(contiguous, batch-mergeable, rows-mergeable), decided structurally on the (symbolic)
    sizes: contiguous means row-major strides; batch-mergeable means dims [:-2] (a bmm's batch)
    flatten into one dim as a view, rows-mergeable the same for dims [:-1] (a linear's rows)."""
    n = len(shape)
    expect: Num = 1
    contiguous = True
    for i in range(n - 1, -1, -1):
        if shape[i] != 1 and stride[i] != expect:
            contiguous = False
            break
        expect = expect * shape[i]
    def merges(upto: int) -> bool:
        return contiguous or all(shape[i] == 1 or shape[i + 1] == 1 or stride[i] == stride[i + 1] * shape[i + 1]
                                 for i in range(upto))

    return contiguous, merges(n - 3), merges(n - 2)


def meta_of(v: torch.Tensor, sm: SymbolMap, node: str, rg: bool = False, is_state: bool = False) -> TensorMeta:
    """A TensorMeta for the fake tensor `v` (the value of node `node`)."""
    try:
        st = v.untyped_storage()
        key = StorageWeakRef(st).cdata
        snb = sm.dim(st.nbytes())
        if is_symbolic(snb) and not snb.free_symbols <= sm.known:
            snb = None  # sized by a symbol the capture specialised away: use the tensor's own bytes
    except Exception:  # noqa: BLE001 - tensors without storage get a key of their own
        key, snb = ("nostorage", next(_fresh)), None
    shape = sm.shape(v.shape)
    try:
        contiguous, mergeable, rows = _layout(shape, sm.shape(v.stride()))
    except Exception:  # noqa: BLE001 - layouts we cannot read: assume copies are needed
        contiguous, mergeable, rows = False, False, False
    t = TensorMeta(shape, v.dtype, key, snb, contiguous, mergeable, rg, is_state, node, rows)
    if t.storage_nbytes is None:
        t.storage_nbytes = t.nbytes
    return t


class Call:
    """One op application with tensors described by TensorMeta."""

    __slots__ = ("node", "name", "args", "kwargs", "ins", "outs")

    def __init__(self, node: fx.Node, name: str, args: tuple, kwargs: dict, ins: list[TensorMeta],
                 outs: list[TensorMeta | None]):
        self.node = node
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.ins = ins
        self.outs = outs

    def arg(self, i: int, name: str | None = None, default: Any = None) -> Any:
        """Positional argument i, or keyword `name`, or `default`."""
        if i < len(self.args):
            return self.args[i]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default

    def t(self, i: int, name: str | None = None) -> TensorMeta | None:
        a = self.arg(i, name)
        return a if isinstance(a, TensorMeta) else None

    @property
    def out(self) -> TensorMeta | None:
        return self.outs[0] if self.outs else None

    @property
    def any_rg(self) -> bool:
        return any(t.rg for t in self.ins)

    def in_bytes(self) -> Num:
        seen, total = set(), 0
        for t in self.ins:
            if id(t) not in seen:
                seen.add(id(t))
                total = total + t.nbytes
        return total

    def out_bytes(self) -> Num:
        return sum((t.nbytes for t in self.outs if t is not None), 0)

    def out_numel(self) -> Num:
        return sum((t.numel for t in self.outs if t is not None), 0)

    def aliases_input(self) -> bool:
        """Every output shares storage with an input: the op moved no data."""
        keys = {t.key for t in self.ins}
        return bool(self.outs) and all(t is None or t.key in keys for t in self.outs)


def flatten_tensors(x: Any) -> list[TensorMeta]:
    out: list[TensorMeta] = []
    if isinstance(x, TensorMeta):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            out.extend(flatten_tensors(y))
    elif isinstance(x, dict):
        for y in x.values():
            out.extend(flatten_tensors(y))
    return out


def as_list(x: Any) -> Sequence[Any]:
    return x if isinstance(x, (list, tuple)) else [x]
