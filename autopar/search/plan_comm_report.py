"""What a pipeline or one-stage candidate sends per step, axis by axis, for the plan's report.

`comm_report(model, c, ...)` is `search.plan_cost.PlanCostModel.evaluate`'s last step: per
mesh axis, rank 0's bytes sent, the time its collectives take and the part of it left exposed
(tp conversions, the data-parallel sync with ZeRO 3's gathers, the cp exchange, pipeline
point-to-point, expert all-to-alls), written to `plan.predicted["comm"]` by `search.plan_write`.
A report only: the step time itself is `evaluate`'s. Reads no node.meta.
"""
from __future__ import annotations

from autopar.search.plan_context import data_axis_name

__all__ = ["comm_report"]


def comm_report(model, c, u, st, starts, ends, stages_of, p2p, dp_time, dp_bytes, dp_exposed, z3f, z3b, rows):
    """Per axis, rank 0's bytes sent, time and exposed time per step (`model`: the
    `PlanCostModel` that evaluated `c`)."""
    m = c.micro
    mine = stages_of[0]
    comm: dict[str, dict[str, float]] = {}
    if c.tp > 1:
        t = m * sum(float(u.tp_comm[starts[s]:ends[s]].sum()) for s in mine)
        comm["tp"] = {"bytes_sent": m * sum(float(u.tp_bytes[starts[s]:ends[s]].sum()) for s in mine),
                      "time_s": t, "exposed_s": t}
    if c.replicas > 1:
        z3 = m * sum(float((z3f + z3b)[starts[s]:ends[s]].sum()) for s in mine)
        comm[data_axis_name(c)] = {"bytes_sent": dp_bytes, "time_s": dp_time, "exposed_s": dp_exposed + z3}
    if c.cp > 1:  # the attention exchange, per step (search.context prices it)
        e = model.context_entry(c)
        t = model.context_exposed(c)
        comm["cp"] = {"bytes_sent": float(e["bytes"][c.context] or 0.0), "time_s": t, "exposed_s": t}
    if c.pp > 1:
        nb = sum(float(u.cross[starts[s] - 1]) for s in range(1, len(starts)))
        comm["pp"] = {"bytes_sent": 2 * m * nb / c.pp, "time_s": 2 * m * sum(p2p) / c.pp,
                      "exposed_s": 0.0}  # inside the simulated makespan
    if c.ep > 1 and model.moe_blocks:  # the collectives estimate counts on rank 0's stages (`rank_ep_comm`)
        t, sent = model.rank_ep_comm(c, {x for s in mine for x in range(starts[s], ends[s])})
        comm["ep"] = {"bytes_sent": m * sent, "time_s": m * t, "exposed_s": m * t}
    return comm
