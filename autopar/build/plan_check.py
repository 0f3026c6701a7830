"""Does a Plan fit this model and this mesh? Checked on the captured graph before any pass
runs, so that a plan for another model is refused whole, never half-applied.

  check_plan_against_graph(plan, global_gm, mesh) -> notes
        every name the plan gives must exist in the captured graph and fit the mesh: the
        mesh itself (axes, order, sizes), parameters and buffers of `param_layouts` (and the
        dims they shard must divide by the axis size), node keys of `node_layouts` and
        `strategies`, pipeline units of `split_points`, module paths of `recompute`, MoE
        blocks for an ep axis. A plan stamped with another model's fingerprint
        (`Plan.graph`) is refused with the difference explained. Raises PlanMismatchError
        (a ValueError) listing every problem; returns notes (warnings) for `plan.notes`.
  check_mesh_fits(global_gm, mesh_sizes)
        before planning a fixed mesh: an axis of size > 1 that cannot split this model
        (tp dividing none of the weights' dims, pp above the pipeline units, ep without MoE
        blocks or not dividing their experts, an axis this version does not run) is a
        ValueError naming the dimension and the sizes that would work.
  axis_notes(plan) -> notes
        after planning: an axis of size > 1 that ended up sharding nothing gets an explicit
        warning (never silence).
  stamp(plan, global_gm)
        record the graph's fingerprint in `plan.graph` (what plans made here carry).
  check_moe_aux_stats(plan, global_gm, mode) -> notes;  check_micro_batches(plan, n)
        MoE auxiliary losses over the global batch ("global", the default) refuse
        n_microbatches > 1 before any step (router statistics would be per micro-batch);
        "micro_batch" keeps them per micro-batch, named in the notes. Recorded as
        `plan.extra["moe_aux_stats"]` for models with router statistics.

Reads node.meta["autopar"] (module paths, through passes.ir and the pipeline units) and the
graph's parameters; writes nothing on nodes. Imports passes, search (MoE detection) and
runtime only (never autopar.api).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch.fx as fx

from autopar.passes import ir
from autopar.passes.plan import Plan
from autopar.passes.plan_schema import explain_stamps, graph_stamp
from autopar.runtime.placement import Partial, Shard

__all__ = ["PlanMismatchError", "check_plan_against_graph", "check_mesh_fits", "axis_notes", "stamp",
           "RUN_AXES", "tp_sizes_that_fit", "MOE_AUX_STATS", "router_stat_keys", "check_moe_aux_stats",
           "check_micro_batches"]

RUN_AXES = ("pp", "dp", "ep", "cp", "tp")  # the axes this version carries out
_MAX_LISTED = 8


class PlanMismatchError(ValueError):
    """A plan that does not fit the captured model or the mesh; the message names every
    field and name that does not fit."""


def _sizes(mesh: Any) -> dict[str, int]:
    return dict(getattr(mesh, "sizes", mesh))


def _mesh_text(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items())


def _few(names, n: int = _MAX_LISTED) -> str:
    names = list(names)
    return ", ".join(repr(x) for x in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _tensors(gm: fx.GraphModule, buffers: bool = True) -> dict[str, tuple[int, ...]]:
    out = {}
    items = list(gm.named_parameters(remove_duplicate=False))
    if buffers:
        items += list(gm.named_buffers(remove_duplicate=False))
    for name, t in items:
        out[name] = tuple(int(s) for s in t.shape)
    return out


def _module_paths(gm: fx.GraphModule) -> set[str]:
    paths: set[str] = set()
    for n in gm.graph.nodes:
        i = ir.get_info(n)
        p = i.module if i is not None else ""
        while p:
            paths.add(p)
            p = p.rpartition(".")[0]
    paths.update(name for name, _ in gm.named_modules() if name)
    return paths


def _divisors(n: int, limit: int = 1024) -> list[int]:
    return [k for k in range(2, min(n, limit) + 1) if n % k == 0]


def stamp(plan: Plan, global_gm: fx.GraphModule) -> None:
    """Record `global_gm`'s fingerprint in `plan.graph` (see plan_schema.graph_stamp)."""
    plan.graph = graph_stamp(global_gm)


