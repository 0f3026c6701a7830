"""recompute: make autograd recompute, in backward, the activations the plan chose not to keep.

For every module path `m` with `plan.recompute[m]` in ("full", "selective"), the call_function
nodes of `m` (module path `m` or below it, with the `getitem`s of their multi-output nodes)
are cut out into a *region*: a small GraphModule (`CheckpointRegion.body`) called through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)` with a
selective-checkpoint policy (`torch.utils.checkpoint.create_selective_checkpoint_contexts`),
or plain checkpointing when the region keeps nothing (cheaper: no dispatch mode).
What the region keeps for backward is then:
  * its inputs (activations produced before it; parameters are inputs too, read by the
    parent's `get_attr` nodes, so ZeRO-3's saved-tensor hooks still see them);
  * the outputs of its *saved* nodes: every dispatched op of such a node that is not a view
    is MUST_SAVE (a linear's mm, attention's fused kernel with its logsumexp), the rest of the
    region PREFER_RECOMPUTE;
  * the outputs of collectives (`torch.ops.autopar.*` ops that communicate): always
    MUST_SAVE, so backward never re-runs a collective, unless
    `plan.extra["recompute_collectives"]` is True.
Saved nodes: mode "full" saves none; mode "selective" saves the nodes listed in
`plan.extra["recompute_save"][m]` (stable node keys "<module path>:<op>#<k>", as
`autopar.cost.analyze` names them and `node_keys` here recomputes them), or, without a list,
every node whose op is in `SELECTIVE_SAVE_OPS` (matmul-class ops and attention: keep what is
expensive to recompute, recompute pointwise ops and norms).

Which node is running is told to the policy by two marker calls (`_save_begin`,
`_save_end`) placed around each saved node in the region's body; they run again, in the same
order, when checkpoint recomputes the body.

Reads: node.meta["autopar"] (module paths), node.meta["nn_module_stack"] (node keys), plan.recompute,
plan.extra["recompute_save"], plan.extra["recompute_collectives"].
Writes: node.meta["autopar"] on the new call and getitem nodes (getitems copy the meta of the
node whose value they carry).
Guarantees: the rewritten graph computes the same values and gradients; a region is one call
placed where its last node was, with nodes that depend on it moved after it; a module path whose
nodes cannot form a region (none found, a higher-order op, an in-place op on a tensor made
outside it, or a node outside the region both fed by it and feeding it) raises ValueError
naming it.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import re
import threading
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import has_side_effect
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.runtime._torch_compat import op_schema

from . import ir

MODES = ("none", "full", "selective")

# ops whose outputs "selective" keeps by default: expensive to recompute, outputs no larger
# than what their consumers save anyway (the FlopCounterMode matmul class and attention)
SELECTIVE_SAVE_OPS = frozenset({
    "aten.linear", "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul",
    "aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten.convolution", "aten.conv1d", "aten.conv2d",
    "aten.conv3d", "aten._grouped_mm", "transformers.grouped_mm_fallback",
})  # fmt: skip

# autopar ops that do not communicate (they may be recomputed like any other op)
LOCAL_AUTOPAR_OPS = frozenset({"leaf", "split", "to_partial"})

_STATE = threading.local()  # .saving: a saved node is running; .observers: measurement callbacks


# ------------------------------------------------------------------------ node names
def op_name(target: Any) -> str:
    """'aten.linear.default' for an OpOverload, 'operator.getitem' for a Python callable (the
    naming `autopar.cost.ops.op_name` uses)."""
    if hasattr(target, "overloadpacket"):
        return str(target)
    mod = getattr(target, "__module__", "") or ""
    if mod in ("_operator", "operator"):
        mod = "operator"
    name = getattr(target, "__name__", str(target))
    return f"{mod}.{name}" if mod else name


def packet(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else name


def is_collective(node: fx.Node) -> bool:
    """A node calling a communicating autopar op (all_reduce, all_gather, ...)."""
    t = node.target
    return (node.op == "call_function" and getattr(t, "namespace", None) == "autopar"
            and getattr(getattr(t, "overloadpacket", None), "__name__", "") not in LOCAL_AUTOPAR_OPS)


def node_keys(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Stable key "<module path>:<op>#<k>" of every call_function node of `gm`, counted in graph
    order per (module path, op) exactly as `autopar.cost.analyze` counts them (getitem and grad
    mode switches have none; the nodes of a higher-order op's body count under its caller)."""
    counts: dict[tuple[str, str], int] = {}
    keys: dict[fx.Node, str] = {}

    def walk(graph: fx.Graph, owner: fx.GraphModule, module: str | None) -> None:
        for node in graph.nodes:
            if node.op == "call_module":
                _count(node, module, f"module.{node.target}")
                continue
            if node.op != "call_function":
                continue
            target = node.target
            if getattr(target, "__name__", "") == "_set_grad_enabled":
                continue
            if getattr(target, "namespace", None) == "higher_order":
                sub = next((a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"), None)
                body = _fetch(owner, sub.target) if sub is not None else None
                if isinstance(body, fx.GraphModule):
                    walk(body.graph, body, module if module is not None else ir.module_path(node))
                else:
                    _count(node, module, f"higher_order.{target.__name__}")
                continue
            name = op_name(target)
            if name == "operator.getitem":
                continue
            _count(node, module, name)

    def _count(node: fx.Node, module: str | None, name: str) -> None:
        mod = module if module is not None else ir.module_path(node)
        short = name.split(".")[1] if name.count(".") >= 1 else name
        k = counts.get((mod, short), 0)
        counts[(mod, short)] = k + 1
        if module is None:
            keys[node] = f"{mod}:{short}#{k}"

    walk(gm.graph, gm, None)
    return keys


def _fetch(mod: nn.Module, target: str) -> Any:
    obj: Any = mod
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def in_module(path: str, prefix: str) -> bool:
    """`path` is module `prefix` or inside it (every path is inside the root, "")."""
    return (path == prefix or path.startswith(prefix + ".")) if prefix else True


# ------------------------------------------------------------------------ runtime side
def _save_begin() -> None:
    _STATE.saving = True


def _save_end() -> None:
    _STATE.saving = False


has_side_effect(_save_begin)
has_side_effect(_save_end)


@contextlib.contextmanager
def observe_cached(callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `callback(t)` for every tensor a region's selective checkpoint caches in forward.

    A measurement aid: saved_tensors_hooks do not see what selective checkpointing caches,
    so tests add these tensors to the ones the hooks saw. It needs a torch whose policy is
    called with the op's output (`SelectiveCheckpointContext.op_output`, as in 2.13); on an
    older one it raises RuntimeError."""
    if "op_output" not in torch.utils.checkpoint.SelectiveCheckpointContext.__init__.__code__.co_varnames:
        raise RuntimeError("observe_cached needs SelectiveCheckpointContext.op_output (torch 2.13 has it)")
    observers = getattr(_STATE, "observers", None)
    if observers is None:
        observers = _STATE.observers = []
    observers.append(callback)
    try:
        yield
    finally:
        observers.remove(callback)


# callables (other than ATen ops, judged by their tags) known to draw no random numbers: the
# markers' and Python's operators, and the runtime modules whose functions are deterministic
# (the fused kernels, tensor-parallel and leaf wrappers, context attention)
_DETERMINISTIC_MODULES = ("_operator", "operator", "builtins", "math", "runtime.kernels", "runtime.tp_ops",
                          "runtime.leaf", "runtime.context_attention", "runtime.context_blocks",
                          "runtime.context_layout")


def _zero_probability(n: fx.Node) -> bool:
    """An op tagged seeded whose drop probability (`dropout_p` of attention, `p` of dropout)
    is the constant 0: it draws nothing."""
    schema = op_schema(n.target)
    if schema is None:
        return False
    for i, a in enumerate(schema.arguments):
        if a.name in ("dropout_p", "p"):
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0
    return False


def draws_random(body: fx.GraphModule) -> bool:
    """Whether running `body` may draw random numbers: an ATen (or custom) op tagged
    nondeterministic_seeded (dropout, bernoulli, rand*), a function of runtime/rng.py (the
    program's dropout), or any callable not known to be deterministic (counted as random)."""
    for n in body.graph.nodes:
        if n.op != "call_function" or n.target in (_save_begin, _save_end):
            continue
        tags = getattr(n.target, "tags", None)
        if tags is not None:  # an op overload
            if torch.Tag.nondeterministic_seeded in tags and not _zero_probability(n):
                return True
            continue
        mod = f".{getattr(n.target, '__module__', None) or ''}."
        if not any(f".{m}." in mod for m in _DETERMINISTIC_MODULES):
            return True
    return False


class CheckpointRegion(nn.Module):
    """Runs `body` under activation checkpointing with a selective policy: outputs of the
    ops between the body's `_save_begin`/`_save_end` markers that are not views, and of
    communicating autopar ops, are kept; everything else is recomputed in backward."""

    # one backward may walk a region (a selective checkpoint's cache is spent by it): the
    # zero-bubble pipeline runs a stage holding one whole (runtime.pipeline_split.allows_one_backward)
    ONE_BACKWARD = True

    def __init__(self, body: fx.GraphModule, region: str, recompute_collectives: bool = False):
        super().__init__()
        self.body = body
        self.region = region
        self.recompute_collectives = recompute_collectives
        # nothing to keep: plain checkpointing, without selective checkpointing's dispatch mode
        self.selective = any(n.target is _save_begin for n in body.graph.nodes) or (
            not recompute_collectives and any(is_collective(n) for n in body.graph.nodes))
        # a body that draws no random numbers recomputes the same values whatever the RNG
        # state: checkpoint need not save and restore every device's RNG state around it (on
        # the CPU the saving is within noise, ~0.5 ms per small region either way; not yet
        # measured on a GPU)
        self.preserve_rng = draws_random(body)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body(*args)
        if not self.selective:
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng)
        _STATE.saving = False
        context_fn = functools.partial(create_selective_checkpoint_contexts, self._policy)
        return checkpoint(self.body, *args, use_reentrant=False, context_fn=context_fn,
                          preserve_rng_state=self.preserve_rng)

    def _policy(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        save = False
        if getattr(func, "namespace", None) == "autopar" and not self.recompute_collectives:
            save = getattr(getattr(func, "overloadpacket", None), "__name__", "") not in LOCAL_AUTOPAR_OPS
        if not save and getattr(_STATE, "saving", False):
            save = not getattr(func, "is_view", False)
        if save:
            for cb in getattr(_STATE, "observers", None) or ():
                out = getattr(ctx, "op_output", None)
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        cb(t)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def extra_repr(self) -> str:
        return (f"region={self.region!r}, selective={self.selective}, "
                f"recompute_collectives={self.recompute_collectives}, preserve_rng={self.preserve_rng}")


# ------------------------------------------------------------------------ the pass
def _module(node: fx.Node) -> str:
    i = ir.get_info(node)
    return i.module if i is not None else ir.module_path(node)


def region_nodes(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    """The call_function nodes of module `path` (and the getitems of its multi-output nodes),
    in graph order."""
    out: list[fx.Node] = []
    chosen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        src = n.args[0] if n.target is operator.getitem and n.args and isinstance(n.args[0], fx.Node) else None
        if (src is not None and src in chosen) or (src is None and in_module(_module(n), path)):
            out.append(n)
            chosen.add(n)
    return out


def region_problem(gm: fx.GraphModule, path: str) -> str | None:
    """Why the nodes of module `path` cannot be one checkpointed region, or None if they can."""
    nodes = region_nodes(gm, path)
    if not nodes:
        return (f"the graph has no node in module {path!r}; use a module path the captured graph keeps "
                "(see autopar.cost.analyze(gm).layers())")
    region = set(nodes)
    outside = {_storage(a) for n in nodes for a in n.all_input_nodes if a not in region} - {None}
    for n in nodes:
        t = n.target
        if getattr(t, "namespace", None) == "higher_order" or getattr(t, "__name__", "") == "_set_grad_enabled":
            return f"it contains {n.format_node()}, a grad-mode switch or higher-order op"
        for a in mutated_args(n):
            st = _storage(a)
            if st is None or st in outside:
                return (f"{n.format_node()} writes into a tensor made outside the module, which "
                        "recomputing would write twice")
    try:
        _deferred(gm, path, nodes)
    except ValueError as e:
        return str(e)
    return None


def mutated_args(n: fx.Node) -> list[fx.Node]:
    """The argument nodes an in-place op writes into."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(v, fx.Node):
            out.append(v)
    return out


def _storage(n: fx.Node):
    """An id of the storage of a node's (fake) value, or None."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return StorageWeakRef(v.untyped_storage()).cdata
    except Exception:  # noqa: BLE001 - tensors without storage
        return None


def _deferred(gm: fx.GraphModule, path: str, nodes: list[fx.Node]) -> list[fx.Node]:
    """Nodes between the region's first and last that depend on it (they move after the call);
    ValueError if one of them also feeds the region (no single call can replace it)."""
    region = set(nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    tainted: set[fx.Node] = set(region)
    deferred: list[fx.Node] = []
    for n in list(gm.graph.nodes)[order[nodes[0]] + 1: order[nodes[-1]]]:
        if n in region:
            bad = [a for a in n.all_input_nodes if a in tainted and a not in region]
            if bad:
                raise ValueError(f"{bad[0].format_node()} is computed from module {path!r} and feeds it again "
                                 f"({n.format_node()}), so the module is not one region")
        elif any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
            deferred.append(n)
    return deferred


def _safe(path: str) -> str:
    return "recompute_" + (re.sub(r"[^0-9A-Za-z_]", "_", path) or "root")


def _extract(gm: fx.GraphModule, path: str, nodes: list[fx.Node], save: set[fx.Node],
             recompute_collectives: bool) -> None:
    """Replace `nodes` of `gm` by one CheckpointRegion call."""
    graph = gm.graph
    region = set(nodes)
    first, last = nodes[0], nodes[-1]
    deferred = _deferred(gm, path, nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in region and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in region for u in n.users)]

    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        ph = body.placeholder(a.name)
        ph.meta = dict(a.meta)
        env[a] = ph
    for n in nodes:
        if n in save:
            _marker(body, _save_begin, n)
        env[n] = body.node_copy(n, lambda x: env[x])
        env[n].meta = dict(n.meta)
        if n in save:
            _marker(body, _save_end, n)
    out = body.output(tuple(env[o] for o in outputs))
    out.meta[ir.KEY] = ir.NodeInfo(shape=None, dtype=None, module=path, kind="output")
    body.lint()
    body_gm = fx.GraphModule(nn.Module(), body, class_name="RecomputeBody")

    name = _safe(path)
    k = 0
    while hasattr(gm, name + (f"_{k}" if k else "")):
        k += 1
    name = name + (f"_{k}" if k else "")
    gm.add_submodule(name, CheckpointRegion(body_gm, path, recompute_collectives))
    with graph.inserting_before(last):
        call = graph.call_module(name, tuple(inputs))
        call.meta[ir.KEY] = ir.NodeInfo(shape=None, dtype=None, module=path, kind="recompute")
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        if "nn_module_stack" in first.meta:
            call.meta["nn_module_stack"] = dict(first.meta["nn_module_stack"])
        items = []
        for i, o in enumerate(outputs):
            g = graph.call_function(operator.getitem, (call, i))
            ir.copy_meta(o, g)
            items.append(g)
    anchor = items[-1] if items else call
    for d in deferred:
        anchor.append(d)
        anchor = d
    for o, g in zip(outputs, items):
        o.replace_all_uses_with(g, delete_user_cb=lambda u: u not in region)
    for n in reversed(nodes):
        graph.erase_node(n)


def _marker(body: fx.Graph, fn, n: fx.Node) -> None:
    m = body.call_function(fn, ())
    i = ir.get_info(n)
    m.meta[ir.KEY] = ir.NodeInfo(shape=None, dtype=None, module=i.module if i else "", kind="marker")


def recompute(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    """Rewrite `gm` so that backward recomputes what `ctx.plan.recompute` chose (see the
    module docstring). Without a plan, or with every module "none", `gm` is returned as is."""
    plan = getattr(ctx, "plan", None)
    modes = dict(getattr(plan, "recompute", None) or {})
    extra = dict(getattr(plan, "extra", None) or {})
    bad = {m: v for m, v in modes.items() if v not in MODES}
    if bad:
        raise ValueError(f"plan.recompute values must be one of {MODES}; got {bad}")
    chosen = sorted((m for m, v in modes.items() if v != "none"), key=lambda m: (m.count("."), m))
    if not chosen:
        return gm
    save_lists: dict[str, list[str]] = extra.get("recompute_save") or {}
    unknown = sorted(set(save_lists) - set(chosen))
    if unknown:
        raise ValueError(f"plan.extra['recompute_save'] lists modules {unknown} that plan.recompute does not "
                         "checkpoint; give them mode 'selective' or drop their lists")
    allow_coll = bool(extra.get("recompute_collectives", False))
    taken: set[str] = set()
    for path in chosen:
        if any(in_module(path, t) for t in taken):
            raise ValueError(f"plan.recompute checkpoints both {path!r} and a module containing it; "
                             "keep one of them")
        taken.add(path)
    keys = node_keys(gm)
    regions: list[tuple[str, list[fx.Node], set[fx.Node]]] = []
    for path in chosen:
        problem = region_problem(gm, path)
        if problem is not None:
            raise ValueError(f"cannot recompute module {path!r}: {problem}; set plan.recompute[{path!r}] = "
                             "'none' or name a module below or above it")
        nodes = region_nodes(gm, path)
        save: set[fx.Node] = set()
        if modes[path] == "selective":
            wanted = save_lists.get(path)
            if wanted is None:
                save = {n for n in nodes if packet(op_name(n.target)) in SELECTIVE_SAVE_OPS}
            else:
                by_key = {keys.get(n): n for n in nodes}
                missing = [k for k in wanted if k not in by_key]
                if missing:
                    raise ValueError(f"plan.extra['recompute_save'][{path!r}] names nodes {missing[:3]} that "
                                     f"module {path!r} does not have; its nodes are e.g. "
                                     f"{[k for k in by_key if k][:5]}")
                save = {by_key[k] for k in wanted}
        regions.append((path, nodes, save))
    for path, nodes, save in regions:
        _extract(gm, path, nodes, save, allow_coll)
    gm.graph.lint()
    gm.recompile()
    return gm
