"""split_pipeline: cut a graph into pipeline stages at module boundaries.

The graph's computation is grouped into *units*, a chain in forward order: the nodes that
depend on the model inputs are named by their module path cut after its first numeric
component (`layers.3`), other module paths cut at the same depth (`tok_emb`, `norm`,
`lm_head`); root-level nodes join the unit before them (the first unit when none is).
`Plan.split_points` names the units at which a new stage starts (`["layers.16", "norm"]`:
three stages). `pipeline_units(gm)` lists the units; the stage search
(`autopar/search/stages.py`) costs and chooses them.

Each stage becomes one `fx.GraphModule` (`Stage0`, `Stage1` ...; lazy: its code is generated at its
first call or `gm.code` read, runtime/_torch_compat.py), readable with `gm.code`:
  * inputs: stage 0 takes the graph's inputs; stage s > 0 takes, in graph order, the tensors
    computed on earlier stages that stage s or a later one reads (a tensor needed two stages
    on passes through the stage between). Its placeholders carry the producing node's name.
  * outputs: the inputs of the next stage (always a tuple); the last stage returns the
    graph's outputs.
  * computation that depends on no input (parameters, buffers, constants: rotary tables,
    casts of weights), or on the inputs only through their sizes (a rotary table sliced to a
    symbolic sequence length, `arange(T)`; random ops excepted), is copied into every stage
    that reads it, so it never crosses a cut. Under context parallelism such a table is
    computed at the global length while its `meta["val"]` keeps the local one: sent, it would
    give the next stage a wrong sequence length.
  * sizes (SymInts) are never sent: a stage computes a size where it first needs it, from
    its own tensors when it has the size's inputs, recomputes a size made of other sizes
    from them, and else re-reads it from the shape of one of its inputs (`aten.sym_size`).
  * `operator.getitem` stays with the node whose tuple it reads.
  * parameters keep their names (`layers.3.attn.wq.weight`). A parameter read on several
    stages (an embedding tied to the LM head; T5's shared embedding, read by the encoder, the
    decoder and the head) is held by each: the first keeps the original tensor, the others a
    copy, and the group is reported in `tied` for the executor, which starts them equal and
    gives every copy the sum of their gradients.

The pass `split_pipeline(gm, ctx)` returns a `PipelineGraph` GraphModule whose children
`stage0` ... `stage{S-1}` are the stage modules and whose forward calls them in order (so it
runs, and trains, like the original on one process). Its `meta["autopar_pipeline"]` is a
`PipelineInfo` (split points, units per stage, stage inputs/outputs, tied groups). Without
split points in the plan the graph is returned unchanged.

Reads: node.meta["autopar"] (module path), node.meta["val"] (tensor vs. size, shapes).
Writes: node.meta of every copied node (all entries, `autopar` included, via ir.copy_meta);
the PipelineGraph's nodes get `autopar` annotations; gm.meta["autopar_pipeline"].
Guarantees: every node of a stage graph is annotated; a stage receives only tensors; the
composed PipelineGraph computes the same outputs (and gradients, tied copies summed) as the
input graph; the input graph is not modified.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.runtime._torch_compat import lazy_graph_module, op_schema

from . import ir
from .pass_manager import PassContext

__all__ = ["Unit", "PipelineInfo", "StageSplit", "pipeline_units", "unit_namer", "split_stages", "split_pipeline",
           "compose", "brief_names", "stage_of_nodes"]

TiedPair = tuple[tuple[int, str], ...]  # ((stage, param name), ...): one weight on 2+ stages
_NUM = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Unit:
    """One link of the chain a pipeline is cut from: a module path and its nodes (graph order)."""

    name: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class PipelineInfo:
    split_points: tuple[str, ...]
    stage_units: tuple[tuple[str, ...], ...]  # unit names per stage
    inputs: tuple[tuple[str, ...], ...]  # node names each stage receives
    outputs: tuple[tuple[str, ...], ...]  # node names each stage returns
    tied: tuple[TiedPair, ...]

    @property
    def n_stages(self) -> int:
        return len(self.stage_units)


@dataclass
class StageSplit:
    units: list[Unit]
    info: PipelineInfo
    stages: list[fx.GraphModule] = field(default_factory=list)


# ------------------------------------------------------------------------ units
def unit_namer(paths: Iterable[str]):
    """Unit of a module path: cut after its first numeric component; paths without one are
    cut at the depth where the numbered blocks sit (so 'model.norm' stays whole when the
    blocks are 'model.layers.N'). The root ("") has no unit (None)."""
    depth = None
    for p in paths:
        for i, part in enumerate(p.split(".") if p else ()):
            if _NUM.match(part):
                depth = i if depth is None else min(depth, i)
                break
    depth = max(depth or 1, 1)

    def name(path: str) -> str | None:
        if not path:
            return None
        parts = path.split(".")
        for i, part in enumerate(parts):
            if _NUM.match(part):
                return ".".join(parts[: i + 1])
        return ".".join(parts[:depth])

    return name


def _input_dependent(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Which nodes depend on the inputs' data. A tensor that depends on the inputs only through
    their sizes (a rotary table sliced to the sequence length, `arange(T)` position ids: under
    context parallelism the sequence is symbolic) counts as input-free: every stage that reads
    it computes it, as it computes a constant, since its value can differ from what its
    `meta["val"]` says (context_positions computes such tables at the global length and leaves
    the meta at the local one), so it must neither travel nor give a stage its sizes. Random
    ops are kept dependent (two stages would draw different values)."""
    dep: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            dep[n] = True
        elif n.op == "get_attr":
            dep[n] = False
        else:
            dep[n] = any(dep[a] for a in n.all_input_nodes)
            if dep[n] and _shape_only(n, dep):
                dep[n] = False
    return dep


