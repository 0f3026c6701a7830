"""Context parallelism in the joint planner's tables: which cp degrees and exchanges a graph
allows, what each costs, and the mesh links a cp plan's data-parallel traffic takes.

`ContextTables` is a part of `plan_tables.PlanTables` (which inherits it); it reads the tables'
`gm`, `gc`, `hw` and `global_batch`. A candidate with cp > 1 (`search.candidate.Candidate`)
is priced as `cost.estimate` prices the same Plan (the one-cost-model rule):

  tokens   every rank holds s / cp tokens of each sequence (zigzag chunks): every node is
           costed at the sequence symbol s / cp (`values`), so compute, saved activations,
           the working set and the bytes crossing unit boundaries shrink as a split of the
           sequence; an attention call's time is cp x its time at s / cp (this rank's queries
           against every chunk's keys: its share of the causal work under the load-balanced
           order).
  sync     ranks along dp and cp hold the same parameters: gradients and ZeRO shards live on
           the joined axis dp+cp (`cost.comm.joined_data_axis`), whose link `links` puts in
           the "dp" entry the cost model reads.
  exchange the attention exchange's exposed seconds per step (`search.context.price_context`:
           ring K/V send/recv overlapped with the block computation, or Ulysses' eight
           all-to-alls on the critical path), added to the step as `cost.estimate` adds
           `plan.extra["context"]["exposed_s"][method]`; `context_entry(c)` is that entry.
           With pp > 1 (each stage holds its layers' exchange: build/program.py cuts the stages
           after the cp passes) a rank runs only its stages' attention calls, and the exposed
           time of every stage slot stretches the schedule: `context_pipeline_factor` scales
           the entry's whole-model figure by the busiest rank's share of the calls (an even
           split of the layers) times (m v + p - 1) / (m v).

Which cp: divisors k > 1 of the world whose 2k zigzag chunks divide the captured sequence, for
a graph that passed `passes.context_positions.check_context_parallel` and has attention; the
method is the cheaper of ring and Ulysses (Ulysses only where the query heads per tp rank
divide by k), or the pinned one. `context_refusal` says why a graph gets no cp at all; for a
sequence captured static it quotes the capture's reason (`gm.meta["autopar_capture"]
["sequence"]["why"]`, written by `autopar.parallelize` and `autopar plan`).

Reads node.meta only through `search.context.context_facts`, and gm.meta["autopar_capture"].
Deterministic; every table is cached on the model and depends only on its key.
"""
from __future__ import annotations

from typing import Any

from autopar.cost.comm import axis_links, joined_data_axis
from autopar.search.candidate import Candidate
from autopar.search.context import ContextFacts, context_entry, context_facts, price_context

__all__ = ["ContextTables", "MemoLink", "data_axis_name"]


def data_axis_name(c: Candidate) -> str:
    """The axis a candidate's gradients are averaged on: "dp", "cp" or the joined "dp+cp"."""
    return "+".join(a for a, k in (("dp", c.dp), ("cp", c.cp)) if k > 1) or "dp"


