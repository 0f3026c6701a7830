"""Recompute search: which activations to keep and which to recompute, under a peak budget.

The plan space (what `passes.recompute` can carry out): each *candidate* — a layer whose nodes
can form one checkpointed region — is either left alone ("off") or checkpointed ("on") with a
set S of its nodes whose outputs the selective policy keeps (collectives are always in S).
The cost of a plan is the time of the forward ops it recomputes (`Timeline.recompute_s`).

The chain model. Nodes are cut into *segments* in forward order: one per candidate (its
first to last node) and runs of other nodes between them. Two exact walks of
`cost.timeline` — every candidate off, every candidate on with S empty ("full") — give for
each segment the bytes it holds at the end of the forward (`held`) and the most memory alive
inside it beyond what earlier segments hold, in the forward and in recompute + backward
(`work_forward`, `work_backward`). A plan's peak is then modelled as

    peak = max over segments s of  sum_{s' < s} held(s') + work(s)

with, for a candidate on with S: held = held_full + bytes(S), work_forward = work_forward_full +
bytes(S), work_backward = work_backward_full; cost = cost_full - time(S). The model is exact
for the two calibrating plans (every storage is counted where the walk counted it) and
conservative for the forward with S; `autopar.recompute_plan` checks every answer with an
exact walk and tightens the model's budget when the walk disagrees.

Two solvers on that model:
  * `solve_milp` — the exact MILP (HiGHS, through highspy, else scipy.optimize.milp): a binary
    per candidate (on) and per saveable node (kept), one or two rows per segment. For small
    graphs (`solve`'s `milp_max_binaries`); beyond, HiGHS does not close its gap in seconds.
  * `solve_dp` — a dynamic program over the segment chain (rotor-style) on memory discretised
    into `resolution` units, each candidate's S chosen by an exact 0/1 knapsack (time kept per
    byte kept) over the same grid; identical layers share their knapsack. States are prefixes
    rounded up, each carrying the exact prefix of its cheapest path, on which constraints are
    checked: the plan is feasible. A greedy pass then spends what rounding left unused. The
    bound is the larger of two relaxations' optima (the DP with everything rounded down, and
    the MILP's LP relaxation); the reported gap is between plan and bound.
Saveable nodes are those whose op is in `SAVEABLE_OPS` (each dispatches one non-view kernel,
or a known composite whose non-view kernels make exactly its outputs and saved buffers, so
the bytes the selective cache keeps are the node's own), that create a storage, and that
recomputation runs (not after the region's last saving node, nor that node itself when it
saves only its inputs: checkpoint stops recomputing at the last saved tensor).

It reads `node.meta` only through `cost.analyze` and `passes.recompute`. Guarantees: both
solvers return plans feasible in the model at the given budget (or status "infeasible"), with
`bound <= cost`; deterministic for a given graph and budget.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch.fx as fx

from autopar.cost.graph import GraphCost, NodeCost
from autopar.cost.ops import packet_name
from autopar.cost.symbolic import evaluate
from autopar.cost.timeline import Region, SegmentUse, Timeline, communicates, node_timer, stop_runs, timeline
from autopar.passes.recompute import SELECTIVE_SAVE_OPS, in_module, mutated_args, region_nodes, region_problem

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

    @property
    def candidates(self) -> list[Segment]:
        return [s for s in self.segments if s.candidate]

    @property
    def n_binaries(self) -> int:
        return sum(1 + len(s.items) for s in self.candidates)


Choices = dict[str, "frozenset[int] | None"]  # candidate -> kept node indices (None: off)


@dataclass
class Solution:
    choices: Choices
    cost_s: float  # recompute time in the model
    bound_s: float  # proven lower bound on the model's optimum
    method: str  # "milp" | "dp" | "none"
    status: str  # "optimal" | "feasible" (time limit) | "infeasible"
    seconds: float
    model_peak: float

    @property
    def gap(self) -> float:
        """(cost - bound) / cost; 0 when the cost is 0."""
        return 0.0 if self.cost_s <= 0 else max(0.0, (self.cost_s - self.bound_s) / self.cost_s)


# ------------------------------------------------------------------------ the chain
def build_chain(gm: fx.GraphModule, gc: GraphCost, values: Mapping | None = None, hardware: Any = None, *,
                recompute_collectives: bool = False) -> ChainModel:
    """Candidates, segments and the two calibrating walks for `gm` (analysed as `gc`)."""
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
    written = _written_nodes(gm)
    full_regions = []
    for layer, first, last, members in spans:
        if members is not None:
            forced = frozenset() if recompute_collectives else frozenset(n.index for n in members if communicates(n))
            full_regions.append(Region(layer, frozenset(n.index for n in members), forced))
    none = timeline(gc, (), vals, hardware=hardware, segment_of=segment_of, keep_points=False)
    full = timeline(gc, full_regions, vals, hardware=hardware, segment_of=segment_of, keep_points=False)
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
            nb = _made_bytes(gc, n, vals)
            if nb > 0 and sec > 0 and _saveable(n) and n.name not in written:
                items.append(Item(n.index, n.key, nb, sec, fl))
        segments.append(Segment(name, first, last, a, True, b, region, items, full_s, full_f))
    return ChainModel(gc, vals, hardware, segments, segment_of, none, full, skipped, time.perf_counter() - t0)


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


def _written_nodes(gm: fx.GraphModule) -> set[str]:
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


def _saveable(n: NodeCost) -> bool:
    p = packet_name(n.op)
    if p not in SAVEABLE_OPS:
        return False
    if p == "aten.scaled_dot_product_attention":  # one fused kernel only when not math attention
        return any(tag == "logsumexp" for _k, _nb, tag in n.saved)
    return True


def _made_bytes(gc: GraphCost, n: NodeCost, vals) -> float:
    """Bytes of the storages node `n` creates (outputs and saved buffers): what the selective
    cache keeps when `n` is kept."""
    total = 0.0
    for k in n.new_storages:
        st = gc.storages.get(k)
        if st is not None and st.producer == n.index and not st.is_state:
            total += evaluate(st.nbytes, vals)
    for k, nb, _t in n.saved:
        if k not in gc.storages:
            total += evaluate(nb, vals)
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


def _off(chain: ChainModel) -> Choices:
    return {s.name: None for s in chain.candidates}


# ------------------------------------------------------------------------ exact MILP
def solve_milp(chain: ChainModel, budget: float, *, time_limit_s: float = 10.0, relax: bool = False) -> Solution:
    """Minimise recompute time subject to the modelled peak <= budget, exactly (HiGHS).
    `relax`: solve the LP relaxation instead (its optimum is `bound_s`; choices are rounded
    down and not necessarily feasible)."""
    t0 = time.perf_counter()
    cands = chain.candidates
    col: dict[tuple[str, int], int] = {}
    cost: list[float] = []
    for s in cands:
        col[(s.name, -1)] = len(cost)
        cost.append(s.full_s)
        for it in s.items:
            col[(s.name, it.index)] = len(cost)
            cost.append(-it.seconds)
    nvar = len(cost)
    if nvar == 0:
        pk = model_peak(chain, {})
        return Solution({}, 0.0, 0.0, "milp", "optimal" if pk <= budget else "infeasible",
                        time.perf_counter() - t0, pk)
    scale = budget if budget > 0 else 1.0  # rows in units of the budget
    rows: list[np.ndarray] = []
    rhs: list[float] = []
    prefix = np.zeros(nvar)  # sum of earlier segments' held bytes: prefix @ x + prefix_c
    prefix_c = 0.0
    for s in chain.segments:
        if not s.candidate:
            rows.append(prefix.copy())
            rhs.append((budget - prefix_c - s.off.work) / scale)
            prefix_c += s.off.held
            continue
        z = col[(s.name, -1)]
        for phase in ("forward", "backward"):
            r = prefix.copy()
            w_off = getattr(s.off, f"work_{phase}")
            r[z] += (getattr(s.full, f"work_{phase}") - w_off) / scale
            if phase == "forward":
                for it in s.items:
                    r[col[(s.name, it.index)]] += it.nbytes / scale
            rows.append(r)
            rhs.append((budget - prefix_c - w_off) / scale)
        for it in s.items:  # kept only when on
            r = np.zeros(nvar)
            r[col[(s.name, it.index)]] = 1.0
            r[z] = -1.0
            rows.append(r)
            rhs.append(0.0)
        prefix[z] += (s.full.held - s.off.held) / scale
        for it in s.items:
            prefix[col[(s.name, it.index)]] += it.nbytes / scale
        prefix_c += s.off.held
    a = np.vstack(rows)
    ub = np.asarray(rhs)
    tscale = max(sum(s.full_s for s in cands), 1e-12)
    c = np.asarray(cost) / tscale
    x, fun, bound, optimal = _highs(c, a, ub, integer=not relax, time_limit_s=time_limit_s)
    secs = time.perf_counter() - t0
    if x is None:
        return Solution(_off(chain), math.inf, math.inf, "milp", "infeasible", secs, math.inf)
    if relax:
        return Solution(_off(chain), math.inf, fun * tscale, "lp", "relaxed", secs, math.inf)
    x = np.round(x).astype(int)
    choices: Choices = {}
    for s in cands:
        if x[col[(s.name, -1)]]:
            choices[s.name] = frozenset(it.index for it in s.items if x[col[(s.name, it.index)]])
        else:
            choices[s.name] = None
    cost_s = model_cost(chain, choices)
    bound_s = cost_s if bound is None or not np.isfinite(bound) else min(cost_s, bound * tscale)
    return Solution(choices, cost_s, max(0.0, bound_s), "milp", "optimal" if optimal else "feasible", secs,
                    model_peak(chain, choices))


def _highs(c: np.ndarray, a: np.ndarray, ub: np.ndarray, *, integer: bool, time_limit_s: float):
    """min c.x s.t. a.x <= ub, 0 <= x <= 1 (binary when `integer`) with HiGHS: highspy when
    installed (quiet), else scipy.optimize.milp. Returns (x or None, objective, dual bound,
    proven optimal)."""
    try:
        import highspy
    except ImportError:
        highspy = None
    n = len(c)
    if highspy is None:
        from scipy.optimize import Bounds, LinearConstraint, milp

        res = milp(c=c, constraints=LinearConstraint(a, -np.inf, ub), integrality=np.full(n, int(integer)),
                   bounds=Bounds(0, 1), options={"time_limit": float(time_limit_s), "mip_rel_gap": 1e-9})
        if res.x is None:
            return None, math.inf, None, False
        bound = getattr(res, "mip_dual_bound", None) if integer else res.fun
        return res.x, float(res.fun), None if bound is None else float(bound), res.status == 0
    from scipy.sparse import csc_matrix

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-9)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, a.shape[0]
    lp.col_cost_ = c.astype(float)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
    lp.row_lower_ = np.full(a.shape[0], -highspy.kHighsInf)
    lp.row_upper_ = ub.astype(float)
    m = csc_matrix(a)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = m.indptr, m.indices, m.data
    if integer:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible point
        return None, math.inf, None, False
    x = np.asarray(h.getSolution().col_value)
    bound = info.mip_dual_bound if integer else info.objective_function_value
    return x, float(info.objective_function_value), float(bound), status == highspy.HighsModelStatus.kOptimal


# ------------------------------------------------------------------------ DP over the chain
def solve_dp(chain: ChainModel, budget: float, *, resolution: int = 4096) -> Solution:
    """Minimise recompute time subject to the modelled peak <= budget by a DP over the segment
    chain on a `resolution`-unit memory grid; the bound comes from the rounded-down DP."""
    t0 = time.perf_counter()
    if budget <= 0:
        return Solution(_off(chain), math.inf, math.inf, "dp", "infeasible", 0.0, math.inf)
    unit = budget / resolution
    cost, choices = _dp(chain, unit, resolution, True, budget)
    lower, _ = _dp(chain, unit, resolution, False, budget)
    # the grid rounds up: the two plans every model is exact for are tried as they are
    for anchor in (_off(chain), {s.name: frozenset() for s in chain.candidates}):
        if model_peak(chain, anchor) <= budget and (choices is None or model_cost(chain, anchor) <
                                                     model_cost(chain, choices)):
            choices = anchor
    if choices is not None:
        choices = fill(chain, choices, budget)  # spend what rounding up left unused
    lower = max(lower, _lp_bound(chain, budget))
    secs = time.perf_counter() - t0
    if choices is None:
        return Solution(_off(chain), math.inf, lower, "dp", "infeasible", secs, math.inf)
    cost_s = model_cost(chain, choices)
    return Solution(choices, cost_s, min(max(0.0, lower), cost_s), "dp",
                    "optimal" if cost_s - lower <= 1e-12 * max(1.0, cost_s) else "feasible", secs,
                    model_peak(chain, choices))


def _slacks(chain: ChainModel, choices: Choices, budget: float):
    """Per segment: (held, room for more held here = min over this and later segments'
    slack, room for more forward work here)."""
    items = {s.name: {it.index: it.nbytes for it in s.items} for s in chain.candidates}
    rows = []
    prefix = 0.0
    for s in chain.segments:
        kept = choices.get(s.name) if s.candidate else None
        if kept is None:
            held, wf, wb = s.off.held, s.off.work, s.off.work
        else:
            m = sum(items[s.name][i] for i in kept)
            held, wf, wb = s.full.held + m, s.full.work_forward + m, s.full.work_backward
        rows.append([held, budget - prefix - max(wf, wb), budget - prefix - wf])
        prefix += held
    after = math.inf  # min slack of the later segments
    out = [None] * len(rows)
    for k in range(len(rows) - 1, -1, -1):
        held, slack, fwd = rows[k]
        out[k] = (held, after, min(fwd, after))
        after = min(after, slack)
    return out


def fill(chain: ChainModel, choices: Choices, budget: float) -> Choices:
    """Improve a feasible plan greedily while the model stays feasible: turn a candidate off
    when that fits, then keep more nodes, the most recompute time per byte first."""
    choices = dict(choices)
    index = {s.name: k for k, s in enumerate(chain.segments)}
    order = sorted(((it.seconds / it.nbytes, s.name, it) for s in chain.candidates for it in s.items),
                   key=lambda x: (-x[0], index[x[1]], x[2].index))
    for s in sorted(chain.candidates, key=lambda s: -s.full_s):
        kept = choices.get(s.name)
        if kept is None:
            continue
        trial = dict(choices)
        trial[s.name] = None
        if model_peak(chain, trial) <= budget:
            choices = trial
    changed = True
    while changed:
        changed = False
        sl = _slacks(chain, choices, budget)
        for _r, name, it in order:
            kept = choices.get(name)
            if kept is None or it.index in kept:
                continue
            _held, room_after, room_here = sl[index[name]]
            if it.nbytes <= min(room_after, room_here) + 1e-9:
                choices[name] = kept | {it.index}
                changed = True
                break
    return choices


def _lp_bound(chain: ChainModel, budget: float) -> float:
    """The LP relaxation's optimum of the MILP: a lower bound on the model's optimum."""
    try:
        sol = solve_milp(chain, budget, time_limit_s=5.0, relax=True)
    except Exception:  # noqa: BLE001 - a bound is optional
        return 0.0
    return sol.bound_s if math.isfinite(sol.bound_s) else 0.0


def _dp(chain: ChainModel, unit: float, q: int, up: bool, budget: float) -> tuple[float, Choices | None]:
    """up: states are prefixes rounded up to `unit`s, each carrying the exact prefix of its
    cheapest path, constraints checked on that (a feasible plan, near-optimal: paths merged
    into one state are compared by cost). down: prefixes and kept bytes rounded down and
    constraints checked on them (a relaxation: its optimum bounds the model's from below)."""
    rnd = (lambda x: int(math.ceil(x / unit - 1e-9))) if up else (lambda x: int(math.floor(x / unit + 1e-9)))
    inf = math.inf
    size = q + len(chain.segments) + 2  # rounding up may carry a prefix past q units
    cost = np.full(size, inf)
    real = np.zeros(size)  # exact prefix (up) / the rounded one times unit (down)
    cost[0] = 0.0
    trace: list[tuple[np.ndarray, np.ndarray]] = []
    knap: dict[tuple, tuple] = {}
    for s in chain.segments:
        new = np.full(size, inf)
        new_real = np.zeros(size)
        src = np.full(size, -1, dtype=np.int64)
        opt = np.full(size, -2, dtype=np.int64)  # -1 off, m >= 0: on with knapsack capacity m

        def relax(h_units: int, held: float, work: float, c: float, code: int) -> None:
            n = size - h_units
            if n <= 0:
                return
            base = real[:n] if up else np.arange(n) * unit
            ok = np.isfinite(cost[:n]) & (base + work <= budget * (1 + 1e-12))
            if not ok.any():
                return
            cand = cost[:n] + c
            nr = (real[:n] + held) if up else (np.arange(n) + h_units) * unit
            tgt = slice(h_units, h_units + n)
            better = ok & ((cand < new[tgt]) | ((cand == new[tgt]) & (nr < new_real[tgt])))
            if better.any():
                idx = np.nonzero(better)[0]
                new[h_units + idx] = cand[idx]
                new_real[h_units + idx] = nr[idx]
                src[h_units + idx] = idx
                opt[h_units + idx] = code

        relax(rnd(s.off.held), s.off.held, s.off.work, 0.0, -1)
        if s.candidate:
            g, kb, keep, ws = _knapsack(s, rnd, q, knap)
            hf = rnd(s.full.held)
            best = -1.0
            for m in range(q + 1):
                if g[m] <= best:  # not a breakpoint: a smaller capacity keeps as much
                    continue
                best = g[m]
                kept = kb[m] if up else m * unit
                if s.full.work_forward + kept > budget:
                    break
                relax(hf + m if not up else hf + rnd(kb[m]), s.full.held + kb[m],
                      max(s.full.work_forward + kept, s.full.work_backward), s.full_s - g[m], m)
        cost, real = new, new_real
        trace.append((src, opt))
    if not np.isfinite(cost).any():
        return inf, None
    p = int(np.argmin(cost))
    total = float(cost[p])
    choices: Choices = {}
    for s, (src, opt) in zip(reversed(chain.segments), reversed(trace)):
        code, prev = int(opt[p]), int(src[p])
        if s.candidate:
            if code < 0:
                choices[s.name] = None
            else:
                _g, _kb, keep, ws = knap[_sig(s, rnd)]
                m, taken = code, []
                for i in range(len(s.items) - 1, -1, -1):
                    if m >= 0 and keep[i][m]:
                        taken.append(s.items[i].index)
                        m -= ws[i]
                choices[s.name] = frozenset(taken)
        p = prev
    return total, choices


def _sig(s: Segment, rnd) -> tuple:
    return tuple((rnd(it.nbytes), it.nbytes, round(it.seconds, 15)) for it in s.items)


def _knapsack(s: Segment, rnd, q: int, cache: dict):
    """g[m] = most recompute time saved by keeping items of total rounded size <= m units;
    kb[m] = the exact bytes of that choice. Identical layers share one computation."""
    sig = _sig(s, rnd)
    hit = cache.get(sig)
    if hit is not None:
        return hit
    g = np.zeros(q + 1)
    kb = np.zeros(q + 1)
    keep: list[np.ndarray] = []
    ws: list[int] = []
    for it in s.items:
        w = rnd(it.nbytes)
        ws.append(w)
        k = np.zeros(q + 1, dtype=bool)
        if w <= q:
            cand = g[: q + 1 - w] + it.seconds
            cand_b = kb[: q + 1 - w] + it.nbytes
            better = cand > g[w:] + 1e-18
            k[w:] = better
            g[w:] = np.where(better, cand, g[w:])
            kb[w:] = np.where(better, cand_b, kb[w:])
        keep.append(k)
    cache[sig] = (g, kb, keep, ws)
    return cache[sig]


def solve(chain: ChainModel, budget: float, *, method: str = "auto", time_limit_s: float = 10.0,
          milp_max_binaries: int = 400, resolution: int = 4096) -> Solution:
    """`method`: "milp", "dp", or "auto" (the MILP when the model has at most
    `milp_max_binaries` binaries, else the DP; the better answer when both run)."""
    if method not in ("auto", "milp", "dp"):
        raise ValueError(f"method must be 'auto', 'milp' or 'dp', got {method!r}")
    if method == "milp":
        return solve_milp(chain, budget, time_limit_s=time_limit_s)
    if method == "dp":
        return solve_dp(chain, budget, resolution=resolution)
    dp = solve_dp(chain, budget, resolution=resolution)
    if chain.n_binaries > milp_max_binaries:
        return dp
    mi = solve_milp(chain, budget, time_limit_s=time_limit_s)
    if mi.status == "infeasible":
        return dp
    best = mi if mi.cost_s <= dp.cost_s else dp
    best.bound_s = max(dp.bound_s, mi.bound_s)
    best.bound_s = min(best.bound_s, best.cost_s)
    return best