# ------------------------------------------------------------------------ the mesh alone
def tp_sizes_that_fit(global_gm: fx.GraphModule, limit: int = 64) -> list[int]:
    """Sizes k >= 2 of a sharding axis for which most of the weights (by elements, matrices
    and larger) have a dimension divisible by k: the sizes worth pinning."""
    mats = [s for s in _tensors(global_gm, buffers=False).values() if len(s) >= 2 and math.prod(s) > 0]
    total = sum(math.prod(s) for s in mats)
    out = []
    for k in range(2, limit + 1):
        covered = sum(math.prod(s) for s in mats if any(d % k == 0 and d >= k for d in s))
        if total and covered * 2 >= total:
            out.append(k)
    return out


def check_mesh_fits(global_gm: fx.GraphModule, mesh: Any) -> None:
    """Raise ValueError when an axis of size > 1 of the fixed mesh `mesh` cannot split this
    model (see the module docstring); the message names the dimension and sizes that fit."""
    sizes = _sizes(mesh)
    problems = []
    other = [a for a, s in sizes.items() if a not in RUN_AXES and s > 1]
    if other:
        problems.append(f"axes {other} are not carried out by this version (it runs {', '.join(RUN_AXES)}); "
                        "give their ranks to dp, tp, pp, ep or cp" + (_SP_HINT if "sp" in other else ""))
    tp = sizes.get("tp", 1)
    if tp > 1:
        mats = {n: s for n, s in _tensors(global_gm, buffers=False).items() if len(s) >= 2}
        if mats and not any(d % tp == 0 and d >= tp for s in mats.values() for d in s):
            dims = sorted({d for s in mats.values() for d in s if d > 1})
            fit = tp_sizes_that_fit(global_gm)
            problems.append(f"tp={tp} divides no dimension of the model's weights (their dims are "
                            f"{', '.join(map(str, dims[:12]))}{' ...' if len(dims) > 12 else ''}), so it would shard "
                            f"nothing; tp sizes that would: {', '.join(map(str, fit[:_MAX_LISTED])) or 'none'}")
    pp = sizes.get("pp", 1)
    if pp > 1:
        from autopar.passes.split_pipeline import brief_names, pipeline_units  # noqa: PLC0415

        units = [u.name for u in pipeline_units(global_gm)]
        if len(units) < pp:
            problems.append(f"pp={pp} needs at least {pp} pipeline units, but the model has {len(units)} "
                            f"({brief_names(units)}); use pp from 2 to {len(units)}" if len(units) >= 2 else
                            f"pp={pp} needs at least {pp} pipeline units, but the model has {len(units)}; "
                            "it cannot be pipelined: use pp=1")
    ep = sizes.get("ep", 1)
    if ep > 1:
        problems += _ep_problems(global_gm, ep, sizes)
    if sizes.get("cp", 1) > 1 and ep > 1:
        problems += _cp_ep_problems(global_gm, sizes)
    if problems:
        raise ValueError(f"mesh {_mesh_text(sizes)} does not fit the model: " + "; ".join(problems))


_SP_HINT = ("; sequence parallelism is not an axis: the tp sharding search chooses it for the norms and "
            "dropouts between tp regions, so give those ranks to tp")


def _cp_ep_problems(global_gm: fx.GraphModule, sizes: Mapping[str, int]) -> list[str]:
    """cp x ep runs for dropless routing: each rank dispatches its chunk's tokens as rows (the
    batch splits over dp x ep x cp). A capacity-limited router drops assignments by their
    order in the whole batch, which a chunk of the sequence cannot know."""
    from autopar.search.expert_detect import detect_moe  # noqa: PLC0415

    out: list[str] = []
    capped = [b.module for b in detect_moe(global_gm) if not b.dropless]
    if capped:
        out.append(f"cp={sizes['cp']} with ep={sizes['ep']} needs dropless routing, but MoE block {capped[0]!r} has a "
                   "capacity (capacity_factor): which assignments it drops depends on every token before them in the "
                   "whole batch, and each cp rank holds only its chunk of the sequence; use capacity_factor=None, or "
                   "put the cp ranks on dp or tp")
    return out


