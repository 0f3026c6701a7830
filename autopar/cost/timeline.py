"""The memory timeline of one training step: what is alive at every point of the forward,
the recomputations and the backward of a graph, under a recompute plan.

A plan is a list of `Region`s (what `passes.recompute` turns into checkpointed calls): node
indices of `GraphCost.nodes` whose activations autograd does not keep, and among them the
`save` nodes whose outputs are kept (selective checkpointing caches their non-view outputs).
With no regions the walk is `memory.liveness` (same rules, same peak); with regions it follows
what `torch.utils.checkpoint` (non-reentrant, selective) does:

forward    every node allocates the storages its outputs create and the buffers it saves; a
           storage is freed after its last reader unless it is *held*: saved by a node outside
           every region (released at that node's backward, the earliest such saver last), an
           input of a region (kept by checkpoint until the region's backward is over), a saved
           node's output or buffer (the selective cache), or a graph output. Buffers a region
           node saves are transient: the checkpoint keeps a handle, not the tensor.
recompute  when backward reaches a region's last node that saves anything (its *stop*), the
           region's nodes before the stop run again, and the stop itself only if it saves
           something it computes (autograd packs an op's inputs before its kernel runs, and
           checkpoint stops at the last pack). Unsaved nodes allocate fresh copies (distinct
           from the forward's storages); saved nodes hand back their cached outputs (a saved
           node the recomputation does not reach keeps its cache until the region's backward
           is over). What the region's nodes save stays until their backward (the earliest
           saver of each storage last); the rest is freed after its last reader.
backward   as `memory.liveness`: gradient buffers reference-counted through views and adds,
           parameter gradients once, dense gradients for the graph outputs.

The bytes held at the end of the forward (`Timeline.saved`) are what saved_tensors_hooks
see (autograd's saved tensors and the regions' inputs) plus what the selective cache keeps.
Recomputation's FLOPs (FlopCounterMode convention) and time (the hardware profile's roofline,
`estimate`'s per-node times) are the forward costs of the nodes recomputed, plus the
checkpoint's own host time over all its nodes (saved-tensor hooks and their replay: the profile's
`checkpoint_node_s`), plus, for a selective region (one that saves some of its nodes), the host
time of torch's selective-checkpoint dispatch mode over all its nodes in the forward and again in
the recompute (`selective_node_s`: cost/hardware.py); `region_recompute` gives one region's without the
walk (the planner prices a pipeline stage's recompute per block with it).

For the recompute search the walk can attribute memory to *segments* (consecutive runs of
nodes): a held storage belongs to the segment of the node whose backward releases it last;
`Timeline.segments` gives, per segment, the bytes it holds at the end of the forward (`held`)
and the most memory alive at any point inside it beyond what earlier segments hold (`work`).

A pipeline stage's graph (`pipeline_memory.stage_graph`: a run of the whole graph's nodes, their
indices kept) walks as it is, with the regions cut to its nodes (`pipeline_memory.stage_regions`).

It reads no `node.meta` (only a GraphCost). Guarantees: without regions `peak`, `forward_end`
and `param_grads` equal `memory.liveness`'s; every point's `alive` is the sum of its parts.
"""
from __future__ import annotations

import math

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .graph import GraphCost
from .memory import GRAPH_ONLY, GradBuffers, LossModel, loss_output_bytes
from .ops import packet_name
from .symbolic import evaluate


@dataclass(frozen=True)
class Region:
    """Nodes (indices into GraphCost.nodes) run under one checkpoint; `save`: those whose
    outputs the selective policy keeps."""

    name: str
    nodes: frozenset[int]
    save: frozenset[int] = frozenset()

    def __post_init__(self):
        if not self.save <= self.nodes:
            raise ValueError(f"region {self.name!r}: saved nodes {sorted(self.save - self.nodes)} are not in it")


@dataclass(frozen=True)
class Point:
    phase: str  # "forward" | "recompute" | "backward"
    node: str
    segment: int
    alive: float  # everything below, bytes
    held: float  # kept for backward (saved, region inputs, cached outputs, outputs before the loss)
    recomputed: float  # storages made by recomputation that are alive
    other: float  # graph inputs and transient activations
    grads: float  # activation gradients (+ the temporary of an accumulation)
    param_grads: float


