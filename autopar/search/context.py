"""Choose how attention is exchanged over a context-parallel (`cp`) axis: ring or Ulysses.

Per attention call, with this rank's shapes (B, H heads of which Hkv kv heads, t = T / cp
local tokens, D head dim; heads already divided by tp), on the cp axis' link:

    ring      cp - 1 steps. In each, the K and V blocks (2 B Hkv t D bytes) move one hop while
              the block attention runs; what the block computation cannot hide is exposed.
              Forward moves K, V; backward moves K, V, dK, dV and computes twice the work.
              With the zigzag layout every step's block work is the same on every rank
              (causal: half a t x t block pair on average).
    ulysses   four all-to-alls forward (q, k, v from sequence- to head-sharded; out back) and
              four backward, of B H t D bytes per rank each (kv heads repeated up to cp when
              fewer), nothing overlapped. Needs this rank's query heads divisible by cp.

The cheaper wins ("auto"); a named method is checked and priced the same. The entry stored in
`plan.extra["context"]` says what was chosen and why, with both prices.

Reads node.meta["val"] of the captured graph (its example sizes).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.cost.comm import axis_links
from autopar.cost.hardware import Hardware, load_profile
from autopar.passes.context_positions import SDPA, check_context_parallel

METHODS = ("auto", "ring", "ulysses")


def plan_context(gm: fx.GraphModule, mesh: Mapping[str, int], method: str = "auto",
                 hardware: str | Hardware | None = None, axis: str = "cp") -> dict[str, Any]:
    """The context-parallel entry of a Plan for `gm` on `mesh` (see the module docstring)."""
    if method not in METHODS:
        raise ValueError(f"context_method={method!r}; choose one of {METHODS}")
    cp = mesh.get(axis, 1)
    check_context_parallel(gm)  # ValueError naming the node that cannot run on a chunk of the sequence
    hw = load_profile(hardware or "cpu-gloo")
    link = axis_links(hw, dict(mesh))[axis]
    tp = mesh.get("tp", 1)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]
    if not calls:
        raise ValueError(f"cp={cp} but the model has no scaled_dot_product_attention: nothing exchanges the "
                         "sequence, so context parallelism does not apply; use a mesh without cp")
    ring_s = ulysses_s = ring_b = ulysses_b = 0.0
    heads_ok = True
    dp = mesh.get("dp", 1)
    seq_len = None
    for n in calls:
        q, k = n.args[0].meta["val"], n.args[1].meta["val"]
        b, h, t, d = (_hint(s) for s in q.shape)
        b = max(1, b // dp)  # this rank's rows (the captured batch is the global one)
        hkv = _hint(k.shape[1])
        seq_len = t
        h_local, hkv_local = max(1, h // tp), max(1, hkv // tp)
        heads_ok = heads_ok and h_local % cp == 0
        item = q.dtype.itemsize
        tl = t // cp
        block_flops = 4 * b * h_local * tl * tl * d * 0.5  # causal zigzag: half a block pair per step, on average
        # a block pair is a (tl x tl) attention, full off the diagonal: its forward kernel's efficiency
        peak = hw.peak(_dtype_name(q.dtype)) * hw.attention_eff(_dtype_name(q.dtype), seq=tl, head_dim=d)
        compute = block_flops / peak
        kv = 2 * b * hkv_local * tl * d * item
        hop = link.time("send_recv", kv)
        ring_s += (cp - 1) * (max(0.0, hop - compute) + max(0.0, 2 * hop - 2 * compute))
        ring_b += 3 * (cp - 1) * kv  # forward: K, V; backward: K, V and dK, dV
        a2a = b * h_local * tl * d * item * cp  # the payload an all-to-all over cp ranks moves, per rank
        ulysses_s += 8 * link.time("all_to_all", a2a)
        ulysses_b += 8 * a2a
    prices = {"ring": ring_s, "ulysses": ulysses_s if heads_ok else None}
    why = []
    if method == "ulysses" and not heads_ok:
        raise ValueError(f"context_method='ulysses' splits each rank's query heads over cp={cp}, which does not divide "
                         f"them (tp={tp}); use context_method='ring' or a cp that divides the heads")
    if method == "auto":
        chosen = "ring" if not heads_ok or ring_s <= ulysses_s else "ulysses"
        why.append(f"cp={cp}: {chosen} attention exchange; exposed communication per step: ring "
                   f"{ring_s * 1e3:.3f} ms" + (f", ulysses {ulysses_s * 1e3:.3f} ms" if heads_ok else
                                               ", ulysses not possible (heads do not divide by cp)"))
    else:
        chosen = method
        why.append(f"cp={cp}: {chosen} attention exchange (asked for); exposed communication per step: ring "
                   f"{ring_s * 1e3:.3f} ms" + (f", ulysses {ulysses_s * 1e3:.3f} ms" if heads_ok else ""))
    return {"axis": axis, "method": chosen, "layout": "zigzag", "attention_calls": len(calls),
            "example_seq_len": seq_len, "exposed_s": prices,
            "bytes": {"ring": ring_b, "ulysses": ulysses_b if heads_ok else None}, "notes": why}


def _hint(s) -> int:
    if isinstance(s, int):
        return s
    hint = s.node.hint
    return int(hint) if hint is not None else 1


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


__all__ = ["plan_context", "METHODS"]
