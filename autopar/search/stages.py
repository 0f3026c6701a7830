"""Pipeline stage search: where to cut a model into stages, by dynamic programming.

The graph is a chain of units (`passes.split_pipeline.pipeline_units`: `tok_emb`,
`layers.0` ... `layers.79`, `norm`, `lm_head`; cuts fall only on these module edges). Each
unit is costed once (`search.stage_costs`) with `autopar.cost` (`analyze` + `estimate`, which cost identical layers
once): forward and backward seconds per micro-batch, bytes saved for backward, the model
states of the parameters it reads (parameters, gradients, fp32 masters and optimizer state
under the plan's ZeRO stage and dp degree; a parameter read by two units, such as a tied
embedding, is counted on every stage that reads it), and the bytes that cross each unit
boundary (every tensor made before it and read after it).

For S stages (pipeline ranks x virtual stages per rank) the search solves, exactly:

    minimise   max over stages s of  T_s = F_s + B_s + p2p(in_s) + p2p(out_s)
    subject to M_s <= memory_limit / v                                           for every stage
      M_s = states_s + max(k_s * (saved_s + in_s + held_s) + bwd0_s,  buckets_s + in_s,  update_s)
               every pinned unit starts a stage; every stage holds at least one unit

(held_s: the outputs a stage keeps until their backward, on the last stage the logits and the
loss's saved log-softmax; bwd0_s: the received output gradient, on the last stage the loss
backward's; buckets_s: the flat gradient buckets below ZeRO-3 with dp; update_s: the optimizer
update's temporary: the phases `cost.estimate` walks, see `cost.memory.CROSS_ENTROPY`),
where F/B are the stage's forward/backward seconds per micro-batch, p2p(x) the time of one
point-to-point transfer of x bytes on the pp axis's link (0 between stages on one rank),
k_s the most micro-batches whose activations stage s holds at once under the schedule
(counted from its action lists: F adds one, B or W releases it), and v the stages per rank
(with v > 1 each stage gets 1/v of the device: a sufficient condition for the rank's sum).
A first DP over (stage, last unit) finds the optimal bottleneck T*; a second DP, among the
splits whose stages all stay within T*, minimises the sum of T_s^2 (balance), both
O(S L^2). The chosen split is then dry-run by `cost.schedule.simulate` with the
per-stage times for the predicted step time and bubble, and its exact per-rank memory is
taken from the schedule's timeline (autopar/build/pipeline.py then reports `cost.estimate`'s
walk of the chosen split where it models the schedule: 7 % under to 10 % over it on gpt-tiny).
Not modelled: workspace and transient peaks inside a layer, recompute (`memory_limit` defaults
to 90 % of the device for that headroom).

Impossible requests raise ValueError with the numbers: more stages than units, pins that
are not units or too many, and memory no split fits (with the smallest achievable
per-stage peak).

It reads node.meta["autopar"] (through passes.split_pipeline) and what `autopar.cost`
reads; writes none. Deterministic: equal inputs give equal splits.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from autopar.cost import GraphCost, load_profile
from autopar.cost.memory import CROSS_ENTROPY, LossModel
from autopar.cost.comm import axis_links, collective_time
from autopar.passes.split_pipeline import brief_names
from autopar.search.stage_costs import Chain, LayerCost, count_chain, cross_bytes, layer_costs
from autopar.cost.schedule import Schedule, held_peaks, in_flight_per_stage, make_schedule, simulate

__all__ = ["LayerCost", "Chain", "StageSearch", "layer_costs", "count_chain", "best_split", "in_flight_per_stage",
           "search_stages", "n_virtual_for", "cross_bytes"]


# ------------------------------------------------------------------------ schedules
def n_virtual_for(schedule: str, n_stages: int | None = None, n_ranks: int | None = None) -> int:
    """Stages per rank a schedule runs: 2 for zbv, n_stages / n_ranks (default 2) for
    interleaved_1f1b, 1 otherwise."""
    key = schedule.lower().replace("-", "_")
    if key == "zbv":
        return 2
    if key == "interleaved_1f1b":
        if n_stages is not None and n_ranks:
            return max(1, n_stages // n_ranks)
        return 2
    return 1


# ------------------------------------------------------------------------ the DP
def best_split(n_units: int, n_stages: int, stage_time: Callable[[int, int, int], float],
               stage_memory: Callable[[int, int, int], float] | None = None,
               memory_limit: float | Sequence[float] | None = None, pins: Sequence[int] = ()
               ) -> tuple[list[int], float]:
    """Exact split of a chain of `n_units` into `n_stages` contiguous, non-empty stages.

    `stage_time(s, i, j)` / `stage_memory(s, i, j)`: cost of units [i, j) as stage s.
    Minimises the largest stage time, then (among splits within it) the sum of squared
    stage times. Stages start at every unit index in `pins`.

    Returns (starts, bottleneck): the first unit of every stage (starts[0] == 0).
    Raises ValueError when no split satisfies the memory limit (the message names the
    smallest achievable largest stage memory).
    """
    L, S = n_units, n_stages
    if S < 1:
        raise ValueError(f"need at least one stage, got {S}")
    if S > L:
        raise ValueError(f"{S} stages need at least {S} units to cut between, but the chain has {L}")
    pinset = sorted(set(pins))
    if any(not 0 < p < L for p in pinset):
        raise ValueError(f"pinned stage starts {pinset} must lie in 1..{L - 1}")
    if len(pinset) > S - 1:
        raise ValueError(f"{len(pinset)} pinned split points need at least {len(pinset) + 1} stages, got {S}")
    pin_prefix = [0] * (L + 1)
    for i in range(L):
        pin_prefix[i + 1] = pin_prefix[i] + (1 if i in pinset else 0)
    limits = [math.inf] * S
    if memory_limit is not None:
        limits = list(memory_limit) if isinstance(memory_limit, (list, tuple)) else [float(memory_limit)] * S

    def ok(s: int, i: int, j: int) -> bool:
        if pin_prefix[j] - pin_prefix[i + 1] > 0:  # a pin strictly inside (i, j)
            return False
        return stage_memory is None or stage_memory(s, i, j) <= limits[s]

    def solve(combine, score, bound: float | None):
        INF = math.inf
        best = [[INF] * (L + 1) for _ in range(S)]
        arg = [[-1] * (L + 1) for _ in range(S)]
        for s in range(S):
            lo_j, hi_j = s + 1, L - (S - 1 - s)
            for j in range(lo_j, hi_j + 1):
                i_range = [0] if s == 0 else range(s, j)
                for i in i_range:
                    prev = 0.0 if s == 0 else best[s - 1][i]
                    if prev == INF or not ok(s, i, j):
                        continue
                    t = stage_time(s, i, j)
                    if bound is not None and t > bound:
                        continue
                    v = combine(prev, score(t))
                    if v < best[s][j]:
                        best[s][j], arg[s][j] = v, i
        return best, arg

    b1, _ = solve(max, lambda t: t, None)
    opt = b1[S - 1][L]
    if opt == math.inf:
        raise ValueError(_memory_error(L, S, stage_memory, limits, ok_pins=lambda i, j: pin_prefix[j] - pin_prefix[i + 1] == 0))
    bound = opt * (1 + 1e-12) + 1e-300
    b2, arg = solve(lambda a, b: a + b, lambda t: t * t, bound)
    starts = [0] * S
    j = L
    for s in range(S - 1, -1, -1):
        i = arg[s][j]
        starts[s] = i
        j = i
    return starts, opt


def _memory_error(L, S, stage_memory, limits, ok_pins) -> str:
    """The smallest achievable largest stage memory (a min-max DP on memory alone)."""
    INF = math.inf
    best = [[INF] * (L + 1) for _ in range(S)]
    for s in range(S):
        for j in range(s + 1, L - (S - 1 - s) + 1):
            for i in ([0] if s == 0 else range(s, j)):
                prev = 0.0 if s == 0 else best[s - 1][i]
                if prev == INF or not ok_pins(i, j):
                    continue
                m = stage_memory(s, i, j) / limits[s] if stage_memory else 0.0
                best[s][j] = min(best[s][j], max(prev, m))
    ratio = best[S - 1][L]
    lim = min(limits)
    need = "no split at all (pins)" if ratio == INF else f"{_gib(ratio * lim)} on its fullest stage ({ratio:.3g}x)"
    return (f"no split of {L} units into {S} stages fits the memory limit of {_gib(lim)} per stage: "
            f"the best split needs {need}. Use more pipeline stages, "
            "a higher ZeRO stage or dp degree, fewer micro-batches in flight (a schedule such as 1f1b instead "
            "of gpipe), smaller micro-batches, or a larger memory_limit")


def _gib(b: float) -> str:
    return f"{b / 2**30:.3g} GiB" if b >= 2**27 else f"{b / 2**20:.3g} MiB" if b >= 2**17 else f"{b:.0f} B"


# ------------------------------------------------------------------------ the search
@dataclass
class StageSearch:
    """The chosen split and what it predicts (times in seconds, memory in bytes)."""

    split_points: list[str]
    stage_units: list[list[str]]
    stage_time_s: list[float]  # per stage, one micro-batch: forward + backward + transfers
    stage_memory: list[float]  # per stage: states + in-flight activations
    stage_fwd_s: list[float]  # per stage, one micro-batch
    stage_bwd_s: list[float]
    p2p_s: list[float]  # per boundary between stage s and s + 1: one transfer
    rank_memory: list[float]  # per pp rank: exact peak over the schedule's timeline
    bottleneck_s: float
    step_s: float  # simulated makespan of one step
    bubble: float
    schedule: str
    n_ranks: int
    n_virtual: int
    n_microbatches: int
    memory_limit: float
    in_flight: list[int]
    hardware: str
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def n_stages(self) -> int:
        return len(self.stage_units)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("seconds")
        d.pop("notes")
        return d


def search_stages(gm: fx.GraphModule | Chain, n_ranks: int, *, n_virtual: int = 1, schedule: str = "1f1b",
                  n_microbatches: int = 1, memory_limit: float | None = None, hardware: Any = "h100-sxm",
                  mesh: Mapping[str, int] | None = None, pins: Sequence[str] = (), microbatch: int | None = None,
                  zero_stage: int = 0, dp: int = 1, optimizer: Any = "adamw", master_dtype: Any = "auto",
                  gc: GraphCost | None = None, loss: LossModel = CROSS_ENTROPY) -> StageSearch:
    """Choose the split points of `gm` for `n_ranks` pipeline ranks x `n_virtual` stages each.

    Args:
        gm: the captured graph, or a `Chain` from `layer_costs` (to search again without costing).
        n_ranks: pipeline ranks (the mesh's pp size).
        n_virtual: stages per rank (2 for zbv; interleaved_1f1b's v).
        schedule: a `runtime.schedules` name ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv").
        n_microbatches: micro-batches per step.
        memory_limit: bytes per device (default: 90 % of the hardware's device memory).
        hardware: profile name or Hardware (times, memory, the pp link).
        mesh: the whole mesh ({"dp": 2, "pp": 4}) to decide whether pp neighbours share a node;
            default {"pp": n_ranks}.
        pins: unit names that must start a stage (a subset of the split points; the rest is searched).
        microbatch, zero_stage, dp, optimizer, master_dtype: see `layer_costs`.
        loss: what the loss adds on the last stage, in multiples of `chain.loss_bytes`
            (`cost.loss_memory.loss_model` of the plan: CROSS_ENTROPY, or VOCAB_PARALLEL).
    """
    t0 = time.perf_counter()
    hw = load_profile(hardware)
    if n_ranks < 1 or n_virtual < 1:
        raise ValueError(f"need n_ranks >= 1 and n_virtual >= 1, got {n_ranks}, {n_virtual}")
    chain = gm if isinstance(gm, Chain) else layer_costs(gm, hw, gc=gc, microbatch=microbatch, optimizer=optimizer,
                                                        zero_stage=zero_stage, dp=dp, master_dtype=master_dtype)
    layers = chain.layers
    L, S = len(layers), n_ranks * n_virtual
    names = [x.name for x in layers]
    if S > L:
        raise ValueError(f"{S} pipeline stages ({n_ranks} ranks x {n_virtual} per rank) need at least {S} units "
                         f"to cut between, but the model has {L}: {brief_names(names)}. Use fewer pipeline ranks or virtual "
                         "stages, or a model with more layers")
    index = {n: i for i, n in enumerate(names)}
    bad = [p for p in pins if p not in index]
    if bad:
        raise ValueError(f"pinned split points {bad} are not pipeline units; a stage can start at one of: "
                         f"{brief_names(names[1:])}")
    if any(index[p] == 0 for p in pins):
        raise ValueError(f"pinned split point {names[0]!r} is the first unit, where stage 0 starts anyway")
    if len(set(pins)) > S - 1:
        raise ValueError(f"{len(set(pins))} pinned split points {list(pins)} make at least {len(set(pins)) + 1} "
                         f"stages, but the pipeline has {S} ({n_ranks} ranks x {n_virtual})")
    sched = make_schedule(schedule, n_ranks, n_microbatches, n_virtual if n_virtual > 1 else None)
    if sched.n_stages != S:
        raise ValueError(f"schedule {schedule!r} runs {sched.n_stages} stages on {n_ranks} ranks, not {S}; "
                         f"use n_virtual={sched.n_stages // n_ranks}")
    s2r = sched.stage_to_rank
    k = in_flight_per_stage(sched)
    cap = float(hw.device.memory_bytes) * 0.9 if memory_limit is None else float(memory_limit)
    per_stage_limit = cap / n_virtual

    # the pp link
    mesh = dict(mesh or {"pp": n_ranks})
    world = math.prod(mesh.values())
    if world > hw.world_size:
        hw = hw.with_nodes(-(-world // hw.gpus_per_node))
    link = axis_links(hw, mesh).get("pp") if "pp" in mesh else None

    def p2p(nbytes: float) -> float:
        if link is None or nbytes <= 0:
            return 0.0
        return collective_time("send_recv", nbytes, 2, link.link, "ring", link.efficiency)

    # prefix sums; parameters read by several units are counted once per stage
    pf = [0.0]
    pa = [0.0]
    for x in layers:
        pf.append(pf[-1] + x.fwd_s + x.bwd_s)
        pa.append(pa[-1] + x.act_bytes)
    readers: dict[str, list[int]] = {}
    for i, x in enumerate(layers):
        for p in x.params:
            readers.setdefault(p, []).append(i)
    own = [0.0] * L
    shared: list[tuple[float, list[int]]] = []  # (bytes, prefix count of its readers)
    for p, us in readers.items():
        b = chain.state_bytes.get(p, 0.0)
        if len(us) == 1:
            own[us[0]] += b
        else:
            cnt = [0] * (L + 1)
            for i in range(L):
                cnt[i + 1] = cnt[i] + (1 if i in us else 0)
            shared.append((b, cnt))
    po = [0.0]
    for x in own:
        po.append(po[-1] + x)
    hop = [p2p(b) for b in chain.cross_bytes]

    def comm(s: int, i: int, j: int) -> float:
        c = 0.0
        if s > 0 and s2r[s - 1] != s2r[s]:
            c += hop[i - 1]
        if s < S - 1 and s2r[s + 1] != s2r[s]:
            c += hop[j - 1]
        return c

    def t_stage(s: int, i: int, j: int) -> float:
        return pf[j] - pf[i] + comm(s, i, j)

    def states(i: int, j: int) -> float:
        return po[j] - po[i] + sum(b for b, cnt in shared if cnt[j] > cnt[i])

    # gradient buckets: a parameter's on the first unit that reads it (a tied one, read on two
    # stages, is counted on the first only: a small under-count on the other)
    # and the optimizer update's temporary, likewise
    bk = [0.0] * (L + 1)
    sk = [0.0] * (L + 1)
    first: dict[int, float] = {}
    first_step: dict[int, float] = {}
    for p, us in readers.items():
        first[us[0]] = first.get(us[0], 0.0) + chain.bucket_bytes.get(p, 0.0)
        first_step[us[0]] = first_step.get(us[0], 0.0) + chain.step_bytes.get(p, 0.0)
    for i in range(L):
        bk[i + 1] = bk[i] + first.get(i, 0.0)
        sk[i + 1] = sk[i] + first_step.get(i, 0.0)

    def held_out(s: int, j: int) -> float:
        """What one in-flight micro-batch holds beyond its saved activations: a stage before the
        last keeps the outputs it sent until their backward; the last keeps the logits (`step`
        holds the outputs) and the loss's saved tensor (`loss`: CROSS_ENTROPY's log-softmax)."""
        if s < S - 1:
            return chain.cross_bytes[j - 1]
        return (1.0 + loss.saved) * chain.loss_bytes

    def at_backward(s: int, j: int) -> float:
        """Alive only while the stage's backward starts: the received gradient of its outputs (the
        last stage: the outputs' gradient and the loss backward's temporary)."""
        if s < S - 1:
            return chain.cross_bytes[j - 1]
        return (1.0 + loss.grad_temp) * chain.loss_bytes

    def m_stage(s: int, i: int, j: int) -> float:
        inb = chain.cross_bytes[i - 1] if s > 0 else 0.0
        act_s = k[s] * (pa[j] - pa[i] + inb + held_out(s, j)) + at_backward(s, j)
        return states(i, j) + max(act_s, bk[j] - bk[i] + inb, sk[j] - sk[i])

    starts, bottleneck = best_split(L, S, t_stage, m_stage, per_stage_limit, [index[p] for p in pins])
    ends = starts[1:] + [L]
    st_time = [t_stage(s, starts[s], ends[s]) for s in range(S)]
    st_mem = [m_stage(s, starts[s], ends[s]) for s in range(S)]
    fwd = [sum(x.fwd_s for x in layers[starts[s]:ends[s]]) for s in range(S)]
    bwd = [sum(x.bwd_s for x in layers[starts[s]:ends[s]]) for s in range(S)]
    p2p_s = [hop[starts[s + 1] - 1] for s in range(S - 1)]
    sim = simulate(sched, f=fwd, b=bwd, p2p=p2p_s)
    act = [(pa[ends[s]] - pa[starts[s]]) + (chain.cross_bytes[starts[s] - 1] if s else 0.0) + held_out(s, ends[s])
           for s in range(S)]
    rank_mem = _rank_memory(sched, [states(starts[s], ends[s]) for s in range(S)], act,
                            [at_backward(s, ends[s]) for s in range(S)],
                            [bk[ends[s]] - bk[starts[s]] + (chain.cross_bytes[starts[s] - 1] if s else 0.0)
                             for s in range(S)], [sk[ends[s]] - sk[starts[s]] for s in range(S)])
    notes = [f"pipeline split by DP over {L} units into {S} stages ({n_ranks} ranks x {n_virtual}): "
             f"starts at {[names[i] for i in starts[1:]]}; bottleneck stage {max(range(S), key=st_time.__getitem__)} "
             f"{bottleneck * 1e3:.3g} ms per micro-batch; {sched.name} with {n_microbatches} micro-batches "
             f"simulated at {sim.makespan * 1e3:.3g} ms per step (bubble {sim.bubble_fraction:.0%})"
             if sim.ok else "pipeline split chosen, but the schedule deadlocked in simulation"]
    if pins:
        notes.append(f"split points pinned by the user: {sorted(pins, key=index.__getitem__)}")
    return StageSearch(
        split_points=[names[i] for i in starts[1:]],
        stage_units=[names[starts[s]:ends[s]] for s in range(S)],
        stage_time_s=st_time, stage_memory=st_mem, stage_fwd_s=fwd, stage_bwd_s=bwd, p2p_s=p2p_s, rank_memory=rank_mem, bottleneck_s=bottleneck,
        step_s=float(sim.makespan or 0.0), bubble=float(sim.bubble_fraction or 0.0), schedule=sched.name,
        n_ranks=n_ranks, n_virtual=n_virtual, n_microbatches=n_microbatches, memory_limit=cap, in_flight=k,
        hardware=hw.name, seconds=time.perf_counter() - t0, notes=notes,
    )  # fmt: skip


def _rank_memory(sched: Schedule, states: list[float], act: list[float], at_bwd: list[float],
                 buckets: list[float], step: list[float]) -> list[float]:
    """Per rank: its stages' states plus the largest of: the most held activations along its
    actions with the largest backward-start temporary of its stages on top; its stages'
    gradient buckets with their inputs (the end of backward); the optimizer update's temporary
    (the three phases `cost.estimate` walks)."""
    out = []
    for r, held in enumerate(held_peaks(sched, act)):
        mine = sched.stages_of(r)
        out.append(sum(states[s] for s in mine) + max(held + max(at_bwd[s] for s in mine),
                                                      sum(buckets[s] for s in mine), sum(step[s] for s in mine)))
    return out
