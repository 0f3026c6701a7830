"""Pipeline stages of a captured graph, for the memory of each pipeline rank (`cost.estimate`).

`stage_of_nodes(gc, split_points)` gives every node its stage the way passes/split_pipeline.py
cuts the graph: a stage starts at the first node inside a split-point unit (`layers.1` holds
`layers.1.attn.wq` ...); a node never goes back to an earlier stage, so root-level nodes stay
with the unit before them. `stage_graph(gc, stage_of, s)` is stage s as a GraphCost of its own:
its nodes, the storages they make, the tensors earlier stages made that it reads (its inputs,
received), the parameters and buffers it reads, and as outputs what later stages read from it (the
last stage: the graph's outputs). `in_flight(schedule, pp, m, s)` is how many micro-batches'
activations stage s holds at once: m under GPipe, min(m, pp - s) under 1F1B (the warm-up
forwards before its first backward).

A rank's peak (`rank_peaks`, which estimate.py calls, for every schedule: GPipe, 1F1B,
interleaved with v stages per rank, ZB-H1, ZBV) follows the rank's own actions in the
schedule (`cost.schedule.walk_peaks`): at each action of stage s, the micro-batches it and
its other stages hold (each its stage's forward end: inputs, saved activations, outputs; F
adds one, B releases it, W under the zero-bubble schedules) plus the running micro-batch's
walk of stage s (`memory.liveness`, the loss on the last stage; earlier stages hold their
outputs until their backward, as the pipeline runtime does), with stage s's gradients made
as backward makes them until its first backward ran and preallocated after, and the
gradients of the rank's other stages whose first backward ran. ZB-H1 and ZBV split a stage's
backward (`StageMemory.split`, `cost.split_backward_memory.split_backward`): its I frees nothing
and keeps the gradients captured for the weights until its W, which releases the micro-batch.
An F peaks at the micro-batch's forward walk (`StageMemory.fwd_peak`), not its whole walk.
Every point also holds the receive buffer of the rank's next action (`StageMemory.inputs` for an
F, `out_grads` for a B or I), posted before the current action computes. The rank holding stage 0
holds the whole local batch all step (the micro-batches are views of it). Model states are the sum of
the rank's stages' (a parameter read on two stages is held by both, as split_pipeline copies
it). The other two points are estimate's: the end of backward (states, gradients, the flat
gradient buffers, the inputs) and the optimizer step (its temporaries).

Recompute inside a stage (`Plan.recompute`): `stage_regions` cuts the plan's checkpoint regions
(`cost.timeline.regions_for` on the whole graph) to a stage's nodes, and `stage_walk` walks the
stage with them (`cost.timeline`): a micro-batch in flight holds the regions' inputs (and a
selective region's cached outputs), not their activations (`held`); its backward recomputes one
region at a time (the transient in `first` / `later`), and the recomputed forward's seconds
(`recompute_s`) lengthen the stage's B (`cost.pipeline_time`). Under ZB-H1 / ZBV such a stage runs
its backward whole at its I (`cost.schedule.fuse_backward`), so its `StageMemory.split` is None.
Without regions `stage_walk` is the `memory.liveness` walk, as before. Both `cost.estimate` and the
planner (`search.plan_pipeline_memory`) build their stage terms with `stage_walk`.

Reads no node.meta (a GraphCost only). Guarantees: the stages partition the nodes in order;
with no split points there is one stage, the graph itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .graph import GraphCost, Storage
from .memory import LossModel, liveness
from .schedule import Schedule, small_schedule, walk_peaks
from .split_backward_memory import SplitBackward, forward_peak, received_grad_bytes, split_backward
from .timeline import Region, timeline


def _inside(module: str, unit: str) -> bool:
    return module == unit or module.startswith(unit + ".")


def stage_of_nodes(gc: GraphCost, split_points: Sequence[str]) -> list[int]:
    """Stage index of every node of `gc` (in node order)."""
    out, s = [], 0
    points = list(split_points)
    for n in gc.nodes:
        while s < len(points) and _inside(n.module, points[s]):
            s += 1
        out.append(s)
    return out


def stage_graph(gc: GraphCost, stage_of: list[int], s: int) -> GraphCost:
    """Stage `s` of `gc` as a GraphCost of its own (see the module docstring)."""
    idx = [i for i, x in enumerate(stage_of) if x == s]
    if not idx:
        raise ValueError(f"pipeline stage {s} has no node: the split points leave it empty")
    lo, hi = idx[0], idx[-1] + 1
    nodes = gc.nodes[lo:hi]
    read = {k for n in nodes for k in n.uses} | {k for n in nodes for k, _nb, _t in n.saved}
    storages: dict = {}
    for k, st in gc.storages.items():
        if st.is_state:
            storages[k] = st
        elif lo <= st.producer < hi:
            storages[k] = st
        elif k in read and st.producer < lo:  # received from an earlier stage (or a graph input)
            storages[k] = Storage(st.nbytes, False, -1)
    last = s == max(stage_of)
    if last:
        outputs = list(gc.outputs)
    else:
        later = {k for n in gc.nodes[hi:] for k in n.uses}
        outputs, seen = [], set()
        for n in nodes:
            for t in n.outputs:
                if t.key in later and t.key not in seen and t.key in storages and storages[t.key].producer >= lo:
                    seen.add(t.key)
                    outputs.append(t)
    # every parameter or buffer the stage reads: one read on several stages (a tied embedding,
    # rotary tables) is held by each, as split_pipeline copies it; read through input-free
    # computation (a rotary table's slice made before the first layer), by the stages whose
    # input-dependent nodes read that computation, where split_pipeline copies it
    held = held_states(gc)
    keys = set().union(*(held[i] for i in range(lo, hi))) if hi > lo else set()
    params = [p for p in gc.params if (p.key in keys if p.key is not None else lo <= p.first_use < hi)]
    return dataclasses.replace(gc, nodes=nodes, storages=storages, outputs=outputs, params=params)


def held_states(gc: GraphCost) -> list[set]:
    """Per node, the parameter and buffer storages a stage holding it must hold: those an
    input-dependent node reads, itself or through the input-free nodes that feed it (cached on
    the GraphCost); an input-free node holds none (split_pipeline copies it to its readers)."""
    hit = gc.__dict__.get("_autopar_held_states")
    if hit is None:
        dep, _feeds, via = dependence(gc)
        hit = gc.__dict__["_autopar_held_states"] = [v if d else set() for d, v in zip(dep, via)]
    return hit


def dependence(gc: GraphCost) -> tuple[list[bool], list[frozenset], list[set]]:
    """Per node of `gc` (cached on the GraphCost): whether it depends on the graph's inputs; the
    input-free nodes (from parameters, buffers or sizes only) it reads, directly or through
    other input-free nodes (an input-free node counts itself); the parameter and buffer
    storages it reads, itself or through input-free producers."""
    hit = gc.__dict__.get("_autopar_dependence")
    if hit is not None:
        return hit
    st = gc.storages
    dep: dict[int, bool] = {}
    feeds: dict[int, frozenset] = {}
    via: dict[int, set] = {}
    for n in gc.nodes:
        d, free, got = False, set(), set()
        for k in n.uses:
            x = st.get(k)
            if x is None:
                continue
            if x.is_state:
                got.add(k)
            elif x.producer < 0 or dep.get(x.producer, True):
                d = True
            else:
                free |= feeds[x.producer]
                got |= via[x.producer]
        dep[n.index], via[n.index] = d, got
        feeds[n.index] = frozenset(free) if d else frozenset(free | {n.index})
    hit = gc.__dict__["_autopar_dependence"] = ([dep[n.index] for n in gc.nodes], [feeds[n.index] for n in gc.nodes],
                                                [via[n.index] for n in gc.nodes])
    return hit


def in_flight(schedule: str | None, pp: int, m: int, s: int) -> int:
    """Micro-batches whose activations stage `s` (one stage per rank) holds at its peak."""
    name = (schedule or "1f1b").lower().replace("-", "_")
    if name == "gpipe":
        return m
    return max(1, min(m, pp - s))


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's memory terms on its rank (bytes): `persistent` parameters, masters,
    optimizer states and buffers on the device; `grads` its gradients on the device; `walk_grads`
    the gradients its walk counts (masters' come after backward); `first` the walk peak of a
    micro-batch with gradients made as backward makes them, `later` with them preallocated;
    `held` what a micro-batch holds between its forward and its backward (the walk's forward
    end); `inputs` the received tensors; `transient` the flat gradient buffers alive until its
    backward ends (ZeRO 0-2); `step_temp` the optimizer step's temporaries; `opt_bytes` the
    bytes its optimizer step moves."""

    persistent: float
    grads: float
    walk_grads: float
    first: float
    later: float
    held: float
    inputs: float
    transient: float
    step_temp: float
    opt_bytes: float = 0.0  # what its optimizer step reads and writes (`cost.pipeline_time`)
    split: SplitBackward | None = None  # ZB-H1 / ZBV: its I and W (None: stage 0, whose W is a full backward)
    out_grads: float = 0.0  # the gradients it receives for its outputs (0 on the last stage)
    fwd_peak: float | None = None  # the most a micro-batch holds during its forward (None: `first`)
    recompute_s: float = 0.0  # seconds its backward recomputes per micro-batch (its checkpoint regions)