def _ep_problems(global_gm: fx.GraphModule, ep: int, sizes: Mapping[str, int]) -> list[str]:
    from autopar.search.expert_detect import detect_moe  # noqa: PLC0415

    out = []
    blocks = detect_moe(global_gm)
    if not blocks:
        out.append(f"ep={ep} but the model has no mixture-of-experts block (no top-k router feeding experts), so "
                   "it would split nothing; give those ranks to dp instead")
        return out
    for b in blocks:
        if b.n_experts % ep:
            fit = _divisors(b.n_experts)
            out.append(f"ep={ep} does not divide the {b.n_experts} experts of MoE block {b.module!r}; ep sizes that "
                       f"would: {', '.join(map(str, fit)) or 'none'}")
            break
    return out


# ------------------------------------------------------------------------ plan vs graph
def check_plan_against_graph(plan: Plan, global_gm: fx.GraphModule, mesh: Any) -> list[str]:
    """Check every name and size `plan` gives against the captured `global_gm` and `mesh` (see
    the module docstring). Raises PlanMismatchError listing every problem; returns warnings."""
    sizes = _sizes(mesh)
    problems: list[str] = []
    notes: list[str] = []
    if list(plan.mesh.items()) != list(sizes.items()):
        problems.append(f"the plan is for mesh {_mesh_text(plan.mesh)} but the mesh is {_mesh_text(sizes)}; "
                        f"build the mesh as autopar.mesh({', '.join(f'{a}={s}' for a, s in plan.mesh.items())})"
                        " (the axis order fixes which ranks share a group)")
    other = [a for a, s in plan.mesh.items() if a not in RUN_AXES and s > 1]
    if other:
        problems.append(f"mesh axes {other} are not carried out by this version (it runs {', '.join(RUN_AXES)}): "
                        "ranks on them would only repeat the work" + (_SP_HINT if "sp" in other else ""))
    actual = graph_stamp(global_gm)
    why = explain_stamps(plan.graph, actual)
    if why and "tensors" in why:
        problems.append(f"the plan is for another model: {why['tensors']}. Plan this model again "
                        "(autopar plan / parallelize without plan=), or drop the plan's \"graph\" entry to check it "
                        "name by name only")
    shapes = _tensors(global_gm)
    keys = set(ir.node_keys(global_gm).values())
    # parameters and their layouts
    bad = [n for n in plan.param_layouts if n not in shapes]
    if bad:
        problems.append(f"param_layouts names {len(bad)} parameters the model does not have: {_few(bad)}"
                        + _close_hint(bad[0], shapes))
    for name, lay in plan.param_layouts.items():
        if name not in shapes:
            continue
        shape = shapes[name]
        for axis, p in lay.axes:
            if axis not in sizes:
                problems.append(f"param_layouts[{name!r}] places it on axis {axis!r}, which the mesh "
                                f"{_mesh_text(sizes)} does not have")
                continue
            k = sizes[axis]
            if isinstance(p, Partial):
                problems.append(f"param_layouts[{name!r}] is {p} on {axis}: a parameter cannot be partial; use R or S(d)")
            elif isinstance(p, Shard) and k > 1:
                if p.dim >= len(shape):
                    problems.append(f"param_layouts[{name!r}] shards dim {p.dim} on {axis}, but the parameter has "
                                    f"shape {shape} ({len(shape)} dims)")
                elif shape[p.dim] % k or shape[p.dim] < k:
                    fit = _divisors(shape[p.dim])
                    problems.append(f"param_layouts[{name!r}] shards dim {p.dim} (size {shape[p.dim]}) over {axis}={k}, "
                                    f"which does not divide it; {axis} sizes that would: "
                                    f"{', '.join(map(str, fit[:_MAX_LISTED])) or 'none'}, or shard another dim")
    # node keys
    for field, table in [("node_layouts", plan.node_layouts)] + \
            [(f"strategies[{a!r}]", t) for a, t in plan.strategies.items()]:
        bad = [k for k in table if k not in keys]
        if bad:
            problems.append(f"{field} names {len(bad)} nodes the captured graph does not have: {_few(bad, 4)}"
                            + (" (the graph was captured differently: " + why["ops"] + ")" if why and "ops" in why
                               else ""))
    for axis in plan.strategies:
        if axis not in sizes:
            problems.append(f"strategies are given on axis {axis!r}, which the mesh {_mesh_text(sizes)} does not have")
    for key, lay in plan.node_layouts.items():
        stray = [a for a, _ in lay.axes if a not in sizes]
        if stray:
            problems.append(f"node_layouts[{key!r}] places it on axes {stray}, which the mesh does not have")
    # pipeline
    pp = sizes.get("pp", 1)
    if plan.split_points:
        from autopar.passes.split_pipeline import brief_names, pipeline_units  # noqa: PLC0415

        units = [u.name for u in pipeline_units(global_gm)]
        bad = [p for p in plan.split_points if p not in units]
        if bad:
            problems.append(f"split_points {bad} are not pipeline units of this model; the units are "
                            f"{brief_names(units)}")
        elif units and units[0] in plan.split_points:
            problems.append(f"split point {units[0]!r} is the first unit: a stage must start after it")
        if pp == 1:
            problems.append(f"the plan has split points {plan.split_points} but the mesh has no pp axis; add "
                            f"pp={len(plan.split_points) + 1} to the mesh or drop the split points")
    if pp > 1:
        try:
            check_mesh_fits(global_gm, {"pp": pp})
        except ValueError as e:
            problems.append(str(e).partition(": ")[2])
    # recompute
    if plan.recompute:
        paths = _module_paths(global_gm)
        bad = [m for m in plan.recompute if m not in paths]
        if bad:
            problems.append(f"recompute names {len(bad)} modules the model does not have: {_few(bad)}"
                            + _close_hint(bad[0], paths))
    # fusions
    if plan.fusions:
        from autopar.passes.rules.fusion_table import parse_entry  # noqa: PLC0415

        for e in plan.fusions:
            try:
                parse_entry(e)
            except ValueError as err:
                problems.append(f"fusions entry {e!r}: {err}")
    # expert parallelism
    ep = sizes.get("ep", 1)
    if ep > 1:
        problems += _ep_problems(global_gm, ep, sizes)
    if sizes.get("cp", 1) > 1 and ep > 1:
        problems += _cp_ep_problems(global_gm, sizes)
    expert = plan.extra.get("expert") if isinstance(plan.extra, dict) else None
    if isinstance(expert, Mapping) and isinstance(expert.get("blocks"), Mapping):
        paths = _module_paths(global_gm)
        bad = [m for m in expert["blocks"] if m not in paths]
        if bad:
            problems.append(f"extra['expert'] names MoE blocks the model does not have: {_few(bad)}")
    if problems:
        raise PlanMismatchError("the plan does not fit this model and mesh, so none of it was applied: "
                                + "; ".join(problems[:12]) + (f" (and {len(problems) - 12} more)"
                                                               if len(problems) > 12 else ""))
    if why and "ops" in why:
        notes.append(f"warning: {why['ops']}; every node the plan names exists in this capture, so the plan is "
                     "applied")
    if why and "dtypes" in why:
        notes.append(f"warning: {why['dtypes']}; its names and shapes fit, so the plan is applied")
    return notes + axis_notes(plan)


