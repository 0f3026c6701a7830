"""The graph as MoE detection walks it (`search/expert_detect.py`, `search/expert.py`): node
order, stable node keys (`passes.ir.node_keys`), which nodes depend on the model's inputs
through tensors, closures and ancestries, and the small shape helpers the walk needs (a
node's shape as ints or symbol strings, equality of symbolic sizes, a capacity operand as a
sympy expression).

API: `MoEGraph(gm)`, `shape_of(n)`, `tensorish(n)`, `sym(x)`, `same_size(a, b)`, `val_expr(x)`.
Reads node.meta["autopar"] (shapes) and node.meta["val"]; writes nothing.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from autopar.passes import ir


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
        self.batch = None
        for n in self.nodes:
            if n.op == "placeholder" and shape_of(n):
                self.batch = shape_of(n)[0]
                break

    def tin(self, n: fx.Node) -> list[fx.Node]:
        return [a for a in n.all_input_nodes if tensorish(a)]

    def closure(self, seeds) -> set:
        """Nodes computed from `seeds` whose other tensor inputs are all token-free or in the set."""
        out = set(seeds)
        start = min(self.order[s] for s in seeds)
        for n in self.nodes[start:]:
            if n in out or n.op != "call_function":
                continue
            ins = self.tin(n)
            if ins and any(a in out for a in ins) and all(a in out or not self.dep[a] for a in ins):
                out.add(n)
        return out

    def descendants(self, seeds) -> set:
        out = set(seeds)
        start = min(self.order[s] for s in seeds)
        for n in self.nodes[start:]:
            if any(a in out for a in n.all_input_nodes):
                out.add(n)
        return out

    def ancestors(self, n: fx.Node) -> set:
        out, stack = set(), [n]
        while stack:
            m = stack.pop()
            for a in m.all_input_nodes:
                if a not in out:
                    out.add(a)
                    stack.append(a)
        return out

    def token_major(self, n: fx.Node, n_tokens) -> bool:
        s = shape_of(n)
        if not s:
            return False
        d0 = s[0]
        if isinstance(d0, str) and isinstance(self.batch, str):
            return any(str(f) == self.batch for f in sym(d0).free_symbols)
        return any(isinstance(d0, int) and isinstance(t, int) and t and d0 % t == 0 for t in n_tokens)
