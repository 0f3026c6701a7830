"""The machinery of fusion patterns: what a match is, the graph queries patterns are written
with, and the checks every match passes (passes/rules/fusion_table.py holds the patterns).

A `Match` names the nodes a fused kernel replaces, the ones whose values it returns, and its
arguments (graph nodes, constants, or `Emit`s: small nodes the rewrite creates, such as a
reshape). `finish` accepts a candidate only if every replaced node other than the outputs is
used only inside the match, no input is computed from a replaced node, the rewrite moves no
node across a random op or a grad-mode switch, and the kernel's torch reference, run on the
fake values of the inputs, gives every output's shape and dtype (a loss may come back in fp32
and is then cast to the graph's dtype).

Reads node.meta["val"] (dtypes, fake values) and node.meta["autopar"] (shapes: the local shape
once a plan is applied, else the global one); writes nothing.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from autopar.runtime.kernels import KERNELS

from .. import ir
from .sharding import requires_grad_nodes

aten = torch.ops.aten

VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)
_ASSERT = aten._assert_tensor_metadata.default
LOW_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_FP32_LOSSES = ("cross_entropy", "linear_cross_entropy")  # kernels that return an fp32 loss


# ---------------------------------------------------------------------------- data


@dataclass(eq=False)
class Emit:
    """A node the rewrite creates for a match: `target(*args, **kwargs)` (arguments may be
    nodes or other Emits); its meta is copied from `like` (same module, same numel)."""

    target: Callable
    args: tuple
    like: fx.Node
    kwargs: dict = field(default_factory=dict)


@dataclass(eq=False)
class Match:
    """One place where a rule applies.

    anchor: the last replaced node in graph order; the fused call takes its place and its
        module path.
    nodes: every node the rewrite removes (anchor and outputs included).
    outputs: the replaced nodes whose values the kernel returns, in the kernel's output order.
    args, kwargs: the kernel's arguments (fx.Node, Emit, or constants).
    casts: per output, the dtype to cast the kernel's result to (None: none needed); only the
        losses use it: their kernels return fp32 where a low-precision graph had a bf16 loss.
    """

    rule: str
    kernel: str
    anchor: fx.Node
    nodes: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]
    args: tuple
    kwargs: dict
    casts: tuple = ()

    @property
    def module(self) -> str:
        i = ir.get_info(self.anchor)
        return i.module if i is not None else ir.module_path(self.anchor)

    def inputs(self) -> list[fx.Node]:
        """Graph nodes the fused computation reads (through Emits too), in first-seen order."""
        out: dict[fx.Node, None] = {}

        def visit(a):
            if isinstance(a, fx.Node):
                out[a] = None
            elif isinstance(a, Emit):
                visit(a.args)
                visit(a.kwargs)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    visit(b)
            elif isinstance(a, dict):
                for b in a.values():
                    visit(b)

        visit(self.args)
        visit(self.kwargs)
        return list(out)

    def describe(self) -> str:
        return f"{self.rule} at {self.module or '(root)'} ({self.anchor.name})"


@dataclass(frozen=True)
class FusionRule:
    name: str
    kernel: str  # key of autopar.runtime.kernels.KERNELS
    match: Callable[[fx.Node, "GraphView"], Match | None]  # tried at every call_function node
    algebra: str


# ---------------------------------------------------------------------------- graph helpers


class GraphView:
    """What the matchers read about one graph, computed once."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.rg = requires_grad_nodes(gm)
        self.types: dict[Any, Any] = {}  # kernel call signature -> output (shape, dtype)s