def stage_regions(regions: Sequence[Region], g: GraphCost) -> list[Region]:
    """The checkpoint regions `regions` (node indices of the whole graph) cut to the nodes of stage
    graph `g`; a region with no node there is dropped."""
    if not g.nodes:
        return []
    lo, hi = g.nodes[0].index, g.nodes[-1].index + 1
    out = []
    for r in regions:
        nodes = frozenset(i for i in r.nodes if lo <= i < hi)
        if nodes:
            out.append(Region(r.name, nodes, frozenset(i for i in r.save if lo <= i < hi)))
    return out


@dataclass(frozen=True)
class StageWalk:
    """One micro-batch's walk of a stage graph (bytes; see `StageMemory` for the names):
    `recompute_s` / `recompute_flops` what its backward recomputes (0 without regions)."""

    first: float
    later: float
    held: float
    inputs: float
    walk_grads: float
    fwd_peak: float
    recompute_s: float = 0.0
    recompute_flops: float = 0.0


def stage_walk(g: GraphCost, values: Mapping, *, param_grad_bytes: Mapping[Any, float] | None,
               storage_divisor: Mapping[Any, int] | None, loss: LossModel, later: bool,
               regions: Sequence[Region] = (), hardware: Any = None,
               compute_divisor: Mapping[int, float] | None = None) -> StageWalk:
    """The walk of stage graph `g` (see the module docstring): `memory.liveness` without
    `regions`, `cost.timeline` with them (already cut to the stage, `stage_regions`); `later`:
    walk again with the gradients preallocated (more than one micro-batch), else `later` is
    `first`. `hardware`, `compute_divisor`: the recomputed ops' time, as `cost.timeline`."""
    kw = dict(param_grad_bytes=param_grad_bytes, storage_divisor=storage_divisor, loss=loss)
    if not regions:
        trace: list = []  # its forward part is the F's peak (`forward_peak`)
        one = liveness(g, values, trace=trace, **kw)
        again = liveness(g, values, grads_preallocated=True, **kw).peak if later else one.peak
        return StageWalk(first=float(one.peak), later=float(again), held=float(one.forward_end),
                         inputs=float(one.inputs), walk_grads=float(one.param_grads),
                         fwd_peak=forward_peak(g, values, storage_divisor=storage_divisor, loss=loss, trace=trace))
    kw.update(hardware=hardware, compute_divisor=compute_divisor)
    one = timeline(g, regions, values, keep_points=False, **kw)
    again = one.later_peak if later else one.peak  # the walk with the gradients preallocated, from the same walk
    return StageWalk(first=float(one.peak), later=float(again), held=float(one.forward_end), inputs=float(one.inputs),
                     walk_grads=float(one.param_grads), fwd_peak=float(one.forward_peak),
                     recompute_s=float(one.recompute_s),
                     recompute_flops=float(one.recompute_flops))