@dataclass(frozen=True)
class SegmentUse:
    held: float  # bytes this segment holds at the end of the forward
    work_forward: float  # max over its forward points of alive - bytes held by earlier segments
    work_backward: float  # the same over its recompute and backward points

    @property
    def work(self) -> float:
        return max(self.work_forward, self.work_backward)


@dataclass
class Timeline:
    points: list[Point]
    peak: float
    peak_phase: str
    peak_node: str
    inputs: float  # graph inputs, alive all step
    saved: float  # held for backward at the end of the forward (hooks + selective cache)
    saved_by: dict[str, float]  # "autograd" | "region_inputs" | "cached": first reason a storage is held
    outputs: float
    forward_end: float
    param_grads: float
    recompute_flops: float  # forward FLOPs run again in backward (FlopCounterMode convention)
    recompute_s: float  # their time on the hardware profile
    recomputed_nodes: int
    segments: list[SegmentUse] = field(default_factory=list)
    forward_peak: float = 0.0  # the most alive at a forward point (inputs, each node, the loss's saved tensor)
    # the peak with every parameter gradient allocated from the start: what a walk with
    # grads_preallocated=True gives (only the parameter gradients differ), without walking again
    later_peak: float = 0.0


def timeline(gc: GraphCost, regions: Iterable[Region] = (), values: Mapping | None = None, *,
             hardware: Any = None, param_grad_bytes: Mapping[Any, float] | None = None,
             grads_preallocated: bool = False, storage_divisor: Mapping[Any, int] | None = None,
             segment_of: Sequence[int] | None = None, keep_points: bool = True,
             loss: LossModel = GRAPH_ONLY, compute_divisor: Mapping[int, float] | None = None) -> Timeline:
    """Walk forward, recomputations and backward (see the module docstring).

    Args:
        regions: the recompute plan (disjoint); `regions_for` builds them from plan fields.
        values: symbol values (default: the capture's example sizes).
        hardware: profile for recomputation time (default: the one `gc` was analysed with).
        param_grad_bytes, grads_preallocated, storage_divisor, loss: as `memory.liveness`.
        segment_of: per node, in order, its segment number (non-decreasing); fills `Timeline.segments`.
        keep_points: record every point (off: only the totals, faster).
        compute_divisor: node index -> the share of its work one rank does (tensor parallelism:
            `node_time.layout_divisors`), applied to the recomputed ops' time and FLOPs as
            `estimate` applies it to the forward's.
    """
    regions = list(regions)
    vals = gc.values() if values is None else values
    div = storage_divisor or {}
    nodes = gc.nodes
    # a pipeline stage's graph (`pipeline_memory.stage_graph`) keeps its nodes' indices in the
    # whole graph: a contiguous run from `base`; `n_nodes` is one past its last index
    base = nodes[0].index if nodes else 0
    n_nodes = base + len(nodes)
    at = {n.index: n for n in nodes}

    def ev(x, key=None):
        v = evaluate(x, vals)
        return v / div[key] if key in div else v

    region_of: dict[int, Region] = {}
    for r in regions:
        for i in r.nodes:
            if i in region_of:
                raise ValueError(f"regions {region_of[i].name!r} and {r.name!r} both contain node {at[i].name}")
            region_of[i] = r

    size: dict[Any, float] = {k: ev(st.nbytes, k) for k, st in gc.storages.items() if not st.is_state}
    producer = {k: st.producer for k, st in gc.storages.items()}
    state = {k for k, st in gc.storages.items() if st.is_state}
    new_of: dict[int, list[Any]] = defaultdict(list)  # buffers created inside an op and saved
    for n in nodes:
        for key, nb, _tag in n.saved:
            if key not in gc.storages and key not in size:  # tp-sharded as its node's output
                size[key] = ev(nb, key)
                new_of[n.index].append(key)
                producer[key] = n.index
    graph_inputs = {k for k, st in gc.storages.items() if st.producer < 0 and not st.is_state}

    last_use: dict[Any, int] = {}
    for n in nodes:
        for k in n.new_storages:
            last_use.setdefault(k, n.index)
        for k in n.uses:
            last_use[k] = n.index

    # --- hold records: key -> [(releasing node index, why)]; n_nodes: released at backward start
    holds: dict[Any, list[tuple[int, str]]] = defaultdict(list)
    save_min: dict[Any, int] = {}
    for n in nodes:
        if n.index in region_of:
            continue
        for key, _nb, _t in n.saved:
            if key not in state:
                save_min[key] = min(save_min.get(key, n.index), n.index)
    for key, i in save_min.items():
        holds[key].append((i, "autograd"))
    stop: dict[str, int | None] = {}
    for r in regions:
        members = sorted(r.nodes)
        grad_nodes = [i for i in members if at[i].has_grad_fn]
        savers = [i for i in members if at[i].saved]
        stop[r.name] = savers[-1] if savers else None
        release = grad_nodes[0] if grad_nodes else base
        inputs = {k for i in members for k in at[i].uses
                  if k not in state and producer.get(k, -1) not in r.nodes}
        for k in inputs:
            holds[k].append((release, "region_inputs"))
        st = stop[r.name]
        for i in sorted(r.save):
            # handed to the recomputation when it re-runs the node; a node it does not reach
            # (the stop when that saves only inputs, or later) keeps its cache to the region's end
            reached = st is not None and (i < st or (i == st and stop_runs(at[i])))
            for k in _made_by(at[i], new_of, producer):
                holds[k].append((st, "cached") if reached else (release, "cached_to_end"))
    out_keys = {t.key for t in gc.outputs if not t.is_state}
    for k in out_keys:
        holds[k].append((n_nodes, "output"))
    priority = ("autograd", "region_inputs", "cached", "cached_to_end", "output")
    reason = {k: min((why for _i, why in rel), key=priority.index) for k, rel in holds.items()}

    seg = list(segment_of) if segment_of is not None else [0] * len(nodes)
    n_seg = (max(seg) + 1) if seg else 1
    last_seg = seg[-1] if seg else 0

    def seg_at(i: int) -> int:
        return last_seg if i >= n_nodes else seg[i - base]

    owner: dict[Any, int] = {k: seg_at(min(i for i, _ in rel)) for k, rel in holds.items()}
    release_at: dict[int, list[Any]] = defaultdict(list)
    for k, rel in holds.items():
        for i, why in rel:
            if why != "cached":  # the recomputation releases those
                release_at[i].append(k)
    count: dict[Any, int] = {k: len(rel) for k, rel in holds.items()}

    def sz(k) -> float:
        return size.get(k[2], 0.0) if isinstance(k, tuple) and k[:1] == ("re",) else size.get(k, 0.0)

    # --- bookkeeping of what is alive
    alive: dict[Any, str] = {}  # key -> "held" | "re" | "other"
    parts = {"held": 0.0, "re": 0.0, "other": 0.0}
    seg_held = [0.0] * n_seg
    gb = GradBuffers(gc, ev, param_grad_bytes, grads_preallocated)
    points: list[Point] = []
    peak = [-1.0, "forward", "(inputs)"]
    fwd_peak = [0.0]
    bare = [-1.0]  # the most alive at a point without the parameter gradients (`later_peak`)

    def alloc(k, kind: str) -> None:
        if k in alive:
            return
        b = sz(k)
        alive[k] = kind
        parts[kind] += b
        if k in owner and kind == "held":
            seg_held[owner[k]] += b

    def free(k) -> None:
        kind = alive.pop(k, None)
        if kind is None:
            return
        b = sz(k)
        parts[kind] -= b
        if k in owner and kind == "held":
            seg_held[owner[k]] -= b

    def total() -> float:
        return parts["held"] + parts["re"] + parts["other"] + gb.live

    work = [[0.0] * n_seg, [0.0] * n_seg]  # forward, recompute + backward

    def point(phase: str, name: str, i: int, transient: float = 0.0) -> None:
        x = total() + transient
        a = x + gb.param_grads
        if x > bare[0]:
            bare[0] = x
        s = seg_at(i)
        if segment_of is not None:
            w = a - sum(seg_held[:s])
            row = work[phase != "forward"]
            if w > row[s]:
                row[s] = w
        if a > peak[0]:
            peak[0], peak[1], peak[2] = a, phase, name
        if phase == "forward" and a > fwd_peak[0]:
            fwd_peak[0] = a
        if keep_points:
            points.append(Point(phase, name, s, a, parts["held"], parts["re"], parts["other"],
                                gb.live + transient, gb.param_grads))

    # --- forward
    for k in graph_inputs:
        alloc(k, "held" if k in holds else "other")
    inputs_bytes = sum(size[k] for k in graph_inputs)
    free_at: dict[int, list[Any]] = defaultdict(list)
    for k, st in gc.storages.items():
        if st.is_state or k in holds or st.producer < 0:
            continue
        free_at[last_use.get(k, st.producer)].append(k)
    point("forward", "(inputs)", base)
    for n in nodes:
        i = n.index
        for k in n.new_storages:
            if k in size and producer.get(k) == i:
                alloc(k, "held" if k in holds else "other")
        for k in new_of.get(i, ()):
            alloc(k, "held" if k in holds else "other")
        point("forward", n.name, i)
        for k in new_of.get(i, ()):
            if k not in holds:
                free(k)  # a region node's saved buffer: checkpoint keeps a handle only
        for k in free_at.get(i, ()):
            free(k)
    forward_end = total()
    held_keys = [k for k in holds if k in alive]
    saved_keys = [k for k in held_keys if any(why != "output" for _i, why in holds[k])]
    saved = sum(size.get(k, 0.0) for k in saved_keys)
    saved_by: dict[str, float] = {"autograd": 0.0, "region_inputs": 0.0, "cached": 0.0}
    for k in saved_keys:
        saved_by[reason[k].replace("cached_to_end", "cached")] += size.get(k, 0.0)
    outputs = sum(size.get(k, 0.0) for k in out_keys if k not in saved_keys)
    held_at_end = list(seg_held)

    def release(k) -> None:
        count[k] -= 1
        if count[k] == 0 and k not in graph_inputs:
            free(k)

    # --- the loss (its saved tensor, then its backward makes the seed), then backward
    loss_out = loss_output_bytes(gc, ev)
    last = nodes[-1].index if nodes else 0
    if loss != GRAPH_ONLY:  # the graph alone: no points of its own (the walk as it always was)
        point("forward", "(loss)", last, loss.saved * loss_out)
    gb.seed(gc.outputs)
    if not loss.outputs_held:  # else the caller keeps them to the end of backward
        for k in release_at.get(n_nodes, ()):
            release(k)
    if loss != GRAPH_ONLY:
        point("backward", "(loss)", last, (loss.saved + loss.grad_temp) * loss_out)
    re_flops = re_s = 0.0
    re_nodes = 0
    timer = None
    re_release: dict[int, list[Any]] = defaultdict(list)
    for n in reversed(nodes):
        i = n.index
        r = region_of.get(i)
        if r is not None and stop[r.name] == i:
            if timer is None:
                timer = node_timer(gc, hardware, vals)
            f, s_, k_ = _recompute(r, i, at, new_of, producer, state, graph_inputs, alive, alloc, free,
                                   point, count, re_release, ev, timer, compute_divisor or {})
            re_flops, re_s, re_nodes = re_flops + f, re_s + s_, re_nodes + k_
        if n.has_grad_fn:
            gb.backward(n, lambda transient: point("backward", n.name, i, transient))  # noqa: B023 - called now
        for k in re_release.pop(i, ()):
            release(k)
        for k in release_at.get(i, ()):
            release(k)
    if loss.outputs_held:
        for k in release_at.get(n_nodes, ()):
            release(k)
    segments: list[SegmentUse] = []
    if segment_of is not None:
        segments = [SegmentUse(held_at_end[s], work[0][s], work[1][s]) for s in range(n_seg)]
    return Timeline(points=points, peak=peak[0], peak_phase=peak[1], peak_node=peak[2], inputs=inputs_bytes,
                    saved=saved, saved_by=saved_by, outputs=outputs, forward_end=forward_end, param_grads=gb.param_grads,
                    recompute_flops=re_flops, recompute_s=re_s, recomputed_nodes=re_nodes,
                    segments=segments, forward_peak=fwd_peak[0],
                    later_peak=bare[0] + GradBuffers(gc, ev, param_grad_bytes, True).param_grads)


