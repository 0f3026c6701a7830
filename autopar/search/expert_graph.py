"""The graph as MoE detection walks it (`search/expert_detect.py`, `search/expert.py`): node
order, stable node keys (`passes.ir.node_keys`), which nodes depend on the model's inputs
through tensors, closures and ancestries, and the small shape helpers the walk needs (a
node's shape as ints or symbol strings, equality of symbolic sizes, a capacity operand as a
sympy expression).

API: `MoEGraph(gm)` (`closure(seeds)`, `descendants(seeds, stop=None)`, `ancestors(n, within=None)`,
`router(t)`: walks that cost what they find, not the rest of the graph), `shape_of(n)`,
`tensorish(n)`, `sym(x)`, `same_size(a, b)` (memoised), `val_expr(x)`.
Reads node.meta["autopar"] (shapes) and node.meta["val"]; writes nothing.
"""
from __future__ import annotations

import functools
import heapq

import sympy
import torch
import torch.fx as fx

from autopar.passes import ir
from autopar.search.expert_props import RouterIndex, find_router


def shape_of(n) -> tuple | None:
    """A node's shape: ints, symbolic sizes as strings ("8*s72"); None for a non-tensor."""
    if not isinstance(n, fx.Node):
        return None
    i = ir.get_info(n)
    if i is not None and i.shape is not None:
        return i.shape
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(s if isinstance(s, int) else str(s) for s in val.shape)
    return None


def tensorish(n) -> bool:
    """Whether `n` gives a tensor (or a tuple holding one): a data edge, not a size."""
    if not isinstance(n, fx.Node) or n.op == "output":
        return False
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
        return True
    return n.op == "get_attr" or shape_of(n) is not None


def sym(x) -> sympy.Expr:
    """A size (int or symbol string) as a sympy expression."""
    return sympy.sympify(x) if isinstance(x, str) else sympy.Integer(int(x))


def same_size(a, b) -> bool:
    """Whether two sizes (ints or symbol strings) are equal for every value of their symbols."""
    try:
        return _same_size(a, b)
    except TypeError:  # an unhashable size: not memoised
        return _same_size.__wrapped__(a, b)


@functools.lru_cache(maxsize=4096)
def _same_size(a, b) -> bool:
    # memoised: every block of a deep MoE asks the same few questions, and sympy's simplify
    # costs milliseconds each
    try:
        return sympy.simplify(sym(a) - sym(b)) == 0
    except (sympy.SympifyError, TypeError):
        return str(a) == str(b)


def val_expr(x):
    """A capacity operand as a sympy expression (SymInt node or int)."""
    if isinstance(x, int):
        return sympy.Integer(x)
    if isinstance(x, fx.Node):
        v = x.meta.get("val")
        if isinstance(v, int):
            return sympy.Integer(v)
        if isinstance(v, torch.SymInt):
            return sympy.sympify(str(v.node.expr))
    return None


class MoEGraph:
    """A graph as the detector walks it: node order, stable node keys, which nodes depend on
    the inputs through tensors, the batch size of the first input."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.keys = ir.node_keys(gm)
        self.dep: dict[fx.Node, bool] = {}
        for n in self.nodes:
            # data dependence on an input through tensors (sizes do not count: arange(N) is token-free)
            self.dep[n] = n.op == "placeholder" or any(self.dep.get(a, False) for a in n.all_input_nodes
                                                       if tensorish(a))
        self._routers = None
        self.batch = None
        for n in self.nodes:
            if n.op == "placeholder" and shape_of(n):
                self.batch = shape_of(n)[0]
                break

    def tin(self, n: fx.Node) -> list[fx.Node]:
        return [a for a in n.all_input_nodes if tensorish(a)]

    # The walks below follow users from the seeds in graph order (a heap keyed by position)
    # instead of scanning every node after the first seed: a block's walk costs the size of
    # what it finds, not the rest of the graph, so detection is linear in the layers, not
    # quadratic. Each equals the plain scan it replaces (tests/unit/test_plan_speed_invariance.py
    # checks them against it).
    def closure(self, seeds) -> set:
        """Nodes computed from `seeds` whose other tensor inputs are all token-free or in the set."""
        out = set(seeds)
        heap = [(self.order[u], u) for s in out for u in s.users]
        heapq.heapify(heap)
        seen: set = set()
        while heap:
            _, n = heapq.heappop(heap)
            if n in seen or n in out:
                continue
            seen.add(n)
            if n.op != "call_function":
                continue
            ins = self.tin(n)
            # a node that reads a member joins when its other tensor inputs are token-free or
            # members: every member input precedes it, so it is decided when popped
            if ins and any(a in out for a in ins) and all(a in out or not self.dep[a] for a in ins):
                out.add(n)
                for u in n.users:
                    heapq.heappush(heap, (self.order[u], u))
        return out

    def descendants(self, seeds, stop: fx.Node | None = None) -> set:
        """`seeds` and every node computed from them; with `stop`, only those up to `stop` in
        graph order (what an intersection with `stop`'s ancestry needs)."""
        out = set(seeds)
        last = self.order[stop] if stop is not None else len(self.nodes)
        stack = list(out)
        while stack:
            m = stack.pop()
            for u in m.users:
                if u not in out and self.order[u] <= last:
                    out.add(u)
                    stack.append(u)
        return out

    def ancestors(self, n: fx.Node, within: set | None = None) -> set:
        """Every node `n` is computed from; with `within`, only those reached through members of
        `within` (ancestors that are themselves in `within`: the region between a set and `n`
        when `within` holds that set's descendants)."""
        out, stack = set(), [n]
        while stack:
            m = stack.pop()
            for a in m.all_input_nodes:
                if a not in out and (within is None or a in within):
                    out.add(a)
                    stack.append(a)
        return out

    def router(self, t: fx.Node):
        """`expert_props.find_router(t)`, with the walk bounded by this graph's router index."""
        if self._routers is None:
            self._routers = RouterIndex(self.nodes, self.order)
        return find_router(t, self._routers)

    def token_major(self, n: fx.Node, n_tokens) -> bool:
        s = shape_of(n)
        if not s:
            return False
        d0 = s[0]
        if isinstance(d0, str) and isinstance(self.batch, str):
            return any(str(f) == self.batch for f in sym(d0).free_symbols)
        return any(isinstance(d0, int) and isinstance(t, int) and t and d0 % t == 0 for t in n_tokens)
