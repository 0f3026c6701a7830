"""Sharding strategies of one node over one mesh axis: the registry and its helpers.

A *strategy* says which placements (`R`, `S(d)`, `P(sum)`, see runtime/placement.py) the
tensor inputs of a node must have on one mesh axis for the node, run unchanged on local
pieces, to produce its output in a given placement; `work` is the share of the op's compute
one rank does; `impl` names a local implementation other than the op itself
(`"vocab_embedding"`, `"mean_partial"`). `ins` is aligned with `OpView.inputs` (the node's
distinct tensor-valued input nodes); an entry `None` means "any placement: the op reads only
the input's dtype/device".

The table of rules (one function per ATen op, `passes/rules/sharding_table.py`) registers
with `@rule("aten.linear.default", ...)`. `strategies_for(node, axis, k)` evaluates the rule
of a node and always returns at least the replicated strategy: an op without a rule is
replicated and reported (`OpView.unruled`), never an error. A strategy that would shard a
dim which does not divide by the axis size is left out and the reason recorded
(`OpView.excluded`); symbolic dims (the batch) are never sharded on a non-data axis.

Reads node.meta["autopar"] (shapes, layouts on other axes) through passes/ir.py; writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from autopar.runtime.placement import Partial, Placement, R, Replicate, Shard

from .. import ir

PS = Partial("sum")


@dataclass(frozen=True)
class Strategy:
    ins: tuple[Placement | None, ...]
    out: Placement | None
    work: float = 1.0
    impl: str | None = None

    def __str__(self) -> str:
        ins = ",".join("*" if p is None else str(p) for p in self.ins)
        return f"{ins}->{self.out if self.out is not None else '-'}" + (f"[{self.impl}]" if self.impl else "")


def parse_strategy(text: str) -> tuple[tuple[str, ...], str, str | None]:
    """Inverse of str(Strategy) up to placements as text: (ins, out, impl)."""
    impl = None
    if text.endswith("]"):
        text, _, impl = text[:-1].rpartition("[")
    ins, _, out = text.partition("->")
    return tuple(i for i in ins.split(",") if i), out, impl


Rule = Callable[["OpView"], list[Strategy]]
RULES: dict[str, Rule] = {}


def rule(*names: str):
    def deco(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
        return fn
    return deco


def op_name(target: Any) -> str:
    if hasattr(target, "overloadpacket") and hasattr(target, "namespace"):  # an OpOverload
        return f"{target.namespace}.{target.__name__}"
    if getattr(target, "__module__", None) == "_operator":
        return f"operator.{target.__name__}"
    return getattr(target, "__name__", str(target))


def value_shape(n: fx.Node) -> tuple | None:
    """Shape of a tensor node, or of the first element of a tuple-of-tensors node (chunk, topk:
    their rules give the placement of every element); None for anything else."""
    i = ir.get_info(n)
    if i is not None and i.shape is not None:
        return i.shape
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)) and val and all(isinstance(x, torch.Tensor) for x in val):
        return tuple(x if isinstance(x, int) else str(x) for x in val[0].shape)
    return None


def is_tuple(n: fx.Node) -> bool:
    i = ir.get_info(n)
    return (i is None or i.shape is None) and value_shape(n) is not None


def is_tensor(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op != "output" and value_shape(n) is not None


@dataclass
class OpView:
    """What a rule sees of one node: tensor arguments in order, their shapes, the axis size."""

    node: fx.Node
    op: str
    k: int
    axis: str
    args_t: list[fx.Node]  # tensor-valued arguments in flattened (args, kwargs) order, repeats kept
    inputs: list[fx.Node]  # distinct tensor inputs (node.all_input_nodes order, tensors only)
    forbidden: dict[fx.Node, set[int]] = field(default_factory=dict)  # dims sharded on another axis
    excluded: list[str] = field(default_factory=list)
    unruled: bool = False

    # --- shapes --------------------------------------------------------------------------
    def shape(self, n: fx.Node) -> tuple:
        return value_shape(n)

    @property
    def in_shapes(self) -> list[tuple]:
        return [self.shape(a) for a in self.args_t]

    @property
    def out_shape(self) -> tuple | None:
        return value_shape(self.node)

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if len(self.node.args) > i:
            return self.node.args[i]
        return self.node.kwargs.get(name, default)

    # --- divisibility ----------------------------------------------------------------------
    def can_shard(self, shape: tuple, d: int, who: fx.Node | None = None) -> bool:
        """Whether dim d of `shape` may be sharded k ways; records why not."""
        if d < 0 or d >= len(shape):
            return False
        n = shape[d]
        if who is not None and d in self.forbidden.get(who, ()):
            return False
        if not isinstance(n, int):
            return False  # symbolic (the batch): sharded by the data axis only
        if n % self.k or n < self.k:
            if n > 1:
                self.excluded.append(f"{self.node.name}: dim {d} of size {n} does not divide by {self.axis}={self.k}")
            return False
        return True

    def out_ok(self, d: int) -> bool:
        s = self.out_shape
        return s is not None and self.can_shard(s, d, self.node)


# --- helpers rules compose ---------------------------------------------------------------------
def replicated(v: OpView) -> Strategy:
    return Strategy(tuple(R for _ in v.args_t), R if v.out_shape is not None else None, 1.0)


def dim_map(v: OpView, maps: Sequence[Sequence[int | None]], *, partial: Sequence[Sequence[Placement]] = (),
            skip_out: Sequence[int] = (), work_partial: float = 1.0) -> list[Strategy]:
    """Strategies of an op whose output dim d comes from dim maps[j][d] of argument j (None:
    the argument lacks it or broadcasts it). `partial`: argument patterns with P that give a
    P output (the op is linear in those arguments). `skip_out`: output dims never sharded."""
    out = [replicated(v)]
    oshape = v.out_shape
    if oshape is None:
        return out
    for d in range(len(oshape)):
        if d in skip_out or not v.out_ok(d):
            continue
        ins: list[Placement] = []
        good = True
        for j, a in enumerate(v.args_t):
            m = maps[j][d] if d < len(maps[j]) else None
            ashape = v.shape(a)
            if m is None or ashape[m] == 1 and oshape[d] != 1:
                ins.append(R)
                continue
            if ashape[m] != oshape[d] or not v.can_shard(ashape, m, a):
                good = False
                break
            ins.append(Shard(m))
        if good:
            out.append(Strategy(tuple(ins), Shard(d), 1.0 / v.k))
    for pat in partial:
        out.append(Strategy(tuple(pat), PS, work_partial))
    return out


def broadcast_maps(v: OpView) -> list[list[int | None]]:
    nd = len(v.out_shape)
    maps = []
    for s in v.in_shapes:
        off = nd - len(s)
        maps.append([d - off if d - off >= 0 else None for d in range(nd)])
    return maps


def strategies_for(node: fx.Node, axis: str, k: int, forbidden: dict[fx.Node, set[int]] | None = None) -> OpView:
    """Evaluate the rule of `node` for axis `axis` of size k; the strategies are in
    `view.strategies` (deduplicated, each with ins aligned to `view.inputs`)."""
    inputs = [a for a in node.all_input_nodes if is_tensor(a)]
    args_t = [a for a in _flat((node.args, node.kwargs)) if is_tensor(a)]
    v = OpView(node=node, op=op_name(node.target), k=k, axis=axis, args_t=args_t, inputs=inputs,
               forbidden=forbidden or {})
    fn = RULES.get(v.op)
    raw: list[Strategy]
    if fn is None:
        v.unruled = True
        raw = [replicated(v)]
    else:
        try:
            raw = fn(v)
        except (IndexError, TypeError, KeyError) as e:  # a rule that cannot read this call: replicate it
            v.unruled = True
            v.excluded.append(f"{node.name}: rule for {v.op} failed ({type(e).__name__}: {e}); replicated")
            raw = [replicated(v)]
    seen: dict[str, Strategy] = {}
    for s in raw:
        merged = _merge(v, s)
        if merged is not None and str(merged) not in seen:
            seen[str(merged)] = merged
    if not seen:
        seen["R"] = _merge(v, replicated(v))
    v.strategies = list(seen.values())  # type: ignore[attr-defined]
    return v


def requires_grad_nodes(gm: fx.GraphModule, inputs_require_grad: bool = False) -> set[fx.Node]:
    """Nodes whose value depends on a trainable parameter (their gradient flows); with
    `inputs_require_grad`, on a floating-point graph input too."""
    params = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            i = ir.get_info(n)
            if inputs_require_grad and i is not None and i.dtype and i.dtype.startswith(("float", "bfloat")):
                out.add(n)
        elif n.op == "get_attr":
            if str(n.target) in params:
                out.add(n)
        elif n.op == "call_function" and any(a in out for a in n.all_input_nodes):
            i = ir.get_info(n)
            if i is None or i.dtype is None or i.dtype.startswith(("float", "bfloat", "complex")) or i.shape is None:
                out.add(n)
    return out


def partial_grad(s: Strategy, p: Placement | None, node: fx.Node, rg: set[fx.Node]) -> bool:
    """A replicated input of a strategy with a sharded or partial output receives a partial
    gradient (each rank back-propagates through its piece), which must be summed."""
    return (node in rg and isinstance(p, Replicate) and s.out is not None
            and not isinstance(s.out, Replicate) and s.work > 0)


def _merge(v: OpView, s: Strategy) -> Strategy | None:
    """Per-argument placements -> per-distinct-input placements (None if an input is used
    twice with different placements)."""
    if len(s.ins) != len(v.args_t):
        raise ValueError(f"rule for {v.op} gave {len(s.ins)} placements for {len(v.args_t)} tensor arguments")
    per: dict[fx.Node, Placement | None] = {}
    for a, p in zip(v.args_t, s.ins):
        if a in per and per[a] != p:
            if per[a] is None:
                per[a] = p
                continue
            if p is None:
                continue
            return None
        per[a] = p
    return Strategy(tuple(per.get(a) for a in v.inputs), s.out, s.work, s.impl)


def _flat(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flat(e)]
    if isinstance(x, dict):
        return [y for e in x.values() for y in _flat(e)]
    return [x]


def is_shard(p: Placement | None) -> bool:
    return isinstance(p, Shard)


def is_partial(p: Placement | None) -> bool:
    return isinstance(p, Partial)


def is_rep(p: Placement | None) -> bool:
    return isinstance(p, Replicate)


__all__ = ["Strategy", "OpView", "RULES", "rule", "strategies_for", "dim_map", "broadcast_maps", "replicated",
           "op_name", "PS", "parse_strategy", "is_tensor", "is_tuple", "value_shape",
           "requires_grad_nodes", "partial_grad"]
