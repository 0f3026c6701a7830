"""Symbolic sizes: the SymInts of a captured graph as sympy expressions in `b` and `s`.

A graph captured with a dynamic batch (and optionally sequence) dimension carries SymInts
(`s77`, `s12` ...) in `node.meta["val"]`. `SymbolMap.from_graph` names them: dim 0 of the
first tensor input whose dim 0 is symbolic becomes `b` (batch), the first symbolic dim 1
becomes `s` (sequence); any other free symbol keeps its own name (`names=` renames them). Every cost in
`autopar.cost` is then an int (static dims) or a sympy expression in these symbols, so a
graph is re-costed for other sizes by substitution, without capturing again.

It reads `node.meta["val"]` of placeholders. Guarantees: the same SymInt always maps to
the same expression object (cached), so identical layers produce identical, cheaply
comparable expressions; `evaluate` is memoised per (expression, sizes).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Iterable, Mapping, Union

import sympy
import torch
import torch.fx as fx

B = sympy.Symbol("b", positive=True, integer=True)
S = sympy.Symbol("s", positive=True, integer=True)

Num = Union[int, float, sympy.Expr]


def prod(xs: Iterable[Num]) -> Num:
    out: Num = 1
    for x in xs:
        out = out * x
    return out


def is_symbolic(x: Any) -> bool:
    return isinstance(x, sympy.Basic) and not x.is_Number


def _plain(e: sympy.Expr) -> Num:
    if e.is_Integer:
        return int(e)
    if e.is_Number:
        return float(e)
    return e


class SymbolMap:
    """Maps the graph's SymInts to expressions over named symbols, with their example values."""

    def __init__(self, rename: Mapping[sympy.Symbol, sympy.Symbol] | None = None,
                 hints: Mapping[sympy.Symbol, int] | None = None):
        self.rename = dict(rename or {})
        self.hints: dict[sympy.Symbol, int] = dict(hints or {})  # over the *renamed* symbols
        self._cache: dict[Any, Num] = {}
        self.known = set(self.rename.values())

    @staticmethod
    def from_graph(gm: fx.GraphModule, names: Mapping[str, str] | None = None) -> "SymbolMap":
        """Name the graph's symbols. `names` overrides the choice, e.g. {"s77": "b", "s12": "s"}."""
        rename: dict[sympy.Symbol, sympy.Symbol] = {}
        hints: dict[sympy.Symbol, int] = {}
        for n in gm.graph.nodes:
            v = n.meta.get("val") if n.op == "placeholder" else None
            if not isinstance(v, torch.Tensor):
                continue
            for dim, d in enumerate(v.shape):
                if not isinstance(d, torch.SymInt) or not isinstance(d.node.expr, sympy.Symbol):
                    continue
                e = d.node.expr
                if e in rename:
                    continue
                if dim == 0 and B not in rename.values():
                    rename[e] = B
                elif dim == 1 and S not in rename.values():
                    rename[e] = S
                else:
                    rename[e] = _own(e)
                if d.node.hint is not None:
                    hints[rename[e]] = int(d.node.hint)
        for old, new in (names or {}).items():
            match = [k for k in rename if str(k) == old]
            if not match:
                raise ValueError(f"symbol {old!r} is not a symbolic input size of this graph; "
                                 f"its symbols are {sorted(str(k) for k in rename)}")
            prev = rename[match[0]]
            target = sympy.Symbol(new, positive=True, integer=True)
            rename[match[0]] = target
            if prev in hints:
                hints[target] = hints.pop(prev)
        return SymbolMap(rename, hints)

    def dim(self, d: Any) -> Num:
        """An int, or the sympy expression of a SymInt over the named symbols."""
        if isinstance(d, int):
            return d
        if isinstance(d, torch.SymInt):
            e = d.node.expr
            hit = self._cache.get(e)
            if hit is None:
                hit = _plain(e.xreplace({s: self.rename.get(s) or _own(s) for s in e.free_symbols}))
                self._cache[e] = hit
            return hit
        if isinstance(d, (torch.SymFloat, torch.SymBool)):
            return d.node.hint if d.node.hint is not None else 0
        return d

    def shape(self, shape: Iterable[Any]) -> tuple[Num, ...]:
        return tuple(self.dim(d) for d in shape)

    @property
    def symbols(self) -> dict[str, sympy.Symbol]:
        return {str(s): s for s in self.rename.values()}

    def values(self, sizes: Mapping[str, int] | None = None) -> dict[sympy.Symbol, int]:
        """Symbol -> value: the example values, overridden by `sizes` ({"b": 8, "s": 4096})."""
        vals = dict(self.hints)
        known = self.symbols
        for k, v in (sizes or {}).items():
            if k not in known:
                raise ValueError(f"size {k!r} is not a symbol of this graph (its symbols: {sorted(known) or 'none'}); "
                                 "capture with dynamic shapes for that dimension to re-cost it")
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"size {k}={v!r} must be a positive integer")
            vals[known[k]] = v
        return vals


@lru_cache(maxsize=None)
def _own(s: sympy.Symbol) -> sympy.Symbol:
    return sympy.Symbol(str(s), positive=True, integer=True)


def evaluate(x: Num, values: Mapping[sympy.Symbol, int]) -> float:
    """The number `x` stands for at `values` (ints pass through)."""
    if not isinstance(x, sympy.Basic):
        return x
    items = tuple(values.items())
    key = _VALUE_KEYS.get(items)
    if key is None:  # str(Symbol) runs sympy's printer (~10 us): once per distinct sizes, not per call
        if len(_VALUE_KEYS) > 4096:
            _VALUE_KEYS.clear()
        key = _VALUE_KEYS[items] = tuple(sorted((str(k), v) for k, v in items))
    return _evaluate(x, key)


# the items of a `values` mapping -> _evaluate's key (names sorted); symbols hash by their cached
# hash, so this costs a tuple per call instead of printing every symbol
_VALUE_KEYS: dict[tuple, tuple[tuple[str, int], ...]] = {}


@lru_cache(maxsize=65536)
def _evaluate(x: sympy.Expr, values: tuple[tuple[str, int], ...]) -> float:
    sub = {s: sympy.Integer(v) for s in x.free_symbols for (k, v) in values if str(s) == k}
    missing = [str(s) for s in x.free_symbols if s not in sub]
    if missing:
        raise ValueError(f"no value for size symbol(s) {missing}; pass them in sizes=")
    r = x.xreplace(sub)
    r = r.evalf() if not r.is_Number else r
    f = float(r)
    return int(f) if math.isfinite(f) and f == int(f) else f
