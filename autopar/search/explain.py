"""Explanations of a joint-planner decision: the report `plan_for` returns and its text.

`PlanReport` holds the chosen candidate's predictions, the top-k alternatives with theirs,
and for every dimension (tp, pp, dp, ep, cp, ZeRO stage, micro-batches, schedule, sequence
parallelism, recompute) the values that were considered and why each lost to the chosen one:
slower by so much (its best evaluated plan), provably slower (its lower bound already
exceeded the chosen plan's time, so the search never costed it), or does not fit ("tp=4
needs 91.2 GiB on a rank, the limit is 72 GiB"). It is plain data: `to_dict()` /
`from_dict()` round-trip through JSON (the planner's cache stores it). The rows of the sequence
parallelism, recompute and cp dimensions come from the cost model (`sequence_parallel_rows`,
`recompute_rows`, `context_rows`: for cp the exchange chosen with both methods' exposed time
and the activation saving, or what cp would have cost, or why the graph cannot take it).

`render_plan(plan)` prints a Plan the planner made from the copy it keeps in
`plan.extra["planner"]`: mesh, predicted step time, tokens/s, MFU, memory per rank by
category, bytes per mesh axis, the reasons and the alternatives.

Reads and writes no node.meta. Deterministic: the copy a Plan keeps has no timings (the
report `plan_for` returns has them, on its last line).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from autopar.search.candidate import plain
from autopar.search.plan_selective import selective_keep

DIMENSIONS = ("tp", "pp", "dp", "ep", "cp", "zero_stage", "n_microbatches", "schedule")
MEMORY_ORDER = ("params", "grads", "master", "optimizer", "buffers", "activations", "workspace", "comm_buffers",
                "optimizer_step_temp", "peak", "limit")


def gib(n: float) -> str:
    if n != n:  # nan
        return "n/a"
    for unit, d in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= d:
            return f"{n / d:.4g} {unit}"
    return f"{n:.0f} B"


def seconds(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s < 10 else f"{s:.4g} s"


@dataclass
class PlanReport:
    """What the joint planner chose, what it predicted, and why (see the module docstring).

    chosen / alternatives: `candidate.Evaluation.to_dict()` of the chosen candidate and of the
    top-k (best first, the chosen one included). dimensions: dimension -> one row per value
    considered: {"value", "status" ("chosen" | "slower" | "bound" | "no fit"), "step_s",
    "peak_bytes", "label", "reason"}. search: candidate counts, pruning and timings.
    """

    chosen: dict[str, Any]
    alternatives: list[dict[str, Any]]
    dimensions: dict[str, list[dict[str, Any]]]
    search: dict[str, Any]
    hardware: str
    memory_limit: float
    world_size: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return plain(asdict(self))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "PlanReport":
        return PlanReport(**d)

    def reasons(self) -> list[str]:
        """One line per dimension: the chosen value and why the others lost."""
        return [line for dim in DIMENSIONS + ("sequence_parallel", "recompute")
                if (line := self.reason(dim))]

    def reason(self, dim: str) -> str:
        rows = self.dimensions.get(dim) or []
        if not rows:
            return ""
        chosen = [r for r in rows if r["status"] == "chosen"]
        others = [r for r in rows if r["status"] != "chosen"]
        head = f"{dim}={chosen[0]['value']}" if chosen else f"{dim}"
        own = chosen[0].get("reason") if chosen else ""
        if not others:
            return f"{head}: {own or 'the only value possible here'}"
        return f"{head}: " + (f"{own}; " if own else "") + "; ".join(f"{dim}={r['value']} {r['reason']}"
                                                                   for r in others)

    def text(self) -> str:
        c = self.chosen
        lines = [f"autopar joint plan for {self.world_size} ranks of {self.hardware} "
                 f"(memory limit {gib(self.memory_limit)} per rank)",
                 f"  chosen: {c['label']}"]
        lines += _prediction_lines(c)
        lines.append("  why:")
        lines += [f"    - {r}" for r in self.reasons()]
        lines.append(f"  top {len(self.alternatives)} plans:")
        best = self.alternatives[0]["step_s"] if self.alternatives else c["step_s"]
        for i, a in enumerate(self.alternatives):
            lines.append(f"    {i + 1}. {a['label']:<60} step {seconds(a['step_s']):>10}  "
                         f"(+{(a['step_s'] / best - 1) * 100:.1f}%)  peak {gib(a['peak_bytes'])}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        s = self.search
        timing = (f"; {s['seconds']:.2f} s ({s.get('ilp_seconds', 0.0):.2f} s in sharding ILPs)"
                  + (" [cached]" if s.get("cached") else "")) if "seconds" in s else ""
        lines.append(f"  search: {s.get('candidates', 0)} candidates, {s.get('evaluated', 0)} costed, "
                     f"{s.get('pruned_bound', 0)} pruned by bound, {s.get('no_fit', 0)} do not fit, sharding "
                     f"ILPs for tp in {s.get('tp_solved', [])}{timing}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _prediction_lines(c: dict[str, Any]) -> list[str]:
    out = [f"  predicted step {seconds(c['step_s'])}, {c['tokens_per_s']:,.0f} "
           f"{c.get('throughput_unit', 'tokens')}/s, MFU {c['mfu']:.1%}"
           + (f", pipeline bubble {c['bubble']:.1%}" if c.get("bubble") else "")
           + (f", recompute {seconds(c['recompute_s'])}" if c.get("recompute_s") else "")]
    mem = c.get("memory", {})
    cats = [f"{k} {gib(mem[k])}" for k in MEMORY_ORDER if k in mem and (mem[k] or k in ("peak", "limit"))]
    out.append("  memory on the fullest rank: " + ", ".join(cats))
    if c.get("comm"):
        out.append("  per rank and step: " + "; ".join(
            f"{axis} sends {gib(v['bytes_sent'])} in {seconds(v['time_s'])} ({seconds(v['exposed_s'])} exposed)"
            for axis, v in sorted(c["comm"].items())))
    if c.get("split_points"):
        out.append(f"  pipeline stages start at {c['split_points']}")
    if c.get("recompute"):
        for mode in ("full", "selective"):
            units = sorted((u for u, m in c["recompute"].items() if m == mode), key=_natural)
            if units:
                out.append(f"  recompute ({mode}): {_brief(units)}")
    return out


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in s.replace(".", " ").split()]


def _brief(names: list[str]) -> str:
    from autopar.passes.split_pipeline import brief_names  # noqa: PLC0415

    return brief_names(names)


def render_plan(plan) -> str:
    """The planner's view of a Plan it made (mesh, predictions, reasons, alternatives); plans
    it did not make print their mesh and notes."""
    rep = plan.extra.get("planner") if hasattr(plan, "extra") else None
    if not rep:
        return f"Plan(mesh={plan.mesh}, zero_stage={plan.zero_stage}, n_microbatches={plan.n_microbatches})\n" + \
            "\n".join(f"  - {n}" for n in plan.notes)
    return PlanReport.from_dict(rep).text()


def dimension_rows(values: dict[Any, dict[str, Any]], chosen_value: Any, chosen_step: float, limit: float,
                   dim: str) -> list[dict[str, Any]]:
    """Rows for one dimension from the search's per-value records: best feasible evaluation
    (step, label), smallest bound among unevaluated candidates, smallest memory need among
    those that do not fit."""
    rows = []
    for value in sorted(values, key=_sort_key):
        rec = values[value]
        row = {"value": value, "step_s": rec.get("best_step"), "peak_bytes": rec.get("best_peak"),
               "label": rec.get("best_label")}
        if value == chosen_value:
            row["status"] = "chosen"
            row["reason"] = ""
        elif rec.get("best_step") is not None:
            row["status"] = "slower"
            row["reason"] = (f"is {(rec['best_step'] / chosen_step - 1) * 100:.1f}% slower at best "
                             f"({seconds(rec['best_step'])}: {rec['best_label']})")
        elif rec.get("bound") is not None:
            row["status"] = "bound"
            row["reason"] = (f"cannot beat it: even its lower bound {seconds(rec['bound'])} is "
                             f"{(rec['bound'] / chosen_step - 1) * 100:.1f}% over the chosen {seconds(chosen_step)}")
        else:
            need = rec.get("min_need")
            row["status"] = "no fit"
            more = "" if rec.get("need_exact", True) else "more than "
            row["reason"] = (f"needs {more}{gib(need)} on a rank ({rec.get('min_need_label')}), over the limit of "
                             f"{gib(limit)}" if need is not None else "is not possible here")
            row["peak_bytes"] = need
        rows.append(row)
    return rows


def _sort_key(v):
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))


def sequence_parallel_rows(model: Any, chosen: Any) -> list[dict]:
    """The sequence-parallel row of a report: what the sharding ILP of the chosen tp found.
    `model`: the planner's cost model; `chosen`: its `Evaluation`."""
    t = chosen.candidate.tp
    if t == 1:
        return []
    info = model.sharding(t)
    sp = info.sequence_parallel
    sol = info.solution
    gap = "n/a" if sol is None or sol.gap is None else f"{sol.gap:.2%}"
    why = (f"the sharding ILP for tp={t} ({sol.status if sol else ''}, gap {gap}) found "
           + ("all-gather / reduce-scatter pairs (sequence parallel) cheaper than all-reduces"
              if sp else "all-reduces (no sequence parallelism) cheapest"))
    return [{"value": "yes" if sp else "no", "status": "chosen", "reason": why, "step_s": chosen.step_s,
             "peak_bytes": chosen.peak_bytes, "label": chosen.candidate.label()}]

