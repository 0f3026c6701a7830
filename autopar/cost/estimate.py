"""`estimate(gm, plan, hardware) -> Estimate`: predicted step time and memory per rank.

The captured graph is what one rank runs on one micro-batch: with data parallelism every dp
rank runs it on its own slice of the batch. For a graph captured at the global batch (as
`autopar.parallelize` captures it) pass `batch_is_global=True`, which costs the captured b
divided by dp * ep * n_microbatches (expert-parallel ranks split the batch too); or set the batch yourself with `global_batch=` or
`sizes={"b": ...}` (all need the batch dimension captured dynamic).

Time of a node (roofline): max(matmul FLOPs / (peak[dtype] * eff.matmul) + other FLOPs /
(vector peak * eff.vector), bytes / (memory bandwidth * eff.memory)) + kernel overhead;
attention uses eff.attention and counts half the score matrix when causal. Backward: the
node's backward FLOPs, twice its other FLOPs, and bytes = output gradients + input gradients
+ saved tensors. Collective nodes in the graph (`autopar.all_reduce` ...) block the stream.

Data parallelism (Plan.mesh[dp_axis] = n), as `runtime.zero` runs it, with payloads as
`runtime.collectives.COUNTER` counts them (parameters sharded by dim-0 rows; communication
buffers pad every parameter's rows to ceil(rows/n): `memory.padded_numel`):
  ZeRO 0   gradients in buckets (`runtime.zero_shard.make_buckets`: reverse parameter order,
           the first bucket at most min(1 MB, bucket_mb), then `bucket_mb`, split at dtype
           changes), each all-reduced when its last gradient is ready, in bucket order, on a
           communication stream that overlaps the rest of backward;
  ZeRO 1   the same all-reduce (full gradients); after the optimizer step every bucket's
           updated rows all-gathered (padded; exposed);
  ZeRO 2   the same buckets reduce-scattered (padded input), then the same all-gather;
  ZeRO 3   per unit (`runtime.zero_stage3.default_units`, from the parameter names: one per
           top-level child, list-like children per element, root parameters one more): the
           unit all-gathered when its first parameter is read (each parameter is read just
           before its first use; prefetched one unit ahead), all-gathered again in backward
           only when autograd saved one of its parameters (an embedding's weight is not), and
           its gradients reduce-scattered after its backward. A unit read again after
           another one is gathered again (the runtime frees the previous unit on a switch).
           With m micro-batches every forward gathers and every backward re-gathers; only the
           last reduce-scatters (the program runs the others under `no_sync`).
The terms come from `zero_comm` (`bucket_overlap`, `zero3_walk`), which the planner calls too.
Exposed communication = what is left after the overlap; step = forward + backward + exposed
communication + optimizer step (memory bound). Overlap is not free: while a bucket reduction or
a ZeRO-3 gather / reduce-scatter is in flight, the compute beside it runs (1 + k) times slower,
k the profile's `contention` for the axis' link (`cost.overlap`; 0 on cpu-gloo), so the exposed
communication is what cannot hide behind the slowed compute, and `contention_s` (part of
`comm_exposed_s`) the slowdown itself. Blocking collectives (tensor parallel) overlap nothing.

Memory per rank: model states (`memory.model_states`), plus the activation peak from the
liveness walk (`memory.liveness` with the loss around the outputs: `CROSS_ENTROPY` on gathered
logits, or under `Plan.loss_parallel` the vocab-parallel loss on the shards, whose two tp
all-reduces are priced as blocking: `cost.loss_memory`), plus
transient buffers: ZeRO 0/1 keep a flat copy of every
gradient bucket until backward finishes (what `runtime.zero.GradReducer` does), ZeRO 2 every
bucket's padded input and output (`ScatterReducer`), ZeRO 3 holds two units of gathered
parameters (current + prefetch). The optimizer step adds one temporary
per parameter element for Adam's foreach denominator.

Precision comes from the Plan's fields, as the ZeRO engine runs them (`passes.plan.
engine_options`): `param_dtype` (None: the graph's own) prices parameters and their gradients,
`master_dtype` adds master copies (with their own gradients, as the engine keeps them) and
sets the optimizer states' dtype, `reduce_dtype` sizes gradient communication and its
buffers, and `offload` moves masters, their gradients and optimizer states out of device
memory (`memory["offloaded"]`; not in `peak`; the step then runs on the CPU after the rank's
gradient rows go down and before its parameter rows come back, `optimizer_step.offload_step_seconds`
at the profile's host bandwidths). Matmuls and attention are timed at the peak of
`param_dtype` (the compute dtype); activation bytes stay the captured graph's.

Expert parallelism (`plan.extra["expert"]`, an ep axis): the batch splits over dp x ep; rank
0 keeps its experts' parameters and runs them on its dispatched rows (`expert_memory`: their
storages and compute scaled to the routed rows); the dispatcher's all-to-alls and the
non-expert gradients' all-reduce over ep block the stream (`expert_comm.ep_events`).
Pipeline (pp > 1 with `plan.split_points`, every schedule, v stages per rank):
`memory["peak_per_pp_rank"]`, each rank's stages walked along its own actions in the schedule
(`pipeline_memory.rank_peaks`), and `peak` their maximum; the step is the simulated schedule's
with per-stage seconds, the boundaries' sends on the pp link, each rank's gradient sync and
optimizer step (`pipeline_time.estimate_pipeline_step`); the joint planner calls the same two
functions (tests/unit/test_one_cost_model_pipeline.py). Inside the stages: the tensor-parallel
conversions the plan's strategies make the shard pass insert (`tp_conversions`, per micro-batch;
given the captured fx graph: not a GraphCost alone, nor a graph with tp collectives of its own)
and ZeRO 3's gathers per micro-batch, its reduce-scatters once (`pipeline_time.stage_zero3`).
Recompute inside the stages: each stage walks its own checkpoint regions
(`pipeline_memory.stage_walk`: a micro-batch in flight holds the regions' inputs, its backward one
region's recomputed activations at a time), its B lengthened by the recomputed forward, and
under ZB-H1 / ZBV a stage with regions runs one fused backward (`schedule.fuse_backward`);
`recompute_s` is then the busiest rank's. Not in a pipeline's step yet:
offload's CPU step (the device step is priced). Measured against whole training steps on a gloo world for every strategy
(tests/dist/test_memory_truth.py, +-10%).

Recompute (`Plan.recompute`, `Plan.extra["recompute_save"]`): the activation walk is
`cost.timeline` over the checkpointed regions (what autograd keeps, what is recomputed in
backward), and the recomputed forward ops' time is added to the backward (`recompute_s`), with
the host time of torch's selective-checkpoint dispatch mode for selective regions (the
profile's `selective_node_s` per node of the region, in its forward and its recompute).

Fusions (`Plan.fusions`): on a GPU profile the graph costed is a copy with the plan's fusions
applied by the fuse pass the rank runs (`cost/fused_graph.py`): each fused kernel is one op
with its own traffic and saved tensors, the plan's node keys carried over. On a CPU profile
the fused calls run their torch references and the graph is costed unfused; a GraphCost given
alone has no graph to fuse (noted). The joint planner ranks candidates unfused
(`search.plan_write.unfused`).

Tensor-parallel plug-in: `Plan.node_layouts` maps a node key ("<module path>:<op>#<k>") to its
output layout; a node's compute is divided by the sizes of the axes where its output is
Shard or Partial, its new storages by those where it is Shard (the dp axis is ignored: graph
shapes are already per dp rank).

It reads nothing from `node.meta` beyond what `analyze` reads. Guarantees: deterministic
output (no ids, no timestamps); `to_json()` round-trips through `json.loads`;
`Estimate.collectives()` equals `runtime.collectives.COUNTER.snapshot()` of one training step
of the runtime (gloo test tests/dist/test_cost_counter.py), the reported-loss all-reduce
(`metric_all_reduce`) aside. The graph's own collectives and expert parallelism's run once per
micro-batch and are counted so (with pp: every stage's per micro-batch, the pipeline's ranks
counted together); the router statistics' all-reduces of an MoE model without ep are priced
from `plan.extra["router_stats"]` (`expert_comm.router_stat_events`;
tests/dist/test_cost_counter_micro.py).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.passes.plan import Plan, torch_dtype

from . import comm as C
from .estimate_report import CommReport, Estimate, LayerReport
from .fused_graph import fused_copy
from .power import sustained
from .graph import GraphCost, analyze
from .hardware import Hardware, load_profile
from .comm import joined_data_axis
from .memory import (HELD_OUTPUTS, OptimizerSpec, StateBytes, device_resident, liveness, model_states,
                     padded_numel, rows_of, tp_local_shape, with_param_dtype)
from .optimizer_step import offload_step_seconds, step_bytes
from .expert_comm import ep_events
from .loss_memory import loss_collectives, loss_model
from .expert_memory import ep_compute_divisor, ep_memory
from .pipeline_memory import (StageMemory, pipeline_schedule, rank_peaks, received_grad_bytes, split_backward,
                              stage_graph, stage_of_nodes, stage_regions, stage_walk)
from .timeline import Region, regions_for, timeline
from .node_time import NodeTimer, layout_divisors
from .symbolic import evaluate
from .pipeline_time import estimate_pipeline_step
from .schedule import fuse_backward
from .tp_conversions import node_tp_seconds
from .zero_comm import bucket_caps, bucket_overlap, grad_buckets, zero3_events, zero3_payloads, zero3_walk

__all__ = ["estimate", "Estimate", "LayerReport", "CommReport", "NodeTimer"]


def _pipeline_peaks(gc: GraphCost, plan: Plan, pp: int, stage_memory, zero3_transient: float,
                    notes: list[str], regions: list[Region]):
    """(peak per pipeline rank along its schedule's actions (`pipeline_memory.rank_peaks`: every
    schedule, virtual stages too), the schedule, the stage graphs, their memory terms); None
    with a note when the stages do not fit the schedule. `regions`: the plan's checkpoint
    regions on `gc` (their stages walk them, `stage_memory`, and run one fused backward)."""
    stage_of = stage_of_nodes(gc, plan.split_points)
    n_stages = max(stage_of) + 1 if stage_of else 1
    try:
        sched = pipeline_schedule(plan.schedule, pp, plan.n_microbatches, n_stages)
    except ValueError as e:
        notes.append(f"per-rank pipeline memory not modelled: {e}")
        return None
    graphs = [stage_graph(gc, stage_of, s) for s in range(n_stages)]
    mems = [stage_memory(g) for g in graphs]
    # under ZB-H1 / ZBV a stage holding checkpoint regions runs its backward whole at its I and no W
    # (runtime/pipeline.py): price and walk that schedule (its walk recomputes, `stage_memory`)
    sched = fuse_backward(sched, {s for s, g in enumerate(graphs) if stage_regions(regions, g)})
    return rank_peaks(sched, mems, zero3_transient), sched, graphs, mems


def _with_fusions(gm, plan: Plan, hw: Hardware, kernels, analysis):
    """(graph, plan, analysis, note): `plan.fusions` applied to a copy of the graph where they run
    as fused kernels (cost/fused_graph.py), else the graph as given and why."""
    if not plan.fusions:
        return gm, plan, analysis, None
    if hw.device.kind != "cuda":
        return gm, plan, analysis, (f"fusions costed unfused: on {hw.name} ({hw.device.kind}) the fused calls run "
                                    "their torch references, the same ops")
    if not isinstance(gm, fx.GraphModule):
        return gm, plan, analysis, "fusions costed unfused: a GraphCost has no graph to fuse (pass the GraphModule)"
    got = fused_copy(gm, plan, hw, kernels=kernels, analysis=analysis)
    if got is None:
        return gm, plan, analysis, "plan.fusions match nothing in this graph (fused already): costed as it is"
    fused, plan, n, fused_analysis = got
    return fused, plan, fused_analysis, f"fusions: {n} matches of plan.fusions costed as their fused kernels"


def estimate(gm: fx.GraphModule | GraphCost, plan: Plan | None = None, hardware: Hardware | str = "h100-sxm", *,
             sizes: Mapping[str, int] | None = None, global_batch: int | None = None,
             batch_is_global: bool = False,
             optimizer: Any = "adamw", master_dtype: torch.dtype | str | None = "auto",
             grad_dtype: torch.dtype | None = None, algorithm: str = "auto",
             kernels: Mapping[str, Any] | None = None, analysis: GraphCost | None = None) -> Estimate:
    """Predict step time and memory per rank of training `gm` under `plan` on `hardware`.

    Args:
        gm: the captured graph (or a GraphCost from `analyze`, to re-cost without re-analysing).
        plan: the Plan (mesh, dp axis, ZeRO stage, bucket size, layouts, micro-batches);
            None: one device.
        hardware: a Hardware or a profile name / path ("h100-64", "cpu-gloo" ...).
        sizes: values of the size symbols ({"b": 4, "s": 8192}); default the captured sizes.
        global_batch: sets b = global_batch / (dp * ep * n_microbatches) (needs a dynamic batch dim).
        batch_is_global: the graph was captured at the global batch (autopar.parallelize's
            capture): b = the captured b / (dp * ep * n_microbatches), unless `global_batch` or
            `sizes["b"]` say otherwise.
        optimizer: "adamw", "adam", "sgd", "sgd_momentum", or a torch.optim class/instance.
        master_dtype: master weights' dtype; "auto": the plan's `master_dtype` (None: no masters,
            as the engine runs a plan without one).
        grad_dtype: gradient dtype (default: the parameter's).
        algorithm: collective algorithm: "ring", "tree", or "auto" (the faster one per call, as
            NCCL's tuner picks; bytes_sent follows the choice).
        kernels: overrides for the profile's kernel choices (e.g. {"sdpa": "math"}).
        analysis: `analyze(gm, hardware, kernels=kernels)` done already (a caller costing many
            plans of one graph): used instead of analysing `gm` again; `gm` itself still gives
            the plan's tensor-parallel conversions (a GraphCost alone as `gm` has none).
    """
    t0 = time.perf_counter()
    hw = load_profile(hardware)
    plan = plan or Plan(mesh={"dp": 1})
    gm, plan, analysis, fusion_note = _with_fusions(gm, plan, hw, kernels, analysis)
    gc = analysis if analysis is not None else gm if isinstance(gm, GraphCost) else analyze(gm, hw, kernels=kernels)
    param_dt = torch_dtype(plan.param_dtype)
    if param_dt is not None:  # the engine casts every floating parameter (not buffers) to it
        gc = dataclasses.replace(gc, params=with_param_dtype(gc.params, param_dt))
    mesh = dict(plan.mesh)
    notes: list[str] = [fusion_note] if fusion_note else []
    hw = sustained(hw, gc, plan.param_dtype)  # the power limit under this graph's GEMM duty
    if hw.power_ratio < 1.0:
        notes.append(f"sustained load: GEMMs and attention at {hw.power_ratio:.3f} x their burst throughput (the "
                     f"graph's GEMM duty {hw.power_duty:.2f}; {hw.name}'s power rows)")
    world = math.prod(mesh.values())
    if world > hw.world_size:  # more ranks than the profile has: more nodes of the same kind
        nodes = -(-world // hw.gpus_per_node)
        notes.append(f"the mesh has {world} ranks, {hw.name} {hw.world_size}: costed on {nodes} nodes "
                     f"of {hw.gpus_per_node}")
        hw = hw.with_nodes(nodes)
    links = C.axis_links(hw, mesh)
    dp_axis = plan.dp_axis if plan.dp_axis in mesh else None
    dp = mesh.get(dp_axis, 1) if dp_axis else 1
    sizes = dict(sizes or {})
    ep = mesh.get("ep", 1)  # expert-parallel ranks split the batch too (api.parallelize: dp x ep)
    per = dp * ep * plan.n_microbatches
    if global_batch is None and batch_is_global and "b" not in sizes:
        captured_b = next((v for k, v in gc.values().items() if str(k) == "b"), None)
        if captured_b is None:
            raise ValueError("batch_is_global=True needs a graph captured with a dynamic batch dim (symbol b); "
                             "this one is static: cost the per-rank graph captured at the local batch instead")
        global_batch = int(captured_b)
    if global_batch is not None:
        if global_batch % per:
            raise ValueError(f"global_batch={global_batch} does not divide by dp * ep * n_microbatches = {per}; "
                             "pick a multiple")
        sizes["b"] = global_batch // per
    context = plan.extra.get("context") or {}
    cp = mesh.get(context.get("axis", "cp"), 1) if context else 1
    if cp > 1:  # context parallelism: each rank holds s / cp tokens and averages gradients over dp x cp
        captured_s = next((v for k, v in gc.values().items() if str(k) == "s"), None)
        if captured_s is not None and "s" not in sizes:
            sizes["s"] = int(captured_s) // cp
        dp_axis, dp, links = joined_data_axis(hw, mesh, dp_axis, context.get("axis", "cp"), links)
        notes.append(f"context parallel cp={cp} ({context.get('method')}): s / {cp} tokens per rank, attention "
                     f"against all {cp} chunks, gradients over {dp_axis}")
    values = gc.values(sizes)
    ev = lambda x: evaluate(x, values)  # noqa: E731
    timer = NodeTimer(hw, values, compute_dtype=plan.param_dtype)
    comp_div, mem_div = layout_divisors(gc, plan)
    epm = ep_memory(gc, gc.params, plan, ev)  # expert parallelism: this rank's experts and their rows
    notes += epm.notes
    for k, f in epm.scale.items():
        mem_div[k] = mem_div.get(k, 1) / f if f > 0 else math.inf
    rank_params = epm.params
    ep_ev = ep_events(gc, rank_params, plan, ev, {p.name: math.prod(rows_of(tp_local_shape(
        p, plan.param_layouts, mesh, dp_axis))) for p in rank_params if not p.is_buffer})  # all-to-alls, grad_avg
    notes += ep_ev.notes

    # --- compute per node, per layer ------------------------------------------------------
    fwd_t = [0.0] * len(gc.nodes)
    bwd_t = [0.0] * len(gc.nodes)
    graph_comm: list[tuple[int, str, str, float, bool]] = []  # (node, op, axis, payload, backward)
    for n in gc.nodes:
        k_ep = epm.compute.get(n.index)  # expert parallelism: the routed rows (0: another rank's expert)
        f, b = timer.node(n, comp_div.get(n.index, 1) if k_ep is None else comp_div.get(n.index, 1) / k_ep) \
            if k_ep != 0 else (0.0, 0.0)
        if cp > 1 and "scaled_dot_product_attention" in n.op:  # local queries against every chunk's keys
            f, b = f * cp, b * cp
        fwd_t[n.index], bwd_t[n.index] = f, b
        for cm in n.cost.comm:
            if cm.rows is not None and cm.axis in mesh:  # uneven pieces padded to ceil(rows / n)
                payload = float(C.padded_payload(cm.op, int(ev(cm.rows)), int(ev(cm.row_bytes)), mesh[cm.axis]))
            else:
                payload = ev(cm.nbytes)
            graph_comm.append((n.index, cm.op, cm.axis, payload, cm.backward))
    by_kind = dict.fromkeys(("matmul", "attention", "other"), 0.0)  # one micro-batch's compute per kind of work
    for n in gc.nodes:
        by_kind[n.cost.kind if n.cost.kind in by_kind else "other"] += fwd_t[n.index] + bwd_t[n.index]
    graph_comm += [(e.node, e.op, e.axis or ep_ev.axis, e.payload, e.backward) for e in ep_ev.events]
    last = gc.nodes[-1].index if gc.nodes else 0  # the vocab-parallel loss's all-reduces (loss_memory)
    graph_comm += [(last, op, axis, payload, False) for op, axis, payload in loss_collectives(gc, plan, ev)]
    comm_reports: dict[tuple[str, str, str], CommReport] = {}

    def add_comm(op, axis, phase, payload, t, exposed):
        r = comm_reports.setdefault((op, axis, phase), CommReport(op, axis, phase, 0, 0.0, 0.0, 0.0, 0.0))
        r.calls += 1
        r.payload_bytes += payload
        al = links.get(axis)
        r.bytes_sent += al.bytes_sent(op, payload, algorithm) if al else 0.0
        r.time_s += t
        r.exposed_s += exposed

    layer_comm: dict[str, float] = {}
    graph_comm_total = 0.0  # of one micro-batch: every micro-batch runs the graph's collectives (with pp, every
    # stage runs its own per micro-batch: the reports then count the pipeline's ranks together)
    for idx, op, axis, payload, backward in graph_comm:
        al = links.get(axis)
        if al is None:
            notes.append(f"collective {op} on axis {axis!r} which the mesh {mesh} lacks: not costed")
            continue
        t = al.time(op, payload, algorithm)
        (bwd_t if backward else fwd_t)[idx] += t  # blocking: on the critical path
        graph_comm_total += t
        for _ in range(plan.n_microbatches):
            add_comm(op, axis, "backward" if backward else "forward", payload, t, t)
        lay = gc.nodes[idx].layer
        layer_comm[lay] = layer_comm.get(lay, 0.0) + t
    fwd_compute, bwd_compute = sum(fwd_t), sum(bwd_t)

    # --- model states ------------------------------------------------------------------
    if master_dtype == "auto":
        master_dtype = torch_dtype(plan.master_dtype)
    opt = OptimizerSpec.of(optimizer)
    states: StateBytes = model_states(rank_params, opt, zero_stage=plan.zero_stage if dp > 1 else 0, dp=dp, rank=0,
                                      master_dtype=master_dtype, grad_dtype=grad_dtype,
                                      param_layouts=plan.param_layouts, mesh=mesh, dp_axis=dp_axis,
                                      separate_masters=plan.offload, as_engine=True)
    reduce_dt = torch_dtype(plan.reduce_dtype)
    zero = plan.zero_stage if dp > 1 else 0

    # --- data-parallel communication and its overlap ----------------------------------------
    trainable = [p for p in rank_params if p.requires_grad]
    grad_item = {p.name: (reduce_dt or grad_dtype or p.dtype).itemsize for p in trainable}  # communicated
    # after TP, before ZeRO
    shapes = {p.name: tp_local_shape(p, plan.param_layouts, mesh, dp_axis) for p in rank_params if not p.is_buffer}
    local = {name: math.prod(rows_of(sh)) for name, sh in shapes.items()}
    padded = {name: padded_numel(sh, dp) for name, sh in shapes.items()}  # per rank, in ZeRO buffers
    # backward timeline: end time of each node's backward, walking in reverse
    bwd_end = [0.0] * (len(gc.nodes) + 1)
    t = 0.0
    for n in reversed(gc.nodes):
        t += bwd_t[n.index]
        bwd_end[n.index] = t
    bwd_total = t
    comm_total = comm_exposed = 0.0
    fwd_exposed = bwd_exposed = step_exposed = 0.0  # what overlapped communication adds (slowdown included)
    contention_s = 0.0  # the part of it that is compute slowed by concurrent collectives
    transient = 0.0
    z3_units = None
    if dp > 1 and trainable:
        al = links[dp_axis]
        if zero < 3:
            buckets = grad_buckets(trainable, plan.bucket_mb, local)
            op = "all_reduce" if zero < 2 else "reduce_scatter"
            payloads = [float(sum((local[p.name] if zero < 2 else dp * padded[p.name]) * grad_item[p.name]
                                  for p in members)) for members in buckets]
            # the last micro-batch's backward beside the reduction stream: slowed by the link's
            # contention while a bucket is in flight (`zero_comm.bucket_overlap`)
            ready = [max(bwd_end[min(p.first_use, len(gc.nodes) - 1)] if p.first_use < len(gc.nodes)
                         else bwd_total for p in members) for members in buckets]
            durations = [al.time(op, payload, algorithm) for payload in payloads]
            for payload, d in zip(payloads, durations):
                comm_total += d
                add_comm(op, dp_axis, "backward", payload, d, 0.0)
            bwd_exposed, contention_s = bucket_overlap(ready, durations, bwd_total, al.contention)
            if comm_reports.get((op, dp_axis, "backward")):
                comm_reports[(op, dp_axis, "backward")].exposed_s = bwd_exposed
            # every bucket's flat buffer lives until backward finishes (GradReducer: the copy;
            # ScatterReducer: the padded input and this rank's output)
            transient = sum(payloads) * (1 + 1 / dp if zero == 2 else 1)
            if zero >= 1:
                for members in buckets:
                    payload = float(sum(padded[p.name] * p.dtype.itemsize for p in members))
                    d = al.time("all_gather", payload, algorithm)
                    comm_total += d
                    step_exposed += d
                    add_comm("all_gather", dp_axis, "step", payload, d, d)
        else:
            # every micro-batch gathers every unit (and re-gathers saved ones in backward); only
            # the last reduce-scatters (earlier ones accumulate under no_sync: runtime.program)
            events = zero3_events(gc)
            gather, rs = zero3_payloads(rank_params, dp, padded, grad_item)
            z3_units = (gather, rs)  # a pipeline walks them per stage (`pipeline_time.stage_zero3`)
            seg_f, seg_b, pre_f, pre_b = events.segments(fwd_t, bwd_t)
            w = zero3_walk(events, seg_f, seg_b, pre_f, pre_b, gather, rs,
                           lambda o, x: al.time(o, x, algorithm), al.contention)
            n_acc = plan.n_microbatches - 1
            fwd_exposed = plan.n_microbatches * w.fwd
            bwd_exposed = w.bwd + n_acc * w.bwd_accum
            contention_s = plan.n_microbatches * w.slowed[0] + w.slowed[1] + n_acc * w.slowed[2]
            for calls, times in ((w.calls, 1), (w.calls_accum, n_acc)):
                for _ in range(times):
                    for o, phase, payload, d, k in calls:
                        comm_total += d
                        add_comm(o, al.axis, phase, payload, d, 0.0)
                        lay = gc.nodes[events.starts[k]].layer
                        layer_comm[lay] = layer_comm.get(lay, 0.0) + d
            transient = 2 * dp * max(gather.values(), default=0.0)  # the gathered unit and the prefetched one
    comm_total += graph_comm_total * plan.n_microbatches
    comm_exposed = fwd_exposed + bwd_exposed + step_exposed + graph_comm_total * plan.n_microbatches

    # --- optimizer step (memory bound: `optimizer_step.step_bytes`) ---
    opt_bytes = step_bytes(states.master, states.optimizer, states.params, states.grads, states.master_grads,
                           dp if zero in (1, 2) else 1)
    optimizer_s = opt_bytes / (hw.device.memory_bandwidth * hw.eff("memory")) if trainable else 0.0
    offload_copy_s = 0.0
    if plan.offload and trainable:  # the step runs on the CPU: gradients down, parameters back up
        g_item = max(grad_item.values())
        m_item = master_dtype.itemsize if master_dtype is not None else max(p.dtype.itemsize for p in trainable)
        offload_copy_s, optimizer_s = offload_step_seconds(states.opt_elems, states.master + states.optimizer,
                                                           g_item, m_item, hw.host_bandwidth,
                                                           hw.host_memory_bandwidth, zero_stage=plan.zero_stage)
        optimizer_s += offload_copy_s

    n_micro = plan.n_microbatches
    fwd_s = fwd_compute * n_micro + fwd_exposed
    bwd_s = bwd_compute * n_micro
    step_s = fwd_s + bwd_s + bwd_exposed + step_exposed + optimizer_s
    if cp > 1:  # the attention exchange: what its overlap leaves exposed (search/context.py prices it)
        method = context.get("method")
        exposed = float((context.get("exposed_s") or {}).get(method) or 0.0)
        payload = float((context.get("bytes") or {}).get(method) or 0.0)
        op = "send_recv" if method == "ring" else "all_to_all"
        add_comm(op, context.get("axis", "cp"), "attention", payload, exposed, exposed)
        step_s += exposed

    # --- memory -----------------------------------------------------------------------
    pg_bytes = {k: 0.0 for k in epm.dropped}  # other ranks' experts: no gradient here
    for p in trainable:
        if p.key is not None:
            row = states.per_param.get(p.name, {})
            pg_bytes[p.key] = row.get("grads", 0) - row.get("master_grads", 0)  # masters' come after backward
    loss_mem = loss_model(gc, plan)  # CROSS_ENTROPY on gathered logits, or the vocab-parallel loss
    live = liveness(gc, values, param_grad_bytes=pg_bytes, grads_preallocated=n_micro > 1,
                    storage_divisor=mem_div, loss=loss_mem)
    recompute_s = 0.0
    regions: list[Region] = []
    if any(v != "none" for v in plan.recompute.values()):  # the checkpointed regions' walk replaces the plain one
        try:
            regions = regions_for(gc, dict(plan.recompute), dict(plan.extra.get("recompute_save") or {}))
            live = timeline(gc, regions, values, hardware=hw, param_grad_bytes=pg_bytes,
                            grads_preallocated=n_micro > 1, storage_divisor=mem_div, keep_points=False,
                            loss=loss_mem, compute_divisor=ep_compute_divisor(comp_div, epm.compute))
            recompute_s = live.recompute_s * n_micro
            bwd_s += recompute_s
            step_s += recompute_s
        except ValueError as e:  # a plan for another graph's node keys: reported, costed without it
            regions = []
            notes.append(f"recompute could not be modelled on this graph ({e}); every saved tensor is kept")
    def stage_memory(g: GraphCost) -> StageMemory:
        """The memory terms of pipeline stage graph `g` on its rank (`pipeline_memory.StageMemory`)."""
        st = model_states(g.params, opt, zero_stage=zero, dp=dp, rank=0, master_dtype=master_dtype,
                          grad_dtype=grad_dtype, param_layouts=plan.param_layouts, mesh=mesh, dp_axis=dp_axis,
                          separate_masters=plan.offload, as_engine=True)
        pg = {k_: 0.0 for k_ in epm.dropped}
        for p in g.params:
            if p.requires_grad and p.key is not None:
                row = st.per_param.get(p.name, {})
                pg[p.key] = row.get("grads", 0) - row.get("master_grads", 0)
        loss = loss_mem if g.outputs is gc.outputs or list(g.outputs) == list(gc.outputs) else HELD_OUTPUTS
        regs = stage_regions(regions, g)  # its checkpoint regions: walked as they recompute
        w = stage_walk(g, values, param_grad_bytes=pg, storage_divisor=mem_div, loss=loss, later=n_micro > 1,
                       regions=regs, hardware=hw, compute_divisor=ep_compute_divisor(comp_div, epm.compute))
        trainable_s = [p for p in g.params if p.requires_grad]
        trans = 0.0
        if dp > 1 and zero < 3:  # the stage's flat gradient buckets until its backward ends
            trans = sum((local[p.name] if zero < 2 else dp * padded[p.name]) * grad_item[p.name]
                        for p in trainable_s) * (1 + 1 / dp if zero == 2 else 1)
        d, _host = device_resident({**st.to_dict(), "master_grads": st.master_grads}, plan.offload, zero)
        tmp = opt.step_temporary(st.optimizer - (4 * len(trainable_s) if opt.step_tensor else 0), hw.device.kind)
        return StageMemory(persistent=d["params"] + d["master"] + d["optimizer"] + d["buffers"], grads=d["grads"],
                           walk_grads=w.walk_grads, first=w.first, later=w.later,
                           held=w.held, inputs=w.inputs, transient=trans,
                           step_temp=0.0 if plan.offload else tmp,
                           opt_bytes=step_bytes(st.master, st.optimizer, st.params, st.grads, st.master_grads,
                                                dp if zero in (1, 2) else 1) if trainable_s else 0.0,
                           split=split_backward(g, values, param_grad_bytes=pg, storage_divisor=mem_div, loss=loss)
                           if g.nodes[0].index > 0 and not regs else None,  # stage 0: W is its whole backward
                           out_grads=received_grad_bytes(g, values, mem_div) if loss is HELD_OUTPUTS else 0.0,
                           fwd_peak=w.fwd_peak, recompute_s=w.recompute_s)

    # offload: masters (at ZeRO-3 the shards themselves), their gradients and the states on the CPU
    dev, offloaded = device_resident({**states.to_dict(), "master_grads": states.master_grads}, plan.offload, zero)
    persistent = dev["params"] + dev["master"] + dev["optimizer"] + dev["buffers"]
    dev_grads = dev["grads"]
    end_of_bwd = persistent + dev_grads + transient + live.inputs
    adam_tmp = opt.step_temporary(states.optimizer - (4 * len(trainable) if opt.step_tensor else 0), hw.device.kind)
    opt_peak = persistent + dev_grads + (0 if plan.offload else adam_tmp)
    peak = max(persistent + live.peak + (transient if zero == 3 else 0), end_of_bwd, opt_peak)
    memory = {**{k: float(v) for k, v in states.to_dict().items() if k != "total"},
              "activations": float(live.saved), "activation_peak": float(live.peak),
              "transient": float(transient), "peak": float(peak), "capacity": float(hw.device.memory_bytes),
              "offloaded": float(offloaded)}
    pp = mesh.get("pp", 1)
    if pp > 1 and plan.split_points:  # per pipeline rank: its stage's states and walk
        # the stages hold this rank's parameters only (with ep, not the other ranks' experts)
        got = _pipeline_peaks(dataclasses.replace(gc, params=rank_params), plan, pp, stage_memory,
                              transient if dp > 1 and zero == 3 else 0.0, notes, regions)
        if got:
            memory["peak_per_pp_rank"] = [float(x) for x in got[0]]
            memory["peak"] = peak = float(max(got[0]))
            step_s, stage_s, bubble, optimizer_s = estimate_pipeline_step(  # the schedule's step (pipeline_time)
                gc, got[1], got[2], got[3], fwd_t, bwd_t, values, mem_div, links, dp_axis, zero, dp, n_micro,
                bucket_caps(plan.bucket_mb), lambda p: (local[p.name] if zero < 2 else dp * padded[p.name])
                * grad_item[p.name], lambda p: padded[p.name] * p.dtype.itemsize,
                hw.device.memory_bandwidth * hw.eff("memory"), zero3_units=z3_units, algorithm=algorithm,
                tp_node=node_tp_seconds(gm, gc, plan, values, links, hw.kernel_overhead_s)
                if isinstance(gm, fx.GraphModule) and not any(cm.axis == "tp" for n in gc.nodes for cm in n.cost.comm)
                else None)
            if regions:  # what the busiest rank's stages recompute, every micro-batch
                recompute_s = n_micro * max(sum(got[3][s].recompute_s for s in got[1].stages_of(r))
                                            for r in range(got[1].n_ranks))
            notes.append(f"pipeline: {got[1].name} simulated with per-stage seconds {[f'{x:.3g}' for x in stage_s]}, "
                         f"bubble {bubble:.1%}")
    memory["headroom"] = memory["capacity"] - memory["peak"]
    if peak > hw.device.memory_bytes:
        notes.append(f"peak memory {peak / 2**30:.1f} GiB exceeds the device's "
                     f"{hw.device.memory_bytes / 2**30:.1f} GiB")

    # --- per layer ----------------------------------------------------------------------
    saved_by_layer = {k: ev(v) for k, v in gc.saved_bytes_by_layer().items()}
    params_by_layer: dict[str, float] = {}
    for p in gc.params:
        if not p.is_buffer:
            row = states.per_param.get(p.name, {})
            params_by_layer[p.layer] = params_by_layer.get(p.layer, 0.0) + row.get("params", 0)
    layers = []
    for name, nodes in gc.layers().items():
        layers.append(LayerReport(
            name=name, nodes=len(nodes),
            fwd_flops=sum(ev(n.cost.flops) / comp_div.get(n.index, 1) for n in nodes),
            bwd_flops=sum(ev(n.bwd_flops) / comp_div.get(n.index, 1) for n in nodes),
            fwd_s=sum(fwd_t[n.index] for n in nodes), bwd_s=sum(bwd_t[n.index] for n in nodes),
            comm_s=layer_comm.get(name, 0.0), saved_bytes=saved_by_layer.get(name, 0.0),
            param_bytes=params_by_layer.get(name, 0.0),
        ))  # fmt: skip

    fwd_flops = sum(ly.fwd_flops for ly in layers) * n_micro
    bwd_flops = sum(ly.bwd_flops for ly in layers) * n_micro
    dtypes = [n.cost.dtype for n in gc.nodes if n.cost.kind in ("matmul", "attention")]
    main = plan.param_dtype or (max(set(dtypes), key=dtypes.count) if dtypes else "fp32")  # MFU against this peak
    mfu = (fwd_flops + bwd_flops) / (step_s * hw.peak(main)) if step_s > 0 else 0.0
    per_axis: dict[str, dict[str, float]] = {}
    for r in comm_reports.values():
        a = per_axis.setdefault(r.axis, {"payload": 0.0, "sent": 0.0, "time_s": 0.0})
        a["payload"] += r.payload_bytes
        a["sent"] += r.bytes_sent
        a["time_s"] += r.time_s
    if gc.unknown_ops:
        notes.append("ops without a cost rule (fallback: bytes in+out, 1 FLOP per output element): "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(gc.unknown_ops.items())))
    if gc.unknown_saved:
        notes.append("ops without a saved-tensor rule (fallback: all inputs saved): "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(gc.unknown_saved.items())))
    for op, why in sorted(gc.rule_errors.items()):
        notes.append(f"the rule for {op} could not cost a call ({why}); fallback used")
    if plan.offload:
        notes.append(f"offload: the optimizer step runs on the CPU ({hw.host_memory_bandwidth / 1e9:.0f} GB/s) after "
                     f"{offload_copy_s * 1e3:.3g} ms of host<->device copies ({hw.host_bandwidth / 1e9:.0f} GB/s)")
    if plan.param_dtype is not None:
        notes.append(f"compute costed at the {plan.param_dtype} peak (the plan's param_dtype); activation bytes as "
                     "captured")
    if (plan.split_points or plan.schedule) and "peak_per_pp_rank" not in memory:
        notes.append("pipeline stages: time and memory costed as one stage until split_points are set (then the "
                     "schedule's step and memory['peak_per_pp_rank'])")
    notes.append(f"graph costed per micro-batch of sizes {dict((str(k), v) for k, v in values.items()) or 'static'}")
    return Estimate(
        hardware=hw.name, mesh=mesh, zero_stage=zero, sizes={str(k): int(v) for k, v in values.items()},
        world_size=math.prod(mesh.values()), step_s=step_s, fwd_s=fwd_s, bwd_s=bwd_s + bwd_exposed,
        optimizer_s=optimizer_s, comm_s=comm_total, comm_exposed_s=comm_exposed,
        comm_overlapped_s=max(0.0, comm_total - (comm_exposed - contention_s)), contention_s=contention_s, fwd_flops=fwd_flops, bwd_flops=bwd_flops, mfu=mfu,
        memory=memory, bytes_per_axis=per_axis,
        comm=sorted(comm_reports.values(), key=lambda r: (r.phase, r.axis, r.op)), layers=layers,
        unknown_ops=dict(sorted(gc.unknown_ops.items())), unknown_saved=dict(sorted(gc.unknown_saved.items())),
        notes=notes, analysis_s=time.perf_counter() - t0, recompute_s=recompute_s,
        compute_by_kind={k: v * n_micro for k, v in by_kind.items()},
    )  # fmt: skip
