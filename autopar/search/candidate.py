"""The discrete choices of a joint plan, their enumeration, and what the cost model predicts.

`Candidate` fixes the mesh (tp x pp x dp, x ep for MoE, x cp with its attention exchange for
models with attention), the ZeRO stage, the number of
micro-batches and, with pp > 1, the pipeline schedule and its virtual stages per rank (`vpp`:
searched for interleaved_1f1b, `virtual_choices`; fixed by the schedule otherwise,
`SCHEDULE_VIRTUAL`); the continuous choices (every node's sharding, split points,
recompute) are solved inside `plan_cost.PlanCostModel.evaluate`, whose answer is an
`Evaluation`. `candidates(model, world, pins, support)` lists every candidate the pins, the
mesh and the model allow: tp at most the GPUs of a node, pp at most the pipeline units, dp x ep
x micro-batches dividing the global batch, ZeRO 1-3 only with dp > 1, interleaved schedules
only with micro-batches divisible by pp, searched schedules `SEARCHED_SCHEDULES` (gpipe only
when pinned), interleaved_1f1b with every v of `virtual_choices` up to the first whose ideal
bubble (p - 1) / (v m) is under 1 % (or the "pp_virtual" pin). Context parallelism: cp = k for
the divisors k of the world for which `model.context_options(k, tp)` (`search.plan_context`)
gives an exchange (2k zigzag chunks divide the sequence; the cheaper method, or the pinned
one), with pp and ep where the runtime runs them (`support["cp_with_pp"]`, `["cp_with_ep"]`),
ZeRO 1-3 whenever dp x cp > 1 (the shards live on the joined dp+cp axis). An MoE model whose
auxiliary losses read router statistics gets one micro-batch only unless
`support["moe_aux_stats"]` is "micro_batch" (`one_micro_batch`: under the default "global"
the runtime refuses micro-batches, build/plan_check.py `check_moe_aux_stats`).

`plain(x)`: numpy numbers and arrays as Python ones, tuples as lists (what json writes and reads
back unchanged), for every report the search keeps.

Reads and writes no node.meta. Deterministic: candidates come in a fixed order.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import torch.fx as fx

__all__ = ["Candidate", "Evaluation", "SCHEDULE_VIRTUAL", "SEARCHED_SCHEDULES", "candidates", "plain",
           "virtual_choices", "one_micro_batch", "has_router_stats"]

SEARCHED_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")
SCHEDULE_VIRTUAL = {"1f1b": 1, "gpipe": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2}


BUCKET_MB = (25.0, 100.0, 400.0, 1600.0)  # gradient bucket sizes the planner tries (MiB; 25: DDP's default)


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
    vpp: int = 0  # stages per pipeline rank for interleaved_1f1b (0: the schedule's default)
    cp: int = 1  # context parallel: each rank holds 1/cp of every sequence
    context: str = "none"  # the attention exchange over cp ("ring" | "ulysses"; "none" when cp == 1)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.ep * self.cp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same parameters and average their gradients: dp x cp (the
        joined dp+cp axis carries gradient sync and ZeRO shards)."""
        return self.dp * self.cp

    @property
    def virtual(self) -> int:
        if self.pp == 1:
            return 1
        if self.vpp > 0 and self.schedule == "interleaved_1f1b":
            return self.vpp
        return SCHEDULE_VIRTUAL.get(self.schedule, 1)

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def mesh(self) -> dict[str, int]:
        """Mesh axes of size > 1 in autopar's canonical order (pp outermost, tp innermost, so
        that tp groups stay inside a node; cp between ep and tp, `runtime.mesh.AXIS_ORDER`);
        {"dp": 1} for one device."""
        m = {a: s for a, s in (("pp", self.pp), ("dp", self.dp), ("ep", self.ep), ("cp", self.cp), ("tp", self.tp))
             if s > 1}
        return m or {"dp": 1}

    def dims(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "zero_stage": self.zero,
                "n_microbatches": self.micro, "schedule": self.schedule, "context_method": self.context}

    def label(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}({self.context})")
        parts.append(f"ZeRO-{self.zero}")
        parts.append(f"{self.micro} micro-batch{'es' if self.micro > 1 else ''}")
        if self.pp > 1:
            parts.append(self.schedule + (f"(v={self.virtual})" if self.schedule == "interleaved_1f1b" else ""))
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
    bucket_mb: float | None = None  # ZeRO 0-2 gradient buckets it was priced with (None: the search's default)

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


