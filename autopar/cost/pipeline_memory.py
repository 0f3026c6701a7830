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

A rank's peak (estimate.py) is then its stage's walk of one micro-batch (`memory.liveness`,
the loss on the last stage; the earlier stages hold their outputs until their backward, as
the pipeline runtime does) plus `in_flight - 1` more micro-batches' forward end (inputs,
saved activations, outputs) held while the first backward runs, and the later micro-batches'
walk with the gradients already allocated.

Reads no node.meta (a GraphCost only). Guarantees: the stages partition the nodes in order;
with no split points there is one stage, the graph itself.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .graph import GraphCost, Storage


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
    # rotary tables) is held by each, as split_pipeline copies it
    params = [p for p in gc.params if lo <= p.first_use < hi or (p.key is not None and p.key in read)]
    return dataclasses.replace(gc, nodes=nodes, storages=storages, outputs=outputs, params=params)


def in_flight(schedule: str | None, pp: int, m: int, s: int) -> int:
    """Micro-batches whose activations stage `s` (one stage per rank) holds at its peak."""
    name = (schedule or "1f1b").lower().replace("-", "_")
    if name == "gpipe":
        return m
    return max(1, min(m, pp - s))


__all__ = ["in_flight", "stage_graph", "stage_of_nodes"]
