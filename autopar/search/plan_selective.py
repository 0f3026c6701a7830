"""Selective recompute in the joint planner: what a block recomputed "selective" keeps, frees and replays.

A block the planner recomputes "selective" (`Plan.recompute[block] = "selective"`, with
`Plan.extra["recompute_save"][block]` the node keys it keeps, as `passes.recompute` and
`cost.estimate` read them) keeps the outputs of its expensive nodes: the matmul-class ops and
fused attention kernels of `passes.recompute.SELECTIVE_SAVE_OPS` whose outputs checkpointing can
cache (`recompute_chain.is_saveable`: a fused attention kernel, not one computed from its math)
and that a node other than a collective reads (a row-parallel GEMM's partial sums feed only
their reduction, whose output is kept).
It recomputes the rest in backward: norms, pointwise ops, and attention computed unfused, whose
score matrix is what Korthikanti et al. 2022 (arXiv 2205.05198, "selective activation
recomputation") drop. Where a block recomputed whole would replay its GEMMs, this replays only
the cheap nodes; what it frees is what the full recompute frees less the kept storages.

Per unit of the planner's chain (`PlanTables`), at one (tp, rows, cp):
  * `rc_save`: the full recompute's saved bytes freed (`UnitCosts.rc_save`) less the bytes of
    the kept nodes' storages on one rank (each divided as the sharding ILP divides it);
  * `rc_time`: the full recompute's forward seconds (`UnitCosts.rc_time`) less the kept nodes'
    forward seconds (`UnitCosts.node_fwd`).
These choose what to recompute; the chosen plan's peak and replay time are then `cost.timeline`'s
walk of the same regions (`plan_rank.rank_recompute`, `plan_pipeline_memory`), as estimate walks
them.

Reads node.meta only through `cost.analyze`. Deterministic; cached per model and size.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np
import sympy
import torch.fx as fx

from autopar.cost.ops import packet_name
from autopar.cost.symbolic import evaluate
from autopar.cost.timeline import communicates, stop_runs
from autopar.passes.recompute import SELECTIVE_SAVE_OPS, in_module
from autopar.search.recompute_chain import is_saveable, made_bytes, written_nodes

__all__ = ["BLOCK_UNIT", "FLAVORS", "kept_nodes", "selective_keep", "selective_keys", "selective_units", "with_modes"]

FLAVORS = ("full", "selective")  # how the planner recomputes a block
BLOCK_UNIT = re.compile(r"(^|\.)\d+$")  # a pipeline unit named after a numbered module (layers.3): a block


def kept_nodes(gm: fx.GraphModule, gc: Any, modules: Sequence[str]) -> dict[str, tuple]:
    """Per module path of `modules`, the `NodeCost`s of `gc` (`gm` analysed) "selective" keeps:
    expensive, cacheable nodes of the module that recomputation would otherwise run (not past the
    region's last saving node, not that node when it saves only its inputs, no collective,
    nothing written in place later). Modules with none are left out."""
    written = written_nodes(gm)
    out = {}
    for name in modules:
        members = [n for n in gc.nodes if in_module(n.module, name)]
        saving = [n.index for n in members if n.saved]
        if not saving:
            continue
        stop = max(saving)
        readers: dict = {}  # storage -> the members reading it
        for n in members:
            for k in n.uses:
                readers.setdefault(k, []).append(n)
        kept = tuple(n for n in members
                     if n.index <= stop and not communicates(n) and packet_name(n.op) in SELECTIVE_SAVE_OPS
                     and not (n.index == stop and not stop_runs(n)) and n.kind not in ("view", "none")
                     and is_saveable(n) and n.name not in written and _read_in_recompute(n, readers))
        if kept:
            out[name] = kept
    return out


def selective_keep(model: Any) -> dict[int, tuple]:
    """Per block unit (index) of a `PlanTables`, the `NodeCost`s "selective" keeps (`kept_nodes`)."""
    hit = model._split_cache.get("sel_keep")
    if hit is None:
        blocks = [name for u, name in enumerate(model.unit_names) if model.blocks[u] > 0]
        by_name = kept_nodes(model.gm, model.gc, blocks)
        hit = model._split_cache["sel_keep"] = {model.unit_names.index(b): k for b, k in by_name.items()}
    return hit


def _read_in_recompute(n: Any, readers: dict) -> bool:
    """Whether a node of the region other than a collective reads `n`'s output: a row-parallel
    GEMM's partial sums feed only their reduction, whose output the region keeps anyway (kept,
    they would be a full-size tensor held for nothing)."""
    return any(not communicates(r) for t in n.outputs for r in readers.get(t.key, ()) if r is not n)


def selective_keys(model: Any, unit: str) -> list[str]:
    """The node keys "selective" keeps in `unit` (`Plan.extra["recompute_save"][unit]`)."""
    return [n.key for n in selective_keep(model).get(model.unit_names.index(unit), ())]


def selective_units(model: Any, u: Any, t: int, rows: int, cp: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(bytes freed, forward seconds replayed) per unit and micro-batch when each block is
    recomputed "selective", at tp = t, `rows` per micro-batch, s / cp tokens; `u`: that size's
    `UnitCosts`."""
    key = ("sel_units", t, rows, cp)
    hit = model._split_cache.get(key)
    if hit is not None:
        return hit
    keep = selective_keep(model)
    div = model.sharding(t).mem_div
    values = model._values(rows, cp)
    scale = 1.0 if model.symbolic_batch else rows / (model.captured_rows or rows)
    kept_b, kept_t = np.zeros(model.L), np.zeros(model.L)
    memo: dict = {}

    def ev(x) -> float:
        if not isinstance(x, sympy.Basic):
            return float(x)
        r = memo.get(x)
        if r is None:
            r = memo[x] = float(evaluate(x, values))
        return r

    for x, nodes in keep.items():
        for n in nodes:
            kept_b[x] += made_bytes(model.gc, n, ev, div)
            kept_t[x] += float(u.node_fwd[n.index])
    rc_save = np.where(model.blocks > 0, np.maximum(u.rc_save - kept_b * scale, 0.0), 0.0)
    rc_time = np.where(model.blocks > 0, np.maximum(u.rc_time - kept_t, 0.0), 0.0)
    hit = model._split_cache[key] = (rc_save, rc_time)
    return hit


def with_modes(model: Any, u: Any, flavor: str, pinned: dict[int, str], t: int, rows: int, cp: int = 1) -> Any:
    """`u` with each unit's recompute columns for its mode: `pinned[x]` where given, else `flavor`
    ("full": the columns as they are)."""
    if flavor not in FLAVORS:
        raise ValueError(f"recompute flavor {flavor!r}: choose one of {FLAVORS}")
    sel = np.array([pinned.get(x, flavor) == "selective" for x in range(model.L)])
    if not sel.any():
        return u
    rs, rt = selective_units(model, u, t, rows, cp)
    return dataclasses.replace(u, rc_save=np.where(sel, rs, u.rc_save), rc_time=np.where(sel, rt, u.rc_time))
