"""Recompute search: which activations to keep and which to recompute, under a peak budget.

The plan space and the chain model that prices a plan (segments, their held bytes and working
sets, the peak and recompute time of a choice) are `search/recompute_chain.py`'s; its public
names import from here too. `autopar.build.recompute_plan` checks every answer with an exact walk
and tightens the model's budget when the walk disagrees.

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

`ladder` / `ladder_choices`: the fixed order in which `autopar.build.recompute_plan` recomputes
saveable nodes by default (greedy by seconds per byte freed, a layer's own checkpointing cost
charged to its first node; norms, pointwise and attention before any GEMM), so that a
smaller budget never recomputes less.

It reads `node.meta` only through `cost.analyze` and `passes.recompute`. Guarantees: both
solvers return plans feasible in the model at the given budget (or status "infeasible"), with
`bound <= cost`; deterministic for a given graph and budget.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

# the chain model; its public names are importable from here, as callers import them
from autopar.cost.ops import packet_name
from autopar.search.recompute_chain import (NO_ACTIVATION, NO_MODULE, SAVEABLE_OPS, ChainModel, Choices,  # noqa: F401
                                            Item, Segment, build_chain, model_cost, model_peak, off_choices,
                                            regions_of)

__all__ = ["Solution", "solve", "solve_dp", "solve_milp", "fill", "ladder", "ladder_choices", "recompute_class",
           "NO_ACTIVATION", "NO_MODULE", "SAVEABLE_OPS",
           "ChainModel", "Choices", "Item", "Segment", "build_chain", "model_cost", "model_peak", "regions_of"]


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
        return Solution(off_choices(chain), math.inf, math.inf, "milp", "infeasible", secs, math.inf)
    if relax:
        return Solution(off_choices(chain), math.inf, fun * tscale, "lp", "relaxed", secs, math.inf)
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
        return Solution(off_choices(chain), math.inf, math.inf, "dp", "infeasible", 0.0, math.inf)
    unit = budget / resolution
    cost, choices = _dp(chain, unit, resolution, True, budget)
    lower, _ = _dp(chain, unit, resolution, False, budget)
    # the grid rounds up: the two plans every model is exact for are tried as they are
    for anchor in (off_choices(chain), {s.name: frozenset() for s in chain.candidates}):
        if model_peak(chain, anchor) <= budget and (choices is None or model_cost(chain, anchor) <
                                                     model_cost(chain, choices)):
            choices = anchor
    if choices is not None:
        choices = fill(chain, choices, budget)  # spend what rounding up left unused
    lower = max(lower, _lp_bound(chain, budget))
    secs = time.perf_counter() - t0
    if choices is None:
        return Solution(off_choices(chain), math.inf, lower, "dp", "infeasible", secs, math.inf)
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


# ------------------------------------------------------------------------ the monotone ladder
# what to recompute first: cheap to run again, memory freed per second of recomputation
# (norms, then pointwise activations and casts, then attention, GEMMs last)
_NORMS = frozenset({"aten.rms_norm", "aten.layer_norm", "aten.native_layer_norm", "aten._fused_rms_norm",
                    "aten.rsqrt", "aten.pow", "aten.mean"})
_ATTENTION = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                        "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                        "aten._scaled_dot_product_cudnn_attention", "aten.softmax", "aten._softmax"})
_GEMMS = frozenset({"aten.linear", "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul",
                    "aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten._grouped_mm",
                    "transformers.grouped_mm_fallback"})


def recompute_class(op: str) -> int:
    """0 norms, 1 pointwise (activations, casts, embedding lookups ...), 2 attention, 3 GEMMs."""
    p = packet_name(op)
    return 0 if p in _NORMS else 2 if p in _ATTENTION else 3 if p in _GEMMS else 1


def ladder(chain: ChainModel) -> list[list[tuple[str, int]]]:
    """Every saveable node of every candidate in the order a shrinking budget recomputes them,
    cut into groups of one node per candidate layer (the bisection unit of
    `recompute_plan`). The order is greedy by recompute seconds per byte freed, counting for
    the first node of a layer the layer's own cost of being checkpointed at all (the nodes
    that are not saveable run again too): cheap, large activations first (norms, pointwise
    activations), attention later, GEMMs last; ties by that class, then layer order. Layers
    with nothing saveable come last, whole. A plan recomputes a prefix of the flattened
    ladder, so a smaller budget never recomputes less (`ladder_choices`)."""
    cands = chain.candidates
    nodes = chain.gc.nodes
    fixed = [max(0.0, s.full_s - sum(it.seconds for it in s.items)) for s in cands]
    on = [False] * len(cands)
    heap: list[tuple[bool, float, int, int, int, bool]] = []
    for si, s in enumerate(cands):
        for pos, it in enumerate(s.items):
            c = recompute_class(nodes[it.index].op)
            heap.append((c == 3, (it.seconds + fixed[si]) / max(it.nbytes, 1.0), c, si, pos, False))
    heapq.heapify(heap)
    done: set[tuple[int, int]] = set()
    flat: list[tuple[str, int]] = []
    while heap:
        _g, _k, _c, si, pos, was_on = heapq.heappop(heap)
        if (si, pos) in done or was_on != on[si]:
            continue  # a stale key: the layer was switched on since
        done.add((si, pos))
        flat.append((cands[si].name, cands[si].items[pos].index))
        if not on[si]:
            on[si] = True
            for p2, it in enumerate(cands[si].items):
                if (si, p2) not in done:
                    c = recompute_class(nodes[it.index].op)
                    heapq.heappush(heap, (c == 3, it.seconds / max(it.nbytes, 1.0), c, si, p2, True))
    step = max(1, len(cands))
    out = [flat[i:i + step] for i in range(0, len(flat), step)]
    whole = [(s.name, -1) for s in cands if not s.items and s.full_s > 0]  # only full or off: last
    return out + ([whole] if whole else [])


def ladder_choices(chain: ChainModel, steps: list[tuple[str, int]]) -> Choices:
    """The choices that recompute exactly `steps` (a prefix of the flattened ladder): a layer
    with none of them is off; one with some keeps its other saveable nodes (all of them
    recomputed: full)."""
    out: Choices = {s.name: None for s in chain.candidates}
    gone: dict[str, set[int]] = {}
    for name, idx in steps:
        gone.setdefault(name, set()).add(idx)
    for s in chain.candidates:
        if s.name in gone:
            out[s.name] = frozenset(it.index for it in s.items if it.index not in gone[s.name] and -1 not in gone[s.name])
    return out


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
