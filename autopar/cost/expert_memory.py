"""Expert parallelism's memory on one rank, costed on the global graph (`cost.estimate`).

With `plan.extra["expert"]` (search/expert.py `plan_experts`) on an ep axis of P ranks, rank r
keeps experts [r * E/P, (r + 1) * E/P) of every block and the expert pass (passes/expert.py)
rewrites the block around them. The estimate's rank is rank 0. For a "slots" block
(models/moe.py: a slot buffer of E * C rows, every expert run on its C slots; C = the block's
N tokens dropless, the model's capacity otherwise) what runs differs from the captured graph
as follows, with K the top-k and the routing balanced (`block_rows`: a local expert receives
R = N * K * P / E rows, at most the ep group's capacity; this rank sends E / P x R of its N * K
assignments):

  expert parameters      of other ranks' experts: gone (their states and gradients 0)
  other experts' nodes   not run (their storages and compute 0)
  local experts' nodes   run on R rows instead of C: storages and compute scaled by R / C
                         (dropless: K * P / E)
  slot-sized storages    of the block (E * C or E * C + 1 rows: the slot buffer, the stacked
  and their nodes        expert outputs, the combine's input): become the dispatched and
                         combined E / P x R rows (`moe.dispatch`, the local concatenation,
                         `moe.combine`): scaled by R / (P C) (dropless: K / E)

`EPMemory.compute` carries the compute factors, which `cost.estimate` applies as a divisor of
each node's work (and the planner's one-stage tables, `search.plan_rank`, the same). Other
idioms ("sorted": transformers' grouped experts, "dense") are not modelled here (their
parameters are ep-sharded through `plan.param_layouts` when grouped); `ep_memory` says so in
its notes. Measured against a 4-rank gloo run of moe-tiny (tests/dist/test_memory_truth.py):
the routing of a fresh router is uneven, so ranks differ by a few percent around the balanced
figure.

Reads no node.meta (only a GraphCost and the plan entry). Guarantees: with P = 1 or no
expert entry it returns the parameters unchanged and no scales.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .graph import GraphCost, ParamInfo


@dataclass
class EPMemory:
    params: list[ParamInfo]  # what rank 0 keeps
    dropped: set[Any] = field(default_factory=set)  # storage keys of other ranks' expert parameters
    scale: dict[Any, float] = field(default_factory=dict)  # storage key -> bytes factor on this rank
    notes: list[str] = field(default_factory=list)
    # node index -> compute factor on this rank (0: the node does not run here); the routed rows
    # of the same model as the storages: local experts K * P / E, slot-sized nodes K / E
    compute: dict[int, float] = field(default_factory=dict)


def _expert_prefix(names: list[str]) -> str:
    """The module path common to one expert's parameters ("layers.0.moe.experts.3")."""
    parts = [n.split(".")[:-1] for n in names]
    common = parts[0]
    for p in parts[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    if len(names) == 1 and len(common) > 1:  # one parameter: its module is a part of the expert
        common = common[:-1]
    return ".".join(common)


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@dataclass(frozen=True)
class BlockRows:
    """One slots block's rows on one rank of P, the routing taken as balanced: `tokens` N (the
    rank's), `row_bytes` of a token row, `slots` C of the captured graph (rows each expert runs
    on: N dropless, the model's capacity otherwise), `per_expert` rows a local expert receives
    (N K P / E, at most the ep group's capacity: P C for the model's rule, the plan's
    C = min(N P, ceil(cf N P K / E)) when it forces a capacity factor), `kept` assignments this
    rank sends (E / P x per_expert: N K when nothing is dropped)."""

    tokens: float
    row_bytes: float
    slots: float
    per_expert: float
    kept: float


def block_rows(gc: GraphCost, b: Mapping[str, Any], ep: int, ev: Callable[[Any], float],
               capacity_factor: float | None = None, by_key: Mapping[Any, Any] | None = None) -> BlockRows | None:
    """`BlockRows` of one block's plan entry (`MoEBlock.to_json()`); None when its token node is
    not in the graph. `cost.expert_comm` sizes the all-to-alls from the same rows. `by_key`:
    the graph's nodes by key, when the caller has them (a walk of the graph otherwise)."""
    if by_key is None:
        by_key = {n.key: n for n in gc.nodes if n.key in (b.get("tokens"), (b.get("entries") or [None])[0])}
    tokens = by_key.get(b.get("tokens"))
    if tokens is None or not tokens.outputs:
        return None
    E, K, D = int(b["n_experts"]), int(b["top_k"]), max(int(b["hidden"]), 1)
    t = tokens.outputs[0]
    n_tok = ev(t.numel) / D
    row_bytes = ev(t.nbytes) / max(n_tok, 1)
    entry = by_key.get((b.get("entries") or [None])[0])
    slots = ev(entry.outputs[0].numel) / D if entry is not None and entry.outputs else n_tok
    if capacity_factor is not None:
        group = min(n_tok * ep, math.ceil(capacity_factor * n_tok * ep * K / E))
    else:
        group = n_tok * ep if b.get("dropless", False) else ep * slots
    per_expert = min(n_tok * K * ep / E, group)
    return BlockRows(n_tok, row_bytes, slots, per_expert, per_expert * E / ep)


def ep_memory(gc: GraphCost, params: list[ParamInfo], plan: Any, ev: Callable[[Any], float],
              by_key: Mapping[Any, Any] | None = None) -> EPMemory:
    """Rank 0's parameters and storage scales under the plan's expert parallelism (see the
    module docstring). `ev` evaluates a symbolic size at the costed sizes; `by_key`: the
    graph's nodes by key, when the caller has them."""
    entry = (getattr(plan, "extra", None) or {}).get("expert") or {}
    ep = int((getattr(plan, "mesh", None) or {}).get(entry.get("axis", "ep"), 1)) if entry else 1
    if ep <= 1 or not entry.get("blocks"):
        return EPMemory(list(params))
    out = EPMemory(list(params))
    layouts: Mapping[str, Any] = getattr(plan, "param_layouts", {}) or {}
    drop_names: set[str] = set()
    by_key = by_key if by_key is not None else {n.key: n for n in gc.nodes}
    for module, b in sorted(entry["blocks"].items()):
        E = int(b["n_experts"])
        if b.get("idiom") != "slots":
            out.notes.append(f"expert block {module} ({b.get('idiom')}): activations and expert compute costed as "
                             "the global graph's (not modelled per ep rank)")
            continue
        per_rank = E // ep
        by_expert: dict[int, list[str]] = {}
        for name, e in b["expert_params"].items():
            by_expert.setdefault(int(e), []).append(name)
        for e, names in by_expert.items():
            if e >= per_rank:  # another rank's expert, unless a layout shards it over ep instead
                drop_names |= {n for n in names if not _on_ep(layouts.get(n))}
        rows = block_rows(gc, b, ep, ev, entry.get("capacity_factor"), by_key)
        if rows is None:
            out.notes.append(f"expert block {module}: token node {b.get('tokens')} not found; its activations and "
                             "expert compute costed as the global graph's")
            continue
        local = rows.per_expert / max(rows.slots, 1e-300)  # a local expert's rows / the captured slots
        prefixes = {e: _expert_prefix(names) for e, names in by_expert.items()}
        for n in gc.nodes:
            if not _inside(n.module, module):
                continue
            e = next((e for e, p in prefixes.items() if _inside(n.module, p)), None)
            if e is None:
                continue
            out.compute[n.index] = local if e < per_rank else 0.0
            for k in list(n.new_storages) + [k for k, _nb, _t in n.saved if k in gc.storages]:
                st = gc.storages.get(k)
                if st is not None and not st.is_state and st.producer == n.index:
                    out.scale[k] = local if e < per_rank else 0.0
        # slot-sized storages of the block: E * C (+ 1) rows of the block's hidden size
        slot_sizes = {E * rows.slots * rows.row_bytes, (E * rows.slots + 1) * rows.row_bytes}
        for n in gc.nodes:
            if not _inside(n.module, module) or any(_inside(n.module, p) for p in prefixes.values()):
                continue
            for k in n.new_storages:
                st = gc.storages.get(k)
                if st is None or st.is_state or st.producer != n.index or k in out.scale:
                    continue
                if any(abs(ev(st.nbytes) - s) < 0.5 for s in slot_sizes):
                    out.scale[k] = out.compute[n.index] = rows.kept / (E * rows.slots)
    if drop_names:
        out.params = [p for p in params if p.name not in drop_names]
        out.dropped = {p.key for p in params if p.name in drop_names and p.key is not None}
    return out


def ep_compute_divisor(comp_div: Mapping[int, float], compute: Mapping[int, float]) -> dict[int, float]:
    """Node compute divisors with `EPMemory.compute`'s factors applied (a node this rank does
    not run: math.inf), for `cost.timeline`'s recompute time; `cost.estimate` and the planner
    pass the same."""
    out = dict(comp_div)
    for i, k in compute.items():
        out[i] = comp_div.get(i, 1) / k if k > 0 else math.inf
    return out


def _on_ep(layout: Any) -> bool:
    """Whether a parameter layout shards the ep axis (grouped experts keep their rows so)."""
    p = dict(getattr(layout, "axes", ())).get("ep")
    return p is not None and type(p).__name__ == "Shard"


__all__ = ["BlockRows", "EPMemory", "block_rows", "ep_compute_divisor", "ep_memory"]
