"""The joint planner's cache: a request's key, and plans and reports stored as JSON files.

`graph_fingerprint(gm)` hashes what the planner reads of a graph (ops, shapes, dtypes, module
paths, parameters); `cache_key(...)` adds every argument that changes the answer and the
planner's version (`PLANNER_VERSION`: bump it when the same request may get another plan).
`disk_get` / `disk_put` read and write `plan-<key>.json` in a cache directory (`plan_for`'s
`cache_dir` or $AUTOPAR_PLAN_CACHE); a file that cannot be read is a miss.

Reads node.meta["autopar"] (through `passes.ir`) for the fingerprint; writes nothing.
Deterministic: equal requests give equal keys.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Mapping

import torch.fx as fx

from autopar.passes import ir
from autopar.search.candidate import plain

__all__ = ["PLANNER_VERSION", "cache_key", "disk_get", "disk_put", "graph_fingerprint"]

PLANNER_VERSION = 7  # 2: precision and offload priced; 3: cp searched, tied pipelines under ZeRO, the loss in memory;
# 4: ep priced as estimate, pipeline memory from the schedule walk, pp x cp and ep x cp planned;
# 5: recompute planned under zb_h1 / zbv (stages holding regions priced as one backward), tp > 1 with a
# symbolic MoE capacity, collectives per micro-batch; 6: pipeline stages that recompute walked with their
# checkpoint regions (memory) and their recomputed forward in each stage's backward (time); 7: blocks
# recomputed "selective", the gradient bucket size searched (`planner.BUCKET_MB`)


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A hash of what the planner reads: ops, shapes, dtypes, module paths, parameters."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        i = ir.get_info(n)
        h.update(f"{n.op}|{n.target}|{i.shape if i else None}|{i.dtype if i else None}|"
                 f"{i.module if i else ''}\n".encode())
    for name, p in gm.named_parameters(remove_duplicate=False):
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{p.requires_grad}\n".encode())
    return h.hexdigest()[:24]


def cache_key(gm, world, hw, pins, limit, global_batch, top_k, optimizer, support) -> str:
    """The key of one planner request: the planner version, the graph's fingerprint and every
    argument that changes the answer."""

    def enc(x):
        if isinstance(x, Mapping):
            return {str(k): enc(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
        if isinstance(x, (list, tuple)):
            return [enc(v) for v in x]
        if isinstance(x, (int, float, str, bool)) or x is None:
            return x
        return str(x)

    blob = json.dumps({"v": PLANNER_VERSION, "graph": graph_fingerprint(gm), "world": world, "hw": hw.to_dict(),
                       "pins": enc(pins), "limit": limit, "batch": global_batch, "k": top_k, "opt": str(optimizer),
                       "support": enc(support)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def disk_get(cache_dir: str | None, key: str):
    """(plan dict, report dict) stored under `key` in `cache_dir`, or None."""
    if not cache_dir:
        return None
    path = os.path.join(cache_dir, f"plan-{key}.json")
    try:
        with open(path) as f:
            d = json.load(f)
        return d["plan"], d["report"]
    except (OSError, ValueError, KeyError):
        return None


def disk_put(cache_dir: str | None, key: str, value) -> None:
    """Store (plan dict, report dict) under `key` in `cache_dir` (atomically: a reader sees the
    old file or the new one)."""
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"plan-{key}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(plain({"plan": value[0], "report": value[1]}), f, indent=1)
    os.replace(tmp, path)