def _close_hint(name: str, known) -> str:
    import difflib  # noqa: PLC0415

    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ------------------------------------------------------------------------ axes that do nothing
def _shards_on(plan: Plan, axis: str) -> bool:
    if any(isinstance(lay.get(axis), (Shard, Partial)) for lay in plan.param_layouts.values()):
        return True
    for text in plan.strategies.get(axis, {}).values():
        if "S(" in text or "P(" in text:
            return True
    return False


def axis_notes(plan: Plan) -> list[str]:
    """Warnings for axes of size > 1 that the plan leaves doing nothing (see the module
    docstring); empty when every axis splits something."""
    out = []
    for axis, k in plan.mesh.items():
        if k < 2:
            continue
        if axis == plan.dp_axis:
            continue
        if axis == "pp":
            if plan.split_points and len(plan.split_points) + 1 < k:
                out.append(f"warning: pp={k} but the plan has {len(plan.split_points) + 1} stages")
            continue
        if axis == "ep":
            continue  # plan_experts refuses an ep axis without MoE blocks
        if axis in plan.strategies and not _shards_on(plan, axis):
            out.append(f"warning: {axis}={k} shards nothing: the sharding search kept every op and parameter "
                       f"replicated on {axis} (on this hardware profile the collectives cost more than the work "
                       f"they split), so its {k} ranks repeat the same work; pin param_layouts, plan for another "
                       f"hardware profile, or give these ranks to dp")
    if plan.zero_stage and plan.dp * plan.mesh.get("cp", 1) == 1:  # ZeRO shards over dp+cp (runtime/program.py)
        out.append(f"warning: zero_stage={plan.zero_stage} with dp=1 shards nothing (ZeRO splits over dp, and cp)")
    return out