# ------------------------------------------------------------------------ candidates
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def virtual_choices(n_units: int, pp: int, n_blocks: int = 0) -> list[int]:
    """The stages per rank (v >= 2) the search tries for interleaved_1f1b on `pp` ranks and a
    chain of `n_units` pipeline units, `n_blocks` of them repeated blocks: for every k, the
    least v whose stages need at most k units each (v = ceil(n_units / (pp k))): a larger v
    with the same longest stage does the same work per stage in more, smaller slices (more
    point-to-point hops and activations in flight) for a bubble no smaller per stage time;
    plus every v that splits the blocks evenly (n_blocks divisible by pp x v, Megatron's
    split). At most about 2 sqrt(n_units / pp) + divisors values; each stage has >= 1 unit."""
    top = n_units // pp
    if pp < 2 or top < 2:
        return []
    out = {max(2, min(top, -(-n_units // (pp * k)))) for k in range(1, -(-n_units // (2 * pp)) + 1)}
    if n_blocks and n_blocks % pp == 0:
        out |= {v for v in range(2, top + 1) if (n_blocks // pp) % v == 0}
    return sorted(out)


def _few_bubbles(vs: list[int], p: int, m: int) -> list[int]:
    """`vs` up to the first v whose ideal interleaved bubble, (p - 1) / (v m) of the step, is
    under 1 %: a deeper interleave could save less than that and adds point-to-point hops."""
    out = []
    for v in vs:
        out.append(v)
        if (p - 1) / (v * m) < 0.01:
            break
    return out


def candidates(model: Any, world: int, pins: Mapping[str, Any], support: Mapping[str, bool]) -> list[Candidate]:
    """Every candidate of the outer search that the pins, the mesh and the model allow.
    `model`: the `plan_cost.PlanCostModel` (its tables: hw, L, blocks, global_batch, has_moe,
    n_experts, gm, `context_options`); `support`: the planner's RUNTIME_SUPPORT flags."""
    hw = model.hw
    L = model.L
    G = model.global_batch
    eps = [1]
    if model.has_moe and support.get("ep"):
        eps += [e for e in _divisors(world) if e > 1 and model.n_experts % e == 0]
    cps = [k for k in _divisors(world) if k > 1] if support.get("cp") and pins.get("cp", 0) != 1 else []
    tied = has_tied(model.gm)
    # tied weights take ZeRO 1-3 and 16-bit masters under pp where the runtime supports it
    # (runtime/pipeline_tied.py); fp16 with loss scaling pipelines too (runtime/zero_optim.py
    # LossScaleGroup: the last stage scales, every stage unscales, one verdict over the job)
    prec = getattr(model, "precision", None) or {}
    sixteen = prec.get("param_dtype") in ("bf16", "fp16")
    n_blocks = int(np.count_nonzero(np.asarray(getattr(model, "blocks", ())) > 0))
    micro_ok = not one_micro_batch(model, support)
    out = []
    for t in _divisors(world):
        if t > hw.gpus_per_node and "tp" not in pins:
            continue
        for e in eps:
            if world % (t * e):
                continue
            ctx = [(1, "none")]
            if cps and (e == 1 or support.get("cp_with_ep")):
                ctx += [(k, meth) for k in cps if (world // (t * e)) % k == 0
                        for meth in model.context_options(k, t, pins.get("context_method"))]
            for k, meth in ctx:
                for p in _divisors(world // (t * e * k)):
                    if p > L or (e > 1 and p > 1 and not support.get("ep_with_pp")):
                        continue
                    if k > 1 and p > 1 and not support.get("cp_with_pp"):
                        continue
                    d = world // (t * e * p * k)
                    if G % (d * e):
                        continue
                    rows = G // (d * e)
                    zeros = [0, 1, 2, 3] if d * k > 1 else [0]
                    for m in (_divisors(rows) if micro_ok else [1]):
                        for sched in (["none"] if p == 1 else
                                      ([pins["schedule"]] if "schedule" in pins else list(SEARCHED_SCHEDULES))):
                            vs = [0]
                            if sched == "interleaved_1f1b":
                                vs = [pins["pp_virtual"]] if "pp_virtual" in pins else \
                                    _few_bubbles(virtual_choices(L, p, n_blocks), p, m)
                            for v in vs:
                                c0 = Candidate(t, p, d, e, 0, m, sched, v, k, meth)
                                if c0.n_stages > L or v == 1:
                                    continue
                                if c0.virtual > 1 and m % p:
                                    continue
                                if p > 1 and m < p and sched != "1f1b":
                                    continue  # fewer micro-batches than ranks: 1F1B is as good as any
                                for z in zeros:
                                    if p > 1 and tied and (z or sixteen) and not support.get("zero_with_tied_pp"):
                                        continue
                                    c = replace(c0, zero=z)
                                    if _matches(c, pins):
                                        out.append(c)
    return out


_ROUTER_STATS: "weakref.WeakKeyDictionary[fx.GraphModule, list]" = weakref.WeakKeyDictionary()


def one_micro_batch(model: Any, support: Mapping[str, Any]) -> bool:
    """Whether every candidate must run one micro-batch: an MoE model (`model.has_moe`) whose
    graph has router statistics (`search.expert_detect.router_stats`: its auxiliary loss reads
    them) under `support["moe_aux_stats"]` "global" (the default), which the runtime refuses to
    compute per micro-batch."""
    return support.get("moe_aux_stats", "global") == "global" and has_router_stats(model)


def has_router_stats(model: Any) -> bool:
    """Whether the planner's model (`plan_cost.PlanCostModel`) is an MoE whose graph has router
    statistics (cached per graph)."""
    return bool(router_stat_keys(model))


def router_stat_keys(model: Any) -> list[str]:
    """The router statistics (`search.expert_detect.router_stats`) of the planner's model's
    graph, [] without MoE (cached per graph: on a 671B graph the walk costs seconds)."""
    if not getattr(model, "has_moe", False):
        return []
    gm = model.gm
    if gm not in _ROUTER_STATS:
        from autopar.search.expert_detect import router_stats  # noqa: PLC0415

        try:
            _ROUTER_STATS[gm] = list(router_stats(gm, getattr(model, "moe_blocks", None)))
        except ValueError:  # an MoE the detection cannot take apart: no statistics it could make global
            _ROUTER_STATS[gm] = []
    return _ROUTER_STATS[gm]


def _matches(c: Candidate, pins: Mapping[str, Any]) -> bool:
    for k, v in (("tp", c.tp), ("pp", c.pp), ("dp", c.dp), ("ep", c.ep), ("cp", c.cp), ("zero_stage", c.zero),
                 ("n_microbatches", c.micro)):
        if k in pins and pins[k] != v:
            return False
    if "schedule" in pins and c.pp > 1 and pins["schedule"].lower().replace("-", "_") != c.schedule:
        return False
    if pins.get("context_method") not in (None, "auto") and c.cp > 1 and pins["context_method"] != c.context:
        return False
    if "pp_virtual" in pins and c.pp > 1 and c.virtual != pins["pp_virtual"]:
        return False
    sp = pins.get("split_points")
    if sp and c.n_stages < len(sp) + 1:
        return False
    return True


def has_tied(gm: fx.GraphModule) -> bool:
    return len(list(gm.named_parameters(remove_duplicate=False))) != len(list(gm.named_parameters()))