_PURE_MODULES = ("_operator", "operator", "math", "autopar.runtime.context_layout")  # Python callables that draw nothing


def _shape_only(n: fx.Node, dep: dict[fx.Node, bool]) -> bool:
    """A deterministic tensor op whose input-dependent arguments are all sizes."""
    if n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor):
        return False
    tags = getattr(n.target, "tags", None)  # an op overload's; a Python function (take_positions) has none
    if tags is None:
        if getattr(n.target, "__module__", None) not in _PURE_MODULES:
            return False
    else:
        schema = op_schema(n.target)
        if torch.Tag.nondeterministic_seeded in tags or (schema is not None and schema.is_mutable):
            return False
    return all(_is_size(a) for a in n.all_input_nodes if dep[a])


def _is_size(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool)


def _unit_of_nodes(gm: fx.GraphModule, dep: dict[fx.Node, bool]) -> tuple[list[str], dict[fx.Node, str]]:
    compute = [n for n in gm.graph.nodes if dep[n] and n.op not in ("placeholder", "output")]
    namer = unit_namer(ir.info(n).module for n in compute)
    key: dict[fx.Node, str | None] = {}
    for n in compute:
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                and n.args[0] in key:
            key[n] = key[n.args[0]]
        else:
            key[n] = namer(ir.info(n).module)
    order: list[str] = []
    prev = None
    pending: list[fx.Node] = []
    for n in compute:
        k = key[n]
        if k is None:
            if prev is None:
                pending.append(n)
                continue
            key[n] = k = prev
        if k not in order:
            order.append(k)
        for p in pending:
            key[p] = k
        pending = []
        prev = k
    if pending:  # no node has a module path: one unit
        order.append("(root)")
        for p in pending:
            key[p] = "(root)"
    return order, key  # type: ignore[return-value]


def pipeline_units(gm: fx.GraphModule) -> list[Unit]:
    """The chain of units of `gm` in forward order (see the module docstring)."""
    dep = _input_dependent(gm)
    order, key = _unit_of_nodes(gm, dep)
    members: dict[str, list[str]] = {k: [] for k in order}
    for n, k in key.items():
        members[k].append(n.name)
    return [Unit(k, tuple(members[k])) for k in order]


