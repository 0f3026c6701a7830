"""The tensor-parallel conversions a Plan's sharding strategies make the shard pass insert, and
their seconds per pipeline stage: what `cost.estimate` adds to a pipeline's stage times.

The captured graph holds no tensor-parallel collective; `passes/shard.py` inserts them where a
producer's placement differs from the one its consumer's strategy reads (and, backward, where a
replicated input of a sharded computation receives a partial gradient). In a pipeline they run
inside the stage graphs, blocking, on every micro-batch, so they lengthen the stages the schedule
simulates (at pp = 1 they add to the step: `build.predict` adds `plan.extra["shard"]`'s total).

  resolve_strategies(gm, plan, axis)   node -> Strategy, the plan's text per node key
                                       (`plan.strategies[axis]`) matched among the valid ones as
                                       the shard pass matches them; None without strategies
  edge_conversions(chosen, rg)         (consumer, producer, src, dst, partial gradient) once per
                                       (producer, target placement, partial gradient): the
                                       enumeration of `search.shard_tables.conversions`
  consumer_positions(gm, gc)           fx node -> the GraphCost node a conversion it consumes
                                       counts at (a node the cost model does not list: the
                                       node before it; the graph's output: the last node)
  node_tp_seconds(gm, gc, plan, ...)   per node, the seconds of the conversions it consumes,
                                       per micro-batch (forward + backward, `cost.placements.
                                       conversion_time` at the tensor's bytes at the plan's
                                       sizes; the graph's output: the last node), so each
                                       counts in its consumer's pipeline stage

The joint planner charges the same conversions to the pipeline unit of their consumer
(`search.plan_tables.units`: the tables' `tp_comm`, and per node `node_tp` at
`consumer_positions`, which moves with a stage's copy of an input-free node), half to the
forward and half to the backward, as `cost.pipeline_time.estimate_pipeline_step` splits these
(over each stage's run nodes, `stage_run_nodes`).

Reads node.meta through `passes.ir` (shapes, dtypes) and the sharding rules; writes none.
Deterministic.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.passes import ir
from autopar.passes.rules.sharding import (Strategy, is_tensor, partial_grad, requires_grad_nodes, strategies_for,
                                          value_shape)
from autopar.passes.vocab_head import logits_input

from .placements import Replicate, Shard, conversion_time
from .symbolic import evaluate

__all__ = ["consumer_positions", "resolve_strategies", "edge_conversions", "node_tp_seconds"]


def resolve_strategies(gm: fx.GraphModule, plan, axis: str) -> dict[fx.Node, Strategy] | None:
    """Node -> its strategy on `axis` (see the module docstring); None when the plan names none.
    A node without an entry is left out (the shard pass keeps it replicated)."""
    table = (getattr(plan, "strategies", None) or {}).get(axis)
    k = int(plan.mesh.get(axis, 1))
    if not table or k < 2:
        return None
    keys = ir.node_keys(gm)
    out: dict[fx.Node, Strategy] = {}
    for n in gm.graph.nodes:
        text = table.get(keys.get(n, ""))
        if n.op == "output":  # replicated, but the vocab-sharded logits of a loss_parallel plan (not gathered)
            ins = [a for a in n.all_input_nodes if is_tensor(a)]
            hit = logits_input(gm, ins, k) if getattr(plan, "loss_parallel", False) else None
            j = hit[0] if hit is not None else None
            out[n] = Strategy(tuple(Shard(a.meta["val"].dim() - 1) if i == j else Replicate()
                                    for i, a in enumerate(ins)), None, 0.0)
            continue
        if text is None:
            continue
        if n.op == "get_attr":
            shape = value_shape(n) or ()
            valid = [Strategy((), Replicate(), 0.0)] + [Strategy((), Shard(d), 0.0) for d in range(len(shape))
                                                       if isinstance(shape[d], int) and shape[d] % k == 0
                                                       and shape[d] >= k]
        else:
            valid = strategies_for(n, axis, k).strategies  # type: ignore[attr-defined]
        got = next((s for s in valid if str(s) == text), None)
        if got is not None:
            out[n] = got
    return out


def edge_conversions(chosen: Mapping[fx.Node, Strategy], rg) -> list[tuple[fx.Node, fx.Node, Any, Any, bool]]:
    """The conversions of a solution: (consumer, producer, src, dst, partial gradient), once per
    (producer, target placement, partial gradient), at its first consumer in graph order."""
    seen: set = set()
    out = []
    for v, s in chosen.items():
        ins = [a for a in v.all_input_nodes if is_tensor(a)]
        for a, p in zip(ins, s.ins):
            if p is None or a not in chosen:
                continue
            pg = partial_grad(s, p, a, rg)
            key = (a, str(p), pg)
            if key in seen:
                continue
            seen.add(key)
            src = chosen[a].out
            if src == p and not (pg and isinstance(p, Replicate)):
                continue
            out.append((v, a, src, p, pg))
    return out


def _nbytes(gc, a: fx.Node, values) -> float:
    """Bytes of node `a`'s value (the first tensor of a tuple) at `values` (the global tensor)."""
    v = a.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = next((x for x in v if isinstance(x, torch.Tensor)), None)
    if not isinstance(v, torch.Tensor):
        return 0.0
    numel = math.prod(gc.symbols.shape(v.shape)) if v.dim() else 1
    return float(evaluate(numel * v.dtype.itemsize, values))


def consumer_positions(gm: fx.GraphModule, gc) -> dict[fx.Node, int]:
    """fx node -> index of the GraphCost node its conversions count at: itself, or the node
    before it where the cost model does not list it; the graph's output: the last node."""
    where = {n.name: n.index for n in gc.nodes}
    last = gc.nodes[-1].index if gc.nodes else 0
    at: dict[fx.Node, int] = {}
    cur = gc.nodes[0].index if gc.nodes else 0
    for n in gm.graph.nodes:
        cur = last if n.op == "output" else where.get(n.name, cur)
        at[n] = cur
    return at


def node_tp_seconds(gm: fx.GraphModule, gc, plan, values, links: Mapping[str, Any], launch_s: float,
                    axis: str = "tp") -> dict[int, float] | None:
    """Seconds per micro-batch (forward + backward) of the conversions the shard pass inserts
    for `plan` on `axis`, per GraphCost node index of their consumer (see the module docstring):
    a consumer the cost model does not list counts at the node before it, the graph's output at
    the last node. None when the plan has no strategies on `axis` or the mesh no such link."""
    chosen = resolve_strategies(gm, plan, axis)
    link = links.get(axis)
    if not chosen or link is None or not gc.nodes:
        return None
    k = int(plan.mesh[axis])
    at = consumer_positions(gm, gc)
    rg = requires_grad_nodes(gm)
    memo: dict = {}
    out: dict[int, float] = {}
    for v, a, src, dst, pg in edge_conversions(chosen, rg):
        nb = memo.get(a)
        if nb is None:
            nb = memo[a] = _nbytes(gc, a, values)
        out[at[v]] = out.get(at[v], 0.0) + conversion_time(src, dst, pg, nb, link, k, launch_s)
    return out