# buffers an op makes from its inputs before computing (autograd packs them before the kernel)
INPUT_COPY_TAGS = frozenset({"rows_copy", "matmul_copy", "attn_bias", "original_self"})


def stop_runs(n) -> bool:
    """Whether recomputation runs the region's stop node `n` itself: autograd packs an op's
    inputs before the kernel runs and its outputs after, and checkpoint stops at the last
    pack; so the stop node runs only if it saves something it computes."""
    if not n.op.startswith("aten."):
        return True  # custom autograd functions save after their forward has run
    outs = {t.key for t in n.outputs}
    for key, _nb, tag in n.saved:
        if key in outs or (tag not in ("activation", "state") and tag not in INPUT_COPY_TAGS):
            return True
    return False


def _made_by(n, new_of, producer) -> list[Any]:
    """Storages node `n` creates: its outputs' new storages and the buffers it saves."""
    return [k for k in n.new_storages if producer.get(k) == n.index] + list(new_of.get(n.index, ()))


def _recompute(r: Region, stop: int, nodes, new_of, producer, state, graph_inputs, alive, alloc, free, point,
               count, re_release, ev, timer, cdiv) -> tuple[float, float, int]:
    """Run region `r`'s nodes up to `stop` again; returns (FLOPs, seconds, nodes recomputed).
    `nodes`: node index -> node."""
    seq = [j for j in sorted(r.nodes) if j < stop or (j == stop and stop_runs(nodes[j]))]
    cached = {k for j in r.save if j in seq for k in _made_by(nodes[j], new_of, producer)}

    def rk(k):  # a storage made by an unsaved region node is a fresh copy when recomputed
        return ("re", r.name, k) if producer.get(k, -1) in r.nodes and k not in cached else k

    # what the region's nodes save is kept until the earliest saver's backward
    savers: dict[Any, int] = {}
    for j in sorted(r.nodes):
        for key, _nb, _t in nodes[j].saved:
            if key not in state:
                k = rk(key)
                savers[k] = min(savers.get(k, j), j)
    for k, j in savers.items():
        count[k] = count.get(k, 0) + 1
        re_release[j].append(k)
    # the cache hands its tensors to the recomputation: they stay as long as it needs them
    for k in cached:
        count[k] -= 1
    last: dict[Any, int] = {}
    for j in seq:
        for k in _made_by(nodes[j], new_of, producer):
            last.setdefault(rk(k), j)
        for k in nodes[j].uses:
            if k not in state:
                last[rk(k)] = j
    free_at: dict[int, list[Any]] = defaultdict(list)
    for k, j in last.items():
        if count.get(k, 0) <= 0 and k not in graph_inputs:
            free_at[j].append(k)
    for j in seq:
        n = nodes[j]
        for k in _made_by(n, new_of, producer):
            k2 = rk(k)
            alloc(k2, "re" if k2 != k else "held")
        point("recompute", n.name, j)
        for k in free_at.get(j, ()):
            free(k)
    for k in cached:  # cached outputs not read by the recomputation (after its stop)
        if count.get(k, 0) <= 0 and k not in last and k in alive:
            free(k)
    return _recompute_cost(r, seq, nodes, ev, timer, cdiv)