class ContextTables:
    """Context-parallel tables of `plan_tables.PlanTables` (see the module docstring)."""

    # ------------------------------------------------------------------ the graph's facts
    def context_facts(self) -> ContextFacts | None:
        """The graph's attention calls when context parallelism can run on it, else None
        (`context_refusal` says why)."""
        if not hasattr(self, "_ctx_facts"):
            self._ctx_refusal = ""
            self._ctx_facts = None
            if self.seq_len() is None:
                why = (self.gm.meta.get("autopar_capture") or {}).get("sequence", {}).get("why")
                self._ctx_refusal = (f"the sequence dim was captured static: {why}" if why else
                                     "the sequence dim was captured static (capture with dynamic_seq=True, as "
                                     "parallelize does on a mesh with cp, for the planner to consider cp)")
            else:
                try:
                    self._ctx_facts = context_facts(self.gm)
                except ValueError as e:
                    self._ctx_refusal = str(e)
        return self._ctx_facts

    def context_refusal(self) -> str:
        """Why the graph gets no cp candidate ("" when it may)."""
        self.context_facts()
        return self._ctx_refusal

    def seq_len(self) -> int | None:
        """The captured sequence length when it is symbolic (the symbol "s"), else None."""
        for k, v in self.gc.values().items():
            if str(k) == "s":
                return int(v)
        return None

    def values_at(self, sizes: dict[str, int], cp: int) -> dict[str, int]:
        """Symbol values by name at `sizes`, the sequence at s / cp."""
        if cp > 1:
            sizes = {**sizes, "s": self.seq_len() // cp}
        return {str(k): v for k, v in self.gc.values(sizes or None).items()}

    # ------------------------------------------------------------------ choices and prices
    def context_options(self, k: int, t: int, pinned: str | None = None) -> list[str]:
        """The exchange to plan with cp = k on tp = t ranks (chosen at pp = 1: with pp both
        methods' figures scale by the same `context_pipeline_factor`): [] when k
        cannot split the sequence (or Ulysses was pinned and the heads do not divide), else the
        pinned method or the cheaper one at dp = world / (t k)."""
        facts = self.context_facts()
        if facts is None or facts.seq_len % (2 * k):
            return []
        if pinned in ("ring", "ulysses"):
            return [pinned] if pinned == "ring" or facts.heads_divide(k, t) else []
        d = max(1, self.world // (t * k))
        c = Candidate(tp=t, dp=d, cp=k, context="ring")
        return [self.context_entry(c, "auto")["method"]] if self.global_batch % d == 0 else ["ring"]

    def context_entry(self, c: Candidate, method: str | None = None) -> dict[str, Any]:
        """`plan.extra["context"]` for candidate `c` (its method, or `method`)."""
        key = ("context", c.tp, c.dp, c.cp, tuple(c.mesh().items()), method or c.context)
        hit = self._split_cache.get(key)
        if hit is None:
            facts = self.context_facts()
            rows = max(1, self.global_batch // c.dp)  # this rank's rows of a step, as plan_context counts them
            prices = price_context(facts, c.cp, c.tp, rows, self.links(c)["cp"], self.hw)
            hit = context_entry(facts, c.cp, c.tp, prices, "auto")  # its note: the cheaper, both prices
            if (method or c.context) not in ("auto", hit["method"]):  # pinned to the dearer one
                hit = context_entry(facts, c.cp, c.tp, prices, method or c.context)
            self._split_cache[key] = hit
        return hit

    def context_exposed(self, c: Candidate) -> float:
        """Seconds per step the attention exchange of `c` adds (0 without cp); with pp, the
        busiest rank's share of it stretched by the schedule (`context_pipeline_factor`)."""
        if c.cp < 2:
            return 0.0
        return float(self.context_entry(c)["exposed_s"][c.context] or 0.0) * self.context_pipeline_factor(c)

    def context_pipeline_factor(self, c: Candidate) -> float:
        """What part of the whole model's exchange (`context_entry`: every attention call, all of
        a rank's rows) lengthens the step of a pipelined candidate: a pp rank runs the attention
        calls of its stages only, at most v ceil(n / (p v)) of the n calls with its v stages per
        rank of an even split of the layers; and an exposed second on every stage of every
        micro-batch lengthens a pipeline's step by (m v + p - 1) / (m v) seconds (1F1B, GPipe
        and interleaved: the step is m v + p - 1 stage slots). 1 without pp."""
        if c.pp < 2:
            return 1.0
        facts = self.context_facts()
        n = len(facts.calls) if facts is not None else 0
        if n == 0:
            return 1.0
        v, m = c.virtual, c.micro
        share = min(n, v * -(-n // (c.pp * v))) / n
        return share * (m * v + c.pp - 1) / (m * v)

    # ------------------------------------------------------------------ links
    def links(self, c: Candidate) -> dict:
        """Memoised links of `c`'s mesh axes; with cp, "dp" is the joined dp+cp axis (gradient
        sync and ZeRO shards)."""
        mesh = c.mesh()
        key = tuple(mesh.items())
        hit = self._links.get(key)
        if hit is None:
            raw = axis_links(self.hw, mesh)
            if c.cp > 1:
                joined, _size, raw = joined_data_axis(self.hw, mesh, "dp" if c.dp > 1 else None, "cp", raw)
                raw = {**raw, "dp": raw[joined]}
            hit = self._links[key] = {a: MemoLink(al) for a, al in raw.items()}
        return hit


class MemoLink:
    """An `AxisLink` whose times and bytes are memoised (the search asks for the same few
    payloads many times). Every collective takes the algorithm `cost.estimate` prices by
    default ("auto": the faster of ring and tree where both exist, as NCCL's tuner picks), so
    that the planner's figures are estimate's."""

    def __init__(self, al):
        self.al = al
        self.axis, self.size = al.axis, al.size
        self._t: dict = {}
        self._b: dict = {}

    def time(self, op: str, nbytes: float) -> float:
        key = (op, nbytes)
        t = self._t.get(key)
        if t is None:
            t = self._t[key] = self.al.time(op, nbytes, "auto")
        return t

    def bytes_sent(self, op: str, nbytes: float) -> float:
        key = (op, nbytes)
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = self.al.bytes_sent(op, nbytes, "auto")
        return b
