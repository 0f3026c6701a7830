"""The plan and its predictions as tables: what `autopar plan` prints and `dump` keeps.

`plan_tables(result, top)` returns rich renderables (the chosen plan with its predictions,
then the `top` alternatives ranked); `plan_text(result, top)` the same as plain text.
Deterministic: no timings of the search itself, no paths.

Reads and writes no node.meta keys.
"""
from __future__ import annotations

from io import StringIO
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from autopar.tools.planning import PlanResult


def _ms(s: Any) -> str:
    return "?" if s is None else f"{float(s) * 1e3:.3f} ms"


def _bytes(b: Any) -> str:
    if b is None:
        return "?"
    b = float(b)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024:
            return f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} PiB"


def mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.items())


def _context_text(p) -> str:
    """cp's size and the attention exchange the plan runs (ring / Ulysses), or "none"."""
    cp = p.mesh.get("cp", 1)
    if cp < 2:
        return "none"
    ctx = p.extra.get("context") if isinstance(p.extra, dict) else None
    method = ctx.get("method") if isinstance(ctx, dict) else None
    return f"cp={cp}, {method or 'auto'} attention exchange"


def _expert_text(p) -> str:
    """ep's size and the MoE blocks the plan spreads over it, or "none"."""
    ep = p.mesh.get("ep", 1)
    if ep < 2:
        return "none"
    spec = p.extra.get("expert") if isinstance(p.extra, dict) else None
    blocks = spec.get("blocks") if isinstance(spec, dict) else None
    return f"ep={ep}" + (f", {len(blocks)} MoE blocks" if blocks else ", MoE blocks found at build")


def plan_tables(r: PlanResult, top: int = 1):
    p, pred = r.best.plan, r.best.predicted
    t = Table(title=f"autopar plan: {r.source.name} on {mesh_text(p.mesh)} ({r.hardware.name})", show_header=True)
    t.add_column("dimension")
    t.add_column("choice / prediction")
    rows = [
        ("planner", r.planner), ("global batch" + (", sequence" if r.seq else ""),
                                  f"{r.batch}" + (f" x {r.seq}" if r.seq else "")),
        ("data parallel", f"{p.dp_axis}={p.dp}" if p.dp_axis else "none"), ("ZeRO stage", str(p.zero_stage)),
        ("micro-batches", str(p.n_microbatches)),
        ("tensor parallel", ", ".join(f"{a}={p.mesh[a]} ({len(s)} nodes placed)" for a, s in p.strategies.items())
         or "none"),
        ("sharded parameters", str(len(p.param_layouts))),
        ("context parallel", _context_text(p)),
        ("expert parallel", _expert_text(p)),
        ("pipeline", f"{len(p.split_points) + 1} stages, {p.schedule}, cuts before {', '.join(p.split_points)}"
         if p.split_points else "none"),
        ("recompute", ", ".join(f"{k} {v}" for k, v in p.recompute.items() if v != "none") or "none"),
        ("predicted step time", _ms(pred.get("step_s"))),
        ("  forward / backward", f"{_ms(pred.get('fwd_s'))} / {_ms(pred.get('bwd_s'))}") if "fwd_s" in pred else
        ("  compute (forward + backward)", _ms(pred.get("compute_s"))),
        ("  communication (exposed)", f"{_ms(pred.get('comm_s'))} ({_ms(pred.get('comm_exposed_s'))})"),
        ("predicted MFU", f"{pred['mfu']:.1%}" if isinstance(pred.get("mfu"), (int, float)) else "?"),
        ("predicted peak memory / rank", f"{_bytes(pred.get('peak_bytes'))} of {_bytes(pred.get('capacity_bytes'))}"
                                         + ("" if pred.get("fits", True) else "  DOES NOT FIT")),
    ]
    if p.mesh.get("pp", 1) > 1 and "pipeline_bubble" in pred:
        rows.append(("  pipeline bubble", f"{pred['pipeline_bubble']:.1%}"))
    fused = pred.get("with_fusions")
    if fused:  # the ranking above is unfused; what runs has the plan's Triton fusions
        rows.append(("with its fusions: step, peak / rank", f"{_ms(fused.get('step_s'))}, {_bytes(fused.get('peak_bytes'))}"))
    for k, v in rows:
        t.add_row(k, v)
    out = [t]
    if top > 1:
        a = Table(title=f"top {min(top, len(r.candidates))} of {len(r.candidates)} candidates (best first)")
        for col in ("#", "mesh", "ZeRO", "micro-batches", "schedule", "predicted step", "peak / rank", "fits"):
            a.add_column(col, justify="right" if col in ("#", "predicted step", "peak / rank") else "left")
        for i, c in enumerate(r.candidates[:top]):
            row = c.row()
            a.add_row(str(i), mesh_text(row["mesh"]), str(row["zero_stage"]), str(row["n_microbatches"]),
                      row["schedule"] or "-", _ms(row["step_s"]), _bytes(row["peak_bytes"]),
                      "yes" if row["fits"] else "NO")
        out.append(a)
    return Group(*out)


def plan_text(r: PlanResult, top: int = 1, width: int = 110) -> str:
    buf = StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(plan_tables(r, top))
    notes = [r.planner_note] + list(r.notes) + list(r.best.plan.notes)
    return buf.getvalue().rstrip() + "\nnotes:\n" + "\n".join(f"  - {n}" for n in notes)
