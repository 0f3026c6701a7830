"""The joint planner's cost model: one candidate plan -> predicted step time and memory per rank.

A `Candidate` fixes the mesh (tp x pp x dp, x ep for MoE), the ZeRO stage, the number of
micro-batches and, with pp > 1, the pipeline schedule. `PlanCostModel.evaluate` predicts its
step time and the memory of every rank. The model is composed from `autopar.cost`'s parts,
each ingredient costed once and cached, so that a search over thousands of candidates on a
70B graph costs seconds:

  per tp degree t  the sharding ILP (`search.shard_ilp.solve_sharding`, identical layers solved
                   once) on the captured graph: every node's compute divisor and every
                   storage's memory divisor (`Plan.node_layouts`, applied as `cost.estimate`
                   applies them), the parameters' layouts, and the conversions the shard pass
                   will insert (one per producer, placement and partial gradient).
  per (t, b)       for every pipeline unit (`passes.split_pipeline.pipeline_units`: tok_emb,
                   layers.0 ... norm, lm_head) at b rows per micro-batch: forward and backward
                   seconds (cost.estimate's roofline timer, TP divisors applied), the tensor-
                   parallel conversions at b rows (blocking, half forward, half backward),
                   saved-activation bytes (TP-divided; each storage charged to the unit that
                   saves it first), FLOPs, the bytes crossing each unit boundary, and the
                   liveness walk's working set beyond the saved tensors (gradients of
                   activations, the logits ...; `cost.liveness`, exact at 1 row and at the
                   most rows, the chord in between: an overestimate, the peak being convex).
                   Identical blocks are costed once.
  per (t, z, d, e) model states per unit (`cost.model_states` with the TP layouts: params,
                   grads, fp32 master, optimizer, buffers; one parameter of each kind) under
                   ZeRO stage z over d ranks; expert parameters (`search.expert.detect_moe`)
                   divided over e expert-parallel ranks, whose all-to-alls and routed expert
                   compute come from `search.expert.ep_cost`.

For a candidate:
  stages   S = pp x v stages; an exact min-max DP over the unit boundaries (vectorised over
           (first, last) unit pairs; for long chains in many stages on a band of stage lengths,
           certified or redone in full), then among the splits within the optimal bottleneck
           the one with the least sum of squared stage times, as `search.stages.best_split`. A
           stage's time includes the recomputation it needs to fit its memory: whole blocks
           (`layers.N`) fully recomputed, as few as fit (the recompute budget per stage; blocks
           of one range are treated as alike in the DP, which is exact for a transformer's
           identical layers, and the final choice takes the blocks that free most memory per
           second of recomputation). With one stage per rank the stage's memory is the rank's
           (exact); with v per rank each stage gets 1/v of the device in the DP (sufficient),
           the recompute is then chosen per rank against the sum of its stages' in-flight
           activations, and the schedule walk below has the last word.
  time     pp = 1: m (F + B). pp > 1: the schedule's simulator (`runtime.schedules.simulate`)
           with per-stage F, B and point-to-point times. Then per rank: gradient
           synchronisation over dp per unit in backward order, overlapped with the last
           micro-batch's backward (ZeRO 0/1 all-reduce, 2 reduce-scatter, padded as the
           runtime pads); the ZeRO 1/2 parameter all-gather after the step (exposed); ZeRO 3
           per micro-batch: each unit gathered before its forward (prefetched one unit ahead)
           and again before its backward, its gradients reduce-scattered after it; expert
           all-to-alls (dispatch and combine, forward and backward, blocking); the optimizer
           step (memory bound, as cost.estimate). The step is the slowest rank's.
  memory   per rank: its stages' states (a parameter read on two stages counted on both) + the
           activations it holds at the schedule's worst point (F adds a micro-batch's saved
           bytes and its stage input, B/W release them) + the working set + communication
           buffers (ZeRO 0/1 the flat gradient copy, 2 its padded input and output, 3 two
           gathered units); or the optimizer step's peak (states + one temporary per
           optimizer state element), whichever is larger.

Bounds (`lower_bounds`, `optimistic_bounds` without the ILP, and a split's bound before its
schedule is simulated) never exceed these predictions; the planner prunes with them.

Simplifications (stated so that a reader can weigh predictions): times are per rank and the
same on every tp/dp rank; stage-boundary transfers send the whole activation (a sequence-
parallel boundary would send 1/t of it); the working set is the whole graph's, on every
stage; data parallel comm of virtual stages other than the rank's last is taken as ready when
the rank's last backward starts; every gradient is taken as allocated while activations peak
(one micro-batch: conservative by up to the gradients); ZeRO 3 regathers every unit every
micro-batch; recomputed blocks keep their input only (collective outputs inside a block,
which the recompute pass keeps, are not counted). `tests/unit/test_planner.py` checks the
pp = 1 predictions against `cost.estimate` for dp, ZeRO and tp plans.

It reads node.meta only through `cost.analyze`, `passes.ir` and the sharding rules; writes
nothing. Deterministic: equal inputs give equal numbers.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import sympy
import torch
import torch.fx as fx

from autopar.cost import analyze, evaluate, liveness, load_profile, model_states
from autopar.cost.comm import axis_links
from autopar.cost.estimate import _divisors, NodeTimer
from autopar.cost.graph import GraphCost
from autopar.cost.hardware import Hardware
from autopar.cost.memory import OptimizerSpec, padded_numel, rows_of, tp_local_shape
from autopar.passes.plan import Plan
from autopar.passes.rules.sharding import is_tensor, partial_grad, requires_grad_nodes, value_shape
from autopar.passes.split_pipeline import pipeline_units
from autopar.runtime.placement import Layout, Partial, Placement, Replicate, Shard
from autopar.runtime.schedules import Kind, make_schedule, simulate
from autopar.runtime.zero_shard import FIRST_BUCKET_MB

__all__ = ["Candidate", "Evaluation", "PlanCostModel", "ShardInfo", "SCHEDULE_VIRTUAL", "plain"]

INF = math.inf
_BLOCK = re.compile(r"(^|\.)\d+$")  # a unit named after a numbered module: layers.3
_EXPERT = re.compile(r"\.experts\.\d+\.")
SCHEDULE_VIRTUAL = {"1f1b": 1, "gpipe": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2}
CATEGORIES = ("params", "grads", "master", "optimizer", "buffers")


# ------------------------------------------------------------------------ candidates
@dataclass(frozen=True, order=True)
class Candidate:
    """The discrete choices of a plan (the continuous ones — sharding of every node, split
    points, recompute — are solved inside `PlanCostModel.evaluate`)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    zero: int = 0
    micro: int = 1  # micro-batches per step
    schedule: str = "none"  # pipeline schedule ("none" when pp == 1)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.ep

    @property
    def virtual(self) -> int:
        return SCHEDULE_VIRTUAL.get(self.schedule, 1) if self.pp > 1 else 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def mesh(self) -> dict[str, int]:
        """Mesh axes of size > 1 in autopar's canonical order (pp outermost, tp innermost, so
        that tp groups stay inside a node); {"dp": 1} for one device."""
        m = {a: s for a, s in (("pp", self.pp), ("dp", self.dp), ("ep", self.ep), ("tp", self.tp)) if s > 1}
        return m or {"dp": 1}

    def dims(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "zero_stage": self.zero,
                "n_microbatches": self.micro, "schedule": self.schedule}

    def label(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts.append(f"ZeRO-{self.zero}")
        parts.append(f"{self.micro} micro-batch{'es' if self.micro > 1 else ''}")
        if self.pp > 1:
            parts.append(self.schedule)
        return " ".join(parts)


@dataclass
class Evaluation:
    """What the cost model predicts for one candidate (seconds, bytes, per step)."""

    candidate: Candidate
    step_s: float
    peak_bytes: float  # the fullest rank's peak
    limit_bytes: float
    memory: dict[str, float]  # the fullest rank by category
    compute_s: float  # the busiest rank's forward + backward (+ recompute), all micro-batches
    bubble: float  # pipeline idle fraction (0 without a pipeline)
    recompute_s: float
    optimizer_s: float
    comm: dict[str, dict[str, float]]  # axis -> bytes_sent, time_s, exposed_s (per rank per step)
    flops: float  # model FLOPs per step on one rank (no recompute)
    mfu: float
    tokens_per_s: float
    rows_per_micro: int
    split_points: list[str] = field(default_factory=list)
    stage_units: list[list[str]] = field(default_factory=list)
    recompute: dict[str, str] = field(default_factory=dict)  # unit (module path) -> "full"
    rank_peaks: list[float] = field(default_factory=list)  # per pp rank
    notes: list[str] = field(default_factory=list)
    pruned: bool = False  # not simulated: its bound is over the cutoff it was given

    @property
    def feasible(self) -> bool:
        return self.peak_bytes <= self.limit_bytes * (1 + 1e-9)

    @property
    def shortfall(self) -> float:
        return max(0.0, self.peak_bytes - self.limit_bytes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (numpy numbers as Python ones)."""
        d = {k: v for k, v in self.__dict__.items() if k != "candidate"}
        d["candidate"] = self.candidate.dims()
        d["label"] = self.candidate.label()
        d["feasible"] = self.feasible
        return plain(d)


def plain(x: Any) -> Any:
    """`x` with numpy scalars and arrays turned into Python numbers and lists, tuples into
    lists: what json writes and reads back unchanged."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return [plain(v) for v in x.tolist()]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x)
    return x


@dataclass
class ShardInfo:
    """The sharding ILP's answer for one tp degree, in the forms the cost model uses."""

    tp: int
    solution: Any  # ShardSolution, or None for tp = 1
    param_placements: dict[str, Placement]
    node_placements: dict[str, Placement]
    strategies: dict[str, str]
    comp_div: dict[int, int]
    mem_div: dict[Any, int]
    conversions: list[tuple[int, Placement | None, Placement, bool, float, float]]  # unit, src, dst, pg, c0, c1
    sequence_parallel: bool = False
    summary: str = ""
    seconds: float = 0.0


@dataclass
class _Units:
    """Per-unit costs at one (tp, rows per micro-batch): arrays over the chain's units."""

    fwd: np.ndarray
    bwd: np.ndarray
    tp_comm: np.ndarray
    act: np.ndarray
    cross: np.ndarray  # len L - 1
    rc_save: np.ndarray
    rc_time: np.ndarray
    flops: np.ndarray
    tp_bytes: np.ndarray  # bytes one rank sends on tp per unit and micro-batch
    expert_f: np.ndarray  # the dense expert computation inside fwd / bwd (replaced under ep)
    expert_b: np.ndarray
    workspace: float | None = None


@dataclass
class _States:
    cat: dict[str, np.ndarray]  # per unit, its own parameters (read by that unit only)
    shared: list[tuple[dict[str, float], np.ndarray]]  # parameters read by several units: bytes, reader prefix
    grad_payload: np.ndarray  # per unit: gradient sync payload (all-reduce input / reduce-scatter input)
    gather: np.ndarray  # per unit: parameter all-gather payload (this rank's padded piece)
    adam_tmp: np.ndarray  # per unit: the optimizer step's temporary
    total: dict[str, float]  # every parameter once


class PlanCostModel:
    """The cost model of plans for one captured graph on one kind of hardware (see the module
    docstring). `world` is the mesh size the plans are for (it sets how many nodes the
    hardware has, hence which axes cross nodes).

    Args:
        gm: the captured global graph (batch dim dynamic, or static: then times and
            activations scale linearly with the rows of a micro-batch).
        hardware: profile name or Hardware.
        world: ranks of the mesh.
        global_batch: rows per step (default: the captured batch).
        optimizer, master_dtype: model-state accounting (`cost.model_states`).
        param_pins: parameter name -> tp placement for the sharding ILP.
        gc: `analyze(gm, hardware)` when already computed.
    """

    def __init__(self, gm: fx.GraphModule, hardware: Any, world: int, *, global_batch: int | None = None,
                 optimizer: Any = "adamw", master_dtype: Any = "auto", param_pins: Mapping[str, Placement] | None = None,
                 node_pins: Mapping[str, Placement] | None = None, gc: GraphCost | None = None,
                 bucket_mb: float = 25.0):
        hw = load_profile(hardware)
        self.base_hw = hw
        if world > hw.world_size:
            hw = hw.with_nodes(-(-world // hw.gpus_per_node))
        self.hw: Hardware = hw
        self.world = world
        self.gm = gm
        self.gc = gc if gc is not None else analyze(gm, self.base_hw)
        self.opt = OptimizerSpec.of(optimizer)
        half = {p.dtype for p in self.gc.params if p.requires_grad} & {torch.float16, torch.bfloat16}
        self.master_dtype = (torch.float32 if half else None) if master_dtype == "auto" else master_dtype
        self.param_pins = dict(param_pins or {})
        self.bucket_bytes = (min(FIRST_BUCKET_MB, bucket_mb) * 2**20, bucket_mb * 2**20)
        self.node_pins = dict(node_pins or {})
        self.symbolic_batch = any(str(k) == "b" for k in self.gc.values())
        self.captured_rows = self._captured_rows()
        self.global_batch = int(global_batch or self.captured_rows or 1)
        self.max_rows = self.global_batch  # rows of a micro-batch at most (dp = micro-batches = 1)
        self._chain()
        self._experts()
        dtypes = [n.cost.dtype for n in self.gc.nodes if n.cost.kind in ("matmul", "attention")]
        self.main_dtype = max(set(dtypes), key=dtypes.count) if dtypes else "fp32"
        self._shard: dict[int, ShardInfo] = {}
        self._units: dict[tuple, _Units] = {}
        self._states: dict[tuple, _States] = {}
        self._links: dict[tuple, dict] = {}
        self._scheds: dict[tuple, Any] = {}
        self._split_cache: dict[tuple, Any] = {}
        self.ilp_seconds = 0.0

    # ------------------------------------------------------------------ graph structure
    def _captured_rows(self) -> int | None:
        for k, v in self.gc.values().items():
            if str(k) == "b":
                return int(v)
        for n in self.gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], int):
                return int(v.shape[0])
        return None

    def tokens_per_row(self) -> tuple[float, str]:
        """Tokens in one row of the batch ("tokens") for a token model, else (1, "samples")."""
        for n in self.gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and isinstance(v, torch.Tensor):
                if not v.dtype.is_floating_point and v.dim() >= 2:
                    return float(math.prod(int(d) for d in v.shape[1:])), "tokens"
                return 1.0, "samples"
        return 1.0, "samples"

    def _chain(self) -> None:
        gm, gc = self.gm, self.gc
        units = pipeline_units(gm)
        self.unit_names = [u.name for u in units]
        L = self.L = len(units)
        unit_of = {name: i for i, u in enumerate(units) for name in u.nodes}
        by_name = {n.name: n for n in gm.graph.nodes}
        # a node outside every unit (input-free: a weight cast, a rotary table) is costed with
        # the first unit that reads it, as split_pipeline copies it there
        memo: dict[str, int] = {}

        def unit_for(name: str, depth: int = 0) -> int | None:
            if name in unit_of:
                return unit_of[name]
            if name in memo:
                return memo[name]
            n = by_name.get(name)
            if n is None or depth > 50:
                return None
            got = [unit_for(u.name, depth + 1) for u in n.users if u.op != "output"]
            got = [g for g in got if g is not None]
            memo[name] = min(got) if got else (L - 1 if any(u.op == "output" for u in n.users) else None)
            return memo[name]

        cur = 0
        self.node_unit: list[int] = []
        for nc in gc.nodes:
            u = unit_for(nc.name) if nc.name in by_name else None
            if u is None:
                u = cur  # a node inlined from a higher-order op: its caller's unit
            cur = u if nc.name in unit_of else cur
            self.node_unit.append(u)
        self.fx_unit = {n: (unit_for(n.name) if n.op != "output" else L - 1) for n in gm.graph.nodes}
        self.blocks = np.array([1.0 if _BLOCK.search(name) else 0.0 for name in self.unit_names])
        # parameters each unit reads, directly or through input-free computation
        key_name = {p.key: p.name for p in gc.params if p.key is not None}
        reads: list[set[str]] = [set() for _ in units]
        for nc, u in zip(gc.nodes, self.node_unit):
            for k in nc.uses:
                if k in key_name:
                    reads[u].add(key_name[k])
        readers: dict[str, list[int]] = {}
        for i, r in enumerate(reads):
            for p in r:
                readers.setdefault(p, []).append(i)
        for p in gc.params:
            readers.setdefault(p.name, [0])  # held even if no unit reads it
        self.readers = readers
        # boundary bytes as c0 + c1 * rows (the activations crossing are linear in the batch)
        from autopar.search.stages import _cross_bytes  # noqa: PLC0415

        if self.symbolic_batch:
            one = np.array(_cross_bytes(gm, gc, units, {"b": 1}, 1.0))
            two = np.array(_cross_bytes(gm, gc, units, {"b": 2}, 1.0))
            self.cross_c1 = two - one
            self.cross_c0 = one - self.cross_c1
        else:
            rows = self.captured_rows or 1
            self.cross_c0 = np.zeros(max(L - 1, 0))
            self.cross_c1 = np.array(_cross_bytes(gm, gc, units, {}, 1.0)) / rows
        self.rg = requires_grad_nodes(gm)

    def _experts(self) -> None:
        """MoE blocks (`search.expert.detect_moe` when that module is there): expert parameters,
        the units holding blocks, and what an expert-parallel degree costs (`ep_cost`)."""
        self.moe_blocks: list = []
        try:
            from autopar.search.expert import detect_moe  # noqa: PLC0415

            self.moe_blocks = detect_moe(self.gm)
        except Exception:  # noqa: BLE001 - no detector, or a block it cannot take apart: no expert parallelism
            self.moe_blocks = []
        self.expert_params = {n for b in self.moe_blocks for n in b.expert_params}
        self.n_experts = math.gcd(*[b.n_experts for b in self.moe_blocks]) if self.moe_blocks else 0
        self.moe_units = np.zeros(self.L)
        for n in self.expert_params:
            for u in self.readers.get(n, []):
                self.moe_units[u] = 1.0
        # the expert computation of the captured graph (which the expert pass replaces by the
        # routed rows only): nodes under an `experts` module
        self.expert_node = [".experts." in f".{nc.module}." for nc in self.gc.nodes]

    @property
    def has_moe(self) -> bool:
        return self.n_experts > 1

    def links(self, c: Candidate) -> dict:
        mesh = c.mesh()
        key = tuple(mesh.items())
        hit = self._links.get(key)
        if hit is None:
            hit = self._links[key] = {a: _MemoLink(al) for a, al in axis_links(self.hw, mesh).items()}
        return hit

    # ------------------------------------------------------------------ sharding per tp degree
    def sharding(self, t: int) -> ShardInfo:
        """The sharding ILP's plan for tp = t (solved once per t; t = 1: everything replicated)."""
        hit = self._shard.get(t)
        if hit is not None:
            return hit
        if t == 1:
            info = ShardInfo(1, None, {}, {}, {}, {}, {}, [], summary="no tensor parallelism")
        else:
            from autopar.search.shard_ilp import solve_sharding  # noqa: PLC0415

            sol = solve_sharding(self.gm, "tp", t, mesh={"dp": max(self.world // t, 1), "tp": t},
                                 hardware=self.hw, param_pins=self.param_pins or None,
                                 node_pins=self.node_pins or None, gc=self.gc)
            self.ilp_seconds += sol.seconds
            nodes = {n: sol.keys[n] for n in sol.chosen}
            params = {str(n.target): s.out for n, s in sol.chosen.items()
                      if n.op == "get_attr" and s.out is not None and not isinstance(s.out, Replicate)}
            node_pl = {nodes[n]: s.out for n, s in sol.chosen.items()
                       if n.op == "call_function" and s.out is not None and not isinstance(s.out, Replicate)}
            plan = Plan(mesh={"tp": t}, dp_axis=None,
                        node_layouts={k: Layout.of({"tp": p}) for k, p in node_pl.items()})
            comp_div, mem_div = _divisors(self.gc, plan)
            convs, sp = self._conversions(sol, t)
            info = ShardInfo(t, sol, params, node_pl, sol.strategies(), comp_div, mem_div, convs, sp,
                             sol.summary(), sol.seconds)
        self._shard[t] = info
        return info

    def _conversions(self, sol, t: int):
        """The conversions the shard pass inserts for a solution, each once per (producer,
        target placement, partial gradient), charged to the first consumer's unit, with its
        payload as c0 + c1 * rows."""
        b_names = [str(orig) for orig, new in self.gc.symbols.rename.items() if str(new) == "b"]
        other = {str(orig): int(v) for orig, new in self.gc.symbols.rename.items()
                 for k, v in self.gc.values().items() if k == new and str(new) != "b"}
        from autopar.search.shard_ilp import _nbytes  # noqa: PLC0415

        def nbytes(a, rows):
            return _nbytes(a, {**other, **{s: rows for s in b_names}})

        seen: set = set()
        out = []
        ag_rs = 0
        ar = 0
        for v, s in sol.chosen.items():
            ins = [a for a in v.all_input_nodes if is_tensor(a)]
            for a, p in zip(ins, s.ins):
                if p is None or a not in sol.chosen:
                    continue
                pg = partial_grad(s, p, a, self.rg)
                key = (a, str(p), pg)
                if key in seen:
                    continue
                seen.add(key)
                src = sol.chosen[a].out
                if src == p and not (pg and isinstance(p, Replicate)):
                    continue
                if b_names:
                    one, two = nbytes(a, 1), nbytes(a, 2)
                    c1 = two - one
                    c0 = one - c1
                else:  # a static batch: a tensor whose dim 0 is the batch scales with it
                    shape = value_shape(a) or ()
                    rows0 = self.captured_rows or 1
                    full = nbytes(a, 0)
                    c0, c1 = (0.0, full / rows0) if shape and shape[0] == rows0 else (full, 0.0)
                unit = self.fx_unit.get(v)
                out.append((unit if unit is not None else 0, src, p, pg, float(c0), float(c1)))
                if isinstance(p, Shard) and isinstance(src, Replicate) or isinstance(src, Partial) and isinstance(p, Shard):
                    ag_rs += 1
                if isinstance(src, Partial) and isinstance(p, Replicate):
                    ar += 1
        return out, ag_rs > 0 and ag_rs >= ar

    # ------------------------------------------------------------------ per-unit tables
    def rows_per_micro(self, c: Candidate) -> int | None:
        per = c.dp * c.ep * c.micro
        if self.global_batch % per:
            return None
        return self.global_batch // per

    def units(self, t: int, rows: int) -> _Units:
        key = (t, rows)
        hit = self._units.get(key)
        if hit is not None:
            return hit
        gc, L = self.gc, self.L
        info = self.sharding(t)
        values = self._values(rows)
        scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
        timer = NodeTimer(self.hw, values)
        fwd, bwd, act, flops = np.zeros(L), np.zeros(L), np.zeros(L), np.zeros(L)
        ef, eb = np.zeros(L), np.zeros(L)
        memo: dict = {}

        def ev(x):  # identical layers repeat the same expressions: evaluate each once
            if not isinstance(x, sympy.Basic):
                return x
            r = memo.get(x)
            if r is None:
                r = memo[x] = evaluate(x, values)
            return r

        items, rep = self._unit_items(t)
        for u in range(L):
            r = rep[u]
            if r != u:  # an identical unit was costed already
                fwd[u], bwd[u], act[u], flops[u], ef[u], eb[u] = fwd[r], bwd[r], act[r], flops[r], ef[r], eb[r]
                continue
            for nc, d, is_exp, saved in items[u]:
                f, b = timer.node(nc, d)
                fwd[u] += f
                bwd[u] += b
                if is_exp:
                    ef[u] += f
                    eb[u] += b
                if nc.cost.kind not in ("none", "view", "comm"):
                    flops[u] += (ev(nc.cost.flops) + ev(nc.bwd_flops)) / d
                for nb, md in saved:
                    act[u] += ev(nb) / md
        fwd, bwd, act, flops, ef, eb = (x * scale for x in (fwd, bwd, act, flops, ef, eb))
        tpc = np.zeros(L)
        tp_bytes = np.zeros(L)
        if t > 1:
            from autopar.search.shard_ilp import conversion_time  # noqa: PLC0415

            link = axis_links(self.hw, {"dp": max(self.world // t, 1), "tp": t})["tp"]
            memo: dict = {}
            for unit, src, dst, pg, c0, c1 in info.conversions:
                nb = c0 + c1 * rows
                k2 = (src, dst, pg, nb)
                tm = memo.get(k2)
                if tm is None:
                    tm = memo[k2] = conversion_time(src, dst, pg, nb, link, t, self.hw.kernel_overhead_s)
                tpc[unit] += tm
                tp_bytes[unit] += _conversion_bytes(src, dst, pg, nb, t)
        cross = self.cross_c0 + self.cross_c1 * rows
        cross_in = np.concatenate([[0.0], cross])
        rc_save = np.where(self.blocks > 0, np.maximum(act - cross_in, 0.0), 0.0)
        rc_time = np.where(self.blocks > 0, fwd + tpc / 2, 0.0)
        out = _Units(fwd + tpc / 2, bwd + tpc / 2, tpc, act, cross, rc_save, rc_time, flops, tp_bytes, ef, eb)
        self._units[key] = out
        return out

    def _values(self, rows: int) -> dict[str, int]:
        """Symbol values with the batch at `rows`, keyed by name (cost.evaluate compares
        symbols by name, and a str key is much cheaper to name than a sympy Symbol)."""
        vals = self.gc.values({"b": rows}) if self.symbolic_batch else self.gc.values()
        return {str(k): v for k, v in vals.items()}

    def _unit_items(self, t: int):
        """Per unit its nodes with their compute divisor, expert flag and the saved storages it
        is charged for (each storage to the first node that saves it); and per unit the first
        unit with the same items (identical blocks are costed once)."""
        key = ("items", t)
        hit = self._split_cache.get(key)
        if hit is None:
            info, gc = self.sharding(t), self.gc
            items: list[list] = [[] for _ in range(self.L)]
            seen: set = set()
            for nc, u, is_exp in zip(gc.nodes, self.node_unit, self.expert_node):
                saved = []
                for k, nb, _tag in nc.saved:
                    if k in seen or gc._is_state(k):
                        continue
                    seen.add(k)
                    saved.append((nb, info.mem_div.get(k, 1)))
                items[u].append((nc, info.comp_div.get(nc.index, 1), is_exp, tuple(saved)))
            first: dict = {}
            rep = []
            for u, its in enumerate(items):
                sig = tuple((id(nc.cost), nc.bwd_flops, nc.has_grad_fn, tuple(nb for _k, nb, _t in nc.saved), d, e, sv)
                            for nc, d, e, sv in its)
                rep.append(first.setdefault(sig, u))
            hit = self._split_cache[key] = (items, rep)
        return hit

    def optimistic_units(self, t: int, rows: int) -> tuple[np.ndarray, ...]:
        """Per unit (forward, backward, their expert parts) seconds per micro-batch with every
        node's work divided by t: no sharding does better, and it needs no ILP."""
        key = ("optimistic", t, rows)
        hit = self._split_cache.get(key)
        if hit is not None:
            return hit
        values = self._values(rows)
        scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
        timer = NodeTimer(self.hw, values)
        L = self.L
        f_, b_, ef, eb = np.zeros(L), np.zeros(L), np.zeros(L), np.zeros(L)
        for nc, u, is_exp in zip(self.gc.nodes, self.node_unit, self.expert_node):
            f, b = timer.node(nc, t)
            f_[u] += f
            b_[u] += b
            if is_exp:
                ef[u] += f
                eb[u] += b
        hit = self._split_cache[key] = tuple(x * scale for x in (f_, b_, ef, eb))
        return hit

    def optimistic_bounds(self, c: Candidate, recompute: bool = True) -> tuple[float, float]:
        """`lower_bounds` without the sharding ILP: every node's work and every saved tensor
        divided by tp, the model states of tp = 1 divided by tp (padding aside, which the
        0.1 % slack covers)."""
        rows = self.rows_per_micro(c)
        f0, b0, ef, eb = self.optimistic_units(c.tp, rows)
        f, b = self._ep_adjusted(c, rows, f0, b0, ef, eb)
        st = self.states(1, c.zero, c.dp, c.ep)
        t = c.tp
        opt_tot = self._opt_time((st.total["master"] + st.total["optimizer"]) / t, st.total["params"] / t,
                                 st.total["grads"] / t, c)
        u1 = self.units(1, rows)
        act = self._act_floor(u1, t, recompute) + self._inputs_floor(c, u1)
        return self._time_bound(c, f, b, opt_tot, st, t), self._mem_bound(c, sum(st.total.values()) / t * (1 - 1e-3), act)

    def _inputs_floor(self, c: Candidate, u: _Units) -> float:
        """Every stage but the first keeps its input (the activation crossing its first
        boundary) for each micro-batch in flight: at least the smallest boundary each."""
        S = c.n_stages
        return (S - 1) * float(u.cross.min()) if S > 1 and len(u.cross) else 0.0

    def _act_floor(self, u: _Units, div: int, recompute: bool) -> float:
        """The least activation bytes one micro-batch keeps over all units: a recomputed block
        keeps its input only."""
        act = u.act / div
        if recompute:
            cross_in = np.concatenate([[0.0], u.cross])
            act = np.where(self.blocks > 0, np.minimum(act, cross_in), act)
        return float(act.sum())

    def workspace(self, t: int, rows: int) -> float:
        """Liveness peak beyond the saved tensors (activation gradients, temporaries, logits).
        The walk is exact at 1 row and at the most rows any plan of this world gives a micro-
        batch; in between the chord (the peak is a maximum of sums linear in the rows, so
        convex in them, and the chord lies above it: never an underestimate)."""
        u = self.units(t, rows)
        if u.workspace is None:
            hi = self.max_rows
            if not self.symbolic_batch or rows in (1, hi) or hi <= 1:
                u.workspace = self._liveness_extra(t, rows)
            else:
                w1, wh = self._liveness_extra(t, 1), self._liveness_extra(t, hi)
                u.workspace = w1 + (wh - w1) * (rows - 1) / (hi - 1)
        return u.workspace

    def _liveness_extra(self, t: int, rows: int) -> float:
        key = ("live", t, rows)
        hit = self._split_cache.get(key)
        if hit is None:
            info = self.sharding(t)
            values = self._values(rows)
            scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
            live = liveness(self.gc, values, param_grad_bytes={p.key: 0.0 for p in self.gc.params if p.key is not None},
                            storage_divisor=info.mem_div)
            hit = self._split_cache[key] = max(0.0, live.peak - live.saved) * scale
        return hit

    def _param_kinds(self, t: int):
        """Parameters grouped by what their states depend on (shape, dtype, trainable, buffer,
        tp placement): the 80 blocks of a 70B model have a dozen kinds. Returns
        (representatives, kind index per parameter, TP layouts)."""
        key = ("kinds", t)
        hit = self._split_cache.get(key)
        if hit is None:
            info = self.sharding(t)
            layouts = {n: Layout.of({"tp": p}) for n, p in info.param_placements.items()}
            reps, index, kinds = [], {}, []
            for p in self.gc.params:
                k = (tuple(p.shape), p.numel, p.dtype, p.requires_grad, p.is_buffer, str(layouts.get(p.name)))
                if k not in index:
                    index[k] = len(reps)
                    reps.append(p)
                kinds.append(index[k])
            hit = self._split_cache[key] = (reps, kinds, layouts)
        return hit

    def states(self, t: int, zero: int, dp: int, ep: int = 1) -> _States:
        """Model states per unit (see the module docstring), `cost.model_states` for one
        parameter of every kind."""
        key = (t, zero, dp, ep)
        hit = self._states.get(key)
        if hit is not None:
            return hit
        reps, kinds, layouts = self._param_kinds(t)
        mesh = {"dp": dp, "tp": t}
        z = zero if dp > 1 else 0
        dense = model_states(reps, self.opt, zero_stage=z, dp=dp, rank=0, master_dtype=self.master_dtype,
                             param_layouts=layouts, mesh=mesh, dp_axis="dp").per_param
        opt_states = max(self.opt.states, 1)
        per_kind = []
        for p in reps:
            row = {c: float(dense.get(p.name, {}).get(c, 0)) for c in CATEGORIES}
            if p.is_buffer:
                row = {c: 0.0 for c in CATEGORIES}
                row["buffers"] = float(p.numel * p.dtype.itemsize)
            shape = tp_local_shape(p, layouts, mesh, "dp")
            if p.requires_grad and not p.is_buffer:
                gp = float(math.prod(rows_of(shape)) * p.dtype.itemsize if z < 2
                           else dp * padded_numel(shape, dp) * p.dtype.itemsize)
                ga = float(padded_numel(shape, dp) * p.dtype.itemsize)
            else:
                gp = ga = 0.0
            tmp = row["optimizer"] / opt_states if self.opt.states else 0.0
            per_kind.append((row, gp, ga, tmp))
        L = self.L
        cat = {c: np.zeros(L) for c in CATEGORIES}
        grad_payload, gather, adam = np.zeros(L), np.zeros(L), np.zeros(L)
        shared: list[tuple[dict[str, float], np.ndarray]] = []
        total = {c: 0.0 for c in CATEGORIES}
        for p, kind in zip(self.gc.params, kinds):
            row, gp, ga, tmp = per_kind[kind]
            if ep > 1 and p.name in self.expert_params:
                row = {c: v / ep for c, v in row.items()}
                gp, ga, tmp = gp / ep, ga / ep, tmp / ep
            for c in CATEGORIES:
                total[c] += row[c]
            us = self.readers[p.name]
            if len(us) == 1:
                u = us[0]
                for c in CATEGORIES:
                    cat[c][u] += row[c]
                grad_payload[u] += gp
                gather[u] += ga
                adam[u] += tmp
            else:
                cnt = np.zeros(L + 1)
                mark = np.zeros(L)
                mark[us] = 1.0
                cnt[1:] = np.cumsum(mark)
                shared.append(({**row, "_grad": gp, "_gather": ga, "_adam": tmp}, cnt))
                # the gradient is synchronised by the last reader's stage; count it there
                grad_payload[us[-1]] += gp
                gather[us[0]] += ga
        out = _States(cat, shared, grad_payload, gather, adam, total)
        self._states[key] = out
        return out

    # ------------------------------------------------------------------ schedules
    def schedule(self, c: Candidate):
        key = (c.schedule, c.pp, c.micro)
        hit = self._scheds.get(key)
        if hit is None:
            v = c.virtual
            hit = self._scheds[key] = make_schedule(c.schedule, c.pp, c.micro, v if v > 1 else None)
        return hit

    # ------------------------------------------------------------------ bounds
    def lower_bounds(self, c: Candidate, recompute: bool = True) -> tuple[float, float]:
        """(step time, peak memory) that no split, recompute or overlap can beat: the busiest
        rank does at least its share (and the largest unit) of every micro-batch and of the
        optimizer step; a one-stage-per-rank schedule also waits for the first forward to
        reach each stage (`_chain_factor`); a rank holds at least its share of the model
        states and of the activations in flight (`_mem_bound`), recomputed where `recompute`,
        plus the working set and ZeRO 3's gathered units."""
        rows = self.rows_per_micro(c)
        u = self.units(c.tp, rows)
        st = self.states(c.tp, c.zero, c.dp, c.ep)
        f, b = self._ep_adjusted(c, rows, u.fwd, u.bwd, u.expert_f, u.expert_b)
        opt_tot = self._opt_time(st.total["master"] + st.total["optimizer"], st.total["params"], st.total["grads"], c)
        act = self._act_floor(u, 1, recompute) + self._inputs_floor(c, u)
        z3 = 2 * c.dp * float(st.gather.max()) if c.zero == 3 and c.dp > 1 else 0.0
        fixed = self.workspace(c.tp, rows) + z3  # every rank's peak has these on top
        return self._time_bound(c, f, b, opt_tot, st), self._mem_bound(c, sum(st.total.values()), act) + fixed

    def _mem_bound(self, c: Candidate, states: float, act: float) -> float:
        """The fullest rank's memory is at least the ranks' average, and at least a weighted
        average: a stage s holds k_s micro-batches' activations at once, so a rank whose stages
        have a_s of them holds at least max_s k_s a_s >= a_r h_r (h_r = 1 / sum 1/k_s over its
        stages); spread as evenly as any split can, the fullest rank holds A / sum_s 1/k_s, and
        with weights 1/h_r the states add their share (`_in_flight_floor` gives k_s)."""
        if c.pp == 1:
            return states + act
        k_s, s2r = _in_flight_floor(c)
        inv = [0.0] * c.pp
        for k, r in zip(k_s, s2r):
            inv[r] += 1.0 / max(k, 1.0)
        H = sum(inv)
        h_max = max(1.0 / x for x in inv if x > 0)
        return max((states + act / c.virtual) / c.pp, (states / h_max + act) / H)

    def _time_bound(self, c: Candidate, f: np.ndarray, b: np.ndarray, opt_tot: float,
                    st: _States | None = None, div: float = 1.0) -> float:
        """A step time no split, recompute or overlap can beat (see `lower_bounds`). The
        data-parallel traffic a rank cannot avoid is in it too: one collective of the total
        payload is never slower than its buckets (alpha-beta, so ranks' shares sum to at least
        the whole); ZeRO 1/2's parameter gather follows the step; ZeRO 3's gathers and
        reduce-scatters share one stream and overlap only compute; with one stage, the
        gradient sync overlaps at most the last micro-batch's backward."""
        m, p = c.micro, c.pp
        per = f + b
        F, B = float(f.sum()), float(b.sum())
        z = c.zero if c.dp > 1 else 0
        fwd_min, bwd_min, after, sync = F, B, 0.0, 0.0
        if st is not None and c.dp > 1:
            al = self.links(c)["dp"]
            gp = float(st.grad_payload.sum()) / div * (1 - 1e-3)
            ga = float(st.gather.sum()) / div * (1 - 1e-3)
            if z < 3:
                sync = al.time("all_reduce" if z < 2 else "reduce_scatter", gp) if gp > 0 else 0.0
                after = al.time("all_gather", ga) if z in (1, 2) and ga > 0 else 0.0
            else:
                g = al.time("all_gather", ga) if ga > 0 else 0.0
                rs = al.time("reduce_scatter", gp) if gp > 0 else 0.0
                fwd_min, bwd_min = max(F, g), max(B, g + rs)
        lb = max((m * (fwd_min + bwd_min) + opt_tot + after) / p, m * float(per.max()))
        if p == 1:
            lb = max(lb, m * (fwd_min + bwd_min) + max(0.0, sync - B) + after + opt_tot)
        elif c.virtual == 1:
            gamma = 1.0 if c.schedule in ("1f1b", "gpipe") else float(np.min(np.where(per > 0, f / np.maximum(per, 1e-300), 1.0)))
            lb = max(lb, _chain_factor(m, p, gamma) * float(per.sum()))
        return lb

    def _opt_time(self, master_opt: float, params: float, grads: float, c: Candidate) -> float:
        if not any(p.requires_grad for p in self.gc.params):
            return 0.0
        z = c.zero if c.dp > 1 else 0
        nbytes = 2 * master_opt + params / (c.dp if z in (1, 2) else 1) + grads
        return nbytes / (self.hw.device.memory_bandwidth * self.hw.eff("memory"))

    def _ep_terms(self, c: Candidate, rows: int) -> tuple[float, float, float]:
        """(all-to-all seconds, routed expert compute seconds, non-expert gradient averaging over
        ep) per micro-batch for the whole model (`search.expert.ep_cost`)."""
        if c.ep < 2 or not self.moe_blocks:
            return 0.0, 0.0, 0.0
        key = ("ep", c.mesh().items().__repr__(), rows)
        hit = self._split_cache.get(key)
        if hit is None:
            from autopar.search.expert import ep_cost  # noqa: PLC0415

            other = sum(p.numel * p.dtype.itemsize for p in self.gc.params
                        if not p.is_buffer and p.requires_grad and p.name not in self.expert_params) / c.tp
            e = ep_cost(self.moe_blocks, c.mesh(), "ep", self.hw, tokens_per_rank=rows * self.tokens_per_row()[0],
                        non_expert_param_bytes=other)
            hit = self._split_cache[key] = (e.a2a_s, e.expert_s, e.grad_sync_s)
        return hit

    def _ep_adjusted(self, c: Candidate, rows: int, fwd, bwd, expert_f, expert_b):
        """Per-unit forward and backward with expert parallelism: the dense expert computation of
        the captured graph replaced by the routed rows' (ep_cost's busiest rank), plus the
        blocking all-to-alls, spread over the units that hold MoE blocks."""
        if c.ep < 2 or not self.moe_blocks:
            return fwd, bwd
        a2a, comp, _g = self._ep_terms(c, rows)
        share = self.moe_units / max(self.moe_units.sum(), 1.0)
        return (fwd - expert_f + share * (a2a / 2 + comp / 3),
                bwd - expert_b + share * (a2a / 2 + 2 * comp / 3))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, c: Candidate, limit: float, *, pins: Sequence[str] = (), recompute: Any = "auto",
                 minimise: str = "time", cutoff: float | None = None) -> Evaluation:
        """Predict `c` (see the module docstring).

        Args:
            limit: bytes per device every rank must stay under.
            pins: unit names that must start a stage (pinned split points).
            recompute: "auto" (as little as fits, per stage), "none", "full" (every block),
                or {unit: "full" | "none"} for pinned units (the rest "auto").
            minimise: "time", or "memory" (the split and recompute that need the least memory,
                for reporting how far an infeasible request is from fitting).
            cutoff: a step time to beat; when the split's bound is over it, the schedule is not
                simulated and the Evaluation comes back with `pruned` set and the bound as its
                step time. A plan over the memory limit is not simulated either (step = inf).
        """
        rows = self.rows_per_micro(c)
        if rows is None or rows < 1:
            raise ValueError(f"{c.label()}: the global batch of {self.global_batch} rows does not divide by "
                             f"dp x ep x micro-batches = {c.dp * c.ep * c.micro}")
        u = self.units(c.tp, rows)
        st = self.states(c.tp, c.zero, c.dp, c.ep)
        links = self.links(c)
        L, S, m, v = self.L, c.n_stages, c.micro, c.virtual
        z = c.zero if c.dp > 1 else 0
        if S > L:
            raise ValueError(f"{c.label()}: {S} stages need at least {S} units, the model has {L}")
        # in-flight micro-batches per stage without building the step's schedule (exact for
        # 1F1B and GPipe, a floor otherwise); the schedule itself is built only for a split that
        # fits on a small version of it
        if c.pp > 1:
            k_s, s2r = _in_flight_floor(c)
            k_s = np.array(k_s)
        else:
            k_s, s2r = np.ones(1), [0]
        exact_k = c.pp == 1 or c.schedule in ("1f1b", "gpipe")
        sched = None
        P = c.pp
        stages_of = [[s for s in range(S) if s2r[s] == r] for r in range(P)]
        # per-unit times per micro-batch, with ZeRO-3 gathers and expert parallelism
        f0, b0 = self._ep_adjusted(c, rows, u.fwd, u.bwd, u.expert_f, u.expert_b)
        z3f, z3b = self._zero3_exposed(f0, b0, st, links) if z == 3 else (np.zeros(L), np.zeros(L))
        F_u, B_u = f0 + z3f, b0 + z3b
        ws = self.workspace(c.tp, rows)
        fixed = ws + (2 * c.dp * float(st.gather.max()) if z == 3 else 0.0)  # ZeRO 3: a unit gathered + the next
        trans_u = st.grad_payload * ((1 + 1 / c.dp) if z == 2 else 1.0) if z < 3 and c.dp > 1 else np.zeros(L)
        pp_link = links.get("pp")
        hop = np.array([pp_link.time("send_recv", float(x)) if pp_link is not None and x > 0 else 0.0
                        for x in u.cross]) if S > 1 else np.zeros(max(L - 1, 0))
        rc_pin = self._recompute_pins(recompute)
        # with v stages on a rank each gets 1/v of what the working set leaves (sufficient for the
        # rank; the recompute below is chosen per rank and the schedule walk has the last word);
        # with one stage per rank the check is exact
        stage_limit = [(limit - fixed) / v + fixed] * S
        chain = _Chain(F_u, B_u, u.act, u.cross, hop, u.rc_save, u.rc_time, self.blocks, st, trans_u, fixed, rc_pin)
        pin_idx = sorted(self.unit_names.index(p) for p in pins)
        if S == 1:
            starts = [0]
        else:
            starts = chain.split(S, k_s, s2r, stage_limit, pin_idx, minimise, limit / v)
            if starts is None and cutoff is not None and v == 1 and exact_k:  # exact here: nothing fits
                lb_m = self.lower_bounds(c, recompute != "none")[1]
                return Evaluation(candidate=c, step_s=INF, peak_bytes=max(lb_m, limit * (1 + 1e-6)), limit_bytes=limit,
                                  memory={"peak": lb_m, "limit": limit}, compute_s=0.0, bubble=0.0, recompute_s=0.0,
                                  optimizer_s=0.0, comm={}, flops=0.0, mfu=0.0, tokens_per_s=0.0, rows_per_micro=rows,
                                  notes=["no split fits the memory limit (peak: a lower bound)"])
            if starts is None:  # nothing fits: the split that needs the least memory, for the report
                starts = chain.split(S, k_s, s2r, stage_limit, pin_idx, "memory", limit / v)
        ends = starts[1:] + [L]
        # recompute, as little as fits: with one stage per rank per stage (its memory is the
        # rank's); with several per rank over the rank's blocks together, against the rank's
        # sum of in-flight activations (an upper bound of what its schedule holds)
        base_a = [float(u.act[starts[s]:ends[s]].sum()) + (float(u.cross[starts[s] - 1]) if starts[s] > 0 else 0.0)
                  for s in range(S)]
        base_st = [chain.states_range(starts[s], ends[s]) for s in range(S)]
        groups = [[s] for s in range(S)] if v == 1 else [[s for s in range(S) if s2r[s] == r] for r in range(P)]
        chosen_all: set[int] = set()
        for g in groups:
            excess = sum(base_st[s] + k_s[s] * base_a[s] for s in g) + fixed - (stage_limit[g[0]] if v == 1 else limit)
            blocks = [(x, float(k_s[s])) for s in g for x in range(starts[s], ends[s])]
            chosen_all |= set(self._choose_recompute(blocks, u, excess, rc_pin, recompute, minimise))
        rc_units: dict[str, str] = {}
        F_s, B_s, act_s, states_s, cats_s, rc_s = [], [], [], [], [], []
        for s in range(S):
            i, j = starts[s], ends[s]
            chosen = [x for x in range(i, j) if x in chosen_all]
            saved = sum(u.rc_save[x] for x in chosen)
            rtime = sum(u.rc_time[x] for x in chosen)
            for x in chosen:
                rc_units[self.unit_names[x]] = "full"
            F_s.append(float(F_u[i:j].sum()))
            B_s.append(float(B_u[i:j].sum()) + rtime)
            act_s.append(base_a[s] - saved)
            states_s.append(base_st[s])
            cats_s.append(chain.categories(i, j))
            rc_s.append(rtime)
        # per rank: its states by category and its optimizer step (no schedule needed)
        cats_r = [{k: sum(cats_s[s][k] for s in stages_of[r]) for k in CATEGORIES} for r in range(P)]
        st_r = [sum(states_s[s] for s in stages_of[r]) for r in range(P)]
        opt_r = [self._opt_time(x["master"] + x["optimizer"], x["params"], x["grads"], c) for x in cats_r]
        early = dict(candidate=c, limit_bytes=limit, compute_s=0.0, bubble=0.0, recompute_s=0.0, optimizer_s=0.0,
                     comm={}, flops=0.0, mfu=0.0, tokens_per_s=0.0, rows_per_micro=rows,
                     split_points=[self.unit_names[i] for i in starts[1:]])
        # memory per rank: states + the most activations held along its actions, first on the
        # schedule with at most 2p micro-batches (it never holds more: the peak is in the
        # warm-up), which decides most plans that do not fit without building the step's
        # schedule; then the split's time bound; only then the step's schedule
        if c.pp > 1 and cutoff is not None and minimise == "time":
            small = _small_schedule(c.schedule, c.pp, c.micro if c.schedule == "gpipe" else min(c.micro, 2 * c.pp),
                                    v)
            held_small = _held_peaks(small, act_s)
            worst = max(st_r[r] + held_small[r] + fixed for r in range(P))
            if worst > limit * (1 + 1e-9):
                return Evaluation(step_s=INF, peak_bytes=worst, memory={"peak": worst, "limit": limit},
                                  notes=["over the memory limit (peak: a lower bound)"], **early)
            lb = self._split_bound(c, F_s, B_s, opt_r, stages_of)
            if lb >= cutoff:
                return Evaluation(step_s=lb, peak_bytes=worst, memory={"peak": worst, "limit": limit},
                                  notes=["bound over the cutoff (peak: a lower bound)"], pruned=True, **early)
        if c.pp > 1:
            sched = self.schedule(c)
            held = _held_peaks(sched, act_s)
        rank_peaks, rank_cats = [], []
        for r in range(P):
            mine = stages_of[r]
            best = held[r] if sched is not None else act_s[0]
            trans = sum(float(trans_u[starts[s]:ends[s]].sum()) for s in mine)
            adam = sum(chain.adam_range(starts[s], ends[s]) for s in mine)
            peak = max(st_r[r] + best + fixed,  # forward/backward: activations held, the working set
                       st_r[r] + trans,  # end of backward: the flat gradient buffers (ZeRO 0-2)
                       st_r[r] + adam)  # the optimizer step's temporaries
            rank_peaks.append(peak)
            rank_cats.append({**cats_r[r], "activations": best, "workspace": ws, "comm_buffers": trans + (fixed - ws),
                              "optimizer_step_temp": adam, "peak": peak})
        full = int(np.argmax(rank_peaks))
        memory = dict(rank_cats[full], limit=limit)
        tpr, _unit = self.tokens_per_row()
        common = dict(candidate=c, peak_bytes=max(rank_peaks), limit_bytes=limit, memory=memory, rows_per_micro=rows,
                      split_points=[self.unit_names[i] for i in starts[1:]],
                      stage_units=[self.unit_names[starts[s]:ends[s]] for s in range(S)], recompute=rc_units,
                      rank_peaks=rank_peaks)
        if max(rank_peaks) > limit * (1 + 1e-9) and minimise == "time":
            return Evaluation(step_s=INF, compute_s=0.0, bubble=0.0, recompute_s=0.0, optimizer_s=0.0, comm={},
                              flops=0.0, mfu=0.0, tokens_per_s=0.0, notes=["over the memory limit"], **common)
        # time: the schedule, then per rank data-parallel sync, the optimizer step
        p2p = [float(hop[starts[s + 1] - 1]) for s in range(S - 1)]
        if sched is not None:
            sim = simulate(sched, f=F_s, b=B_s, p2p=p2p)
            if not sim.ok:
                raise ValueError(f"{c.label()}: the schedule deadlocks in simulation: {sim.summary()}")
            ends_r = [tl[-1].end if tl else 0.0 for tl in sim.timelines]
            busy = list(sim.busy)
            bubble = float(sim.bubble_fraction)
        else:
            ends_r = [m * (F_s[0] + B_s[0])]
            busy = list(ends_r)
            bubble = 0.0
        dp_link = links.get("dp")
        step = 0.0
        dp_time = dp_bytes = dp_exposed_max = 0.0
        ep_sync = self._ep_terms(c, rows)[2]
        for r in range(P):
            mine = stages_of[r]
            exposed, after, t_r, b_r = self._dp_sync(r, mine, starts, ends, B_s, B_u, ends_r[r], st, dp_link, z, c)
            if r == 0:
                dp_time, dp_bytes = t_r, b_r
            step = max(step, ends_r[r] + exposed + after + ep_sync + opt_r[r])
            dp_exposed_max = max(dp_exposed_max, exposed + after)
        comm = self._comm_report(c, u, st, starts, ends, stages_of, p2p, dp_time, dp_bytes, dp_exposed_max, z3f,
                                 z3b, rows)
        flops = m * max(sum(float(u.flops[starts[s]:ends[s]].sum()) for s in stages_of[r]) for r in range(P))
        mfu = m * float(u.flops.sum()) / P / (step * self.hw.peak(self.main_dtype)) if step > 0 else 0.0
        rc_total = m * max(sum(rc_s[s] for s in stages_of[r]) for r in range(P))
        notes = [f"{c.micro} micro-batches for {c.pp} pipeline ranks: mostly bubble"] if 1 < c.pp and c.micro < c.pp \
            else []
        return Evaluation(step_s=step, compute_s=max(busy), bubble=bubble, recompute_s=rc_total,
                          optimizer_s=max(opt_r), comm=comm, flops=flops, mfu=mfu,
                          tokens_per_s=self.global_batch * tpr / step if step > 0 else 0.0, notes=notes, **common)

    def _split_bound(self, c: Candidate, F_s, B_s, opt_r, stages_of) -> float:
        """A bound on the step of a split before simulating it: each rank's work; with one stage
        per rank, also the first forward reaching stage s and (1F1B, GPipe) the last backward
        leaving it, around its m micro-batches."""
        m = c.micro
        lb = max(m * sum(F_s[s] + B_s[s] for s in mine) + opt_r[r] for r, mine in enumerate(stages_of))
        if c.virtual == 1:
            beta = 1.0 if c.schedule in ("1f1b", "gpipe") else 0.0
            pre_f = pre_b = 0.0
            for s in range(len(F_s)):
                lb = max(lb, pre_f + m * (F_s[s] + B_s[s]) + max(opt_r[s], beta * pre_b))
                pre_f += F_s[s]
                pre_b += B_s[s]
        return lb

    def _dp_sync(self, r, mine, starts, ends, B_s, B_u, end_r, st: _States, dp_link, z, c):
        """(exposed, after the step, time, bytes sent) of rank r's data-parallel gradient sync:
        buckets as the runtime forms them (reverse order, the first at most FIRST_BUCKET_MB,
        then bucket_mb), each synchronised once its last gradient is ready, one after another;
        ZeRO 1/2's parameter all-gather after the step. ZeRO 3's comm is in the unit times."""
        if c.dp < 2 or dp_link is None:
            return 0.0, 0.0, 0.0, 0.0
        if z == 3:
            t = b = 0.0
            for s in mine:
                for x in range(starts[s], ends[s]):
                    if st.gather[x] > 0:
                        t += c.micro * (2 * dp_link.time("all_gather", float(st.gather[x]))
                                        + dp_link.time("reduce_scatter", float(st.grad_payload[x])))
                        b += c.micro * (2 * dp_link.bytes_sent("all_gather", float(st.gather[x]))
                                        + dp_link.bytes_sent("reduce_scatter", float(st.grad_payload[x])))
            return 0.0, 0.0, t, b
        op = "all_reduce" if z < 2 else "reduce_scatter"
        last = min(mine)  # the rank's stage whose backward ends last (the lowest)
        t0 = end_r - B_s[last]
        ready_at: list[tuple[float, float, float]] = []
        for s in sorted(mine, reverse=True):
            if s != last:  # earlier virtual stages: ready when the last one's backward starts
                for x in range(ends[s] - 1, starts[s] - 1, -1):
                    ready_at.append((t0, float(st.grad_payload[x]), float(st.gather[x])))
        ready = t0
        for x in range(ends[last] - 1, starts[last] - 1, -1):
            ready += B_u[x]
            ready_at.append((ready, float(st.grad_payload[x]), float(st.gather[x])))
        free, after, t_all, b_all = t0, 0.0, 0.0, 0.0
        for when, payload, gpay in _buckets(ready_at, self.bucket_bytes):
            d = dp_link.time(op, payload)
            free = max(free, when) + d
            t_all += d
            b_all += dp_link.bytes_sent(op, payload)
            if z >= 1 and gpay > 0:
                g = dp_link.time("all_gather", gpay)
                after += g
                t_all += g
                b_all += dp_link.bytes_sent("all_gather", gpay)
        return max(0.0, free - end_r), after, t_all, b_all

    def _comm_report(self, c, u, st, starts, ends, stages_of, p2p, dp_time, dp_bytes, dp_exposed, z3f, z3b, rows):
        """Per axis, rank 0's bytes sent, time and exposed time per step."""
        m = c.micro
        mine = stages_of[0]
        comm: dict[str, dict[str, float]] = {}
        if c.tp > 1:
            t = m * sum(float(u.tp_comm[starts[s]:ends[s]].sum()) for s in mine)
            comm["tp"] = {"bytes_sent": m * sum(float(u.tp_bytes[starts[s]:ends[s]].sum()) for s in mine),
                          "time_s": t, "exposed_s": t}
        if c.dp > 1:
            z3 = m * sum(float((z3f + z3b)[starts[s]:ends[s]].sum()) for s in mine)
            comm["dp"] = {"bytes_sent": dp_bytes, "time_s": dp_time, "exposed_s": dp_exposed + z3}
        if c.pp > 1:
            nb = sum(float(u.cross[starts[s] - 1]) for s in range(1, len(starts)))
            comm["pp"] = {"bytes_sent": 2 * m * nb / c.pp, "time_s": 2 * m * sum(p2p) / c.pp,
                          "exposed_s": 0.0}  # inside the simulated makespan
        if c.ep > 1 and self.moe_blocks:
            a2a, _comp, grad = self._ep_terms(c, rows)
            share = float(sum(self.moe_units[starts[s]:ends[s]].sum() for s in mine) / max(self.moe_units.sum(), 1.0))
            from autopar.search.expert import ep_cost  # noqa: PLC0415

            e = ep_cost(self.moe_blocks, c.mesh(), "ep", self.hw, tokens_per_rank=rows * self.tokens_per_row()[0])
            al = self.links(c)["ep"]
            comm["ep"] = {"bytes_sent": m * share * al.bytes_sent("all_to_all", e.a2a_payload_bytes),
                          "time_s": m * share * a2a + grad, "exposed_s": m * share * a2a + grad}
        return comm

    def _recompute_pins(self, recompute: Any) -> dict[int, bool] | None:
        if isinstance(recompute, Mapping):
            idx = {n: i for i, n in enumerate(self.unit_names)}
            bad = [k for k in recompute if k not in idx]
            if bad:
                raise ValueError(f"recompute pins {bad} are not units of this model; units: {self.unit_names[:6]} ...")
            return {idx[k]: v == "full" for k, v in recompute.items()}
        return None

    def _choose_recompute(self, blocks: list[tuple[int, float]], u: _Units, excess: float, rc_pin, recompute,
                          minimise: str) -> list[int]:
        """Units to recompute among `blocks` ((unit, micro-batches its stage holds at once)):
        pinned ones, then (auto) as few as free `excess` bytes, most bytes per second first;
        every block when minimising memory."""
        cands = [(x, k) for x, k in blocks if self.blocks[x] > 0 and u.rc_save[x] > 0]
        if recompute == "none":
            return []
        if recompute == "full" or minimise == "memory":
            return [x for x, _k in cands]
        chosen = []
        if rc_pin is not None:
            chosen = [x for x, _k in cands if rc_pin.get(x) is True]
            excess -= sum(k * u.rc_save[x] for x, k in cands if rc_pin.get(x) is True)
            cands = [(x, k) for x, k in cands if x not in rc_pin]
        if excess <= 0:
            return chosen
        cands.sort(key=lambda xk: (-(xk[1] * u.rc_save[xk[0]] / max(u.rc_time[xk[0]], 1e-30)), xk[0]))
        for x, k in cands:
            if excess <= 0:
                break
            chosen.append(x)
            excess -= k * u.rc_save[x]
        return sorted(chosen)

    def _zero3_exposed(self, fwd: np.ndarray, bwd: np.ndarray, st: _States, links) -> tuple[np.ndarray, np.ndarray]:
        """ZeRO-3 communication not hidden behind compute, per unit and micro-batch: forward,
        unit x gathered while unit x-1 computes; backward, gathered again while x+1's backward
        runs, its gradients reduce-scattered on the same stream."""
        L = self.L
        al = links.get("dp")
        f_exp, b_exp = np.zeros(L), np.zeros(L)
        if al is None:
            return f_exp, b_exp
        g = np.array([al.time("all_gather", float(x)) if x > 0 else 0.0 for x in st.gather])
        rs = np.array([al.time("reduce_scatter", float(x)) if x > 0 else 0.0 for x in st.grad_payload])
        for x in range(L):
            prev = fwd[x - 1] if x > 0 else 0.0
            f_exp[x] = max(0.0, g[x] - prev)
            nxt = bwd[x + 1] if x + 1 < L else 0.0
            b_exp[x] = max(0.0, g[x] + (rs[x + 1] if x + 1 < L else 0.0) - nxt)
        b_exp[0] += rs[0]
        return f_exp, b_exp


# ------------------------------------------------------------------------ the split DP
class _Chain:
    """Prefix sums of one candidate's chain and the vectorised stage DP over it."""

    def __init__(self, F, B, act, cross, hop, rc_save, rc_time, blocks, st: _States, trans, fixed, rc_pin):
        L = len(F)
        self.L = L
        z = np.zeros(1)
        self.PT = np.concatenate([z, np.cumsum(F + B)])
        self.PA = np.concatenate([z, np.cumsum(act)])
        self.PRS = np.concatenate([z, np.cumsum(rc_save)])
        self.PRT = np.concatenate([z, np.cumsum(rc_time)])
        self.PB = np.concatenate([z, np.cumsum(blocks * (rc_save > 0))])
        self.PTR = np.concatenate([z, np.cumsum(trans)])
        self.cat_prefix = {k: np.concatenate([z, np.cumsum(v)]) for k, v in st.cat.items()}
        own = sum(st.cat.values())
        self.PS = np.concatenate([z, np.cumsum(own)])
        self.PAD = np.concatenate([z, np.cumsum(st.adam_tmp)])
        self.shared = st.shared
        self.cross_in = np.concatenate([[0.0], cross, [0.0]])  # index i: bytes into unit i (i = 0 .. L)
        self.hop = np.concatenate([[0.0], hop, [0.0]])  # index i: p2p at the boundary before unit i
        self.fixed = fixed
        self.rc_pin = rc_pin

    def states_range(self, i: int, j: int) -> float:
        s = self.PS[j] - self.PS[i]
        for row, cnt in self.shared:
            if cnt[j] > cnt[i]:
                s += sum(row[c] for c in CATEGORIES)
        return float(s)

    def categories(self, i: int, j: int) -> dict[str, float]:
        out = {k: float(p[j] - p[i]) for k, p in self.cat_prefix.items()}
        for row, cnt in self.shared:
            if cnt[j] > cnt[i]:
                for c in CATEGORIES:
                    out[c] += row[c]
        return out

    def adam_range(self, i: int, j: int) -> float:
        s = self.PAD[j] - self.PAD[i]
        for row, cnt in self.shared:
            if cnt[j] > cnt[i]:
                s += row["_adam"]
        return float(s)

    def _arrays(self, I: np.ndarray, J: np.ndarray) -> dict[str, np.ndarray]:
        """Per-stage quantities of the stages [I, J) (index arrays of one shape, broadcast)."""
        states = self.PS[J] - self.PS[I]
        adam = self.PAD[J] - self.PAD[I]
        for row, cnt in self.shared:
            has = (cnt[J] - cnt[I]) > 0
            states = states + has * sum(row[c] for c in CATEGORIES)
            adam = adam + has * row["_adam"]
        return dict(T=self.PT[J] - self.PT[I], A=self.PA[J] - self.PA[I] + self.cross_in[I],
                    RS=self.PRS[J] - self.PRS[I], RT=self.PRT[J] - self.PRT[I], NB=self.PB[J] - self.PB[I],
                    TR=self.PTR[J] - self.PTR[I], states=states, adam=adam)

    def _costs(self, mx, valid, S, k_s, s2r, limit, minimise: str, I, J, opt_limit: float) -> list[np.ndarray]:
        """Each stage's cost over the (end, start) pairs: time with the recompute it needs to
        fit its memory limit (`limit[s]`, or one for all; inf where it cannot), or its memory
        after recomputing every block."""
        out = []
        opt_peak = np.maximum(mx["states"] + mx["adam"], mx["states"] + mx["TR"])
        for s in range(S):
            k = float(k_s[s]) if s < len(k_s) else 1.0
            mem0 = mx["states"] + k * mx["A"] + self.fixed
            if minimise == "memory":
                out.append(np.where(valid, np.maximum(mem0 - k * mx["RS"], opt_peak), INF))
                continue
            need = mem0 - (limit[s] if isinstance(limit, (list, tuple, np.ndarray)) else limit)
            with np.errstate(divide="ignore", invalid="ignore"):
                per = np.where(mx["NB"] > 0, k * mx["RS"] / np.maximum(mx["NB"], 1), 0.0)
                n_rc = np.where(need > 0, np.where(per > 0, np.ceil(need / np.where(per > 0, per, 1) - 1e-9), INF), 0.0)
                rc_t = np.where(n_rc > 0, n_rc * mx["RT"] / np.maximum(mx["NB"], 1), 0.0)
            ok = valid & (n_rc <= mx["NB"]) & (opt_peak <= opt_limit)
            t = mx["T"] + rc_t
            if s > 0 and s2r[s - 1] != s2r[s]:
                t = t + self.hop[I]
            if s < S - 1 and s2r[s + 1] != s2r[s]:
                t = t + self.hop[J]
            out.append(np.where(ok, t, INF))
        return out

    def split(self, S: int, k_s, s2r, limit: float | Sequence[float], pins: Sequence[int], minimise: str,
              opt_limit: float | None = None) -> list[int] | None:
        """Stage starts (starts[0] == 0) minimising the bottleneck stage time (then the sum of
        squared stage times), each stage within its `limit` (one per stage, or one for all)
        after its recompute; None if none fits.
        minimise="memory": the split whose fullest stage needs the least memory.

        Long chains cut into many stages are solved on a band of stage lengths (at most
        2 L/S + 3 units) first; that answer is the optimum when no run of more units than the
        band allows is as fast as its bottleneck (a longer stage could not be the bottleneck's
        equal), and otherwise the full DP runs."""
        L = self.L
        W = 2 * (-(-L // S)) + 3
        if minimise == "time" and not pins and 3 * W < 2 * (L + 1):
            J = np.arange(L + 1)[:, None]
            I = J - np.arange(1, W + 1)[None, :]
            got = self._dp(S, k_s, s2r, limit, minimise, np.maximum(I, 0), J, I >= 0, opt_limit)
            if got is not None:
                starts, opt = got
                longest = float(np.min(self.PT[W + 1:] - self.PT[: L - W]))  # any W+1 consecutive units
                if longest > opt * (1 + 1e-9):
                    return starts
        J = np.arange(L + 1)[:, None]
        I = np.arange(L + 1)[None, :]
        valid = J > I
        if pins:
            cnt = np.zeros(L + 2)
            for p in pins:
                cnt[p + 1:] += 1  # cnt[x] = pins < x
            inner = cnt[np.broadcast_to(J, valid.shape)] - cnt[np.minimum(np.broadcast_to(I, valid.shape) + 1, L + 1)]
            valid &= inner <= 0
        got = self._dp(S, k_s, s2r, limit, minimise, I, J, valid, opt_limit)
        return None if got is None else got[0]

    def _dp(self, S, k_s, s2r, limit, minimise, I, J, valid, opt_limit=None):
        """The two DPs over arrays indexed [end j, option]: the least bottleneck, then among
        splits within it the least sum of squares. Returns (starts, bottleneck) or None."""
        I, J = np.broadcast_arrays(I, J)
        mx = self._arrays(I, J)
        costs = self._costs(mx, valid, S, k_s, s2r, limit, minimise, I, J, limit if opt_limit is None else opt_limit)
        L = self.L
        best = np.full(L + 1, INF)
        best[0] = 0.0
        for s in range(S):
            best = np.maximum(best[I], costs[s]).min(axis=1)
        opt = best[L]
        if not math.isfinite(opt):
            return None
        bound = opt * (1 + 1e-9) + 1e-300
        acc = np.full(L + 1, INF)
        acc[0] = 0.0
        args = []
        for s in range(S):
            c2 = np.where(costs[s] <= bound, costs[s] ** 2 if minimise == "time" else costs[s], INF)
            cand = acc[I] + c2
            pick = cand.argmin(axis=1)
            args.append(I[np.arange(L + 1), pick])
            acc = cand[np.arange(L + 1), pick]
        starts = [0] * S
        j = L
        for s in range(S - 1, -1, -1):
            i = int(args[s][j])
            starts[s] = i
            j = i
        return starts, float(opt)


def _held_peaks(sched, act_s) -> list[float]:
    """Per rank, the most activation bytes held along its actions (F adds its stage's, B or W
    releases them)."""
    out = []
    for acts in sched.actions:
        held = best = 0.0
        for a in acts:
            if a.kind is Kind.F:
                held += act_s[a.stage]
                if held > best:
                    best = held
            elif a.kind is Kind.B or a.kind is Kind.W:
                held -= act_s[a.stage]
        out.append(best)
    return out


@functools.lru_cache(maxsize=256)
def _small_schedule(name: str, p: int, m: int, v: int):
    return make_schedule(name, p, m, v if v > 1 else None)


def _in_flight_floor(c: Candidate) -> tuple[Sequence[float], Sequence[int]]:
    """Per stage, how many micro-batches' activations it holds at once (at least: equal in every
    case checked), and its rank, without building the step's schedule: 1F1B runs min(p - s, m)
    forwards on stage s before its first backward, GPipe all m (tests/unit/test_planner.py
    checks these against the schedules)."""
    p, m = c.pp, c.micro
    if c.schedule == "1f1b":
        return [float(min(p - s, m)) for s in range(p)], list(range(p))
    if c.schedule == "gpipe":
        return [float(m)] * p, list(range(p))
    # ZB-H1 (W releases later) and two stages per rank: the peak is reached in the warm-up,
    # whose length does not grow past 2p micro-batches; the schedule with min(m, 2p) of them
    # is small and holds no more
    return _small_in_flight(c.schedule, p, min(m, 2 * p), c.virtual)


@functools.lru_cache(maxsize=256)
def _small_in_flight(name: str, p: int, m: int, v: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    from autopar.search.stages import in_flight_per_stage  # noqa: PLC0415

    sched = _small_schedule(name, p, m, v)
    return tuple(float(k) for k in in_flight_per_stage(sched)), tuple(sched.stage_to_rank)


class _MemoLink:
    """An `AxisLink` whose times and bytes are memoised (the search asks for the same few
    payloads many times)."""

    def __init__(self, al):
        self.al = al
        self.axis, self.size = al.axis, al.size
        self._t: dict = {}
        self._b: dict = {}

    def time(self, op: str, nbytes: float) -> float:
        key = (op, nbytes)
        t = self._t.get(key)
        if t is None:
            t = self._t[key] = self.al.time(op, nbytes)
        return t

    def bytes_sent(self, op: str, nbytes: float) -> float:
        key = (op, nbytes)
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = self.al.bytes_sent(op, nbytes)
        return b


def _chain_factor(m: int, S: int, gamma: float) -> float:
    """c such that c x (sum of stage times) bounds the makespan of any split of a chain into S
    stages on S ranks: stage s cannot finish before the first forward reaches it (at least
    gamma of the earlier stages' time) plus its m micro-batches, so the step is at least
    max_s (gamma x sum_{s'<s} T_s' + m T_s) >= sum_s w_s (...) for weights w >= 0 summing to
    one; choosing w so that every T_s' gets the same coefficient c makes the bound
    independent of the split (m = 1: c = 1 ... for gamma = 1, c = 1 / (1 - ((m-1)/m)^S))."""
    w = [0.0] * S
    acc = 0.0  # sum of w_s for s > s'
    for s in range(S - 1, -1, -1):
        w[s] = (1.0 - gamma * acc) / m
        if w[s] < 0:
            return m / S
        acc += w[s]
    return max(1.0 / acc, m / S)


def _buckets(ready: list[tuple[float, float, float]], caps: tuple[float, float]):
    """Group per-unit gradients (in backward order: ready time, sync payload, gather payload)
    into buckets of at most caps[0] bytes for the first and caps[1] after; a unit larger than a
    bucket is cut into pieces (ready when the unit is). Yields (ready, payload, gather payload)."""
    cap = caps[0]
    cur_t, cur_p, cur_g = 0.0, 0.0, 0.0
    for when, p, g in ready:
        if p <= 0:
            continue
        while p > 0:
            room = cap - cur_p
            take = min(p, room) if cur_p > 0 or p <= cap else cap
            frac = take / p
            cur_p += take
            cur_g += g * frac
            cur_t = when
            p -= take
            g -= g * frac
            if cur_p >= cap * (1 - 1e-12):
                yield cur_t, cur_p, cur_g
                cur_p = cur_g = 0.0
                cap = caps[1]
    if cur_p > 0:
        yield cur_t, cur_p, cur_g


def _conversion_bytes(src, dst, pg: bool, nbytes: float, k: int) -> float:
    """Bytes one rank sends for a conversion (forward and backward), ring collectives."""
    ar = 2 * (k - 1) / k * nbytes
    ag = (k - 1) / k * nbytes
    rs = (k - 1) / k * nbytes
    if src == dst:
        return ar if pg and isinstance(dst, Replicate) else 0.0
    if isinstance(dst, Replicate):
        if isinstance(src, Shard):
            return ag + (rs if pg else 0.0)
        if isinstance(src, Partial):
            return ar + (ar if pg else 0.0)
    if isinstance(dst, Shard):
        if isinstance(src, Replicate):
            return ag
        if isinstance(src, Shard):
            return 2 * (k - 1) / k * nbytes / k
        if isinstance(src, Partial):
            return rs + ag
    if isinstance(dst, Partial) and isinstance(src, Shard):
        return ag
    return 0.0
