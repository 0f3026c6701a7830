"""Expert parallelism's memory on one rank, costed on the global graph (`cost.estimate`).

With `plan.extra["expert"]` (search/expert.py `plan_experts`) on an ep axis of P ranks, rank r
keeps experts [r * E/P, (r + 1) * E/P) of every block and the expert pass (passes/expert.py)
rewrites the block around them. The estimate's rank is rank 0. For a dropless "slots" block
(models/moe.py: a slot buffer of E * C rows, C = the block's N tokens, every expert run on its
C slots) what runs differs from the captured graph as follows, with K the top-k and the
routing balanced (each rank receives N * K rows, each local expert N * K * P / E):

  expert parameters      of other ranks' experts: gone (their states and gradients 0)
  other experts' nodes   not run (their storages 0)
  local experts' nodes   run on N * K * P / E rows instead of C = N: scale K * P / E
  slot-sized storages    of the block (E * C or E * C + 1 rows: the slot buffer, the stacked
                         expert outputs, the combine's input): become the dispatched and
                         combined N * K rows (`moe.dispatch`, the local concatenation,
                         `moe.combine`): scale K / E

Other idioms ("sorted": transformers' grouped experts, "dense") and blocks with a capacity are
not modelled here (their parameters are ep-sharded through `plan.param_layouts` when grouped);
`ep_memory` says so in its notes. Measured against a 4-rank gloo run of moe-tiny
(tests/dist/test_memory_truth.py): the routing of a fresh router is uneven, so ranks differ
by a few percent around the balanced figure.

Reads no node.meta (only a GraphCost and the plan entry). Guarantees: with P = 1 or no
expert entry it returns the parameters unchanged and no scales.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .graph import GraphCost, ParamInfo


@dataclass
class EPMemory:
    params: list[ParamInfo]  # what rank 0 keeps
    dropped: set[Any] = field(default_factory=set)  # storage keys of other ranks' expert parameters
    scale: dict[Any, float] = field(default_factory=dict)  # storage key -> bytes factor on this rank
    notes: list[str] = field(default_factory=list)


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


def ep_memory(gc: GraphCost, params: list[ParamInfo], plan: Any, ev: Callable[[Any], float]) -> EPMemory:
    """Rank 0's parameters and storage scales under the plan's expert parallelism (see the
    module docstring). `ev` evaluates a symbolic size at the costed sizes."""
    entry = (getattr(plan, "extra", None) or {}).get("expert") or {}
    ep = int((getattr(plan, "mesh", None) or {}).get(entry.get("axis", "ep"), 1)) if entry else 1
    if ep <= 1 or not entry.get("blocks"):
        return EPMemory(list(params))
    out = EPMemory(list(params))
    layouts: Mapping[str, Any] = getattr(plan, "param_layouts", {}) or {}
    drop_names: set[str] = set()
    for module, b in sorted(entry["blocks"].items()):
        E, K = int(b["n_experts"]), int(b["top_k"])
        if b.get("idiom") != "slots" or not b.get("dropless", False):
            out.notes.append(f"expert block {module} ({b.get('idiom')}, "
                             f"{'dropless' if b.get('dropless') else 'with a capacity'}): activations costed as "
                             "the global graph's (not modelled per ep rank)")
            continue
        per_rank = E // ep
        by_expert: dict[int, list[str]] = {}
        for name, e in b["expert_params"].items():
            by_expert.setdefault(int(e), []).append(name)
        for e, names in by_expert.items():
            if e >= per_rank:
                drop_names |= {n for n in names if "ep" not in dict(getattr(layouts.get(n), "axes", ()))}
        prefixes = {e: _expert_prefix(names) for e, names in by_expert.items()}
        row_bytes = None
        for n in gc.nodes:
            if not _inside(n.module, module):
                continue
            e = next((e for e, p in prefixes.items() if _inside(n.module, p)), None)
            keys = list(n.new_storages) + [k for k, _nb, _t in n.saved if k in gc.storages]
            for k in keys:
                st = gc.storages.get(k)
                if st is None or st.is_state or st.producer != n.index:
                    continue
                if e is not None:
                    out.scale[k] = K * ep / E if e < per_rank else 0.0
        # slot-sized storages of the block: E * C (+ 1) rows of the block's hidden size
        tokens = next((n for n in gc.nodes if n.key == b.get("tokens")), None)
        if tokens is None or not tokens.outputs:
            out.notes.append(f"expert block {module}: token node {b.get('tokens')} not found; slot buffers costed "
                             "as the global graph's")
            continue
        t = tokens.outputs[0]
        n_tok = ev(t.numel) / max(int(b["hidden"]), 1)
        row_bytes = ev(t.nbytes) / max(n_tok, 1)
        slot_sizes = {E * n_tok * row_bytes, (E * n_tok + 1) * row_bytes}
        for n in gc.nodes:
            if not _inside(n.module, module) or any(_inside(n.module, p) for p in prefixes.values()):
                continue
            for k in n.new_storages:
                st = gc.storages.get(k)
                if st is None or st.is_state or st.producer != n.index or k in out.scale:
                    continue
                if any(abs(ev(st.nbytes) - s) < 0.5 for s in slot_sizes):
                    out.scale[k] = K / E
    if drop_names:
        out.params = [p for p in params if p.name not in drop_names]
        out.dropped = {p.key for p in params if p.name in drop_names and p.key is not None}
    return out


__all__ = ["EPMemory", "ep_memory"]
