"""The per-graph tables of the joint planner's cost model (`search.plan_cost`).

Everything `PlanCostModel.evaluate` needs from the captured graph, each ingredient costed once
and cached on the model (`PlanTables`, which `plan_cost.PlanCostModel` extends), so that a
search over thousands of candidates on a 70B graph costs seconds:

  structure        the chain of pipeline units (`passes.split_pipeline.pipeline_units`: tok_emb,
                   layers.0 ... norm, lm_head), every node's unit (a node outside every unit is
                   costed with the first unit that reads it, as split_pipeline copies it there),
                   the parameters each unit reads, the bytes crossing each unit boundary as
                   c0 + c1 x rows, and the MoE blocks (`search.expert_detect.detect_moe`).
  per tp degree t  the sharding ILP (`search.shard_tables.shard_info`: `shard_ilp.solve_sharding`,
                   identical layers solved once) on the captured graph: every node's compute divisor and every
                   storage's memory divisor (`Plan.node_layouts`, applied as `cost.estimate`
                   applies them), the parameters' layouts, and the conversions the shard pass
                   will insert (one per producer, placement and partial gradient).
  per (t, b, cp)   for every pipeline unit at b rows per micro-batch (s / cp tokens a row,
                   `search.plan_context`): forward and backward seconds (cost.estimate's
                   roofline timer, TP divisors applied), the tensor-parallel conversions at b
                   rows (blocking, half forward, half backward), saved-activation bytes
                   (TP-divided; each storage charged to the unit that saves it first), FLOPs,
                   the bytes crossing each unit boundary (one tp rank's shard when sharded), and
                   the liveness walk's working set beyond the saved tensors (`cost.liveness`,
                   exact at 1 row and at the most rows, the chord in between: an overestimate,
                   the peak being convex). Identical blocks are costed once; every node's
                   seconds too (`node_fwd`, `node_bwd`, no tp conversions: what `search.plan_rank`
                   walks). `optimistic_units`: every node's work divided by t (for the bounds).
  per (t, z, d, e) model states per unit (`cost.memory.plan_states`, the count cost.estimate
                   uses, with the TP layouts and the plan's precision: params at param_dtype,
                   masters only when master_dtype differs, gradients as the engine keeps them,
                   optimizer states at their dtype, gradient payloads at reduce_dtype; with
                   offload only what stays on the device, `cost.memory.device_resident`, and
                   what the CPU steps; one parameter of each kind) under ZeRO stage z over d
                   ranks; expert parameters (`search.expert_detect.detect_moe`) over e ep
                   ranks (whole experts divided, grouped ones cut on ep). A unit holds what its
                   nodes read, directly or through input-free computation (`held_states`, as a
                   stage does); one read by several units apart (`UnitStates.shared`), on each
                   reader; one no node reads by the whole model alone (`UnitStates.whole`).
                   Buffers tp-local, the step's temporary without Adam's step scalars, each
                   parameter's gradient in backward (`param_grad`): as cost.estimate counts.
  one stage        `search.plan_rank.RankTables` (inherited): pp = 1 as cost.estimate prices it.
  offload          `search.plan_offload.OffloadTables` (inherited): the host copies and CPU step.
  per mesh         the axes' links (`search.plan_context`: `cost.comm.axis_links`, times and
                   bytes memoised per payload, dp joined with cp).

node.meta: reads `val` of the placeholders (the captured rows of a batch, the tokens in a row)
and otherwise reads node.meta only through `cost.analyze`, `passes.ir` and the sharding rules
(`passes.split_pipeline`, `search.shard_tables`, `search.expert_detect`); writes nothing.
Guarantees: deterministic; a cached table is what computing it again would give (each depends
only on its key and the constructor's arguments); the working set is never an underestimate.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import sympy
import torch
import torch.fx as fx

from autopar.cost import analyze, evaluate, liveness, load_profile
from autopar.cost.comm import axis_links
from autopar.cost.graph import GraphCost
from autopar.cost.hardware import Hardware
from autopar.cost.memory import (HELD_OUTPUTS, OptimizerSpec, device_resident, padded_numel, plan_states,
                                 resolve_precision, rows_of, tp_local_shape, with_param_dtype)
from autopar.cost.pipeline_memory import held_states
from autopar.cost.node_time import NodeTimer
from autopar.cost.power import sustained
from autopar.cost.placements import Placement, conversion_bytes, conversion_time
from autopar.cost.zero_comm import bucket_caps
from autopar.passes.plan import torch_dtype
from autopar.passes.rules.sharding import requires_grad_nodes
from autopar.passes.split_pipeline import pipeline_units
from autopar.search.candidate import Candidate
from autopar.search.expert_detect import detect_moe
from autopar.search.plan_context import ContextTables
from autopar.search.plan_offload import OffloadTables
from autopar.search.plan_rank import RankTables
from autopar.search.plan_selective import BLOCK_UNIT
from autopar.search.shard_tables import ShardInfo, shard_info
from autopar.search.stage_costs import boundary_divisors, cross_bytes

__all__ = ["CATEGORIES", "PlanTables", "ShardInfo", "UnitCosts", "UnitStates", "resolve_precision"]

_EXPERT = re.compile(r"\.experts\.\d+\.")
CATEGORIES = ("params", "grads", "master", "optimizer", "buffers")


@dataclass
class UnitCosts:
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
    workspace: float | None = None
    loss_workspace: float | None = None
    node_fwd: np.ndarray | None = None  # per node of the graph: forward, backward seconds
    node_bwd: np.ndarray | None = None
    node_tp: np.ndarray | None = None  # per node: the tp conversions it consumes (forward + backward)


@dataclass
class UnitStates:
    cat: dict[str, np.ndarray]  # per unit, its own parameters (read by that unit only)
    shared: list[tuple[dict[str, float], np.ndarray]]  # parameters read by several units: bytes, reader prefix
    grad_payload: np.ndarray  # per unit: gradient sync payload (all-reduce input / reduce-scatter input)
    gather: np.ndarray  # per unit: parameter all-gather payload (this rank's padded piece)
    adam_tmp: np.ndarray  # per unit: the optimizer step's temporary
    total: dict[str, float]  # every parameter once
    offload_elems: np.ndarray | None = None  # per unit, with offload: elements the CPU steps
    offload_mo: np.ndarray | None = None  # per unit, with offload: master + optimizer bytes on the host
    host_bytes: float = 0.0  # with offload: what this rank keeps in host memory
    param_grad: np.ndarray | None = None  # per parameter (gc.params order): its gradient in backward, masters' aside
    walk_grad: np.ndarray | None = None  # per unit, its own parameters' `param_grad` (the walk's gradients)
    pay_of: dict[str, tuple[float, float]] | None = None  # per parameter: (its grad_payload, its gather) on this rank
    whole: dict[str, float] | None = None  # parameters no node holds (an unread buffer): the model's, no stage's

    @property
    def master_grads(self) -> float:
        """Bytes of the separate masters' gradients (the part of total["grads"] backward does not make)."""
        return float(self.total["grads"] - self.param_grad.sum()) if self.param_grad is not None else 0.0

    def prefix_sums(self) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Prefix sums over the units (leading 0) per category, of all, and of the optimizer
        temporary, for every split (`search.plan_split`): once, as the table never changes."""
        hit = self.__dict__.get("_prefix_memo")
        if hit is None:
            z = np.zeros(1)
            hit = self._prefix_memo = ({k: np.concatenate([z, np.cumsum(v)]) for k, v in self.cat.items()},
                                       np.concatenate([z, np.cumsum(sum(self.cat.values()))]),
                                       np.concatenate([z, np.cumsum(self.adam_tmp)]))
        return hit


class PlanTables(ContextTables, RankTables, OffloadTables):
    """The per-graph tables of `plan_cost.PlanCostModel` (see the module docstring), each
    computed on first use and cached. The constructor is the model's: its arguments are
    documented on `PlanCostModel`."""

    def __init__(self, gm: fx.GraphModule, hardware: Any, world: int, *, global_batch: int | None = None,
                 optimizer: Any = "adamw", precision: Mapping[str, Any] | None = None,
                 param_pins: Mapping[str, Placement] | None = None,
                 node_pins: Mapping[str, Placement] | None = None, gc: GraphCost | None = None,
                 bucket_mb: float = 25.0, loss_parallel: bool = False):
        hw = load_profile(hardware)
        self.base_hw = hw
        if world > hw.world_size:
            hw = hw.with_nodes(-(-world // hw.gpus_per_node))
        self.hw: Hardware = hw
        self.world = world
        self.gm = gm
        self.gc = gc if gc is not None else analyze(gm, self.base_hw)
        self.opt = OptimizerSpec.of(optimizer)
        self.precision = resolve_precision(self.gc.params, precision)
        self.offload = bool(self.precision.get("offload"))
        self.param_dtype = torch_dtype(self.precision.get("param_dtype"))
        self.reduce_dtype = torch_dtype(self.precision.get("reduce_dtype"))
        self.param_pins = dict(param_pins or {})
        self.bucket_mb = bucket_mb
        self.bucket_bytes = bucket_caps(bucket_mb)
        self.node_pins, self.loss_parallel = dict(node_pins or {}), bool(loss_parallel)  # the ILP's; the loss's
        self.symbolic_batch = any(str(k) == "b" for k in self.gc.values())
        self.captured_rows = self._captured_rows()
        self.global_batch = int(global_batch or self.captured_rows or 1)
        self.max_rows = self.global_batch  # rows of a micro-batch at most (dp = micro-batches = 1)
        self._chain()
        self._experts()
        dtypes = [n.cost.dtype for n in self.gc.nodes if n.cost.kind in ("matmul", "attention")]
        # the compute dtype: the plan's param_dtype (the engine casts the model to it), else as captured
        self.compute_dtype = self.precision.get("param_dtype")
        self.hw = sustained(self.hw, self.gc, self.compute_dtype)  # as cost.estimate: the graph's GEMM duty
        self.main_dtype = self.compute_dtype or (max(set(dtypes), key=dtypes.count) if dtypes else "fp32")
        self._shard: dict[int, ShardInfo] = {}
        self._units: dict[tuple, UnitCosts] = {}
        self._states: dict[tuple, UnitStates] = {}
        self._links: dict[tuple, dict] = {}
        self._scheds: dict[tuple, Any] = {}
        self._split_cache: dict[tuple, Any] = {}
        self.ilp_seconds = 0.0
        self.context_facts()  # before any table reads a size: a guard on the sequence would specialise it

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
        hit = self.__dict__.get("_tokens_per_row_memo")
        if hit is None:  # the placeholders do not change: read them once per model
            hit = self._tokens_per_row_memo = self._read_tokens_per_row()
        return hit

    def _read_tokens_per_row(self) -> tuple[float, str]:
        for n in self.gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and isinstance(v, torch.Tensor):
                if not v.dtype.is_floating_point and v.dim() >= 2:  # hints: int() would specialise a symbolic size
                    return float(math.prod(d if isinstance(d, int) else int(d.node.hint) for d in v.shape[1:])), "tokens"
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
        self.blocks = np.array([1.0 if BLOCK_UNIT.search(name) else 0.0 for name in self.unit_names])
        # parameters each unit holds as a stage holds them (`held_states`): read by its nodes,
        # directly or through input-free computation, which split_pipeline copies to each reader
        key_name = {p.key: p.name for p in gc.params if p.key is not None}
        reads: list[set[str]] = [set() for _ in units]
        for held, u in zip(held_states(gc), self.node_unit):
            reads[u] |= {key_name[k] for k in held if k in key_name}
        readers: dict[str, list[int]] = {}
        for i, r in enumerate(reads):
            for p in r:
                readers.setdefault(p, []).append(i)
        self.unheld = {p.name for p in gc.params if p.name not in readers}  # the whole model holds them
        for p in gc.params:
            readers.setdefault(p.name, [0])
        self.readers = readers
        # boundary bytes as c0 + c1 * rows (the activations crossing are linear in the batch)
        if self.symbolic_batch:
            one = np.array(cross_bytes(gm, gc, units, {"b": 1}, 1.0))
            two = np.array(cross_bytes(gm, gc, units, {"b": 2}, 1.0))
            self.cross_c1 = two - one
            self.cross_c0 = one - self.cross_c1
        else:
            rows = self.captured_rows or 1
            self.cross_c0 = np.zeros(max(L - 1, 0))
            self.cross_c1 = np.array(cross_bytes(gm, gc, units, {}, 1.0)) / rows
        self.rg = requires_grad_nodes(gm)

    def _experts(self) -> None:
        """MoE blocks (`search.expert_detect.detect_moe`), their expert parameters and the
        experts' common count (an ep degree divides it)."""
        self.moe_blocks: list = []
        try:
            self.moe_blocks = detect_moe(self.gm)
        except Exception:  # noqa: BLE001 - no detector, or a block it cannot take apart: no expert parallelism
            self.moe_blocks = []
        self.expert_params = {n for b in self.moe_blocks for n in b.expert_params}
        self.n_experts = math.gcd(*[b.n_experts for b in self.moe_blocks]) if self.moe_blocks else 0

    @property
    def has_moe(self) -> bool:
        return self.n_experts > 1

    # ------------------------------------------------------------------ sharding per tp degree
    def sharding(self, t: int) -> ShardInfo:
        """The sharding ILP's plan for tp = t (solved once per t; t = 1: everything replicated)."""
        if (hit := self._shard.get(t)) is None:
            hit = self._shard[t] = shard_info(self.gm, self.gc, self.hw, self.world, t, param_pins=self.param_pins,
                                              node_pins=self.node_pins, rg=self.rg, fx_unit=self.fx_unit,
                                              captured_rows=self.captured_rows, loss_parallel=self.loss_parallel)
            self.ilp_seconds += hit.seconds
        return hit

    # ------------------------------------------------------------------ per-unit tables
    def rows_per_micro(self, c: Candidate) -> int | None:
        per = c.dp * c.ep * c.micro
        if self.global_batch % per:
            return None
        return self.global_batch // per

    def units(self, t: int, rows: int, cp: int = 1) -> UnitCosts:
        """Per-unit costs at tp = t, `rows` per micro-batch, s / cp tokens per sequence
        (`plan_context`: an attention call costs cp x its time at s / cp)."""
        key = (t, rows, cp)
        hit = self._units.get(key)
        if hit is not None:
            return hit
        gc, L = self.gc, self.L
        info = self.sharding(t)
        values = self._values(rows, cp)
        scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
        timer = NodeTimer(self.hw, values, compute_dtype=self.compute_dtype)
        fwd, bwd, act, flops = (np.zeros(L) for _ in range(4))
        memo: dict = {}

        def ev(x):  # identical layers repeat the same expressions: evaluate each once
            if not isinstance(x, sympy.Basic):
                return x
            r = memo.get(x)
            if r is None:
                r = memo[x] = evaluate(x, values)
            return r

        items, rep = self._unit_items(t)
        node_fb: dict[int, list] = {}  # per costed unit, its nodes' (forward, backward) seconds
        for u in range(L):
            r = rep[u]
            if r != u:  # an identical unit was costed already
                fwd[u], bwd[u], act[u], flops[u] = fwd[r], bwd[r], act[r], flops[r]
                continue
            fb = node_fb[u] = []
            for nc, d, saved in items[u]:
                f, b = timer.node(nc, d)
                k = cp if cp > 1 and "scaled_dot_product_attention" in nc.op else 1  # against every chunk
                fb.append((f * k, b * k))
                fwd[u] += f * k
                bwd[u] += b * k
                if nc.cost.kind not in ("none", "view", "comm"):
                    flops[u] += k * (ev(nc.cost.flops) + ev(nc.bwd_flops)) / d
                for nb, md in saved:
                    act[u] += ev(nb) / md
        fwd, bwd, act, flops = (x * scale for x in (fwd, bwd, act, flops))
        tpc, tp_bytes, loss_t, node_tp = np.zeros(L), np.zeros(L), 0.0, np.zeros(len(gc.nodes))
        if t > 1:
            link = axis_links(self.hw, {"dp": max(self.world // t, 1), "tp": t})["tp"]
            loss_t = sum(link.time(op, nb, "auto") for op, _a, nb in info.loss_comm(gc, ev))  # the vocab-parallel loss:
            fwd[self.node_unit[-1]] += loss_t  # its all-reduces block the last node, as estimate times them
            memo: dict = {}
            for unit, src, dst, pg, c0, c1, at in info.conversions:
                nb = c0 + c1 * rows / cp  # the per-row part is activations: s / cp tokens
                k2 = (src, dst, pg, nb)
                tm = memo.get(k2)
                if tm is None:
                    tm = memo[k2] = conversion_time(src, dst, pg, nb, link, t, self.hw.kernel_overhead_s)
                tpc[unit] += tm
                if at >= 0:
                    node_tp[at] += tm
                tp_bytes[unit] += conversion_bytes(src, dst, pg, nb, t)
        cross = self.cross(rows, cp, t)
        cross_in = np.concatenate([[0.0], cross])
        rc_save = np.where(self.blocks > 0, np.maximum(act - cross_in, 0.0), 0.0)
        rc_time = np.where(self.blocks > 0, fwd + tpc / 2, 0.0)
        out = UnitCosts(fwd + tpc / 2, bwd + tpc / 2, tpc, act, cross, rc_save, rc_time, flops, tp_bytes)
        # per node of the graph (in its order), as `cost.estimate` times them (no tp conversions)
        idx = np.fromiter((nc.index for its in items for nc, *_ in its), dtype=np.int64)
        both = np.array([x for u in range(L) for x in node_fb[rep[u]]]).reshape(-1, 2) * scale
        out.node_fwd, out.node_bwd = np.zeros(len(gc.nodes)), np.zeros(len(gc.nodes))
        out.node_fwd[idx], out.node_bwd[idx] = both[:, 0], both[:, 1]
        out.node_fwd[gc.nodes[-1].index] += loss_t
        out.node_tp = node_tp
        self._units[key] = out
        return out

    def _values(self, rows: int, cp: int = 1) -> dict[str, int]:
        """Symbol values with the batch at `rows` and the sequence at s / cp, keyed by name
        (cost.evaluate compares symbols by name, and a str key is much cheaper to name than a
        sympy Symbol)."""
        return self.values_at({"b": rows} if self.symbolic_batch else {}, cp)

    def cross(self, rows: int, cp: int = 1, t: int = 1) -> np.ndarray:
        """Bytes crossing each unit boundary on one rank at `rows` per micro-batch, s / cp tokens
        and tp = t: a boundary tensor sharded on tp (sequence parallel) counts the shard each
        rank sends and keeps (`search.stage_costs.boundary_divisors`)."""
        if cp == 1 and t == 1:
            return self.cross_c0 + self.cross_c1 * rows
        key = ("cross", cp, t)
        hit = self._split_cache.get(key)
        if hit is None:
            units = pipeline_units(self.gm)
            div = boundary_divisors(self.gc, self.sharding(t).mem_div) if t > 1 else None
            seq = {"s": self.seq_len() // cp} if cp > 1 else {}
            at = lambda b: np.array(cross_bytes(self.gm, self.gc, units, {"b": b, **seq}, 1.0, div))  # noqa: E731
            if self.symbolic_batch:
                one, two = at(1), at(2)
                hit = (2 * one - two, two - one)
            else:
                hit = (np.zeros(max(self.L - 1, 0)), np.array(cross_bytes(
                    self.gm, self.gc, units, seq, 1.0, div)) / (self.captured_rows or 1))
            self._split_cache[key] = hit
        return hit[0] + hit[1] * rows

    def _unit_items(self, t: int):
        """Per unit its nodes with their compute divisor and the saved storages it
        is charged for (each storage to the first node that saves it); and per unit the first
        unit with the same items (identical blocks are costed once)."""
        key = ("items", t)
        hit = self._split_cache.get(key)
        if hit is None:
            info, gc = self.sharding(t), self.gc
            items: list[list] = [[] for _ in range(self.L)]
            seen: set = set()
            for nc, u in zip(gc.nodes, self.node_unit):
                saved = []
                for k, nb, _tag in nc.saved:
                    if k in seen or gc._is_state(k):
                        continue
                    seen.add(k)
                    saved.append((nb, info.mem_div.get(k, 1)))
                items[u].append((nc, info.comp_div.get(nc.index, 1), tuple(saved)))
            first: dict = {}
            rep = []
            for u, its in enumerate(items):
                sig = tuple((id(nc.cost), nc.bwd_flops, nc.has_grad_fn, tuple(nb for _k, nb, _t in nc.saved), d, sv)
                            for nc, d, sv in its)
                rep.append(first.setdefault(sig, u))
            hit = self._split_cache[key] = (items, rep)
        return hit

    def optimistic_units(self, t: int, rows: int, cp: int = 1) -> tuple[np.ndarray, ...]:
        """Per unit (forward, backward) seconds per micro-batch with every
        node's work divided by t (s / cp tokens): no sharding does better, and it needs no ILP."""
        key = ("optimistic", t, rows, cp)
        hit = self._split_cache.get(key)
        if hit is not None:
            return hit
        values = self._values(rows, cp)
        scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
        timer = NodeTimer(self.hw, values, compute_dtype=self.compute_dtype)
        L = self.L
        f_, b_ = np.zeros(L), np.zeros(L)
        for nc, u in zip(self.gc.nodes, self.node_unit):
            f, b = timer.node(nc, t)
            k = cp if cp > 1 and "scaled_dot_product_attention" in nc.op else 1
            f_[u] += f * k
            b_[u] += b * k
        hit = self._split_cache[key] = (f_ * scale, b_ * scale)
        return hit

    def workspace(self, t: int, rows: int, cp: int = 1, at_loss: bool = False) -> float:
        """Liveness peak beyond the saved tensors (activation gradients, temporaries, logits),
        the outputs held through backward as `model.step` holds them. `at_loss`: the walk with
        the loss's own tensors (`ShardInfo.loss`: CROSS_ENTROPY, or VOCAB_PARALLEL; what `cost.estimate`
        walks), whose peak is at the loss's backward, before any parameter gradient exists.
        The walk is exact at 1 row and at the most rows any plan of this world gives a micro-
        batch; in between the chord (the peak is a maximum of sums linear in the rows, so
        convex in them, and the chord lies above it: never an underestimate)."""
        u = self.units(t, rows, cp)
        attr = "loss_workspace" if at_loss else "workspace"
        if getattr(u, attr, None) is None:
            hi = self.max_rows
            if not self.symbolic_batch or rows in (1, hi) or hi <= 1:
                w = self._liveness_extra(t, rows, cp, at_loss)
            else:
                w1, wh = self._liveness_extra(t, 1, cp, at_loss), self._liveness_extra(t, hi, cp, at_loss)
                w = w1 + (wh - w1) * (rows - 1) / (hi - 1)
            setattr(u, attr, w)
        return getattr(u, attr)

    def _liveness_extra(self, t: int, rows: int, cp: int = 1, at_loss: bool = False) -> float:
        key = ("live", t, rows, cp, at_loss)
        if (hit := self._split_cache.get(key)) is None:
            info = self.sharding(t)
            values = self._values(rows, cp)
            scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
            live = liveness(self.gc, values, param_grad_bytes={p.key: 0.0 for p in self.gc.params if p.key is not None},
                            storage_divisor=info.mem_div, loss=info.loss if at_loss else HELD_OUTPUTS)
            hit = self._split_cache[key] = max(0.0, live.peak - live.saved) * scale
        return hit

    def states(self, t: int, zero: int, dp: int, ep: int = 1) -> UnitStates:
        """Model states per unit (see the module docstring), `cost.model_states` for one
        parameter of every kind."""
        key = (t, zero, dp, ep)
        hit = self._states.get(key)
        if hit is not None:
            return hit
        reps, kinds, layouts = self._param_kinds(t, ep)  # grouped experts: their ep rows (`plan_rank`)
        reps = with_param_dtype(reps, self.param_dtype)  # as the engine holds them
        mesh = {"dp": dp, "tp": t, "ep": ep}
        z = zero if dp > 1 else 0
        dense = plan_states(reps, self.opt, precision=self.precision, zero_stage=z, dp=dp, rank=0,
                            param_layouts=layouts, mesh=mesh, dp_axis="dp").per_param
        per_kind = []
        for p in reps:
            full = dense.get(p.name, {})
            dev, host = device_resident(full, self.offload, z)
            row = {c: float(dev.get(c, 0)) for c in CATEGORIES}
            shape = tp_local_shape(p, layouts, mesh, "dp")
            if p.is_buffer:  # its tp-local piece, as cost.model_states counts it
                row = {c: 0.0 for c in CATEGORIES}
                row["buffers"] = float(math.prod(rows_of(shape)) * p.dtype.itemsize)
            if p.requires_grad and not p.is_buffer:
                g_item = (self.reduce_dtype or p.dtype).itemsize  # what is communicated
                gp = float(math.prod(rows_of(shape)) * g_item if z < 2 else dp * padded_numel(shape, dp) * g_item)
                ga = float(padded_numel(shape, dp) * p.dtype.itemsize)
            else:
                gp = ga = 0.0
            # the step's temporary (one per optimizer state element, the step scalar aside, as
            # cost.estimate counts it; on the device only)
            step = 4.0 if self.opt.step_tensor and p.requires_grad and not p.is_buffer and full.get("optimizer") else 0.0
            tmp = 0.0 if self.offload else self.opt.step_temporary(float(full.get("optimizer", 0)) - step,
                                                                   self.hw.device.kind)
            pg = float(full.get("grads", 0) - full.get("master_grads", 0)) if p.requires_grad and not p.is_buffer else 0.0
            elems = float(full.get("opt_elems", 0)) if self.offload else 0.0
            mo = float(full.get("master", 0) + full.get("optimizer", 0)) if self.offload else 0.0
            per_kind.append((row, gp, ga, tmp, elems, mo, host, pg))
        L = self.L
        cat = {c: np.zeros(L) for c in CATEGORIES}
        grad_payload, gather, adam = np.zeros(L), np.zeros(L), np.zeros(L)
        off_elems, off_mo = np.zeros(L), np.zeros(L)
        host_total = 0.0
        shared: list[tuple[dict[str, float], np.ndarray]] = []
        total = {c: 0.0 for c in CATEGORIES}
        param_grad, walk_grad, whole = np.zeros(len(self.gc.params)), np.zeros(L), dict.fromkeys(CATEGORIES, 0.0)
        pay_of: dict[str, tuple[float, float]] = {}
        for i, (p, kind) in enumerate(zip(self.gc.params, kinds)):
            row, gp, ga, tmp, elems, mo, host, pg = per_kind[kind]
            if ep > 1 and p.name in self.slot_expert_params:  # whole experts: E / ep of them here
                row = {c: v / ep for c, v in row.items()}
                gp, ga, tmp, elems, mo, host, pg = gp / ep, ga / ep, tmp / ep, elems / ep, mo / ep, host / ep, pg / ep
            param_grad[i] = pg
            pay_of[p.name] = (gp, ga)
            for c in CATEGORIES:
                total[c] += row[c]
            host_total += host
            us = self.readers[p.name]
            off_elems[us[0]] += elems  # the CPU steps each parameter once (on its first reader's stage)
            off_mo[us[0]] += mo
            if p.name in self.unheld:  # a one-stage plan holds it, a pipeline stage does not
                for c, v in [*row.items(), ("_adam", tmp), ("_walk", sum(row.values()) - row["grads"] + pg)]:
                    whole[c] = whole.get(c, 0.0) + v
                grad_payload[0] += gp
                gather[0] += ga
            elif len(us) == 1:
                u = us[0]
                for c in CATEGORIES:
                    cat[c][u] += row[c]
                grad_payload[u] += gp
                gather[u] += ga
                adam[u] += tmp
                walk_grad[u] += pg
            else:
                cnt = np.zeros(L + 1)
                mark = np.zeros(L)
                mark[us] = 1.0
                cnt[1:] = np.cumsum(mark)
                walk = sum(row[c] for c in CATEGORIES) - row["grads"] + pg  # beside activations (`plan_split`)
                shared.append(({**row, "_grad": gp, "_gather": ga, "_adam": tmp, "_walk": walk}, cnt))
                # the gradient is synchronised by the last reader's stage; count it there
                grad_payload[us[-1]] += gp
                gather[us[0]] += ga
        out = UnitStates(cat, shared, grad_payload, gather, adam, total, off_elems, off_mo, host_total, param_grad,
                         walk_grad, pay_of, whole)
        self._states[key] = out
        return out

    # ------------------------------------------------------------------ copies and sharing
    @property
    def trainable(self) -> bool:
        return any(p.requires_grad and not p.is_buffer for p in self.gc.params)

    def with_buckets(self, bucket_mb: float) -> "PlanTables":
        """The same tables costing ZeRO 0-2 gradient buckets of `bucket_mb` MiB: a shallow copy
        sharing every table but the rank buckets (`plan_rank._rank_buckets`), the one that
        depends on the size. Memory does not: the engines' in-flight flat buffers are priced whole."""
        out = copy.copy(self)
        out.bucket_mb, out.bucket_bytes = float(bucket_mb), bucket_caps(bucket_mb)
        out._split_cache = {k: v for k, v in self._split_cache.items()
                            if not (isinstance(k, tuple) and k and k[0] == "rank_buckets")}
        return out

    def share_tables(self, other: "PlanTables") -> None:
        """Reuse `other`'s sharding ILPs and unit tables (they do not depend on the model states:
        the same graph, hardware and world, another precision or offload)."""
        assert other.gm is self.gm and other.world == self.world and other.compute_dtype == self.compute_dtype \
            and other.loss_parallel == self.loss_parallel
        self._shard, self._units, self._links, self._scheds = other._shard, other._units, other._links, other._scheds