def _recompute_cost(r: Region, seq: Sequence[int], nodes, ev, timer, cdiv) -> tuple[float, float, int]:
    """(FLOPs, seconds, nodes) of running region `r`'s nodes `seq` again (its saved nodes hand
    back their cache; a node another ep rank runs costs nothing here)."""
    flops = secs = 0.0
    done = 0
    for j in seq:
        n = nodes[j]
        if j in r.save:
            continue
        d = cdiv.get(n.index, 1)
        if d == math.inf:  # a node this rank does not run (another ep rank's expert)
            continue
        flops += ev(n.cost.flops) / d
        if n.kind not in ("view", "none"):
            secs += timer.node(n, d)[0]
            done += 1
    # the checkpoint's own host time (its saved-tensor hooks and their replay) over the region; a
    # selective one's dispatch mode on top, in its forward and its recompute
    secs += len(r.nodes) * timer.hw.checkpoint_node_s
    if r.save:
        secs += 2 * len(r.nodes) * timer.hw.selective_node_s
    return flops, secs, done


def region_recompute(gc: GraphCost, r: Region, values: Mapping | None = None, *, hardware: Any = None,
                     compute_divisor: Mapping[int, float] | None = None) -> tuple[float, float, int]:
    """(FLOPs, seconds, nodes) region `r`'s backward recomputes, as `timeline` counts them
    (`Timeline.recompute_flops`, `recompute_s`, `recomputed_nodes` are these summed over its
    regions), without walking the memory: the planner prices a stage's recompute per block."""
    vals = gc.values() if values is None else values
    at = {n.index: n for n in gc.nodes}
    savers = [i for i in sorted(r.nodes) if at[i].saved]
    if not savers:
        return 0.0, 0.0, 0
    stop = savers[-1]
    seq = [j for j in sorted(r.nodes) if j < stop or (j == stop and stop_runs(at[j]))]
    return _recompute_cost(r, seq, at, lambda x: evaluate(x, vals), node_timer(gc, hardware, vals),
                           compute_divisor or {})


