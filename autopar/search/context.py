"""Choose how attention is exchanged over a context-parallel (`cp`) axis: ring or Ulysses.

Per attention call, with this rank's shapes (B, H heads of which Hkv kv heads, t = T / cp
local tokens, D head dim; heads already divided by tp), on the cp axis' link:

    ring      cp - 1 steps. In each, the K and V blocks (2 B Hkv t D bytes) move one hop while
              the block attention runs; what the block computation cannot hide is exposed, and
              the block computation runs (1 + k) times slower while the hop is in flight (k: the
              cp link's `contention`; `cost.overlap.overlap_extra` prices the pair, so the step
              pays max(hop - compute, hop k / (1 + k)) per hop; at k = 0, max(0, hop - compute)).
              Forward moves K, V; backward moves K, V, dK, dV and computes twice the work.
              With the zigzag layout every step's block work is the same on every rank
              (causal: half a t x t block pair on average).
    ulysses   four all-to-alls forward (q, k, v from sequence- to head-sharded; out back) and
              four backward, of B H t D bytes per rank each (kv heads repeated up to cp when
              fewer), nothing overlapped. Needs this rank's query heads divisible by cp.

Both lay the sequence out in 2 cp zigzag chunks, so the sequence must divide by 2 cp.
The cheaper wins ("auto"); a named method is checked and priced the same. The entry stored in
`plan.extra["context"]` says what was chosen and why, with both prices; `cost.estimate` adds
the chosen method's exposed time to the step, and the joint planner prices its cp candidates
with the same entry (`context_facts` once per graph, `price_context` per mesh).

Kv heads are counted as the exchange moves them: a model that repeats its kv heads up to the
query heads before attention exchanges the kv heads themselves (`passes.context_attention.
unrepeated_kv`), so the ring's K/V blocks are priced at Hkv heads.

Reads node.meta["val"] of the captured graph (its example sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.cost.comm import axis_links
from autopar.cost.hardware import Hardware, load_profile
from autopar.cost.overlap import contention_of, overlap_extra
from autopar.passes.context_attention import unrepeated_kv
from autopar.passes.context_positions import SDPA, check_context_parallel

METHODS = ("auto", "ring", "ulysses")


@dataclass(frozen=True)
class ContextFacts:
    """What the exchange's price depends on, read once per graph: per attention call (rows of
    the captured batch, query heads, kv heads, sequence length, head dim, dtype)."""

    calls: tuple[tuple[int, int, int, int, int, torch.dtype], ...]
    seq_len: int
    captured_rows: int

    def heads_divide(self, cp: int, tp: int = 1) -> bool:
        """Ulysses can run: every call's query heads per tp rank divide by cp."""
        return all(max(1, h // tp) % cp == 0 for _b, h, _k, _t, _d, _dt in self.calls)


def context_facts(gm: fx.GraphModule) -> ContextFacts:
    """The graph's attention calls, or ValueError (naming the node) when the graph cannot run on a
    chunk of the sequence or has no attention to exchange."""
    check_context_parallel(gm)  # ValueError naming the node that cannot run on a chunk of the sequence
    calls = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is SDPA:
            q, k = n.args[0].meta["val"], n.args[1].meta["val"]
            b, h, t, d = (_hint(s) for s in q.shape)
            kv = _hint(k.shape[1])
            found = unrepeated_kv(n.args[1])  # kv heads repeated to the query heads: the exchange moves the kv heads
            if found is not None:
                src, transposed = found
                kv = _hint(src.meta["val"].shape[2 if transposed else 1])
            calls.append((b, h, kv, t, d, q.dtype))
    if not calls:
        raise ValueError("the model has no scaled_dot_product_attention: nothing exchanges the sequence, so context "
                         "parallelism does not apply; use a mesh without cp")
    return ContextFacts(tuple(calls), calls[-1][3], calls[-1][0])


def price_context(facts: ContextFacts, cp: int, tp: int, rows: int | None, link, hw: Hardware) -> dict[str, Any]:
    """Exposed seconds and bytes per rank and step of each method for `facts` on a cp axis of
    `cp` ranks whose link is `link` (see the module docstring); `rows`: this rank's rows of a
    step (default: the captured batch). Ulysses' entries are None when the heads do not divide."""
    ring_s = ulysses_s = ring_b = ulysses_b = 0.0
    heads_ok = facts.heads_divide(cp, tp)
    k = contention_of(link)
    for b0, h, hkv, t, d, dtype in facts.calls:
        b = rows if rows is not None else b0
        h_local, hkv_local = max(1, h // tp), max(1, hkv // tp)
        item = dtype.itemsize
        tl = t // cp
        block_flops = 4 * b * h_local * tl * tl * d * 0.5  # causal zigzag: half a block pair per step, on average
        # a block pair is a (tl x tl) attention, full off the diagonal: its forward kernel's efficiency
        peak = hw.peak(_dtype_name(dtype)) * hw.attention_eff(_dtype_name(dtype), seq=tl, head_dim=d)
        compute = block_flops / peak
        kv = 2 * b * hkv_local * tl * d * item
        hop = link.time("send_recv", kv)
        # each hop runs beside the block's attention, which it slows by (1 + k) while in flight
        # (cost.overlap): at k = 0, max(0, hop - compute) forward + max(0, 2 hop - 2 compute) backward
        ring_s += (cp - 1) * (overlap_extra(compute, hop, k) + overlap_extra(2 * compute, 2 * hop, k))
        ring_b += 3 * (cp - 1) * kv  # forward: K, V; backward: K, V and dK, dV
        a2a = b * h_local * tl * d * item * cp  # the payload an all-to-all over cp ranks moves, per rank
        ulysses_s += 8 * link.time("all_to_all", a2a)
        ulysses_b += 8 * a2a
    return {"exposed_s": {"ring": ring_s, "ulysses": ulysses_s if heads_ok else None},
            "bytes": {"ring": ring_b, "ulysses": ulysses_b if heads_ok else None}}


def context_entry(facts: ContextFacts, cp: int, tp: int, prices: Mapping[str, Any], method: str,
                  axis: str = "cp") -> dict[str, Any]:
    """The `plan.extra["context"]` entry for `method` ("auto": the cheaper) at these prices."""
    if method not in METHODS:
        raise ValueError(f"context_method={method!r}; choose one of {METHODS}")
    ring_s, ulysses_s = prices["exposed_s"]["ring"], prices["exposed_s"]["ulysses"]
    heads_ok = ulysses_s is not None
    if method == "ulysses" and not heads_ok:
        raise ValueError(f"context_method='ulysses' splits each rank's query heads over cp={cp}, which does not divide "
                         f"them (tp={tp}); use context_method='ring' or a cp that divides the heads")
    if method == "auto":
        chosen = "ring" if not heads_ok or ring_s <= ulysses_s else "ulysses"
        why = (f"cp={cp}: {chosen} attention exchange; exposed communication per step: ring {ring_s * 1e3:.3f} ms"
               + (f", ulysses {ulysses_s * 1e3:.3f} ms" if heads_ok else
                  ", ulysses not possible (heads do not divide by cp)"))
    else:
        chosen = method
        why = (f"cp={cp}: {chosen} attention exchange (asked for); exposed communication per step: ring "
               f"{ring_s * 1e3:.3f} ms" + (f", ulysses {ulysses_s * 1e3:.3f} ms" if heads_ok else ""))
    return {"axis": axis, "method": chosen, "layout": "zigzag", "attention_calls": len(facts.calls),
            "example_seq_len": facts.seq_len, "exposed_s": dict(prices["exposed_s"]), "bytes": dict(prices["bytes"]),
            "notes": [why]}


def plan_context(gm: fx.GraphModule, mesh: Mapping[str, int], method: str = "auto",
                 hardware: str | Hardware | None = None, axis: str = "cp") -> dict[str, Any]:
    """The context-parallel entry of a Plan for `gm` on `mesh` (see the module docstring)."""
    if method not in METHODS:
        raise ValueError(f"context_method={method!r}; choose one of {METHODS}")
    cp = mesh.get(axis, 1)
    try:
        facts = context_facts(gm)
    except ValueError as e:
        if "no scaled_dot_product_attention" in str(e):
            raise ValueError(f"cp={cp} but {e}") from None
        raise
    hw = load_profile(hardware or "cpu-gloo")
    link = axis_links(hw, dict(mesh))[axis]
    tp, dp = mesh.get("tp", 1), mesh.get("dp", 1)
    rows = max(1, facts.captured_rows // dp)  # this rank's rows (the captured batch is the global one)
    return context_entry(facts, cp, tp, price_context(facts, cp, tp, rows, link, hw), method, axis)


def _hint(s) -> int:
    if isinstance(s, int):
        return s
    hint = s.node.hint
    return int(hint) if hint is not None else 1


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


__all__ = ["ContextFacts", "METHODS", "context_entry", "context_facts", "plan_context", "price_context"]
