"""The sharding ILP's answer for one tp degree, in the forms the joint planner's cost model uses.

`shard_info(gm, gc, hw, world, t, ...)` solves the sharding ILP on the captured graph for
tp = t (`search.shard_ilp.solve_sharding`, identical layers solved once) and turns its
answer into a `ShardInfo`: every node's compute divisor and every storage's memory divisor
(`Plan.node_layouts`, applied as `cost.estimate` applies them: `cost.node_time.layout_divisors`),
the parameters' and nodes' placements, the strategies, and the conversions the shard pass will
insert (`conversions`: one per producer, placement and partial gradient, each charged to a
pipeline unit with its payload as c0 + c1 x rows, so that the tables price it at any rows per
micro-batch). t = 1 is everything replicated, without an ILP.

`loss_parallel` (`Plan.loss_parallel`): the head is pinned as `parallelize(..., loss_parallel=True)`
pins it (`search.shard_loss.head_pins`), the ILP keeps its logits Shard(last dim) and prices
the loss's all-reduces, and `ShardInfo.plan` carries the flag, so that its divisors leave those
logits sharded and `ShardInfo.loss` is the loss the runtime runs (`cost.loss_memory.loss_model`:
`VOCAB_PARALLEL` on the shards, else `CROSS_ENTROPY` on the gathered logits).

`search.plan_tables.PlanTables.sharding` caches one per tp degree. Reads node.meta only
through `passes.ir` and the sharding rules (the ILP's inputs); writes nothing. Deterministic.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import fx

from autopar.cost.graph import GraphCost
from autopar.cost.hardware import Hardware
from autopar.cost.loss_memory import loss_collectives, loss_model
from autopar.cost.memory import CROSS_ENTROPY, LossModel
from autopar.cost.node_time import layout_divisors
from autopar.cost.placements import Layout, Partial, Placement, Replicate, Shard
from autopar.cost.tp_conversions import consumer_positions, edge_conversions
from autopar.passes.plan import Plan
from autopar.passes.rules.sharding import value_shape
from autopar.search.shard_ilp import node_nbytes, solve_sharding
from autopar.search.shard_loss import head_pins

__all__ = ["ShardInfo", "conversions", "shard_info"]


@dataclass
class ShardInfo:
    """The sharding ILP's answer for one tp degree, in the forms the cost model uses."""

    tp: int
    solution: Any  # ShardSolution, or None for tp = 1
    param_placements: dict[str, Placement]
    node_placements: dict[str, Placement]
    strategies: dict[str, str]
    comp_div: dict[int, int]
    mem_div: dict[Any, int]
    # unit, src, dst, pg, c0, c1, the GraphCost node it counts at (`cost.tp_conversions.consumer_positions`)
    conversions: list[tuple[int, Placement | None, Placement, bool, float, float, int]]
    sequence_parallel: bool = False
    summary: str = ""
    seconds: float = 0.0
    plan: Plan | None = None  # the tp layouts as a Plan (with `loss_parallel`): what `layout_divisors` read
    loss: LossModel = CROSS_ENTROPY  # the loss on the outputs under this sharding (`loss_memory.loss_model`)

    def loss_comm(self, gc: GraphCost, ev) -> list[tuple[str, str, float]]:
        """The vocab-parallel loss's all-reduces per micro-batch, (op, axis, payload bytes) at
        the sizes `ev` evaluates (`cost.loss_memory.loss_collectives`); [] when the logits are gathered."""
        return loss_collectives(gc, self.plan, ev) if self.plan is not None else []


def shard_info(gm: fx.GraphModule, gc: GraphCost, hw: Hardware, world: int, t: int, *,
               param_pins: Mapping[str, Placement] | None, node_pins: Mapping[str, Placement] | None, rg,
               fx_unit: Mapping, captured_rows: int | None, loss_parallel: bool = False) -> ShardInfo:
    """The sharding ILP's plan for tp = t on a mesh of `world` ranks (t = 1: everything
    replicated). `rg`: the nodes that need a gradient (`passes.rules.sharding.requires_grad_nodes`);
    `fx_unit`: node -> pipeline unit; `captured_rows`: the batch rows of a static capture;
    `loss_parallel`: the vocab-parallel loss (module docstring)."""
    if t == 1:
        return ShardInfo(1, None, {}, {}, {}, {}, {}, [], summary="no tensor parallelism")
    if loss_parallel:
        param_pins, node_pins = head_pins(gm, t, param_pins, node_pins)
    sol = solve_sharding(gm, "tp", t, mesh={"dp": max(world // t, 1), "tp": t}, hardware=hw,
                         param_pins=param_pins or None, node_pins=node_pins or None, gc=gc,
                         loss_parallel=loss_parallel)
    nodes = {n: sol.keys[n] for n in sol.chosen}
    params = {str(n.target): s.out for n, s in sol.chosen.items()
              if n.op == "get_attr" and s.out is not None and not isinstance(s.out, Replicate)}
    node_pl = {nodes[n]: s.out for n, s in sol.chosen.items()
               if n.op == "call_function" and s.out is not None and not isinstance(s.out, Replicate)}
    plan = Plan(mesh={"tp": t}, dp_axis=None, node_layouts={k: Layout.of({"tp": p}) for k, p in node_pl.items()})
    plan.loss_parallel = bool(loss_parallel)
    comp_div, mem_div = layout_divisors(gc, plan)
    convs, sp = conversions(sol, t, gc=gc, rg=rg, fx_unit=fx_unit, captured_rows=captured_rows,
                            at=consumer_positions(gm, gc))
    return ShardInfo(t, sol, params, node_pl, sol.strategies(), comp_div, mem_div, convs, sp, sol.summary(),
                     sol.seconds, plan, loss_model(gc, plan))


def conversions(sol, t: int, *, gc: GraphCost, rg, fx_unit: Mapping, captured_rows: int | None,
                at: Mapping | None = None):
    """The conversions the shard pass inserts for a solution, each once per (producer, target
    placement, partial gradient), charged to the first consumer's unit (`fx_unit`), with its
    payload as c0 + c1 * rows and the GraphCost node it counts at (`at`, -1 without); and
    whether the solution is sequence parallel (at least as many all-gather / reduce-scatter
    pairs as all-reduces)."""
    b_names = [str(orig) for orig, new in gc.symbols.rename.items() if str(new) == "b"]
    other = {str(orig): int(v) for orig, new in gc.symbols.rename.items()
             for k, v in gc.values().items() if k == new and str(new) != "b"}

    def nbytes(a, rows):
        return node_nbytes(a, {**other, **{s: rows for s in b_names}})

    out = []
    ag_rs = 0
    ar = 0
    for v, a, src, p, pg in edge_conversions(sol.chosen, rg):  # the enumeration cost.estimate prices
        if b_names:
            one, two = nbytes(a, 1), nbytes(a, 2)
            c1 = two - one
            c0 = one - c1
        else:  # a static batch: a tensor whose dim 0 is the batch scales with it
            shape = value_shape(a) or ()
            rows0 = captured_rows or 1
            full = nbytes(a, 0)
            c0, c1 = (0.0, full / rows0) if shape and shape[0] == rows0 else (full, 0.0)
        unit = fx_unit.get(v)
        out.append((unit if unit is not None else 0, src, p, pg, float(c0), float(c1), (at or {}).get(v, -1)))
        if isinstance(p, Shard) and isinstance(src, Replicate) or isinstance(src, Partial) and isinstance(p, Shard):
            ag_rs += 1
        if isinstance(src, Partial) and isinstance(p, Replicate):
            ar += 1
    return out, ag_rs > 0 and ag_rs >= ar