def stage_of_nodes(gm: fx.GraphModule, split_points: Sequence[str]) -> dict[fx.Node, int]:
    """The stage each input-dependent node of `gm` goes to under `split_points` (a node computed
    from parameters, buffers or sizes only is absent: every stage that reads it copies it).
    Raises ValueError for split points that are not units of `gm`."""
    dep = _input_dependent(gm)
    order, key = _unit_of_nodes(gm, dep)
    cuts = _resolve_split_points(order, split_points)
    stage_of_unit = {u: sum(1 for c in cuts if c <= i) for i, u in enumerate(order)}
    return {n: stage_of_unit[k] for n, k in key.items()}


def brief_names(names: Sequence[str]) -> str:
    """Unit names for messages, numbered runs folded: 'tok_emb, layers.0..79, norm, lm_head'."""
    out: list[str] = []
    run: list[str] = []

    def flush():
        if len(run) > 2:
            head, _, first = run[0].rpartition(".")
            out.append(f"{head}.{first}..{run[-1].rpartition('.')[2]}")
        else:
            out.extend(run)
        run.clear()

    for n in names:
        head, _, tail = n.rpartition(".")
        if run and tail.isdigit() and head == run[-1].rpartition(".")[0] \
                and int(tail) == int(run[-1].rpartition(".")[2]) + 1:
            run.append(n)
            continue
        flush()
        if tail.isdigit() and head:
            run.append(n)
        else:
            out.append(n)
    flush()
    return ", ".join(out)


# ------------------------------------------------------------------------ the split
def _resolve_split_points(order: list[str], split_points: Sequence[str]) -> list[int]:
    idx = {u: i for i, u in enumerate(order)}
    bad = [p for p in split_points if p not in idx]
    if bad:
        raise ValueError(f"split points {bad} are not pipeline units of this graph; a stage can start at "
                         f"one of: {brief_names(order[1:])}")
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"split points {list(split_points)} name a unit twice; each starts one stage")
    first = [p for p in split_points if idx[p] == 0]
    if first:
        raise ValueError(f"split point {first[0]!r} is the first unit, where stage 0 starts anyway; "
                         f"name units from {order[1:3]} on")
    return sorted(idx[p] for p in split_points)


def _fetch_attr(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(root: nn.Module, target: str) -> tuple[nn.Module, str]:
    prefix, _, name = target.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), name