def recompute_rows(model: Any, chosen: Any, recompute: Any, limit: float) -> list[dict]:
    """The recompute rows of a report: the blocks recomputed and, when some are, the same plan
    without recompute (over the limit, or slower). `recompute`: the pin ("auto" ...)."""
    n_blocks = int(model.blocks.sum())
    k = len(chosen.recompute)
    modes = set(chosen.recompute.values())
    flavor = modes.pop() if len(modes) == 1 else ("mixed" if modes else "")
    row = {"value": f"{k}/{n_blocks} blocks {flavor}".rstrip(), "status": "chosen", "step_s": chosen.step_s,
           "peak_bytes": chosen.peak_bytes, "label": chosen.candidate.label()}
    if k == 0:
        row["reason"] = (f"nothing recomputed: the plan fits with {gib(limit - chosen.peak_bytes)} to spare"
                         if isinstance(recompute, str) and recompute in ("auto", "none")
                         else "pinned")
        return [row]
    row["reason"] = ""
    rows = [row]
    try:
        without = model.evaluate(chosen.candidate, limit, pins=chosen.split_points, recompute="none")
    except ValueError:
        without = None
    if without is not None:
        rows.append({"value": "none", "status": "no fit" if not without.feasible else "slower",
                     "step_s": without.step_s, "peak_bytes": without.peak_bytes,
                     "label": without.candidate.label(),
                     "reason": (f"needs {gib(without.peak_bytes)} on a rank with this mesh, over the limit of "
                                f"{gib(limit)}") if not without.feasible else
                     f"fits but the chosen plan is faster overall"})
    other = "full" if flavor == "selective" else "selective"  # the same blocks recomputed the other way
    try:
        alt = model.evaluate(chosen.candidate, limit, pins=chosen.split_points,
                             recompute={u: other for u in chosen.recompute}) if selective_keep(model) else None
    except ValueError:
        alt = None
    if alt is not None:
        rows.append({"value": f"{len(alt.recompute)}/{n_blocks} blocks {other}",
                     "status": "no fit" if not alt.feasible else "slower" if alt.step_s >= chosen.step_s else "faster",
                     "step_s": alt.step_s,
                     "peak_bytes": alt.peak_bytes, "label": alt.candidate.label(),
                     "reason": (f"needs {gib(alt.peak_bytes)}, over the limit of {gib(limit)}" if not alt.feasible
                                else f"replays {seconds(alt.recompute_s)} a step against {seconds(chosen.recompute_s)}")})
    return rows