def is_call(n: Any, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def val_of(n: Any) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def dtype_of(n: Any) -> torch.dtype | None:
    v = val_of(n)
    return v.dtype if v is not None else None


def shape_of(n: Any) -> tuple | None:
    """Shape on this rank: the local shape once a plan is applied, else the global one."""
    i = ir.get_info(n) if isinstance(n, fx.Node) else None
    if i is not None and i.shape is not None:
        return tuple(i.local_shape if i.local_shape is not None else i.shape)
    v = val_of(n)
    return tuple(d if isinstance(d, int) else str(d) for d in v.shape) if v is not None else None


def is_float(n: Any) -> bool:
    d = dtype_of(n)
    return d is not None and d.is_floating_point


def is_last_dim(n: Any, dim: Any) -> bool:
    shape = shape_of(n)
    if shape is None or not isinstance(dim, int):
        return False
    return dim in (-1, len(shape) - 1)


def users(n: fx.Node) -> list[fx.Node]:
    """Users other than `_assert_tensor_metadata` checks (which export leaves on casts)."""
    return [u for u in n.users if not is_call(u, _ASSERT)]


def sole_user(n: fx.Node) -> fx.Node | None:
    us = users(n)
    return us[0] if len(us) == 1 else None


def number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def cast_of(n: Any) -> tuple[fx.Node, torch.dtype] | None:
    """(source, dtype) if `n` is a dtype cast on the same device."""
    if not is_call(n, *_CASTS) or not isinstance(n.args[0], fx.Node):
        return None
    dtype = n.args[1] if n.target is aten.to.dtype and len(n.args) > 1 else n.kwargs.get("dtype")
    if not isinstance(dtype, torch.dtype):
        return None
    src, out = val_of(n.args[0]), val_of(n)
    if src is None or out is None or src.device != out.device:
        return None
    return n.args[0], dtype


def other_arg(n: fx.Node, a: Any) -> Any:
    """The other argument of a binary op whose first two args are `a` and something."""
    x, y = n.args[0], n.args[1]
    return y if x is a else x if y is a else None


def plain_binary(n: fx.Node, *targets) -> bool:
    return is_call(n, *targets) and len(n.args) == 2 and not n.kwargs


def same_type(a: Any, b: Any) -> bool:
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and val_of(a) is not None
            and val_of(b) is not None and shape_of(a) == shape_of(b) and dtype_of(a) == dtype_of(b))


def is_weight_1d(w: Any, n_last: Any) -> bool:
    return isinstance(w, fx.Node) and shape_of(w) == (n_last,) and is_float(w)


# ---------------------------------------------------------------------------- fake values


# Emit -> its fake value, for the Emit's life: an Emit's arguments are nodes of a graph the search
# only reads, and running its op on fake values again for each question the fusion search asks
# (types, traffic, dtype: three per match) ran the same fake-tensor ops three times
_EMIT_VALUES: "weakref.WeakKeyDictionary[Emit, Any]" = weakref.WeakKeyDictionary()


def value_of(a: Any, cache: dict | None = None) -> Any:
    """The fake value of a match argument: node -> meta["val"], Emit -> its op run on fake
    values (shapes and dtypes only), containers element-wise, constants as they are.
    `cache` (id(Emit) -> value): a rewrite's own, for Emits whose argument nodes it is
    changing; without one an Emit's value is computed once and kept with the Emit."""
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, Emit):
        if cache is None:
            if a not in _EMIT_VALUES:
                _EMIT_VALUES[a] = a.target(*value_of(a.args), **value_of(a.kwargs))
            return _EMIT_VALUES[a]
        if id(a) not in cache:
            cache[id(a)] = a.target(*value_of(a.args, cache), **value_of(a.kwargs, cache))
        return cache[id(a)]
    if isinstance(a, (list, tuple)):
        return type(a)(value_of(b, cache) for b in a)
    if isinstance(a, dict):
        return {k: value_of(v, cache) for k, v in a.items()}
    return a


def kernel_value(m: Match, cache: dict | None = None) -> Any:
    """What the kernel returns for this match, as fake values (its torch reference run)."""
    return KERNELS[m.kernel].reference(*value_of(m.args, cache), **value_of(m.kwargs, cache))


def _type(t: Any) -> Any:
    return (tuple(map(str, t.shape)), t.dtype) if isinstance(t, torch.Tensor) else None


def _signature(a: Any) -> Any:
    """What a kernel's output types depend on: argument types and constants (identical
    layers share one signature, so their reference runs once)."""
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        return _type(v) if isinstance(v, torch.Tensor) else ("node", str(v))
    if isinstance(a, Emit):
        return ("emit", str(a.target), _signature(a.args), _signature(a.kwargs))
    if isinstance(a, (list, tuple)):
        return tuple(_signature(b) for b in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _signature(v)) for k, v in a.items()))
    return ("const", repr(a))