def pipeline_schedule(schedule: str | None, pp: int, m: int, n_stages: int) -> Schedule:
    """The schedule the runtime runs for `n_stages` stages on `pp` ranks (build/pipeline.py
    `pipeline_shape`); ValueError when the stage count does not fit the schedule."""
    name = (schedule or "1f1b").lower().replace("-", "_")
    v = n_stages // pp
    if n_stages % pp or v < 1 or (name == "zbv" and v != 2) or (name not in ("zbv", "interleaved_1f1b") and v != 1):
        raise ValueError(f"{n_stages} pipeline stages on pp={pp} ranks do not fit schedule {name!r}: give "
                         f"{pp * (2 if name == 'zbv' else 1)} stages (interleaved_1f1b: a multiple of {pp})")
    return small_schedule(name, pp, m, v)


def rank_peaks(schedule: Schedule, stages: Sequence[StageMemory], zero3_transient: float = 0.0) -> list[float]:
    """Peak bytes per pipeline rank (see the module docstring): the most of the schedule walk
    (+ ZeRO 3's two gathered units), the end of backward and the optimizer step. The rank that
    holds stage 0 holds the whole local batch all step (`split_microbatches` slices it; every
    micro-batch is a view of it), not one micro-batch's inputs per micro-batch in flight."""
    batch = stages[0].inputs  # one micro-batch of stage 0's inputs
    less = [batch] + [0.0] * (len(stages) - 1)
    fwd = None if any(x.fwd_peak is None for x in stages) else [x.fwd_peak - d for x, d in zip(stages, less)]
    acts = walk_peaks(schedule, [x.held - d for x, d in zip(stages, less)], [x.first - d for x, d in zip(stages, less)],
                      [x.later - d for x, d in zip(stages, less)], [x.walk_grads for x in stages],
                      [x.split for x in stages] if schedule.splits_backward else None,
                      [(x.inputs, x.out_grads) for x in stages], fwd)
    whole = schedule.n_microbatches * batch
    out = []
    for r, act in enumerate(acts):
        ss = schedule.stages_of(r)
        mine = [stages[s] for s in ss]
        pers = sum(x.persistent for x in mine) + (whole if 0 in ss else 0.0)
        grads = sum(x.grads for x in mine)
        trans = zero3_transient if zero3_transient else sum(x.transient for x in mine)
        inputs = max(x.inputs for s, x in zip(ss, mine) if s != 0) if ss != [0] else 0.0
        out.append(max(pers + act + zero3_transient, pers + grads + trans + inputs,
                       pers + grads + sum(x.step_temp for x in mine)))
    return out


__all__ = ["SplitBackward", "StageMemory", "StageWalk", "dependence", "forward_peak", "held_states", "in_flight",
           "pipeline_schedule", "rank_peaks", "received_grad_bytes", "split_backward", "stage_graph", "stage_of_nodes",
           "stage_regions", "stage_walk"]