# ------------------------------------------------------------------------ MoE auxiliary statistics
MOE_AUX_STATS = ("global", "micro_batch")


def router_stat_keys(global_gm: fx.GraphModule) -> list[str]:
    """The router statistics of the captured graph (reductions over tokens of router outputs:
    a load-balancing loss's expert counts and mean probabilities, a router z-loss;
    `search.expert_detect.router_stats`); empty for a model without a top-k, or whose top-k
    the MoE detection cannot take apart (it is then no MoE this version splits)."""
    import torch  # noqa: PLC0415

    if not any(n.op == "call_function" and n.target is torch.ops.aten.topk.default for n in global_gm.graph.nodes):
        return []
    from autopar.search.expert_detect import router_stats  # noqa: PLC0415

    try:
        return router_stats(global_gm)
    except ValueError:  # MoEDetectError: the ep checks name it where ep is asked for
        return []


def check_moe_aux_stats(plan: Plan, global_gm: fx.GraphModule, mode: str | None) -> list[str]:
    """How the MoE auxiliary losses see the batch, recorded as `plan.extra["moe_aux_stats"]`
    when the model has router statistics (`router_stat_keys`): "global" (the default, or the
    given plan's entry when `mode` is None) computes them as one process over the global batch,
    so a plan with n_microbatches > 1 is refused (`check_micro_batches`); "micro_batch" keeps
    each micro-batch's own statistics (Megatron's) and says so in the returned notes. Raises
    ValueError for another mode or a refused plan."""
    mode = mode if mode is not None else plan.extra.get("moe_aux_stats", "global")
    if mode not in MOE_AUX_STATS:
        raise ValueError(f"moe_aux_stats={mode!r} is not a mode; use 'global' (router statistics over the global "
                         "batch, as one process computes them) or 'micro_batch' (per micro-batch, as Megatron)")
    keys = router_stat_keys(global_gm)
    if not keys:
        plan.extra.pop("moe_aux_stats", None)
        return []
    plan.extra["moe_aux_stats"] = mode
    check_micro_batches(plan, plan.n_microbatches, len(keys))
    if mode == "micro_batch" and plan.n_microbatches > 1:
        return [f"MoE auxiliary statistics per micro-batch (moe_aux_stats='micro_batch'): the {len(keys)} router "
                f"reductions over tokens see one micro-batch's tokens of {plan.n_microbatches}, and the auxiliary "
                "loss is the mean of the micro-batches' losses (Megatron's recipe), not the global batch's"]
    return []


def check_micro_batches(plan: Plan, n_microbatches: int, n_stats: int | None = None) -> None:
    """Refuse `n_microbatches` > 1 for a plan whose MoE auxiliary statistics must be global
    (`plan.extra["moe_aux_stats"] == "global"`): see `check_moe_aux_stats`."""
    if n_microbatches <= 1 or plan.extra.get("moe_aux_stats") != "global":
        return
    what = f"{n_stats} router reductions over tokens" if n_stats else "router reductions over tokens"
    raise ValueError(
        f"n_microbatches={n_microbatches} with MoE auxiliary losses computed over the global batch "
        f"(moe_aux_stats='global'): the model's load-balancing / router z-loss statistics ({what}) would be "
        f"computed per micro-batch, over 1/{n_microbatches} of the tokens, so the auxiliary loss and its gradients "
        "would differ from one process on the whole batch (under 1F1B a micro-batch's backward runs before the "
        "later micro-batches' forwards, so the global statistics do not exist yet). Use n_microbatches=1, or "
        "pass moe_aux_stats='micro_batch' to accept per-micro-batch statistics (Megatron's behaviour; the same "
        "result when the auxiliary loss's weight is 0)")