def context_rows(model: Any, chosen: Any, rows: list[dict]) -> list[dict]:
    """The cp rows of a report (`dimension_rows` for "cp") with why cp was or was not chosen:
    for cp > 1 the exchange, both methods' exposed time and how much smaller each rank's
    activations are; for cp = 1 what cp would cost (each other degree's time over the chosen
    plan), or why the graph cannot take cp at all."""
    c = chosen.candidate
    out = [dict(r) for r in rows]
    for r in out:
        if r["status"] == "slower" and r.get("step_s") is not None:
            r["reason"] = (f"would cost +{seconds(r['step_s'] - chosen.step_s)} a step at best "
                           f"({(r['step_s'] / chosen.step_s - 1) * 100:.1f}% slower: {r['label']})")
    row = next((r for r in out if r["status"] == "chosen"), None)
    if row is None:
        return out
    if c.cp > 1:
        entry = model.context_entry(c)
        one = float(model.units(c.tp, chosen.rows_per_micro, 1).act.sum())
        mine = float(model.units(c.tp, chosen.rows_per_micro, c.cp).act.sum())
        row["reason"] = (f"{c.context} exchange: activations per rank {one / max(mine, 1.0):.2f}x smaller than "
                         f"without cp ({gib(mine)} instead of {gib(one)} a micro-batch), exchange "
                         f"{seconds(model.context_exposed(c))} exposed a step ({entry['notes'][0]})")
    else:
        refusal = model.context_refusal()
        if refusal:
            row["reason"] = f"cp not possible: {refusal}"
        elif len(out) == 1:
            row["reason"] = ("cp not chosen: no cp candidate (none whose 2 cp zigzag chunks divide the sequence "
                             "with this world and these pins, or cp not allowed: `allow`)")
        else:
            row["reason"] = "cp not chosen" + (": the plan fits without it" if chosen.feasible else "")
    return out