def split_stages(gm: fx.GraphModule, split_points: Sequence[str]) -> StageSplit:
    """Cut `gm` into len(split_points) + 1 stage GraphModules (see the module docstring)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    dep = _input_dependent(gm)
    order, key = _unit_of_nodes(gm, dep)
    cuts = _resolve_split_points(order, split_points)
    S = len(cuts) + 1
    unit_stage = {}
    for i, u in enumerate(order):
        unit_stage[u] = sum(1 for c in cuts if c <= i)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")

    # stage of every input-dependent node: its unit's stage, never before an input it reads
    stage: dict[fx.Node, int] = {}
    for n in placeholders:
        stage[n] = 0
    extra: dict[int, list[fx.Node]] = {s: [] for s in range(S)}  # input-free nodes with effects
    cur = 0
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if dep[n]:
            if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                    and dep[n.args[0]]:
                s = stage[n.args[0]]  # a tuple never crosses a cut
            else:
                s = unit_stage[key[n]]
                for a in n.all_input_nodes:
                    if dep[a] and not _is_size(a):
                        s = max(s, stage[a])
            stage[n] = cur = s
        elif not n.users and n.op != "get_attr":
            extra[cur].append(n)  # e.g. an assertion or a grad-mode switch: keep it in place

    # what each stage must receive: values made before it and read on it or after it
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        if not dep[n] or n.op == "output" or _is_size(n):
            continue
        for u in n.users:
            su = S - 1 if u.op == "output" else stage.get(u)
            if su is None:
                continue  # an input-free user: not possible for a dependent value
            last_use[n] = max(last_use.get(n, -1), su)
    live_in: list[list[fx.Node]] = [[] for _ in range(S)]
    for n in sorted(last_use, key=pos.__getitem__):
        for s in range(stage[n] + 1, last_use[n] + 1):
            live_in[s].append(n)
    for s in range(1, S):
        for n in live_in[s]:
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"stage {s} needs {n.format_node()} from an earlier stage, but it is a "
                                 f"{type(v).__name__}, and only tensors travel between stages; move the split "
                                 f"point so that its producer and users share a stage")
    outputs: list[list[fx.Node]] = [live_in[s + 1] for s in range(S - 1)]
    for s in range(S - 1):
        if not outputs[s]:
            raise ValueError(f"stage {s} sends nothing to stage {s + 1} (split points {list(split_points)}): "
                             "the later stages do not depend on the earlier ones; choose other split points")

    # build each stage graph
    stages: list[fx.GraphModule] = []
    uses: dict[int, list[tuple[int, str, torch.Tensor]]] = {}  # id(param) -> [(stage, target, tensor)]
    for s in range(S):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        ins = placeholders if s == 0 else live_in[s]
        for v in ins:
            p = g.placeholder(v.name)
            ir.copy_meta(v, p)
            env[v] = p
        targets: set[str] = set()

        def fetch(x: fx.Node, s=s, g=g, env=env, ins=ins, targets=targets) -> fx.Node:
            if x in env:
                return env[x]
            if not dep[x]:  # input-free: copy it (and what it reads) into this stage
                new = g.node_copy(x, lambda a: fetch(a))
                ir.copy_meta(x, new)
                if x.op == "get_attr":
                    targets.add(str(x.target))
                env[x] = new
                return new
            if _is_size(x):  # sizes are made where needed: copied when their inputs are here (or are sizes)
                if all(a in env or not dep[a] or _is_size(a) for a in x.all_input_nodes):
                    new = g.node_copy(x, lambda a: fetch(a))
                    ir.copy_meta(x, new)
                else:
                    new = _rematerialise_size(x, g, ins, env, fetch, s)
                env[x] = new
                return new
            raise AssertionError(f"stage {s} reads {x.format_node()} (stage {stage.get(x)}) but neither "
                                 "computes nor receives it")

        for n in nodes:
            if n.op in ("placeholder", "output") or n in env or (dep[n] and _is_size(n)):
                continue
            if (dep[n] and stage[n] == s) or n in extra[s]:
                new = g.node_copy(n, lambda a: fetch(a))
                ir.copy_meta(n, new)
                env[n] = new
        if s == S - 1:
            res = fx.node.map_arg(out_node.args[0], fetch)
            o = g.output(res)
            ir.copy_meta(out_node, o)
        else:
            o = g.output(tuple(fetch(v) for v in outputs[s]))
            ir.set_info(o, ir.NodeInfo(shape=None, dtype=None, module="", kind="output"))
        g.lint()
        sm = lazy_graph_module(gm, g, class_name=f"Stage{s}")  # code at first use: other ranks' stages never run
        for t in sorted(targets):
            obj = _fetch_attr(gm, t)
            if isinstance(obj, nn.Parameter):
                uses.setdefault(id(obj), []).append((s, t, obj))
        stages.append(sm)

    # a parameter read on several stages: each later stage holds a copy, tied to the first
    tied: list[TiedPair] = []
    for entries in uses.values():
        st = sorted({e[0] for e in entries})
        if len(st) <= 1:
            continue
        first = min(e for e in entries if e[0] == st[0])
        p = first[2]
        group = [(st[0], first[1])]
        for s in st[1:]:
            targets = sorted({e[1] for e in entries if e[0] == s})
            clone = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            for t in targets:
                owner, attr = _owner(stages[s], t)
                setattr(owner, attr, clone)
            group.append((s, targets[0]))
        tied.append(tuple(group))
    tied.sort()

    stage_units = [[u for u in order if unit_stage[u] == s] for s in range(S)]
    info = PipelineInfo(
        split_points=tuple(order[c] for c in cuts),
        stage_units=tuple(tuple(x) for x in stage_units),
        inputs=tuple(tuple(v.name for v in (placeholders if s == 0 else live_in[s])) for s in range(S)),
        outputs=tuple(tuple(v.name for v in outputs[s]) for s in range(S - 1))
        + (tuple(str(a) for a in _flat(out_node.args[0])),),
        tied=tuple(tied),
    )
    units = [Unit(k, tuple(n.name for n in nodes if key.get(n) == k)) for k in order]
    return StageSplit(units, info, stages)


def _flat(x) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _rematerialise_size(x: fx.Node, g: fx.Graph, ins: Sequence[fx.Node], env, fetch, s: int) -> fx.Node:
    """A size computed on another stage, re-read from this stage's inputs' shapes (or
    recomputed from such sizes)."""
    val = x.meta.get("val")
    if isinstance(val, int):
        return val  # type: ignore[return-value]  (a constant: fx embeds it)
    expr = str(val)  # a SymInt prints as its expression ("s95"); equal expressions, equal sizes
    for v in ins:
        t = v.meta.get("val")
        if not isinstance(t, torch.Tensor):
            continue
        for d, size in enumerate(t.shape):
            if isinstance(size, torch.SymInt) and str(size) == expr:
                new = g.call_function(torch.ops.aten.sym_size.int, (env[v], d))
                ir.copy_meta(x, new)
                return new
    if x.op == "call_function" and all(_is_size(a) or not a.all_input_nodes for a in x.all_input_nodes):
        new = g.node_copy(x, lambda a: fetch(a))
        ir.copy_meta(x, new)
        return new
    raise ValueError(f"stage {s} needs the size {x.format_node()} (= {expr}), which none of its inputs "
                     f"carries in its shape; move the split point so that the size's users share a stage "
                     f"with a tensor of that size")


# ------------------------------------------------------------------------ the pass
def split_pipeline(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The pass: `ctx.plan.split_points` -> a PipelineGraph whose children are the stages."""
    points = list(getattr(ctx.plan, "split_points", []) or [])
    if not points:
        return gm
    split = split_stages(gm, points)
    return compose(gm, split)