def node_timer(gc: GraphCost, hardware: Any, vals):
    """Per-node (forward, backward) seconds on `hardware` (default: the profile `gc` was
    analysed with), as `estimate` computes them."""
    from .node_time import NodeTimer
    from .hardware import load_profile

    return NodeTimer(load_profile(hardware or gc.hardware), vals)


# ------------------------------------------------------------------------ plans -> regions
def communicates(n) -> bool:
    """A node calling an autopar collective (not the local ones: leaf, split, to_partial), as
    `passes.recompute.is_collective` decides: a `torch.ops.autopar` op, named
    "autopar.<op>.<overload>". A fused kernel (a Python function under autopar.runtime.kernels,
    named by its module path) computes locally and is recomputed like any other op."""
    from autopar.passes.recompute import LOCAL_AUTOPAR_OPS

    parts = n.op.split(".")
    return len(parts) == 3 and parts[0] == "autopar" and parts[1] not in LOCAL_AUTOPAR_OPS


def regions_for(gc: GraphCost, modes: Mapping[str, str], save: Mapping[str, Sequence[str]] | None = None, *,
                recompute_collectives: bool = False) -> list[Region]:
    """The regions `passes.recompute` builds for `Plan.recompute` (module path -> mode) and
    `Plan.extra["recompute_save"]` (module path -> node keys), on the analysed graph."""
    from autopar.passes.recompute import SELECTIVE_SAVE_OPS, in_module

    out = []
    save = save or {}
    for path, mode in modes.items():
        if mode == "none":
            continue
        if mode not in ("full", "selective"):
            raise ValueError(f"recompute mode for {path!r} must be 'none', 'full' or 'selective', got {mode!r}")
        members = [n for n in gc.nodes if in_module(n.module, path)]
        if not members:
            raise ValueError(f"no node of the graph is in module {path!r}; modules with nodes: "
                             f"{sorted(gc.layers())[:8]}")
        keep: set[int] = set()
        if mode == "selective":
            wanted = save.get(path)
            if wanted is None:
                keep = {n.index for n in members if packet_name(n.op) in SELECTIVE_SAVE_OPS}
            else:
                by_key = {n.key: n.index for n in members}
                missing = [k for k in wanted if k not in by_key]
                if missing:
                    raise ValueError(f"recompute_save[{path!r}] names nodes {missing[:3]} not in that module")
                keep = {by_key[k] for k in wanted}
        if not recompute_collectives:
            keep |= {n.index for n in members if communicates(n)}
        out.append(Region(path, frozenset(n.index for n in members), frozenset(keep)))
    return out
