"""The step time of a pipeline plan (pp > 1): one implementation for `cost.estimate` and the
joint planner (`search.plan_cost`).

Given per-stage forward and backward seconds of one micro-batch and the point-to-point time of
every stage boundary:

  stage_run_nodes       the nodes a stage runs, as `passes.split_pipeline` builds it: its
                        input-dependent nodes and every input-free node (from parameters,
                        buffers or sizes only: a rotary table, a causal mask) they read,
                        wherever it sits; each stage that reads one computes its own copy (a
                        stage's F and B sum these nodes' seconds, in estimate and planner);
  boundary_bytes        what each stage boundary carries, as the split sends it: every input-
                        dependent tensor made before it (a graph input included) and read after
                        it, at its own size (a view: its elements, sent contiguous, not its
                        base's storage), relayed by every stage it passes;

  stretch_stage_times   the compute beside the pipeline's own transfers runs (1 + k) times
                        slower, k the pp link's contention (`cost.overlap.slowdown`): per
                        micro-batch 2 x (hop in + hop out), taken as overlapping the stage's
                        compute one after another (an upper estimate where sends and receives
                        run at once);
  simulate_ranks        the schedule's dry run (`runtime.schedules.simulate`, through
                        `cost.schedule`): when each rank's last action ends, its busy time, the
                        bubble fraction, and per stage the window of the action that makes its
                        last gradients (its last B or W: the one `runtime.pipeline` runs out of
                        no_sync); ValueError when the schedule deadlocks;
  dp_sync               a rank's data-parallel gradient synchronisation (ZeRO 0/1 all-reduce, 2
                        reduce-scatter), stage by stage as the runtime's per-stage engines run
                        it: each stage's buckets (the runtime's caps) issued as its last
                        gradient action makes them, so an interleaved rank's earlier virtual
                        stages reduce beside its later actions; one stream per rank, the
                        compute beside it slowed by the link's contention; ZeRO 1/2's parameter
                        all-gather after the step;
                        ZeRO 3: counted, its exposure is `stage_zero3`'s), over "pieces" in
                        forward order (the planner's pipeline units, estimate's nodes) with
                        their backward seconds, gradient and gather payloads;
  buckets               payloads in forward order, reversed, in buckets of the runtime's caps;
  stage_zero3           ZeRO 3 inside one stage, as its engine runs it (`runtime.zero_stage3` under
                        `runtime.pipeline`): every micro-batch's forward gathers the stage's units
                        (prefetched one ahead), its backward re-gathers the saved ones, and only
                        the stage's last backward of the step reduce-scatters (the others run under
                        no_sync); `cost.zero_comm.zero3_walk` over the stage graph's own units.
                        Per micro-batch the walk's forward and no_sync backward exposure lengthen
                        the stage's F and B; the last backward's extra (its reduce-scatters, which
                        `finish_backward` waits for after the schedule) is added after the rank's
                        last action for its last-finishing stage;
  recompute             a stage holding checkpoint regions recomputes their forward in every
                        backward: `StageMemory.recompute_s` (`pipeline_memory.stage_walk`, the
                        `cost.timeline` walk) on its B, in estimate and in the planner alike;
  add_stage_terms       those per-stage additions, and the tensor-parallel conversions a stage runs
                        per micro-batch (`cost.tp_conversions`, half to F and half to B, as the
                        planner's tables split them), on F and B before the stretch.

The step is then the slowest rank's: its last action's end + its exposed sync + the gather
after the step + its optimizer step.

Pure functions of numbers: reads no node.meta. Deterministic.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Mapping, Sequence

import dataclasses

from .graph import GraphCost
from .overlap import CommStream, contention_of, slowdown
from .pipeline_memory import dependence, held_states
from .schedule import Kind, Schedule, simulate
from .symbolic import evaluate
from .zero_comm import zero3_events, zero3_walk

__all__ = ["AlgorithmLink", "add_stage_terms", "boundary_bytes", "buckets", "dp_sync", "estimate_pipeline_step",
           "pipeline_step", "rank_pieces", "simulate_ranks", "stage_run_nodes", "stage_zero3", "stretch_stage_times",
           "zero3_tail"]


def stage_run_nodes(gc: GraphCost, lo: int, hi: int) -> list[int]:
    """Indices (in graph order) of the nodes a pipeline stage holding nodes [lo, hi) of `gc` runs:
    its input-dependent nodes and the input-free nodes they read, wherever those sit (see the
    module docstring). An input-free node in [lo, hi) that no input-dependent node reads stays
    with it (nothing else would run it)."""
    dep, feeds = dependence(gc)[:2]
    pos = {n.index: i for i, n in enumerate(gc.nodes)}
    run: set[int] = set()
    read_free: set[int] = set()
    for n in gc.nodes[lo:hi]:
        if dep[pos[n.index]]:
            run.add(n.index)
            read_free |= feeds[pos[n.index]]
    for n in gc.nodes[lo:hi]:  # input-free nodes of the range that no stage's node reads
        if not dep[pos[n.index]] and not _read_anywhere(gc, n.index):
            run.add(n.index)
    return sorted(run | read_free, key=pos.__getitem__)


def boundary_bytes(gc: GraphCost, starts: Sequence[int], values, divisor) -> list[float]:
    """Bytes per rank each boundary carries (see the module docstring): `starts[s]`, the graph
    position where stage s + 1 begins; `divisor`: per storage key, how many ranks share it
    (tensor-parallel layouts: a rank sends its shard)."""
    dep, _feeds = dependence(gc)[:2]
    pos = {n.name: i for i, n in enumerate(gc.nodes)}
    made: dict[int, tuple] = {}  # id -> (tensor, its producer's position (-1: a graph input), last reader)
    for i, n in enumerate(gc.nodes):
        for t in n.reads:
            if t.is_state:
                continue
            p = pos.get(t.node, -1)
            if p >= 0 and not dep[p]:
                continue  # input-free: each stage that reads it computes its own copy
            got = made.get(id(t))
            made[id(t)] = (t, p, i) if got is None else (t, p, max(got[2], i))
    diff = [0.0] * (len(starts) + 1)  # boundaries s with p < starts[s] <= last: a run of them
    for t, p, last in made.values():
        lo, hi = bisect.bisect_right(starts, p), bisect.bisect_right(starts, last)
        if lo < hi:
            nb = float(evaluate(t.nbytes, values)) / divisor.get(t.key, 1)
            diff[lo] += nb
            diff[hi] -= nb
    return list(itertools.accumulate(diff[:-1]))


def _read_anywhere(gc: GraphCost, index: int) -> bool:
    """Whether an input-dependent node of `gc` reads input-free node `index` (cached)."""
    hit = gc.__dict__.get("_autopar_free_read")
    if hit is None:
        dep, feeds = dependence(gc)[:2]
        hit = gc.__dict__["_autopar_free_read"] = set().union(*(f for d, f in zip(dep, feeds) if d))
    return index in hit


def stage_zero3(g: GraphCost, fwd_t, bwd_t, gather, rs, time_of, k: float) -> tuple[float, float, float]:
    """(forward, no_sync backward, the last backward's extra) seconds ZeRO 3 adds to one
    micro-batch of pipeline stage graph `g` (`pipeline_memory.stage_graph`; see the module
    docstring). `fwd_t`, `bwd_t`: per node of the whole graph (global indices), without ZeRO;
    `gather`, `rs`: per ZeRO-3 unit its payloads (`zero_comm.zero3_payloads`); `time_of(op,
    payload)`: seconds on the data axis; `k`: its contention. Each parameter counts as read at
    the stage's first node that reads it (itself or through input-free computation)."""
    lo = g.nodes[0].index
    held = held_states(g)
    params = []
    for p in g.params:
        at = next((i for i, h in enumerate(held) if p.key is not None and p.key in h), None)
        if at is None:
            at = p.first_use - lo if lo <= p.first_use < lo + len(g.nodes) else len(g.nodes)
        params.append(dataclasses.replace(p, first_use=at))
    local = dataclasses.replace(g, nodes=[dataclasses.replace(n, index=i) for i, n in enumerate(g.nodes)],
                                params=params)
    ev = zero3_events(local)
    if not ev.starts:
        return 0.0, 0.0, 0.0
    seg_f, seg_b, pre_f, pre_b = ev.segments([fwd_t[n.index] for n in g.nodes], [bwd_t[n.index] for n in g.nodes])
    w = zero3_walk(ev, seg_f, seg_b, pre_f, pre_b, gather, rs, time_of, k)
    return w.fwd, w.bwd_accum, w.bwd - w.bwd_accum


def add_stage_terms(F_s: list[float], B_s: list[float], tp_s: Sequence[float] | None,
                    z3: Sequence[tuple[float, float, float]] | None) -> None:
    """Add (in place) each stage's tensor-parallel conversions per micro-batch (`tp_s`, half to
    F, half to B) and ZeRO 3's per micro-batch exposure (`z3[s]` from `stage_zero3`)."""
    for s in range(len(F_s)):
        if tp_s is not None:
            F_s[s] += tp_s[s] / 2
            B_s[s] += tp_s[s] / 2
        if z3 is not None:
            F_s[s] += z3[s][0]
            B_s[s] += z3[s][1]


def zero3_tail(mine: Sequence[int], z3: Sequence[tuple[float, float, float]] | None) -> float:
    """The last backward's extra ZeRO-3 seconds of a rank's last-finishing stage (its lowest):
    its reduce-scatters' exposure, waited for after the schedule."""
    return z3[min(mine)][2] if z3 is not None and mine else 0.0


def stretch_stage_times(F_s: list[float], B_s: list[float], hops: Sequence[float], k: float) -> None:
    """Stretch per-stage F and B (in place) by the pipeline transfers beside them (see the
    module docstring); `hops[s]`: seconds of the boundary after stage s."""
    S = len(F_s)
    if S < 2 or k <= 0:
        return
    for s in range(S):
        busy = 2 * ((hops[s - 1] if s > 0 else 0.0) + (hops[s] if s < S - 1 else 0.0))
        w = F_s[s] + B_s[s]
        extra = slowdown(w, busy, k)
        if extra > 0:
            F_s[s], B_s[s] = F_s[s] + extra * F_s[s] / w, B_s[s] + extra * B_s[s] / w


def simulate_ranks(sched: Schedule, F_s: Sequence[float], B_s: Sequence[float], p2p: Sequence[float],
                   what: str = "plan") -> tuple[list[float], list[float], float, dict[int, tuple[float, float]]]:
    """(end of each rank's last action, each rank's busy seconds, bubble fraction, per stage the
    (start, end) of its last B or W: the action whose gradients its engine reduces) of one step."""
    sim = simulate(sched, f=list(F_s), b=list(B_s), p2p=list(p2p))
    if not sim.ok:
        raise ValueError(f"{what}: the schedule deadlocks in simulation: {sim.summary()}")
    windows: dict[int, tuple[float, float]] = {}
    for tl in sim.timelines:
        for t in tl:
            if t.action.kind in (Kind.B, Kind.W):
                windows[t.action.stage] = (t.start, t.end)
    return [tl[-1].end if tl else 0.0 for tl in sim.timelines], list(sim.busy), float(sim.bubble_fraction), windows


def dp_sync(mine: Sequence[int], starts: Sequence[int], ends: Sequence[int], B_s: Sequence[float],
            B_u: Sequence[float], end_r: float, grad_payload: Sequence[float], gather: Sequence[float], dp_link,
            z: int, replicas: int, micro: int, bucket_bytes: tuple[float, float],
            windows: Mapping[int, tuple[float, float]] | None = None) -> tuple[float, float, float, float]:
    """(exposed, after the step, time, bytes sent) of a rank's gradient sync (its stages
    `mine`, stage s = pieces starts[s]..ends[s], its last action ending at `end_r`), on the
    data-parallel link. `windows[s]`: (start, end) of stage s's last gradient action
    (`simulate_ranks`); its pieces' gradients are ready as that action goes through them in
    backward order (their B_u, scaled to the action's length: a W makes them in half a B).
    Without `windows`, the rank's last stage's last backward ends at `end_r`, and its other
    stages' gradients are ready when that backward starts."""
    if replicas < 2 or dp_link is None:
        return 0.0, 0.0, 0.0, 0.0
    if z == 3:
        t = b = 0.0
        for s in mine:
            for x in range(starts[s], ends[s]):
                if gather[x] > 0:
                    t += micro * (2 * dp_link.time("all_gather", float(gather[x]))
                                  + dp_link.time("reduce_scatter", float(grad_payload[x])))
                    b += micro * (2 * dp_link.bytes_sent("all_gather", float(gather[x]))
                                  + dp_link.bytes_sent("reduce_scatter", float(grad_payload[x])))
        return 0.0, 0.0, t, b
    op = "all_reduce" if z < 2 else "reduce_scatter"
    if windows is None:
        last = min(mine)  # the rank's stage whose backward ends last (the lowest)
        windows = {s: (end_r - B_s[last], end_r - B_s[last] if s != last else end_r) for s in mine}
    runs = []  # each stage's engine fills its own buckets, in its backward order
    for s in mine:
        a, b = windows[s]
        scale = (b - a) / B_s[s] if B_s[s] > 0 else 0.0
        ready, ready_at = a, []
        for x in range(ends[s] - 1, starts[s] - 1, -1):
            ready += B_u[x] * scale
            ready_at.append((ready, float(grad_payload[x]), float(gather[x])))
        runs += list(buckets(ready_at, bucket_bytes))
    runs.sort(key=lambda r: r[0])
    t0 = min(windows[s][0] for s in mine)
    stream = CommStream(contention_of(dp_link), free=t0)
    t_c = w_c = t0  # the compute's wall time, and the work done by then (as a full-speed time)
    after, t_all, b_all = 0.0, 0.0, 0.0
    for when, payload, gpay, n in runs:
        if when > w_c:
            t_c = stream.run(t_c, when - w_c) if stream.k > 0 else when
            w_c = when
        d = dp_link.time(op, payload)
        stream.issue(t_c, n * d)  # n equal buckets ready together go one after another
        t_all += n * d
        b_all += n * dp_link.bytes_sent(op, payload)
        if z >= 1 and gpay > 0:
            g = n * dp_link.time("all_gather", gpay)
            after += g
            t_all += g
            b_all += n * dp_link.bytes_sent("all_gather", gpay)
    end_c = stream.run(t_c, end_r - w_c) if stream.k > 0 else end_r  # the backward's end, slowed
    return max(0.0, stream.free - end_c) + (end_c - end_r), after, t_all, b_all


def buckets(ready: list[tuple[float, float, float]], caps: tuple[float, float]):
    """Gradients (ready, sync, gather payloads) in buckets of caps[0] bytes, then caps[1];
    yields (ready, payload, gather payload, count): `count` equal buckets in a row, as one run."""
    cap = caps[0]
    cur_t, cur_p, cur_g = 0.0, 0.0, 0.0
    for when, p, g in ready:
        if p <= 0:
            continue
        while p > 0:
            if cur_p == 0 and cap == caps[1] and p >= 2 * cap:  # whole buckets of this piece, as one run
                n = int(p // cap) - 1  # the last whole one goes through the general path below
                share = g * (cap / p)
                yield when, cap, share, n
                p -= n * cap
                g -= n * share
                continue
            room = cap - cur_p
            take = min(p, room) if cur_p > 0 or p <= cap else cap
            frac = take / p
            cur_p += take
            cur_g += g * frac
            cur_t = when
            p -= take
            g -= g * frac
            if cur_p >= cap * (1 - 1e-12):
                yield cur_t, cur_p, cur_g, 1
                cur_p = cur_g = 0.0
                cap = caps[1]
    if cur_p > 0:
        yield cur_t, cur_p, cur_g, 1


def rank_pieces(graphs, lo_of: Sequence[int], held, payload_of, gather_of) -> tuple[list[float], list[float]]:
    """Per node of the stage graphs `graphs` (nodes lo_of[s] .. in graph order): the gradient
    sync and gather payloads of the trainable parameters each stage holds, at the first node
    of the stage that reads each (`held[node]`: the states a node reads, itself or through
    input-free computation); for `dp_sync` over nodes."""
    pay: list[float] = []
    gat: list[float] = []
    for g, lo in zip(graphs, lo_of):
        n_nodes = len(g.nodes)
        p_s, g_s = [0.0] * n_nodes, [0.0] * n_nodes
        for p in g.params:
            if not p.requires_grad or p.is_buffer:
                continue
            at = next((i for i in range(n_nodes) if p.key in held[lo + i]), 0)
            p_s[at] += payload_of(p)
            g_s[at] += gather_of(p)
        pay += p_s
        gat += g_s
    return pay, gat


def pipeline_step(sched: Schedule, F_s: list[float], B_s: list[float], p2p: Sequence[float], k_pp: float,
                  rank_tail, what: str = "plan") -> tuple[float, list[float], list[float], float]:
    """(step, each rank's end, busy seconds, bubble): the stages' F and B stretched by the
    transfers beside them, the schedule simulated, then per rank its end + `rank_tail(r, end,
    windows)` (its exposed sync, the gather after the step, its optimizer step; `windows`: per
    stage its last gradient action, `simulate_ranks`); the slowest rank's."""
    stretch_stage_times(F_s, B_s, p2p, k_pp)
    ends_r, busy, bubble, windows = simulate_ranks(sched, F_s, B_s, p2p, what)
    return max(e + rank_tail(r, e, windows) for r, e in enumerate(ends_r)), ends_r, busy, bubble


class AlgorithmLink:
    """An axis link whose collectives take one algorithm ("auto": the faster of ring and tree, as
    `cost.estimate` prices data parallelism and the planner's `MemoLink` does)."""

    def __init__(self, al, algorithm: str):
        self.al, self.algorithm = al, algorithm
        self.axis, self.size, self.contention = al.axis, al.size, getattr(al, "contention", 0.0)

    def time(self, op: str, nbytes: float) -> float:
        return self.al.time(op, nbytes, self.algorithm)

    def bytes_sent(self, op: str, nbytes: float) -> float:
        return self.al.bytes_sent(op, nbytes, self.algorithm)


def estimate_pipeline_step(gc, sched: Schedule, graphs, mems, fwd_t, bwd_t, values, mem_div, links: dict,
                           dp_axis: str | None, zero: int, dp: int, n_micro: int, caps: tuple[float, float],
                           payload_of, gather_of, mem_speed: float, tp_node: dict[int, float] | None = None,
                           zero3_units: tuple | None = None, algorithm: str = "auto"
                           ) -> tuple[float, list[float], float, float]:
    """`cost.estimate`'s step of a pipeline: (step, per-stage F + B, bubble, the slowest rank's
    optimizer step). Stage s runs its nodes' forward and backward seconds (`fwd_t`, `bwd_t`,
    tensor-parallel collectives in the graph included); its boundary sends what later stages
    read of it (the stage graph's outputs, tp-local bytes) over the pp link; each rank syncs
    its stages' gradients per node (`rank_pieces`, `dp_sync`) and steps its optimizer on its
    stages' states (`mems[s].opt_bytes` at `mem_speed` bytes/s); a stage's B includes what its
    checkpoint regions recompute (`mems[s].recompute_s`, `pipeline_memory.stage_walk`). `tp_node`: per node the
    tensor-parallel conversions it consumes per micro-batch (`cost.tp_conversions.node_tp_seconds`);
    `zero3_units`: (gather, reduce-scatter payloads per unit) under ZeRO 3 with dp > 1, walked
    per stage (`stage_zero3`); `algorithm`: the data-parallel collectives' (estimate's)."""
    pos = {n.index: i for i, n in enumerate(gc.nodes)}
    runs = [stage_run_nodes(gc, pos[g.nodes[0].index], pos[g.nodes[-1].index] + 1) for g in graphs]
    F_s = [float(sum(fwd_t[k] for k in run)) for run in runs]
    # a stage's checkpoint regions recompute their forward in its backward, every micro-batch
    B_s = [float(sum(bwd_t[k] for k in run)) + mems[s].recompute_s for s, run in enumerate(runs)]
    pp_link, dp_link = links.get("pp"), links.get(dp_axis) if dp_axis and dp > 1 else None
    if dp_link is not None:
        dp_link = AlgorithmLink(dp_link, algorithm)
    z3 = None
    if zero == 3 and dp_link is not None and zero3_units is not None:
        z3 = [stage_zero3(g, fwd_t, bwd_t, zero3_units[0], zero3_units[1], dp_link.time, contention_of(dp_link))
              for g in graphs]
    tp_s = [sum(tp_node.get(k, 0.0) for k in run) for run in runs] if tp_node else None
    add_stage_terms(F_s, B_s, tp_s, z3)
    sent = boundary_bytes(gc, [pos[g.nodes[0].index] for g in graphs[1:]], values, mem_div)
    p2p = [pp_link.time("send_recv", b) if pp_link is not None and b > 0 else 0.0 for b in sent]
    tp_b = tp_node or {}  # a conversion's backward half with its consumer's (as the planner's units)
    B_u = [float(bwd_t[n.index]) + tp_b.get(n.index, 0.0) / 2 for g in graphs for n in g.nodes]
    starts, at = [], 0
    for g in graphs:
        starts.append(at)
        at += len(g.nodes)
    ends = starts[1:] + [at]
    pay, gat = rank_pieces(graphs, [g.nodes[0].index for g in graphs], held_states(gc), payload_of, gather_of)
    opt_r = [sum(mems[s].opt_bytes for s in sched.stages_of(r)) / mem_speed for r in range(sched.n_ranks)]

    def tail(r: int, end: float, windows) -> float:
        exposed, after, _t, _b = dp_sync(sched.stages_of(r), starts, ends, B_s, B_u, end, pay, gat, dp_link, zero, dp,
                                         n_micro, caps, windows)
        return exposed + after + zero3_tail(sched.stages_of(r), z3) + opt_r[r]

    step, _ends, _busy, bubble = pipeline_step(sched, F_s, B_s, p2p, contention_of(pp_link), tail, "estimate")
    return step, [f + b for f, b in zip(F_s, B_s)], bubble, max(opt_r)