# kernel call signature -> output types, for the whole process: a kernel's output types are a
# function of its argument types and constants alone (symbolic sizes by name), so the same call
# in another graph (the meta twin of a model, another mesh) needs no second reference run
_TYPES: dict[Any, Any] = {}


def _output_types(m: Match, g: GraphView) -> tuple | None:
    key = (m.kernel, _signature(m.args), _signature(m.kwargs))
    if key not in g.types:
        if key not in _TYPES:
            try:
                got = kernel_value(m)
            except Exception:  # noqa: BLE001 - a reference that cannot take these values: no match
                got = None
            got = got if isinstance(got, tuple) or got is None else (got,)
            _TYPES[key] = None if got is None else tuple(_type(v) for v in got)
        g.types[key] = _TYPES[key]
    return g.types[key]


# ---------------------------------------------------------------------------- checking a match


def finish(g: GraphView, rule: str, kernel: str, nodes: Iterable[fx.Node], outputs: tuple,
            args: tuple, kwargs: dict | None = None) -> Match | None:
    """A Match if the pattern is self-contained and the kernel computes its outputs' types."""
    kwargs = kwargs or {}
    nodes = set(nodes)
    if any(n.op != "call_function" for n in nodes):
        return None
    for n in list(nodes):  # a removed tensor's dtype checks go with it
        if n not in outputs:
            nodes.update(u for u in n.users if is_call(u, _ASSERT))
    for n in nodes:
        if n in outputs or is_call(n, _ASSERT):
            continue
        if any(u not in nodes for u in n.users):
            return None  # an intermediate value is needed elsewhere: fusing would recompute it
    m = Match(rule, kernel, max(nodes, key=g.order.__getitem__),
              tuple(sorted(nodes, key=g.order.__getitem__)), tuple(outputs), tuple(args), kwargs)
    first = min(g.order[n] for n in nodes)
    if any(_depends_on(i, nodes, first, g) for i in m.inputs()) or _reorders_effects(m, g):
        return None
    got = _output_types(m, g)
    if got is None or len(got) != len(outputs):
        return None
    casts = []
    for o, t in zip(outputs, got):
        want = _type(val_of(o))
        if want is None or t is None or t[0] != want[0]:
            return None
        if t[1] == want[1]:
            casts.append(None)
        elif kernel in _FP32_LOSSES and t[1] == torch.float32 and want[1].is_floating_point:
            casts.append(want[1])  # the graph rounded its loss; round the kernel's the same way
        else:
            return None
    m.casts = tuple(casts)
    return m


def _is_effect(n: fx.Node) -> bool:
    """Nodes whose position matters beyond their inputs: grad-mode switches (pre-dispatch
    graphs) and random ops (their draws follow graph order)."""
    name = getattr(n.target, "__name__", str(n.target))
    return n.op == "call_function" and ("set_grad_enabled" in name or name.split(".")[0] in _RANDOM)


_RANDOM = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "bernoulli_",
           "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "multinomial",
           "normal", "uniform_", "normal_", "exponential_")


def _reorders_effects(m: Match, g: GraphView) -> bool:
    """Whether the rewrite would move a node across a grad-mode switch or a random op.

    The fused call takes the anchor's place; nodes between the first replaced node and the
    anchor that read an output (directly or not) move down to after it, the rest stay.
    """
    lo, hi = g.order[m.nodes[0]], g.order[m.anchor]
    replaced = set(m.nodes)
    span = [n for n in g.nodes[lo + 1:hi] if n not in replaced]
    moved: set[fx.Node] = set(m.outputs)
    moving = False
    for n in span:
        if any(a in moved for a in n.all_input_nodes):
            moved.add(n)
            moving = True
    return moving and any(_is_effect(n) for n in span)


def _depends_on(n: fx.Node, nodes: set[fx.Node], first: int, g: GraphView) -> bool:
    """Whether `n` is, or is computed from, a node in `nodes` (nodes before `first` in graph
    order cannot be)."""
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if x in nodes:
            return True
        if x in seen or g.order.get(x, -1) < first:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
    return False
