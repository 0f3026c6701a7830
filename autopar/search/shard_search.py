"""The sharding search for a Plan: every sharding axis the plan leaves open, solved and written in.

`search_sharding(plan, gm, mesh, hardware)` runs the sharding ILP (`shard_ilp.solve_sharding`)
on each axis of `SHARD_AXES` that the mesh has (size > 1) and the plan does not fix
(`plan.strategies[axis]`); parameter layouts the plan already has on that axis are pins. Rank 0
solves and the others receive its answer (`torch.distributed.broadcast_object_list` when a
process group is up), so every rank carries out the same plan and raises the same error. The
answer goes into the plan: `strategies[axis]`, the parameters' and nodes' layouts on the axis,
notes (`shard_notes`), and `extra["shard"][axis]` (predicted compute and communication, the
ILP's gap, status and time). A graph captured with a dynamic batch is solved at one rank's
micro-batch (`micro_sizes`: the global batch over dp x ep x micro-batches), the size the
strategies run at; `batch_is_static(gm)` tells a capture that specialised the batch dim.

`mesh` is anything with `sizes` ({axis: size}) and `size(axis)` (an autopar Mesh). Reads
node.meta["autopar"] and node.meta["val"] of the placeholders, and what the ILP reads; writes
nothing on nodes. Errors: ValueError naming the axis when the search fails.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.cost.hardware import Hardware
from autopar.cost.placements import Layout, parse_placement
from autopar.passes import ir
from autopar.passes.plan import Plan

if TYPE_CHECKING:
    from autopar.search.shard_ilp import ShardSolution

__all__ = ["SHARD_AXES", "batch_is_static", "micro_sizes", "search_sharding", "shard_notes"]

SHARD_AXES = ("tp",)  # the mesh axes the sharding ILP plans (dp, pp and ep are planned elsewhere)


def micro_sizes(gm: fx.GraphModule, plan: Plan, mesh) -> dict[str, int] | None:
    """{"b": rows of one rank's micro-batch} for a graph captured with a dynamic batch, else None."""
    if batch_is_static(gm):
        return None
    ph = next((n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].dim() > 0), None)
    if ph is None:
        return None
    rows = ph.meta["val"].shape[0]
    hint = getattr(getattr(rows, "node", None), "hint", None)
    rows = int(hint if hint is not None else rows) if not isinstance(rows, int) else rows
    per = plan.dp * mesh.size("ep") * plan.n_microbatches
    return {"b": max(1, rows // per)} if per > 1 else None


def search_sharding(plan: Plan, gm: fx.GraphModule, mesh, hardware: str | Hardware, group=None,
                    node_pins: dict | None = None) -> None:
    """Solve the sharding ILP for every sharding axis the plan does not already fix; rank 0
    solves and the others receive its answer, so every rank carries out the same plan. A graph
    captured with a dynamic batch is solved at one rank's micro-batch (the global batch over
    dp x ep x micro-batches): the size the strategies run at. `group`: the (host) group the
    answer is broadcast on; None: the default group. `node_pins`: {axis: {node key: placement}}
    fixed for that axis's search (e.g. the nodes the expert pass needs replicated on tp)."""
    for axis in SHARD_AXES:
        k = mesh.sizes.get(axis, 1)
        if k < 2 or axis in plan.strategies:
            continue
        result = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            pins = {name: lay[axis] for name, lay in plan.param_layouts.items() if axis in dict(lay.axes)}
            try:
                # scipy's MILP (0.5 CPU-s to import): only where a tp axis is solved, not on the ranks
                # that receive the answer nor on a mesh without tp; a failed import is reported below
                from autopar.search.shard_ilp import solve_sharding  # noqa: PLC0415

                sol = solve_sharding(gm, axis, k, mesh=dict(mesh.sizes), hardware=hardware, param_pins=pins,
                                     node_pins=(node_pins or {}).get(axis), sizes=micro_sizes(gm, plan, mesh),
                                     loss_parallel=plan.loss_parallel and axis == "tp")
                result = {"strategies": sol.strategies(), "params": {n: str(p) for n, p in sol.param_placements().items()},
                          "notes": [sol.summary()] + shard_notes(sol),
                          "layouts": {sol.keys[n]: str(s.out) for n, s in sol.chosen.items()
                                      if s.out is not None and str(s.out) != "R" and n.op == "call_function"},
                          "search": {"compute_s": sol.compute_s, "comm_s": sol.comm_s, "gap": sol.gap,
                                     "seconds": sol.seconds, "status": sol.status}}
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                result = {"error": f"{type(e).__name__}: {e}"}
        if dist.is_initialized():
            box = [result]
            dist.broadcast_object_list(box, src=0, group=group)
            result = box[0]
        if "error" in result:
            raise ValueError(f"the sharding search on {axis}={k} failed: {result['error']}")
        plan.strategies[axis] = result["strategies"]
        for name, p in result["params"].items():
            base = plan.param_layouts.get(name) or Layout.replicated(tuple(mesh.sizes))
            plan.param_layouts[name] = base.replace(axis, parse_placement(p))
        plan.notes += result["notes"]
        for key, p in result["layouts"].items():
            plan.node_layouts[key] = Layout.replicated(tuple(mesh.sizes)).replace(axis, parse_placement(p))
        plan.extra.setdefault("shard", {})[axis] = result["search"]


def shard_notes(sol: ShardSolution) -> list[str]:
    """The solution's notes for the plan: ops replicated for want of a rule, shardings excluded."""
    notes = []
    if sol.unruled:
        notes.append("replicated (no sharding rule): " + ", ".join(f"{op} x{c}" for op, c in sol.unruled.most_common()))
    if sol.excluded:
        uniq = sorted(set(sol.excluded))
        notes.append(f"{len(uniq)} shardings excluded as uneven, e.g. " + "; ".join(uniq[:3]))
    return notes


def batch_is_static(gm: fx.GraphModule) -> bool:
    """True when the capture specialised the batch dim: an input's dim 0 is a number, not a
    symbol (the model reshapes with a literal batch, say)."""
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            shape = ir.info(n).shape
            if shape and isinstance(shape[0], int):
                return True
    return False
