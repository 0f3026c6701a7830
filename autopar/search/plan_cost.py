"""The joint planner's cost model: one candidate plan -> predicted step time and memory per rank.

A `Candidate` (`search.candidate`) fixes the mesh (tp x pp x dp, x ep for MoE), the ZeRO stage,
the number of micro-batches and, with pp > 1, the pipeline schedule. `PlanCostModel.evaluate`
predicts its
step time and the memory of every rank. The model is composed from `autopar.cost`'s parts,
each ingredient costed once and cached, so that a search over thousands of candidates on a
70B graph costs seconds. The ingredients are the per-graph tables of `search.plan_tables`
(`PlanTables`, which `PlanCostModel` extends): per tp degree the sharding ILP's divisors and
conversions; per (tp, rows per micro-batch) every pipeline unit's forward and backward time,
tensor-parallel conversions, saved activations, FLOPs, boundary bytes and the working set; per
(tp, ZeRO stage, dp, ep) the model states per unit. Expert parallelism's collectives and
routed expert compute are rank 0's nodes as `cost.estimate` times them (`search.plan_rank.
rank_nodes`), at any pp.

For a candidate:
  stages   S = pp x v stages; an exact min-max DP over the unit boundaries, then among the
           splits within the optimal bottleneck the one with the least sum of squared stage
           times (`search.plan_split`). A stage's time includes the recomputation it needs to
           fit its memory: whole blocks (`layers.N`) recomputed, as few as fit, the blocks that
           free most memory per second of recomputation; where some are, the same again with
           them "selective" (`search.plan_selective`), the faster kept. With one stage per rank the
           stage's memory is the rank's (exact); with v per rank (interleaved_1f1b: v searched,
           `candidate.virtual_choices`) each stage gets its share of the rank in the DP
           (`search.stage_memory.stage_budgets`: first its share in the time-balanced split,
           walked, which admits an even split that fits, then shares summing to the rank's
           limit), the recompute
           is chosen per rank against the schedule walk, and the walk below has the last word.
  pp = 1   data parallelism and memory are `cost.estimate`'s, by the same functions on the
           rank's whole graph (`search.plan_rank`: buckets of whole parameters ready per node,
           ZeRO 3's runtime units gathered every micro-batch and reduce-scattered once, the
           liveness walk with the gradients as backward makes them, with recompute the
           checkpointed regions' walk, `cost.timeline`; with ep the rank's experts on their
           routed rows and the expert collectives on their nodes, `cost.expert_memory`,
           `cost.expert_comm`);
           tests/unit/test_one_cost_model.py checks the two agree to 1e-6. The rest below is
           the pipeline's per-unit model.
  time     pp = 1: m (F + B). pp > 1: the schedule's simulator (`cost.schedule.simulate`)
           with per-stage F, B and point-to-point times. Then per rank: gradient
           synchronisation over dp per unit in backward order, overlapped with the last
           micro-batch's backward (ZeRO 0/1 all-reduce, 2 reduce-scatter, padded as the
           runtime pads); the ZeRO 1/2 parameter all-gather after the step (exposed); ZeRO 3
           per micro-batch: each unit gathered before its forward (prefetched one unit ahead)
           and again before its backward, its gradients reduce-scattered after it; expert
           all-to-alls (dispatch and combine, forward and backward, blocking); the optimizer
           step (memory bound, as cost.estimate; with offload on the CPU after the host copies,
           `cost.optimizer_step`). Compute at the plan's compute dtype (its
           param_dtype) peak. The step is the slowest rank's. Overlap is not free
           (`cost.overlap`, the profile's `contention` k per link): compute beside a gradient
           bucket or a ZeRO-3 gather / reduce-scatter in flight runs (1 + k) times slower, so
           what is exposed is what cannot hide behind the slowed compute (as `cost.estimate`
           prices it); a stage's compute is stretched by k x the work its pipeline transfers
           overlap (per micro-batch 2 x (hop in + hop out), taken as overlapping its compute one
           after another: an upper estimate where sends and receives run at once).
  memory   per rank: its stages' states (a parameter read on two stages counted on both) + the
           activations it holds at the schedule's worst point (F adds a micro-batch's saved
           bytes and its stage input, B/W release them) + the working set + communication
           buffers (ZeRO 0/1 the flat gradient copy, 2 its padded input and output, 3 two
           gathered units); or the optimizer step's peak (states + one temporary per
           optimizer state element), whichever is larger. That chooses the split; the chosen
           split's per-rank peaks (pp > 1, ep too; recompute walked as its checkpoint regions run,
           its recomputed forward on the stage's B) are then `cost.estimate`'s walk
           along each rank's actions (`search.plan_pipeline_memory`), and its step
           `cost.pipeline_time`'s, ZeRO 3 per stage and tp in stages as estimate's (test_one_cost_model_pipeline).

Bounds (`lower_bounds`, `optimistic_bounds` without the ILP, and a split's bound before its
schedule is simulated) never exceed these predictions; the planner prunes with them. A pipeline
split that recomputes is simulated before its stages are walked: when its last action ends past
the cutoff it is pruned unwalked (its peak then the per-unit model's).

Simplifications (stated so that a reader can weigh predictions): times are per rank and the
same on every tp/dp rank; stage-boundary transfers send the whole activation (a sequence-
parallel boundary would send 1/t of it); the working set is the whole graph's, on every
stage; each stage's data-parallel buckets run on one stream per rank (the engines share the
link); with pp > 1 the split DP holds the gradients backward makes (not the masters') beside
every micro-batch's activations (one micro-batch: conservative by up to them), takes ZeRO 3 per
unit (the chosen split walks it per stage), and recomputed blocks keep their input (and a
selective block its GEMMs' outputs) only (collective outputs inside a block, which the
recompute pass keeps, are not counted; the choice of blocks uses this at pp = 1 too).

node.meta: read only by the tables (`search.plan_tables`: the placeholders' `val`, the rest
through `cost.analyze`, `passes.ir` and the sharding rules); nothing here reads or writes it.
Deterministic. Public: `PlanCostModel`; `Candidate`, `Evaluation` (`search.candidate`) and
`ShardInfo` (`search.shard_tables`) import from here too.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from autopar.cost.optimizer_step import step_bytes
from autopar.cost.overlap import contention_of
from autopar.cost.pipeline_time import simulate_ranks, stretch_stage_times, zero3_tail
from autopar.cost.schedule import fuse_backward, held_peaks, small_schedule
from autopar.search.candidate import Candidate, Evaluation
from autopar.search.plan_comm import dp_sync, stage_payloads, zero3_exposed
from autopar.search.plan_comm_report import comm_report
from autopar.search.plan_pipeline_memory import grads_of, pipeline_rank_peaks, stage_recompute_seconds
from autopar.search.plan_pipeline_time import stage_node_shift, zero3_stage_times
from autopar.search.plan_selective import selective_keep, with_modes
from autopar.search.plan_split import INF, SplitChain, chain_factor, in_flight_floor
from autopar.search.plan_tables import CATEGORIES, PlanTables, UnitCosts, UnitStates
from autopar.search.shard_tables import ShardInfo
from autopar.search.stage_memory import choose_recompute, fit_recompute, freed_bytes, stage_budgets

__all__ = ["Candidate", "Evaluation", "PlanCostModel", "ShardInfo"]

class PlanCostModel(PlanTables):
    """The cost model of plans for one captured graph on one kind of hardware (see the module
    docstring): the per-graph tables of `PlanTables`, and the bounds and evaluation of
    candidates on them. `world` is the mesh size the plans are for (it sets how many nodes the
    hardware has, hence which axes cross nodes).

    Args:
        gm: the captured global graph (batch dim dynamic, or static: then times and
            activations scale linearly with the rows of a micro-batch).
        hardware: profile name or Hardware.
        world: ranks of the mesh.
        global_batch: rows per step (default: the captured batch).
        optimizer: model-state accounting (`cost.memory.plan_states`).
        precision: the Plan's precision fields the plans run with (`plan_tables.resolve_precision`:
            missing ones from the model's default recipe); offload True prices masters and
            optimizer states on the host and the step on the CPU.
        param_pins: parameter name -> tp placement for the sharding ILP.
        gc: `analyze(gm, hardware)` when already computed.
    """

    # ------------------------------------------------------------------ bounds
    def optimistic_bounds(self, c: Candidate, recompute: bool = True) -> tuple[float, float]:
        """`lower_bounds` without the sharding ILP: every node's work and every saved tensor
        divided by tp, the model states of tp = 1 divided by tp (padding aside, which the
        0.1 % slack covers)."""
        rows = self.rows_per_micro(c)
        f0, b0 = self.optimistic_units(c.tp, rows, c.cp)
        f, b = self.rank_ep_floor(c, rows, f0, b0)
        st = self.states(1, c.zero, c.replicas, c.ep)
        t = c.tp
        opt_tot = self._opt_time({k: v / t for k, v in st.total.items()}, st.master_grads / t, c,
                                 *self._offload_totals(st, t))
        u1 = self.units(1, rows, c.cp)
        act = self._act_floor(u1, t, recompute) + self._inputs_floor(c, u1, recompute)
        states = sum(st.total.values()) / t * (1 - 1e-3)
        if self._one_stage(c):  # the gradients may appear only after the activations' peak (ep: the routed rows' fewer)
            return self._time_bound(c, f, b, opt_tot, st, t), max(states - st.total["grads"] / t + act, states) \
                if self._ep_of(c) < 2 else states
        if self._ep_of(c) > 1:  # as `lower_bounds`
            act = 0.0
        return self._time_bound(c, f, b, opt_tot, st, t), max(self._mem_bound(c, states - grads_of(st) / t, act),
                                                                states / c.pp)

    def _inputs_floor(self, c: Candidate, u: UnitCosts, recompute: bool) -> float:
        """Every stage but the first keeps its input (the activation crossing its first
        boundary) for each micro-batch in flight: at least the smallest boundary each; none
        apart where recompute may run (a stage's recomputed first block keeps only that input,
        which `_act_floor` already counts)."""
        S = c.n_stages
        return (S - 1) * float(u.cross.min()) if S > 1 and len(u.cross) and not recompute else 0.0

    def _act_floor(self, u: UnitCosts, div: int, recompute: bool) -> float:
        """The least activation bytes one micro-batch keeps over all units: a recomputed block
        keeps its input only."""
        act = u.act / div
        if recompute:
            cross_in = np.concatenate([[0.0], u.cross])
            act = np.where(self.blocks > 0, np.minimum(act, cross_in / div), act)  # a block's input: at best /tp (sp)
        return float(act.sum())

    def lower_bounds(self, c: Candidate, recompute: bool = True) -> tuple[float, float]:
        """(step time, peak memory) that no split, recompute or overlap can beat: the busiest
        rank does at least its share (and the largest unit) of every micro-batch and of the
        optimizer step; a one-stage-per-rank schedule also waits for the first forward to
        reach each stage (`plan_split.chain_factor`); a rank holds at least its share of the model
        states and of the activations in flight (`_mem_bound`), recomputed where `recompute`,
        plus the working set and ZeRO 3's gathered units."""
        rows = self.rows_per_micro(c)
        u = self.units(c.tp, rows, c.cp)
        st = self.states(c.tp, c.zero, c.replicas, c.ep)
        f, b = self._ep_adjusted(c, u.fwd, u.bwd)
        opt_tot = self._opt_time(st.total, st.master_grads, c, *self._offload_totals(st))
        act = self._act_floor(u, 1, recompute) + self._inputs_floor(c, u, recompute)
        states = sum(st.total.values())
        if self._one_stage(c):  # the walk evaluate prices; with recompute, what the checkpointed walk keeps at least
            z3 = self.zero3_transient(c.tp, c.replicas, self._ep_of(c)) if c.zero == 3 and c.replicas > 1 else 0.0
            grads = float(st.total["grads"])
            one_act = self.rank_act_peak(c, rows, st.param_grad) - grads + z3 if not recompute else act - grads + z3
            return self._time_bound(c, f, b, opt_tot, st), max(states + one_act, states)
        if self._ep_of(c) > 1:  # the dense tables' activations are not the routed rows' (a capacity drops rows)
            act = 0.0
        # the stage walks (`plan_pipeline_memory`): gradients as made
        return self._time_bound(c, f, b, opt_tot, st), max(self._mem_bound(c, states - grads_of(st), act),
                                                             states / c.pp)

    def _one_stage(self, c: Candidate) -> bool:
        """Whether `c` is priced on the rank's whole graph (`search.plan_rank`): one stage."""
        return c.pp == 1

    def _mem_bound(self, c: Candidate, states: float, act: float) -> float:
        """The fullest rank's memory is at least the ranks' average, and at least a weighted
        average: a stage s holds k_s micro-batches' activations at once, so a rank whose stages
        have a_s of them holds at least max_s k_s a_s >= a_r h_r (h_r = 1 / sum 1/k_s over its
        stages); spread as evenly as any split can, the fullest rank holds A / sum_s 1/k_s, and
        with weights 1/h_r the states add their share (`in_flight_floor` gives k_s)."""
        if c.pp == 1:
            return states + act
        k_s, s2r = in_flight_floor(c)
        inv = [0.0] * c.pp
        for k, r in zip(k_s, s2r):
            inv[r] += 1.0 / max(k, 1.0)
        H = sum(inv)
        h_max = max(1.0 / x for x in inv if x > 0)
        return max((states + act / c.virtual) / c.pp, (states / h_max + act) / H)

    def _time_bound(self, c: Candidate, f: np.ndarray, b: np.ndarray, opt_tot: float,
                    st: UnitStates | None = None, div: float = 1.0) -> float:
        """A step time no split, recompute or overlap can beat (see `lower_bounds`). The
        data-parallel traffic a rank cannot avoid is in it too: one collective of the total
        payload is never slower than its buckets (alpha-beta, so ranks' shares sum to at least
        the whole); ZeRO 1/2's parameter gather follows the step; ZeRO 3's gathers and
        reduce-scatters share one stream and overlap only compute; with one stage, the
        gradient sync overlaps at most the last micro-batch's backward."""
        m, p = c.micro, c.pp
        per = f + b
        F, B = float(f.sum()), float(b.sum())
        z = c.zero if c.replicas > 1 else 0
        fwd_min, bwd_min, after, sync = F, B, 0.0, 0.0
        if st is not None and c.replicas > 1:
            al = self.links(c)["dp"]
            gp = float(st.grad_payload.sum()) / div * (1 - 1e-3)
            ga = float(st.gather.sum()) / div * (1 - 1e-3)
            if z < 3:
                sync = al.time("all_reduce" if z < 2 else "reduce_scatter", gp) if gp > 0 else 0.0
                after = al.time("all_gather", ga) if z in (1, 2) and ga > 0 else 0.0
            else:
                g = al.time("all_gather", ga) if ga > 0 else 0.0
                rs = al.time("reduce_scatter", gp) if gp > 0 else 0.0
                fwd_min, bwd_min, last_b = max(F, g), max(B, g + rs), max(B, rs)
        work = m * (fwd_min + bwd_min)
        if z == 3 and st is not None and c.replicas > 1:  # reduce-scatters once a step (pipelines: per stage)
            work = m * fwd_min + (m - 1) * B + last_b
        lb = max((work + opt_tot + after) / p, m * float(per.max()))
        if p == 1:
            lb = max(lb, work + max(0.0, sync - B) + after + opt_tot)
        elif c.virtual == 1:
            gamma = 1.0 if c.schedule in ("1f1b", "gpipe") else float(np.min(np.where(per > 0, f / np.maximum(per, 1e-300), 1.0)))
            lb = max(lb, chain_factor(m, p, gamma) * float(per.sum()))
        return lb + self.context_exposed(c)  # the attention exchange is on top of every rank's step

    def _opt_time(self, x: Mapping[str, float], master_grads: float, c: Candidate, elems: float = 0.0,
                  host_mo: float = 0.0) -> float:
        """The optimizer step of a rank holding states `x` (by category), as cost.estimate prices it
        (`cost.optimizer_step`): on the device, memory bound; offloaded, the CPU's step after the
        rank's gradient rows (`elems`) go down and before its parameter rows come back."""
        if not any(p.requires_grad for p in self.gc.params):
            return 0.0
        if self.offload:
            return sum(self._offload_parts(elems, host_mo, c.zero))
        z = c.zero if c.replicas > 1 else 0
        nbytes = step_bytes(x["master"], x["optimizer"], x["params"], x["grads"], master_grads,
                            c.replicas if z in (1, 2) else 1)
        return nbytes / (self.hw.device.memory_bandwidth * self.hw.eff("memory"))

    def _ep_adjusted(self, c: Candidate, fwd, bwd):
        """Per-unit forward and backward with expert parallelism: rank 0's nodes as cost.estimate
        times them (`search.plan_rank.rank_ep_units`: its experts on their routed rows, the
        expert collectives blocking the nodes they sit on), one stage or a pipeline's."""
        if c.ep < 2 or not self.moe_blocks:
            return fwd, bwd
        return self.rank_ep_units(c, fwd, bwd)

    def schedule(self, c: Candidate):
        """The step's schedule of `c` (v stages per rank for interleaved_1f1b), memoised."""
        key = (c.schedule, c.pp, c.micro, c.virtual)
        hit = self._scheds.get(key)
        if hit is None:
            hit = self._scheds[key] = small_schedule.__wrapped__(c.schedule, c.pp, c.micro, c.virtual)
        return hit

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, c: Candidate, limit: float, *, pins: Sequence[str] = (), recompute: Any = "auto",
                 minimise: str = "time", cutoff: float | None = None, memory_only: bool = False,
                 walk_retry: bool = True) -> Evaluation:
        """Predict `c` (see the module docstring).

        Args:
            limit: bytes per device every rank must stay under.
            pins: unit names that must start a stage (pinned split points).
            recompute: "auto" (as little as fits, per stage: blocks recomputed whole, and where
                they are, the same plan with its blocks "selective" too, `search.plan_selective`,
                the faster kept), "none", "full" or "selective" (every block), or
                {unit: "full" | "selective" | "none"} for pinned units (the rest "auto", whole).
            minimise: "time", or "memory" (the split and recompute that need the least memory,
                for reporting how far an infeasible request is from fitting).
            cutoff: a step time to beat; when the split's bound is over it, the schedule is not
                simulated and the Evaluation comes back with `pruned` set and the bound as its
                step time. A plan over the memory limit is not simulated either (step = inf).
            memory_only: return once the memory is known (step = inf, nothing timed): what the
                planner's report needs of a candidate's least memory.
            walk_retry: a pipeline split that fits on the per-unit model (with the recompute it
                chose) but not on estimate's walk is evaluated again (once) with the limit lowered by the
                difference, so that recompute is chosen to free it (recompute allowed).
        """
        kw = dict(pins=pins, recompute=recompute, minimise=minimise, memory_only=memory_only, walk_retry=walk_retry)
        flavor = "selective" if recompute == "selective" else "full"  # blocks not pinned one way
        ev = self._evaluate(c, limit, flavor, cutoff=cutoff, **kw)
        if flavor == "full" and recompute == "auto" and minimise == "time" and not memory_only and ev.recompute \
                and (ev.pruned or ev.feasible) and selective_keep(self):
            # the blocks it recomputes kept selective: less replayed where what they free still fits
            sel = self._evaluate(c, limit, "selective", cutoff=cutoff if ev.pruned else min(ev.step_s, cutoff or INF), **kw)
            if sel.step_s < ev.step_s and (ev.pruned or not sel.pruned):
                return sel
        return ev

    def _evaluate(self, c: Candidate, limit: float, flavor: str, *, pins: Sequence[str], recompute: Any, minimise: str,
                  cutoff: float | None, memory_only: bool, walk_retry: bool, walk_limit: float | None = None
                  ) -> Evaluation:
        """`evaluate` with the blocks it recomputes recomputed `flavor` ("full" or "selective");
        `walk_limit`: what the walked peaks must fit when a retry lowered `limit` (the walk is the truth)."""
        rows = self.rows_per_micro(c)
        if rows is None or rows < 1:
            raise ValueError(f"{c.label()}: the global batch of {self.global_batch} rows does not divide by "
                             f"dp x ep x micro-batches = {c.dp * c.ep * c.micro}")
        pin_modes = self._pin_modes(recompute)
        u = with_modes(self, self.units(c.tp, rows, c.cp), flavor, pin_modes, c.tp, rows, c.cp)
        st = self.states(c.tp, c.zero, c.replicas, c.ep)
        links = self.links(c)
        L, S, m, v = self.L, c.n_stages, c.micro, c.virtual
        z = c.zero if c.replicas > 1 else 0
        if S > L:
            raise ValueError(f"{c.label()}: {S} stages need at least {S} units, the model has {L}")
        # in-flight micro-batches per stage without building the step's schedule (exact for
        # 1F1B and GPipe, a floor otherwise); the schedule itself is built only for a split that
        # fits on a small version of it
        if c.pp > 1:
            k_s, s2r = in_flight_floor(c)
            k_s = np.array(k_s)
        else:
            k_s, s2r = np.ones(1), [0]
        exact_k = c.pp == 1 or c.schedule in ("1f1b", "gpipe")
        sched = None
        P = c.pp
        stages_of = [[s for s in range(S) if s2r[s] == r] for r in range(P)]
        # per-unit times per micro-batch, with ZeRO-3 gathers and expert parallelism
        f0, b0 = self._ep_adjusted(c, u.fwd, u.bwd)
        # one stage: data parallelism and memory on the rank's whole graph, as cost.estimate
        # prices them (`search.plan_rank`); a pipeline's stages: per unit (`search.plan_comm`)
        one = self._one_stage(c)
        z3f, z3b = zero3_exposed(f0, b0, st, links.get("dp")) if z == 3 and not one else (np.zeros(L), np.zeros(L))
        F_u, B_u = f0 + z3f, b0 + z3b
        ws = self.workspace(c.tp, rows, c.cp)
        R = c.replicas  # ranks holding the same parameters (dp, x cp)
        z3_units = (self.zero3_transient(c.tp, R, self._ep_of(c)) if one else 2 * R * float(st.gather.max())) if z == 3 else 0.0
        fixed = ws + z3_units  # ZeRO 3: a unit gathered + the next
        if one:  # the activation walk's peak with the gradients as backward makes them
            one_act = self.rank_act_peak(c, rows, st.param_grad) - float(st.total["grads"]) + z3_units
        trans_u = st.grad_payload * ((1 + 1 / R) if z == 2 else 1.0) if z < 3 and R > 1 else np.zeros(L)
        pp_link = links.get("pp")
        hop = np.array([pp_link.time("send_recv", float(x)) if pp_link is not None and x > 0 else 0.0
                        for x in u.cross]) if S > 1 else np.zeros(max(L - 1, 0))
        rc_pin = self._recompute_pins(recompute)
        rc_ok = float(recompute != "none")  # the split DP counts on recompute only where it may run
        chain = SplitChain(F_u, B_u, u.act, u.cross, hop, u.rc_save * rc_ok, u.rc_time, self.blocks, st, trans_u, fixed,
                           rc_pin)
        pin_idx = sorted(self.unit_names.index(p) for p in pins)
        small = small_schedule(c.schedule, c.pp, c.micro if c.schedule == "gpipe" else min(c.micro, 2 * c.pp), v) \
            if c.pp > 1 else None
        # v stages on a rank: first each stage's share of its rank in the time-balanced split,
        # walked (admits an even split that fits), checked by the walk; then shares that sum to
        # the rank's limit (sufficient) (`search.stage_memory`). One stage per rank: exact.
        for mode in (("walk", "sum") if v > 1 and minimise == "time" else ("sum",)):
            stage_limit, opt_limit = stage_budgets(chain, k_s, s2r, limit, fixed, mode, small, pin_idx)
            starts = [0] if S == 1 else chain.split(S, k_s, s2r, stage_limit, pin_idx, minimise, opt_limit)
            if starts is None and cutoff is not None and v == 1 and exact_k:  # exact here: nothing fits
                lb_m = self.lower_bounds(c, recompute != "none")[1]
                return Evaluation(candidate=c, step_s=INF, peak_bytes=max(lb_m, limit * (1 + 1e-6)), limit_bytes=limit,
                                  memory={"peak": lb_m, "limit": limit}, compute_s=0.0, bubble=0.0, recompute_s=0.0,
                                  optimizer_s=0.0, comm={}, flops=0.0, mfu=0.0, tokens_per_s=0.0, rows_per_micro=rows,
                                  notes=["no split fits the memory limit (peak: a lower bound)"])
            if starts is None and mode == "walk":
                continue
            if starts is None:  # nothing fits: the split that needs the least memory, for the report
                starts = chain.split(S, k_s, s2r, stage_limit, pin_idx, "memory", opt_limit)
            ends = starts[1:] + [L]
            base_a = [float(u.act[starts[s]:ends[s]].sum()) + (float(u.cross[starts[s] - 1]) if starts[s] > 0 else 0.0)
                      for s in range(S)]
            base_st = [chain.states_range(starts[s], ends[s]) for s in range(S)]
            act_st = [chain.act_states_range(starts[s], ends[s]) for s in range(S)]  # beside the activations
            if v > 1:  # recompute per rank against its schedule walk
                chosen_all, fits = fit_recompute(small, starts, ends, base_st, base_a, k_s, u, self.blocks, chain,
                                                 trans_u, fixed, limit, rc_pin, recompute, minimise, act_st)
                if fits or mode == "sum":
                    break
                continue
            chosen_all = set()  # one stage per rank: as little recompute as fits the stage
            for s in range(S):
                excess = act_st[s] + k_s[s] * base_a[s] + fixed - stage_limit[s]
                if one:
                    excess = base_st[s] + one_act - stage_limit[s]
                elif s == S - 1:  # the loss's backward (see the peak below); recompute frees both alike
                    excess = max(excess, excess + base_st[s] - act_st[s] + self._loss_extra(
                        c, rows, chain.categories(starts[s], ends[s]), ws))
                blocks = [(x, float(k_s[s])) for x in range(starts[s], ends[s])]
                chosen_all |= set(choose_recompute(blocks, u, self.blocks, excess, rc_pin, recompute, minimise))
        rc_units: dict[str, str] = {}
        F_s, B_s, act_s, states_s, cats_s, rc_s = [], [], [], [], [], []
        fused: list[int] = []  # stages holding checkpoint regions: one backward, no I/W split
        for s in range(S):
            i, j = starts[s], ends[s]
            chosen = [x for x in range(i, j) if x in chosen_all]
            if chosen:
                fused.append(s)
            saved = freed_bytes(u, chosen_all, i, j)
            rtime = sum(u.rc_time[x] for x in chosen)
            for x in chosen:
                rc_units[self.unit_names[x]] = pin_modes.get(x, flavor)
            if one and chosen:  # estimate's walk of the checkpointed regions: its peak and recompute time
                rc_peak, rtime = self.rank_recompute(c, rows, tuple(rc_units.items()), st.param_grad)
                one_act = rc_peak - float(st.total["grads"]) + z3_units
            elif chosen:  # the stage's regions as estimate walks them
                rtime = stage_recompute_seconds(self, c, rows, [(self.unit_names[x], pin_modes.get(x, flavor))
                                                                for x in chosen])
            F_s.append(float(F_u[i:j].sum()))
            B_s.append(float(B_u[i:j].sum()) + rtime)
            act_s.append(base_a[s] - saved)
            states_s.append(base_st[s])
            cats_s.append(chain.categories(i, j))
            rc_s.append(rtime)
        shift = stage_node_shift(self, c, u, starts, ends) if S > 1 else None  # input-free copies per stage
        if shift is not None:
            F_s = [a + x for a, x in zip(F_s, shift[0])]
            B_s = [a + x for a, x in zip(B_s, shift[1])]
        F_s, B_s, z3_s = zero3_stage_times(self, c, rows, starts, ends, u, links.get("dp"), F_s, B_s, f0, b0, rc_s, one,
                                           shift)
        # pipeline transfers slow the compute beside them (`cost.pipeline_time`, as cost.estimate)
        stretch_stage_times(F_s, B_s, [float(hop[starts[s + 1] - 1]) for s in range(S - 1)], contention_of(pp_link))
        # per rank: its states by category and its optimizer step (no schedule needed)
        cats_r = [{k: sum(cats_s[s][k] for s in stages_of[r]) for k in CATEGORIES} for r in range(P)]
        st_r = [sum(states_s[s] for s in stages_of[r]) for r in range(P)]
        act_r = [sum(chain.act_states_range(starts[s], ends[s]) for s in stages_of[r]) for r in range(P)]
        off = [(sum(float(st.offload_elems[starts[s]:ends[s]].sum()) for s in stages_of[r]),
                sum(float(st.offload_mo[starts[s]:ends[s]].sum()) for s in stages_of[r]))
               if st.offload_elems is not None else (0.0, 0.0) for r in range(P)]
        opt_r = [self._opt_time(x, st_r[r] - act_r[r], c, *o) for r, (x, o) in enumerate(zip(cats_r, off))]
        early = dict(candidate=c, limit_bytes=limit, compute_s=0.0, bubble=0.0, recompute_s=0.0, optimizer_s=0.0,
                     comm={}, flops=0.0, mfu=0.0, tokens_per_s=0.0, rows_per_micro=rows, recompute=dict(rc_units),
                     split_points=[self.unit_names[i] for i in starts[1:]])
        # memory per rank: states + the most activations held along its actions, first on the
        # schedule with at most 2p micro-batches (it never holds more: the peak is in the
        # warm-up), which decides most plans that do not fit without building the step's
        # schedule; then the split's time bound; only then the step's schedule
        if c.pp > 1 and cutoff is not None and minimise == "time":
            held_small = held_peaks(fuse_backward(small, fused), act_s)
            worst = max(act_r[r] + held_small[r] + fixed for r in range(P))
            if worst > limit * (1 + 1e-9):
                return Evaluation(step_s=INF, peak_bytes=worst, memory={"peak": worst, "limit": limit},
                                  notes=["over the memory limit (peak: a lower bound)"], **early)
            lb = self._split_bound(c, F_s, B_s, opt_r, stages_of)
            if lb >= cutoff:
                return Evaluation(step_s=lb, peak_bytes=worst, memory={"peak": worst, "limit": limit},
                                  notes=["bound over the cutoff (peak: a lower bound)"], pruned=True, **early)
        if c.pp > 1:
            # under ZB-H1 / ZBV a stage holding checkpoint regions runs its backward whole at its
            # I and no W (runtime/pipeline.py): price and walk that schedule
            sched = fuse_backward(self.schedule(c), fused)
            held = held_peaks(sched, act_s)
        pays = stage_payloads(st, starts, ends) if S > 1 and st.shared else None  # each stage's tied copies
        if pays is not None and z < 3 and R > 1:
            trans_u = pays[0] * ((1 + 1 / R) if z == 2 else 1.0)
        rank_peaks, rank_cats = [], []
        for r in range(P):
            mine = stages_of[r]
            best = held[r] if sched is not None else act_s[0]
            trans = sum(float(trans_u[starts[s]:ends[s]].sum()) for s in mine)
            adam = sum(chain.adam_range(starts[s], ends[s]) for s in mine)
            at_loss = st_r[r] + best + fixed + self._loss_extra(c, rows, cats_r[r], ws) if S - 1 in mine else 0.0
            peak = max(act_r[r] + best + fixed,  # forward/backward: activations held, the working set
                       at_loss,
                       st_r[r] + trans,  # end of backward: the flat gradient buffers (ZeRO 0-2)
                       st_r[r] + adam)  # the optimizer step's temporaries
            if one:  # estimate's three points: the walk, the end of backward (buffers, inputs), the step
                end_bufs = self.rank_transient(c)
                peak = max(st_r[r] + one_act - (0.0 if rc_units else base_a[0] - act_s[0]), st_r[r] + end_bufs + self.grad_profile(
                    c.tp, rows, c.cp, self._ep_of(c)).inputs, st_r[r] + adam)
            rank_peaks.append(peak)
            rank_cats.append({**cats_r[r], "activations": best, "workspace": ws, "comm_buffers": trans + (fixed - ws),
                              "optimizer_step_temp": adam, "peak": peak})
        p2p = [float(hop[starts[s + 1] - 1]) for s in range(S - 1)]
        sim = None
        if c.pp > 1 and chosen_all and cutoff is not None and minimise == "time" and not memory_only:
            # its stages' walk with their checkpoint regions costs most: a schedule that ends past
            # the cutoff cannot win (more recompute, from a retry, only lengthens it), so not walked
            sim = simulate_ranks(sched, F_s, B_s, p2p, c.label())
            if max(sim[0]) >= cutoff:
                pk = max(rank_peaks)
                return Evaluation(step_s=max(sim[0]), peak_bytes=pk, memory={"peak": pk, "limit": limit},
                                  notes=["schedule over the cutoff before the walk (peak: the per-unit model's)"],
                                  pruned=True, **early)
        if c.pp > 1:  # estimate's walk of the split, recompute included
            walked = pipeline_rank_peaks(self, c, sched, rows, starts, ends, st, chain, trans_u, rank_cats,
                                         {x: pin_modes.get(x, flavor) for x in chosen_all})
            unit_fits = max(rank_peaks) <= limit * (1 + 1e-9)
            if walk_retry and recompute != "none" and unit_fits and max(walked) > limit * (1 + 1e-9):
                # the per-unit model fits (with its recompute), the walk is over: recompute what the walk adds
                ev = self._evaluate(c, limit - (max(walked) - max(rank_peaks)), flavor, pins=pins, recompute=recompute,
                                    minimise=minimise, cutoff=cutoff, memory_only=memory_only, walk_retry=False,
                                    walk_limit=limit)
                return dataclasses.replace(ev, limit_bytes=limit, memory={**ev.memory, "limit": limit})
            rank_peaks = walked
        full = int(np.argmax(rank_peaks))
        memory = dict(rank_cats[full], limit=limit)
        if self.offload:  # in host memory, not in the peak (every stage's: the rank's when pp = 1)
            memory["offloaded"] = st.host_bytes
        tpr, _unit = self.tokens_per_row()
        common = dict(candidate=c, peak_bytes=max(rank_peaks), limit_bytes=limit, memory=memory, rows_per_micro=rows,
                      split_points=[self.unit_names[i] for i in starts[1:]],
                      stage_units=[self.unit_names[starts[s]:ends[s]] for s in range(S)], recompute=rc_units,
                      rank_peaks=rank_peaks)
        if memory_only:  # the memory a candidate needs (the planner's report): no schedule simulation
            return Evaluation(step_s=INF, compute_s=0.0, bubble=0.0, recompute_s=0.0, optimizer_s=0.0, comm={},
                              flops=0.0, mfu=0.0, tokens_per_s=0.0, notes=["memory only: not timed"], **common)
        if max(rank_peaks) > (walk_limit or limit) * (1 + 1e-9) and minimise == "time":
            return Evaluation(step_s=INF, compute_s=0.0, bubble=0.0, recompute_s=0.0, optimizer_s=0.0, comm={},
                              flops=0.0, mfu=0.0, tokens_per_s=0.0, notes=["over the memory limit"], **common)
        # time: the schedule, then per rank data-parallel sync, the optimizer step
        if sim is not None:
            ends_r, busy, bubble, windows = sim
        elif sched is not None:
            ends_r, busy, bubble, windows = simulate_ranks(sched, F_s, B_s, p2p, c.label())
        else:
            ends_r = [m * (F_s[0] + B_s[0])]
            busy = list(ends_r)
            bubble = 0.0
            windows = None
        dp_link = links.get("dp")
        step = 0.0
        dp_time = dp_bytes = dp_exposed_max = 0.0
        for r in range(P):
            mine = stages_of[r]
            if one:
                rsync = self.rank_sync(c, u, dp_link)
                exposed, after, t_r, b_r = rsync.exposed, rsync.after, rsync.time_s, rsync.bytes_sent
            else:
                exposed, after, t_r, b_r = dp_sync(self, u, mine, starts, ends, B_s, ends_r[r], st, dp_link, z, c,
                                                   windows)  # per node, as cost.estimate (`plan_comm`)
            if r == 0:
                dp_time, dp_bytes = t_r, b_r
            step = max(step, ends_r[r] + exposed + after + zero3_tail(mine, z3_s) + opt_r[r])
            dp_exposed_max = max(dp_exposed_max, exposed + after)
        step += self.context_exposed(c)  # the attention exchange's exposed part (cost.estimate adds the same)
        comm = comm_report(self, c, u, st, starts, ends, stages_of, p2p, dp_time, dp_bytes, dp_exposed_max, z3f,
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
        if c.schedule == "interleaved_1f1b":  # rank r starts with F(r, 0) and ends with B(r, m - 1)
            for r, mine in enumerate(stages_of):
                pre_f, pre_b = sum(F_s[:r]), sum(B_s[:r])
                lb = max(lb, pre_f + m * sum(F_s[s] + B_s[s] for s in mine) + max(opt_r[r], pre_b))
        elif c.virtual == 1:
            beta = 1.0 if c.schedule in ("1f1b", "gpipe") else 0.0
            pre_f = pre_b = 0.0
            for s in range(len(F_s)):
                lb = max(lb, pre_f + m * (F_s[s] + B_s[s]) + max(opt_r[s], beta * pre_b))
                pre_f += F_s[s]
                pre_b += B_s[s]
        return lb

    def _loss_extra(self, c: Candidate, rows: int, cats: dict, ws: float) -> float:
        """What the loss's backward (on the rank of the last stage) needs beyond the usual
        forward/backward peak (states + held activations + the working set): its own working
        set (`workspace(..., at_loss=True)`, the walk `cost.estimate` makes) in place of the
        usual one, and no parameter gradient yet unless an earlier micro-batch made them."""
        return self.workspace(c.tp, rows, c.cp, True) - ws - (cats["grads"] if c.micro == 1 else 0.0)

    def _recompute_pins(self, recompute: Any) -> dict[int, bool] | None:
        if isinstance(recompute, Mapping):
            idx = {n: i for i, n in enumerate(self.unit_names)}
            bad = [k for k in recompute if k not in idx]
            if bad:
                raise ValueError(f"recompute pins {bad} are not units of this model; units: {self.unit_names[:6]} ...")
            return {idx[k]: v != "none" for k, v in recompute.items()}
        return None

    def _pin_modes(self, recompute: Any) -> dict[int, str]:
        """Unit index -> mode of the units pinned to be recomputed."""
        on = self._recompute_pins(recompute) or {}
        return {x: recompute[self.unit_names[x]] for x, v in on.items() if v}
