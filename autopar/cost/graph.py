"""Analyse a captured graph: per-node FLOPs, bytes and saved-for-backward tensors.

`analyze(gm, hardware)` walks the ATen-level GraphModule once, in order:
  * describes every value by a `TensorMeta` (shape in `b`/`s`, dtype, storage key);
  * propagates requires-grad: parameters that require grad seed it, inputs and buffers do
    not, a differentiable op passes it on to its floating-point outputs, and the body of
    `wrap_with_set_grad_enabled(False, ...)` (e.g. rotary tables) gets none;
  * costs every op with `ops.RULES` and lists what autograd saves with `saved.SAVED`,
    resolved to storages so that views and repeated saves are counted once;
  * inlines higher-order ops (their subgraph's nodes are costed under the caller's layer);
  * groups nodes into layers: the module path cut after the first numeric component
    (`layers.3`, `model.layers.3`), other modules cut at the same depth (`tok_emb`, `lm_head`).
Identical calls (same op, shapes, dtypes, flags, arguments) are costed once and the result
shared, so the 80 identical blocks of a 70B model cost one block's rule evaluations.

It reads `node.meta["val"]` and `node.meta["nn_module_stack"]`; it writes nothing (not
`node.meta["autopar"]` either). Guarantees: every call_function node gets a NodeCost;
ops without a cost or saved-tensor rule are counted in `unknown_ops` / `unknown_saved`.
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import sympy
import torch
import torch.fx as fx
import torch.nn as nn

from autopar.passes.ir import module_path as _ir_module_path

from . import ops as O
from . import saved as SV
from .hardware import Hardware, load_profile
from .symbolic import Num, SymbolMap, evaluate
from .tensors import Call, TensorMeta, meta_of


@dataclass
class NodeCost:
    name: str
    key: str  # stable across captures: "<module path>:<op>#<k>" (the Plan's node_layouts key)
    op: str
    module: str  # full module path ('' at the root)
    layer: str  # grouping key ('layers.3')
    index: int  # position in the forward order
    cost: O.OpCost
    bwd_flops: Num  # backward FLOPs (FlopCounterMode convention) for the chosen kernel
    has_grad_fn: bool  # autograd records this op (some input requires grad, op differentiable)
    saved: tuple[tuple[Any, Num, str], ...]  # (storage key, bytes, tag) kept for backward
    new_storages: tuple[Any, ...]  # storages this node's outputs allocate
    uses: tuple[Any, ...]  # storages it reads
    grad_inputs: tuple[TensorMeta, ...]  # inputs that receive a gradient in backward
    outputs: tuple[TensorMeta, ...]
    fallback_cost: bool = False
    fallback_saved: bool = False
    reads: tuple[TensorMeta, ...] = ()  # the input tensors themselves (a view's own shape), once each

    @property
    def kind(self) -> str:
        return self.cost.kind


@dataclass
class ParamInfo:
    name: str
    numel: int
    dtype: torch.dtype
    requires_grad: bool
    is_buffer: bool
    key: Any  # storage key of its get_attr value
    first_use: int  # index of the first node that reads it (len(nodes) if unused)
    layer: str
    shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class Storage:
    nbytes: Num
    is_state: bool
    producer: int  # node index that allocates it (-1: input, parameter or buffer)


@dataclass
class GraphCost:
    """The analysis of one graph: symbolic per-node costs and what memory they touch."""

    nodes: list[NodeCost]
    params: list[ParamInfo]
    storages: dict[Any, Storage]
    outputs: list[TensorMeta]
    symbols: SymbolMap
    kernels: Mapping[str, Any]
    hardware: str
    unknown_ops: Counter = field(default_factory=Counter)
    unknown_saved: Counter = field(default_factory=Counter)
    rule_errors: dict[str, str] = field(default_factory=dict)
    evaluations: int = 0  # distinct calls the rules were run on (the rest reused a result)
    seconds: float = 0.0

    # --- totals (ints or sympy expressions in b, s) -----------------------------------
    def total(self, attr: str) -> Num:
        return sympy.Add(*[getattr(n.cost, attr) for n in self.nodes]) if self._symbolic else \
            sum(getattr(n.cost, attr) for n in self.nodes)

    @property
    def _symbolic(self) -> bool:
        return bool(self.symbols.rename)

    @property
    def flops(self) -> Num:
        """Forward FLOPs, FlopCounterMode convention."""
        return _simplify(self.total("flops"))

    @property
    def bwd_flops(self) -> Num:
        return _simplify(_sum(n.bwd_flops for n in self.nodes))

    @property
    def saved_bytes(self) -> Num:
        """Bytes autograd keeps for backward after the forward: every saved storage once,
        parameters and buffers excluded."""
        seen: dict[Any, Num] = {}
        for n in self.nodes:
            for key, nbytes, _ in n.saved:
                if key not in seen and not self._is_state(key):
                    seen[key] = nbytes
        return _simplify(_sum(seen.values()))

    def saved_bytes_by_layer(self) -> dict[str, Num]:
        """Saved bytes charged to the layer of the first node that saves each storage."""
        seen: set = set()
        out: dict[str, Num] = {}
        for n in self.nodes:
            for key, nbytes, _ in n.saved:
                if key in seen or self._is_state(key):
                    continue
                seen.add(key)
                out[n.layer] = out.get(n.layer, 0) + nbytes
        return out

    def _is_state(self, key) -> bool:
        st = self.storages.get(key)
        return st is not None and st.is_state

    def param_numel(self, trainable_only: bool = True) -> int:
        return sum(p.numel for p in self.params if not p.is_buffer and (p.requires_grad or not trainable_only))

    def layers(self) -> dict[str, list[NodeCost]]:
        out: dict[str, list[NodeCost]] = {}
        for n in self.nodes:
            out.setdefault(n.layer, []).append(n)
        return out

    def values(self, sizes: Mapping[str, int] | None = None) -> dict[sympy.Symbol, int]:
        return self.symbols.values(sizes)

    def at(self, x: Num, sizes: Mapping[str, int] | None = None) -> float:
        """Evaluate a cost (int or expression) at the example sizes overridden by `sizes`."""
        return evaluate(x, self.values(sizes))


def _sum(xs: Iterable[Num]) -> Num:
    xs = list(xs)
    if any(isinstance(x, sympy.Basic) for x in xs):
        return sympy.Add(*xs)
    return sum(xs)


def _simplify(x: Num) -> Num:
    return sympy.expand(x) if isinstance(x, sympy.Basic) else x


# ------------------------------------------------------------------------ layers
_NUM = re.compile(r"^\d+$")


def module_path(node: fx.Node) -> str:
    """Innermost module path of a node ("layers.0.attn.wq"; "" at the root), normalised the
    way `passes.ir` does it (torch versions spell nn_module_stack paths differently)."""
    return _ir_module_path(node)


def layer_namer(paths: Iterable[str]):
    """Layer of a module path: cut after its first numeric component; paths without one are
    cut at the depth of the first repeated container (so 'model.norm' stays whole when the
    blocks are 'model.layers.N')."""
    depth = None
    for p in paths:
        parts = p.split(".")
        for i, part in enumerate(parts):
            if _NUM.match(part):
                depth = i if depth is None else min(depth, i)
                break
    depth = max(depth or 1, 1)

    def name(path: str) -> str:
        if not path:
            return "(root)"
        parts = path.split(".")
        for i, part in enumerate(parts):
            if _NUM.match(part):
                return ".".join(parts[: i + 1])
        return ".".join(parts[:depth])

    return name


# ------------------------------------------------------------------------ the walk
def _hashable(x: Any, ins_index: dict[int, int]) -> Any:
    if isinstance(x, TensorMeta):
        return ("T", ins_index.get(id(x), -1))
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(y, ins_index) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v, ins_index)) for k, v in x.items()))
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


class _Analyzer:
    def __init__(self, gm: fx.GraphModule, kernels: Mapping[str, Any], sm: SymbolMap):
        self.gm = gm
        self.kernels = kernels
        self.sm = sm
        self.nodes: list[NodeCost] = []
        self.storages: dict[Any, Storage] = {}
        self.cache: dict[Any, tuple] = {}
        self.unknown_ops: Counter = Counter()
        self.unknown_saved: Counter = Counter()
        self.key_count: Counter = Counter()
        self.evaluations = 0  # distinct calls costed (identical calls share one evaluation)
        self.rule_errors: dict[str, str] = {}  # op -> why its rule could not cost it (fallback used)
        self.state_by_id: dict[int, tuple[str, bool, bool]] = {}  # id(tensor) -> (name, rg, is_buffer)
        for name, p in gm.named_parameters(remove_duplicate=False):
            self.state_by_id.setdefault(id(p), (name, p.requires_grad, False))
        for name, b in gm.named_buffers(remove_duplicate=False):
            self.state_by_id.setdefault(id(b), (name, False, True))
        self.param_first_use: dict[int, tuple[int, str]] = {}
        self.param_key: dict[int, Any] = {}
        self.namer = layer_namer(module_path(n) for n in gm.graph.nodes)

    def _storage(self, t: TensorMeta, producer: int, is_state: bool = False) -> bool:
        if t.key in self.storages:
            return False
        self.storages[t.key] = Storage(t.storage_nbytes, is_state, producer)
        return True

    def _metas(self, val: Any, node: str, rg: bool, producer: int, is_state: bool = False):
        if isinstance(val, torch.Tensor):
            t = meta_of(val, self.sm, node, rg, is_state)
            return t, [t]
        if isinstance(val, (list, tuple)):
            outs, flat = [], []
            for v in val:
                if isinstance(v, torch.Tensor):
                    t = meta_of(v, self.sm, node, rg, is_state)
                    outs.append(t)
                    flat.append(t)
                else:
                    outs.append(self.sm.dim(v) if isinstance(v, torch.SymInt) else v)
            return outs, flat
        if isinstance(val, torch.SymInt):
            return self.sm.dim(val), []
        return val, []

    def run(self, graph: fx.Graph, env: dict[fx.Node, Any], grad_enabled: bool = True,
            layer: str | None = None, module: str | None = None) -> list[Any]:
        outputs: list[Any] = []
        for node in graph.nodes:
            if node.op == "placeholder":
                if node not in env:
                    val = node.meta.get("val")
                    meta, flat = self._metas(val, node.name, False, -1)
                    for t in flat:
                        self._storage(t, -1)
                    env[node] = meta
            elif node.op == "get_attr":
                env[node] = self._get_attr(node)
            elif node.op == "call_function":
                if getattr(node.target, "__name__", "") == "_set_grad_enabled":  # pre-dispatch no_grad regions
                    grad_enabled = bool(node.args[0])
                    continue
                self._call(node, env, grad_enabled, layer, module)
            elif node.op == "call_module":
                self._call_module(node, env, layer, module)
            elif node.op == "output":
                outputs = list(_as_tuple(fx.node.map_arg(node.args[0], lambda n: env.get(n))))
        return outputs

    def _get_attr(self, node: fx.Node) -> Any:
        obj: Any = self.gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, fx.GraphModule) or isinstance(obj, nn.Module):
            return obj
        if not isinstance(obj, torch.Tensor):
            return obj
        val = node.meta.get("val")
        val = val if isinstance(val, torch.Tensor) else obj
        name, rg, is_buffer = self.state_by_id.get(id(obj), (node.target, False, True))
        t = meta_of(val, self.sm, node.name, rg=bool(rg), is_state=True)
        if id(obj) in self.param_key:  # a tied parameter read through a second name: one storage
            t.key = self.param_key[id(obj)]
        self.param_key.setdefault(id(obj), t.key)
        self._storage(t, -1, is_state=True)
        self.state_by_id.setdefault(id(obj), (name, rg, is_buffer))
        t.node = f"@{id(obj)}"
        return t

    def _call_module(self, node: fx.Node, env, layer, module) -> None:
        val = node.meta.get("val")
        idx = len(self.nodes)
        meta, flat = self._metas(val, node.name, False, idx)
        env[node] = meta
        if node.target == "_guards_fn" or val is None:
            return
        ins = _flat_ins((node.args, node.kwargs), env)
        c = Call(node, f"module.{node.target}", (), {}, ins, flat)
        self._record(node, c, O.fallback(c), list(c.ins), True, layer, module)

    def _call(self, node: fx.Node, env, grad_enabled: bool, layer, module) -> None:
        target = node.target
        if getattr(target, "namespace", None) == "higher_order":
            self._hop(node, env, grad_enabled, layer, module)
            return
        name = O.op_name(target)
        if name == "operator.getitem":
            src, i = node.args
            v = env.get(src)
            env[node] = v[i] if isinstance(v, (list, tuple)) else v
            return
        args = fx.node.map_arg(node.args, lambda n: env.get(n))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env.get(n))
        args = _syms(args, self.sm)
        kwargs = _syms(kwargs, self.sm)
        ins = _flat_ins((args, kwargs), None)
        idx = len(self.nodes)
        any_rg = grad_enabled and any(t.rg for t in ins)
        meta, outs = self._metas(node.meta.get("val"), node.name, False, idx)
        env[node] = meta
        c = Call(node, name, tuple(args), dict(kwargs), ins, outs)
        if O.packet_name(name) in _IDENTITY_DROPOUT and outs and ins and not _dropout_active(c):
            # ATen returns the input itself (p == 0 or eval); fake tensors get a clone from the
            # Python decomposition, so restore the aliasing that really happens
            outs[0].key, outs[0].storage_nbytes = ins[0].key, ins[0].storage_nbytes
        ins_index = {id(t): i for i, t in enumerate(ins)}
        in_keys = {t.key: i for i, t in enumerate(ins)}
        sig = (name, tuple(t.sig() for t in ins), tuple((t.shape, t.dtype, in_keys.get(t.key, -1)) for t in outs),
               _hashable((args, kwargs), ins_index), any_rg)
        hit = self.cache.get(sig)
        if hit is None:
            self.evaluations += 1
            try:
                cost = O.cost_of(c)
            except Exception as e:  # noqa: BLE001 - a rule that cannot read this call: fall back, and say so
                cost = O.fallback(c)
                self.rule_errors.setdefault(name, f"{type(e).__name__}: {e}"[:200])
            bwd = cost.bwd_flops
            if cost.kind == "attention" and O.sdpa_backend(c, self.kernels) == "math" \
                    and name.startswith("aten.scaled_dot_product_attention"):
                bwd = O.sdpa_math_bwd(c)
                extra_r, extra_w = O.sdpa_math_bytes(c)
                cost = _replace(cost, bytes_read=cost.bytes_read + extra_r, bytes_written=cost.bytes_written + extra_w)
            if not (any_rg and cost.differentiable):
                bwd = 0
            try:
                items, fb = SV.saved_items(c, self.kernels) if (any_rg and cost.differentiable) else ([], False)
            except Exception:  # noqa: BLE001 - same: the fallback (all inputs) and a flag
                items, fb = list(ins), True
            pos = []
            out_index = {id(t): i for i, t in enumerate(outs)}
            for it in items:
                if isinstance(it, SV.New):
                    pos.append(("new", it.tag, it.nbytes))
                elif id(it) in ins_index:
                    pos.append(("in", ins_index[id(it)], None))
                elif id(it) in out_index:
                    pos.append(("out", out_index[id(it)], None))
            hit = (cost, bwd, tuple(pos), fb)
            self.cache[sig] = hit
        cost, bwd, pos, fb = hit
        has_grad_fn = any_rg and cost.differentiable
        for t in outs:
            t.rg = has_grad_fn and t.is_float
        items = []
        for kind, i, nbytes in pos:
            if kind == "new":
                items.append(SV.New(i, nbytes))
            else:
                items.append(ins[i] if kind == "in" else outs[i])
        self._record(node, c, cost, items, fb, layer, module, bwd=bwd, has_grad_fn=has_grad_fn)

    def _record(self, node, c: Call, cost: O.OpCost, items, fallback_saved: bool, layer, module,
                bwd: Num = 0, has_grad_fn: bool = False) -> None:
        idx = len(self.nodes)
        mod = module if module is not None else module_path(node)
        lay = layer if layer is not None else self.namer(mod)
        new = tuple(t.key for t in c.outs if self._storage(t, idx))
        saved = []
        for it in items:
            if isinstance(it, SV.New):
                saved.append((("new", node.name, it.tag, len(saved)), it.nbytes, it.tag))
            else:
                saved.append((it.key, self.storages[it.key].nbytes if it.key in self.storages else it.storage_nbytes,
                              "state" if it.is_state else "activation"))
        for t in c.ins:
            if t.is_state and t.rg:
                pid = t.node
                if pid not in self.param_first_use:
                    self.param_first_use[pid] = (idx, lay)
        if cost.fallback:
            self.unknown_ops[c.name] += 1
        if fallback_saved:
            self.unknown_saved[c.name] += 1
        grad_inputs = tuple(t for t in c.ins if t.rg) if has_grad_fn else ()
        short = c.name.split(".")[1] if c.name.count(".") >= 1 else c.name
        k = self.key_count[(mod, short)]
        self.key_count[(mod, short)] += 1
        self.nodes.append(NodeCost(
            name=node.name, key=f"{mod}:{short}#{k}", op=c.name, module=mod, layer=lay, index=idx, cost=cost,
            bwd_flops=bwd, has_grad_fn=has_grad_fn, saved=tuple(saved), new_storages=new,
            uses=tuple(dict.fromkeys(t.key for t in c.ins)), grad_inputs=grad_inputs,
            outputs=tuple(t for t in c.outs if t is not None), fallback_cost=cost.fallback,
            fallback_saved=fallback_saved, reads=tuple({id(t): t for t in c.ins}.values()),
        ))  # fmt: skip

    def _hop(self, node: fx.Node, env, grad_enabled: bool, layer, module) -> None:
        """Inline a higher-order op: cost its subgraph's nodes under this node's layer."""
        name = f"higher_order.{node.target.__name__}"
        args = [env.get(a) if isinstance(a, fx.Node) else a for a in node.args]
        sub_i = next((i for i, a in enumerate(args) if isinstance(a, fx.GraphModule)), None)
        mod = module if module is not None else module_path(node)
        lay = layer if layer is not None else self.namer(mod)
        if sub_i is None:
            idx = len(self.nodes)
            meta, outs = self._metas(node.meta.get("val"), node.name, False, idx)
            env[node] = meta
            ins = _flat_ins(args, None)
            c = Call(node, name, tuple(args), {}, ins, outs)
            self._record(node, c, O.fallback(c), list(ins), True, layer, module)
            return
        sub = args[sub_i]
        operands = args[sub_i + 1:]
        enabled = grad_enabled
        if node.target.__name__ == "wrap_with_set_grad_enabled":
            enabled = bool(args[0])
        sub_env: dict[fx.Node, Any] = {}
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, v in zip(phs, operands):
            sub_env[ph] = v
        outer_gm, self.gm = self.gm, sub
        try:
            outs = self.run(sub.graph, sub_env, enabled, lay, mod)
        finally:
            self.gm = outer_gm
        outs = outs[0] if len(outs) == 1 and isinstance(outs[0], (list, tuple)) else outs
        env[node] = list(outs)


_IDENTITY_DROPOUT = ("aten.dropout", "aten.feature_dropout", "aten.alpha_dropout", "aten.feature_alpha_dropout")


def _dropout_active(c: Call) -> bool:
    p, train = c.arg(1, "p", 0.5), c.arg(2, "train", True)
    return bool(train) and p != 0


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _syms(x: Any, sm: SymbolMap) -> Any:
    if isinstance(x, torch.SymInt):
        return sm.dim(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_syms(y, sm) for y in x) if not isinstance(x, torch.Size) else tuple(_syms(y, sm) for y in x)
    if isinstance(x, dict):
        return {k: _syms(v, sm) for k, v in x.items()}
    return x


def _flat_ins(x: Any, env) -> list[TensorMeta]:
    out: list[TensorMeta] = []
    seen: set[int] = set()

    def visit(y):
        if isinstance(y, fx.Node) and env is not None:
            y = env.get(y)
        if isinstance(y, TensorMeta):
            if id(y) not in seen:
                seen.add(id(y))
                out.append(y)
        elif isinstance(y, (list, tuple)):
            for z in y:
                visit(z)
        elif isinstance(y, dict):
            for z in y.values():
                visit(z)

    visit(x)
    return out


def _replace(cost: O.OpCost, **kw) -> O.OpCost:
    return dataclasses.replace(cost, **kw)


def analyze(gm: fx.GraphModule, hardware: Hardware | str | None = None, *,
            kernels: Mapping[str, Any] | None = None, symbols: Mapping[str, str] | None = None) -> GraphCost:
    """Cost every node of `gm` (symbolically in b, s when the capture was dynamic).

    Args:
        gm: an ATen-level GraphModule (torch.export training IR, or autopar.capture's result).
        hardware: profile (or its name) whose `kernels` decide what autograd saves; default
            "h100-sxm".
        kernels: overrides for the profile's kernel choices, e.g. {"sdpa": "math"}.
        symbols: rename size symbols, e.g. {"s77": "b"} (default: dim 0 of the first input -> b,
            its dim 1 -> s).
    """
    import time

    t0 = time.perf_counter()
    hw = load_profile(hardware or "h100-sxm")
    ks = {**hw.kernels, **(kernels or {})}
    sm = SymbolMap.from_graph(gm, symbols)
    an = _Analyzer(gm, ks, sm)
    outs = an.run(gm.graph, {})
    flat_outs = _flat_ins(outs, None)
    params: list[ParamInfo] = []
    n_nodes = len(an.nodes)
    seen_ids: set[int] = set()
    for name, p in list(gm.named_parameters()) + [(n, b) for n, b in gm.named_buffers()]:
        if id(p) in seen_ids:
            continue
        seen_ids.add(id(p))
        is_buffer = not isinstance(p, nn.Parameter)
        first, lay = an.param_first_use.get(f"@{id(p)}", (n_nodes, "(unused)"))
        params.append(ParamInfo(name, p.numel(), p.dtype, bool(p.requires_grad) and not is_buffer, is_buffer,
                                an.param_key.get(id(p)), first, lay, tuple(p.shape)))
    return GraphCost(nodes=an.nodes, params=params, storages=an.storages, outputs=flat_outs, symbols=sm,
                     kernels=ks, hardware=hw.name, unknown_ops=an.unknown_ops, unknown_saved=an.unknown_saved,
                     rule_errors=an.rule_errors, evaluations=an.evaluations, seconds=time.perf_counter() - t0)
