"""The recompute search's chain model: a graph's checkpointable layers and what they hold.

The plan space (what `passes.recompute` can carry out): each *candidate* — a layer whose nodes
can form one checkpointed region — is either left alone ("off") or checkpointed ("on") with a
set S of its nodes whose outputs the selective policy keeps (collectives are always in S).
The cost of a plan is the time of the forward ops it recomputes (`Timeline.recompute_s`).

`build_chain` cuts the nodes into *segments* in forward order: one per candidate (its first to
last node) and runs of other nodes between them. Two exact walks of `cost.timeline` — every
candidate off, every candidate on with S empty ("full") — give for each segment the bytes it
holds at the end of the forward (`held`) and the most memory alive inside it beyond what
earlier segments hold, in the forward and in recompute + backward (`work_forward`,
`work_backward`). A plan's peak is then modelled as

    peak = max over segments s of  sum_{s' < s} held(s') + work(s)

with, for a candidate on with S: held = held_full + bytes(S), work_forward = work_forward_full +
bytes(S), work_backward = work_backward_full; cost = cost_full - time(S) (`model_peak`,
`model_cost`; `regions_of` gives the checkpointed regions of a plan). The model is exact for the
two calibrating plans (every storage is counted where the walk counted it) and conservative
for the forward with S.

Saveable nodes (`Item`) are those whose op is in `SAVEABLE_OPS` (each dispatches one non-view
kernel, or a known composite whose non-view kernels make exactly its outputs and saved
buffers, so the bytes the selective cache keeps are the node's own), that create a storage,
and that recomputation runs (not after the region's last saving node, nor that node itself
when it saves only its inputs: checkpoint stops recomputing at the last saved tensor). A layer
that cannot be a candidate is in `ChainModel.skipped` with the reason (`NO_MODULE`,
`NO_ACTIVATION`, or the recompute pass's own).

It reads `node.meta` only through `cost.analyze` and `passes.recompute`. Deterministic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx

from autopar.cost.graph import GraphCost, NodeCost
from autopar.cost.memory import CROSS_ENTROPY, LossModel
from autopar.cost.ops import packet_name
from autopar.cost.symbolic import evaluate
from autopar.cost.timeline import Region, SegmentUse, Timeline, communicates, node_timer, stop_runs, timeline
from autopar.passes.recompute import SELECTIVE_SAVE_OPS, in_module, mutated_args, region_nodes, region_problem

__all__ = ["SAVEABLE_OPS", "NO_MODULE", "NO_ACTIVATION", "Item", "Segment", "ChainModel", "Choices", "build_chain",
           "is_saveable", "made_bytes", "written_nodes",
           "model_peak", "model_cost", "regions_of", "off_choices"]

# kernels whose outputs selective checkpointing can keep at the bytes the cost model knows
SAVEABLE_OPS = SELECTIVE_SAVE_OPS | frozenset({
    "aten.silu", "aten.gelu", "aten.relu", "aten.tanh", "aten.sigmoid", "aten.exp", "aten.mul", "aten.add",
    "aten.sub", "aten.div", "aten.neg", "aten.cat", "aten.pow", "aten.rsqrt", "aten.sqrt", "aten.mean",
    "aten.sum", "aten.softmax", "aten._softmax", "aten.log_softmax", "aten._log_softmax", "aten.embedding",
    "aten.native_layer_norm", "aten.layer_norm", "aten._to_copy", "aten.to", "aten.where", "aten.masked_fill",
})  # fmt: skip

NO_MODULE = "nodes outside any module"
NO_ACTIVATION = "saves no activation"


@dataclass(frozen=True)
class Item:
    """A node whose output a checkpointed candidate may keep."""

    index: int
    key: str
    nbytes: float
    seconds: float  # forward time saved in recomputation when kept
    flops: float


@dataclass
class Segment:
    name: str  # the candidate's module path, or "<first node>..<last node>" for the rest
    first: int
    last: int
    off: SegmentUse  # (for the rest: the larger of the two walks)
    candidate: bool = False
    full: SegmentUse | None = None
    region: Region | None = None  # on with S empty (collectives kept)
    items: list[Item] = field(default_factory=list)
    full_s: float = 0.0  # recompute time when on with S empty
    full_flops: float = 0.0


@dataclass
class ChainModel:
    gc: GraphCost
    values: Mapping
    hardware: Any
    segments: list[Segment]
    segment_of: list[int]
    none: Timeline  # exact walk, every candidate off
    full: Timeline  # exact walk, every candidate on with S empty
    skipped: dict[str, str]  # layer -> why it is not a candidate
    seconds: float = 0.0
    loss: LossModel = CROSS_ENTROPY  # what the loss on the outputs adds to every walk

    @property
    def candidates(self) -> list[Segment]:
        return [s for s in self.segments if s.candidate]

    @property
    def n_binaries(self) -> int:
        return sum(1 + len(s.items) for s in self.candidates)


Choices = dict[str, "frozenset[int] | None"]  # candidate -> kept node indices (None: off)


# ------------------------------------------------------------------------ the chain
def build_chain(gm: fx.GraphModule, gc: GraphCost, values: Mapping | None = None, hardware: Any = None, *,
                recompute_collectives: bool = False, loss: LossModel = CROSS_ENTROPY) -> ChainModel:
    """Candidates, segments and the two calibrating walks for `gm` (analysed as `gc`); `loss`:
    what the loss computed from the outputs adds (`cost.memory.CROSS_ENTROPY`, as `model.step`
    runs a cross-entropy loss_fn; `GRAPH_ONLY` for a graph whose loss is inside it)."""
    t0 = time.perf_counter()
    vals = gc.values() if values is None else values
    nodes = gc.nodes
    skipped: dict[str, str] = {}
    cands: list[tuple[int, int, str, list[NodeCost]]] = []
    for layer, members in gc.layers().items():
        why = _not_candidate(gm, gc, layer, members)
        if why:
            skipped[layer] = why
            continue
        cands.append((members[0].index, members[-1].index, layer, members))
    cands.sort()
    kept: list[tuple[int, int, str, list[NodeCost]]] = []
    for c in cands:
        if kept and c[0] <= kept[-1][1]:
            skipped[c[2]] = f"its nodes interleave with those of {kept[-1][2]!r}"
            continue
        kept.append(c)
    segment_of: list[int] = []
    spans: list[tuple[str, int, int, list[NodeCost] | None]] = []
    ci = 0
    i = 0
    while i < len(nodes):
        if ci < len(kept) and i == kept[ci][0]:
            first, last, layer, members = kept[ci]
            spans.append((layer, first, last, members))
            segment_of.extend([len(spans) - 1] * (last - first + 1))
            i, ci = last + 1, ci + 1
            continue
        end = kept[ci][0] - 1 if ci < len(kept) else len(nodes) - 1
        spans.append((f"{nodes[i].name}..{nodes[end].name}", i, end, None))
        segment_of.extend([len(spans) - 1] * (end - i + 1))
        i = end + 1
    written = written_nodes(gm)
    full_regions = []
    for layer, first, last, members in spans:
        if members is not None:
            forced = frozenset() if recompute_collectives else frozenset(n.index for n in members if communicates(n))
            full_regions.append(Region(layer, frozenset(n.index for n in members), forced))
    none = timeline(gc, (), vals, hardware=hardware, segment_of=segment_of, keep_points=False, loss=loss)
    full = timeline(gc, full_regions, vals, hardware=hardware, segment_of=segment_of, keep_points=False,
                    loss=loss)
    timer = node_timer(gc, hardware, vals)
    segments: list[Segment] = []
    by_name = {r.name: r for r in full_regions}
    for s, (name, first, last, members) in enumerate(spans):
        a, b = none.segments[s], full.segments[s]
        if members is None:
            use = SegmentUse(max(a.held, b.held), max(a.work_forward, b.work_forward),
                             max(a.work_backward, b.work_backward))
            segments.append(Segment(name, first, last, use))
            continue
        region = by_name[name]
        stop = max(n.index for n in members if n.saved)
        full_s = full_f = 0.0
        items = []
        for n in members:
            if n.index > stop or n.index in region.save or (n.index == stop and not stop_runs(n)):
                continue
            fl = evaluate(n.cost.flops, vals)
            sec = timer.node(n)[0] if n.kind not in ("view", "none") else 0.0
            full_s += sec
            full_f += fl
            nb = made_bytes(gc, n, lambda x: evaluate(x, vals))
            if nb > 0 and sec > 0 and is_saveable(n) and n.name not in written:
                items.append(Item(n.index, n.key, nb, sec, fl))
        segments.append(Segment(name, first, last, a, True, b, region, items, full_s, full_f))
    return ChainModel(gc, vals, hardware, segments, segment_of, none, full, skipped, time.perf_counter() - t0, loss)


def _not_candidate(gm: fx.GraphModule, gc: GraphCost, layer: str, members: list[NodeCost]) -> str | None:
    if layer == "(root)":
        return NO_MODULE
    if not any(k for n in members for k, _nb, _t in n.saved if not _is_state(gc, k)):
        return NO_ACTIVATION
    by_path = [n for n in gc.nodes if in_module(n.module, layer)]
    if [n.index for n in by_path] != [n.index for n in members]:
        return f"module path {layer!r} also covers nodes of other layers"
    problem = region_problem(gm, layer)
    if problem is not None:
        return problem
    names = {n.name for n in region_nodes(gm, layer) if n.target.__name__ != "getitem"}
    if names != {n.name for n in members}:
        return "the graph's nodes and the analysis's nodes of this module differ"
    return None


def written_nodes(gm: fx.GraphModule) -> set[str]:
    """Nodes whose value (or its storage) a later in-place op writes: selective checkpointing
    must not cache them (it checks cached tensors are not modified)."""
    written: set[str] = set()
    views: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        for a in mutated_args(n):
            base = a
            while base in views:
                base = views[base]
            written.add(base.name)
            written.add(a.name)
        if n.op == "call_function" and getattr(n.target, "is_view", False) and n.args and \
                isinstance(n.args[0], fx.Node):
            views[n] = n.args[0]
        elif n.op == "call_function" and n.target.__name__ == "getitem" and isinstance(n.args[0], fx.Node):
            views[n] = n.args[0]
    return written


def _is_state(gc: GraphCost, key) -> bool:
    st = gc.storages.get(key)
    return st is not None and st.is_state


def is_saveable(n: NodeCost) -> bool:
    p = packet_name(n.op)
    if p not in SAVEABLE_OPS:
        return False
    if p == "aten.scaled_dot_product_attention":  # one fused kernel only when not math attention
        return any(tag == "logsumexp" for _k, _nb, tag in n.saved)
    return True


def made_bytes(gc: GraphCost, n: NodeCost, ev, div: Mapping[Any, float] | None = None) -> float:
    """Bytes of the storages node `n` creates (outputs and saved buffers): what the selective
    cache keeps when `n` is kept. `ev` evaluates a size; `div`: per storage, the ranks it is
    divided over (the sharding's storage divisors)."""
    div = div or {}
    total = 0.0
    for k in n.new_storages:
        st = gc.storages.get(k)
        if st is not None and st.producer == n.index and not st.is_state:
            total += ev(st.nbytes) / div.get(k, 1)
    for k, nb, _t in n.saved:
        if k not in gc.storages:
            total += ev(nb) / div.get(k, 1)
    return total


# ------------------------------------------------------------------------ evaluating choices
def model_peak(chain: ChainModel, choices: Choices) -> float:
    """The chain model's peak for `choices` (see the module docstring)."""
    prefix = peak = 0.0
    items = {s.name: {it.index: it for it in s.items} for s in chain.candidates}
    for s in chain.segments:
        kept = choices.get(s.name) if s.candidate else None
        if kept is None:
            peak = max(peak, prefix + s.off.work)
            prefix += s.off.held
            continue
        m = sum(items[s.name][i].nbytes for i in kept)
        peak = max(peak, prefix + s.full.work_forward + m, prefix + s.full.work_backward)
        prefix += s.full.held + m
    return peak


def model_cost(chain: ChainModel, choices: Choices) -> float:
    total = 0.0
    for s in chain.candidates:
        kept = choices.get(s.name)
        if kept is not None:
            total += s.full_s - sum(it.seconds for it in s.items if it.index in kept)
    return total


def regions_of(chain: ChainModel, choices: Choices) -> list[Region]:
    out = []
    for s in chain.candidates:
        kept = choices.get(s.name)
        if kept is not None:
            out.append(Region(s.name, s.region.nodes, s.region.save | frozenset(kept)))
    return out


def off_choices(chain: ChainModel) -> Choices:
    """Every candidate off."""
    return {s.name: None for s in chain.candidates}