def compose(gm: fx.GraphModule, split: StageSplit) -> fx.GraphModule:
    """The PipelineGraph: calls the stages in order; children `stage0` ...; meta from `gm`."""
    info = split.info
    by_name = {n.name: n for n in gm.graph.nodes}
    top = fx.Graph()
    vals: dict[str, fx.Node] = {}
    for name in info.inputs[0]:
        p = top.placeholder(name)
        ir.copy_meta(by_name[name], p)
        vals[name] = p
    result = None
    for s in range(info.n_stages):
        call = top.call_module(f"stage{s}", tuple(vals[v] for v in info.inputs[s]))
        ir.set_info(call, ir.NodeInfo(shape=None, dtype=None, module=f"stage{s}", kind="op"))
        if s < info.n_stages - 1:
            for k, v in enumerate(info.outputs[s]):
                gi = top.call_function(operator.getitem, (call, k))
                ir.copy_meta(by_name[v], gi)
                vals[v] = gi
        else:
            result = call
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    n_out = len(_flat(out_node.args[0]))
    outs = []
    for k in range(n_out):
        gi = top.call_function(operator.getitem, (result, k))
        src = _flat(out_node.args[0])[k]
        if isinstance(src, fx.Node):
            ir.copy_meta(src, gi)
        else:
            ir.set_info(gi, ir.NodeInfo(shape=None, dtype=None, module=""))
        outs.append(gi)
    o = top.output(tuple(outs))
    ir.copy_meta(out_node, o)
    top.lint()
    out = lazy_graph_module({f"stage{s}": m for s, m in enumerate(split.stages)}, top, class_name="PipelineGraph")
    out.meta.update(gm.meta)
    out.meta["autopar_pipeline"] = info
    return out
