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
outputs until their backward, as the pipeline runtime does; ZB-H1 and ZBV: from its I until its
W also the gradients captured for the weights, `weight_grad_bytes`), with stage s's gradients made
as backward makes them until its first backward ran and preallocated after, and the
gradients of the rank's other stages whose first backward ran. Model states are the sum of
the rank's stages' (a parameter read on two stages is held by both, as split_pipeline copies
it). The other two points are estimate's: the end of backward (states, gradients, the flat
gradient buffers, the inputs) and the optimizer step (its temporaries).

Reads no node.meta (a GraphCost only). Guarantees: the stages partition the nodes in order;
with no split points there is one stage, the graph itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from .graph import GraphCost, Storage
from .schedule import Schedule, small_schedule, walk_peaks
from .symbolic import evaluate


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
    if hit is not None:
        return hit
    st = gc.storages
    dep: dict[int, bool] = {}
    via: dict[int, set] = {}  # per node index: the states it reads, itself or through input-free producers
    for n in gc.nodes:
        d, got = False, set()
        for k in n.uses:
            x = st.get(k)
            if x is None:
                continue
            if x.is_state:
                got.add(k)
            elif x.producer < 0 or dep.get(x.producer, True):
                d = True
            else:
                got |= via[x.producer]
        dep[n.index], via[n.index] = d, got
    held = [via[n.index] if dep[n.index] else set() for n in gc.nodes]
    gc.__dict__["_autopar_held_states"] = held
    return held


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
    pending: float = 0.0  # zero-bubble schedules: held from a micro-batch's I until its W


def weight_grad_bytes(g: GraphCost, values, storage_divisor) -> float:
    """What a micro-batch of stage graph `g` holds between its I and its W under a zero-bubble
    schedule (`runtime.pipeline_split`): the gradient captured at every node that reads a
    trainable parameter (its output's bytes, tp-local), and the gradient received for the
    stage's outputs. Stage 0, whose inputs need no gradient, does its whole backward in W: the
    caller passes 0 for it."""
    div = storage_divisor or {}
    trainable = {p.key for p in g.params if p.requires_grad and not p.is_buffer and p.key is not None}
    seen: set = set()
    total = 0.0
    outs = [t for n in g.nodes if any(k in trainable for k in n.uses) for t in n.outputs] + list(g.outputs)
    for t in outs:
        if t.key in g.storages and t.key not in seen and not g.storages[t.key].is_state:
            seen.add(t.key)
            total += float(evaluate(g.storages[t.key].nbytes, values)) / div.get(t.key, 1)
    return total


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
    (+ ZeRO 3's two gathered units), the end of backward and the optimizer step."""
    acts = walk_peaks(schedule, [x.held for x in stages], [x.first for x in stages], [x.later for x in stages],
                      [x.walk_grads for x in stages], [x.pending for x in stages] if schedule.splits_backward else None)
    out = []
    for r, act in enumerate(acts):
        mine = [stages[s] for s in schedule.stages_of(r)]
        pers = sum(x.persistent for x in mine)
        grads = sum(x.grads for x in mine)
        trans = zero3_transient if zero3_transient else sum(x.transient for x in mine)
        out.append(max(pers + act + zero3_transient, pers + grads + trans + max(x.inputs for x in mine),
                       pers + grads + sum(x.step_temp for x in mine)))
    return out


__all__ = ["StageMemory", "held_states", "in_flight", "pipeline_schedule", "rank_peaks", "stage_graph", "stage_of_nodes",
           "weight_grad_bytes"]
