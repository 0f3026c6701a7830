"""Human-readable views of a plan: the text `model.plan_text()` prints and dumps keep.

Deterministic: no timings, ids or paths, so that reports diff cleanly between runs.
"""
from __future__ import annotations

from io import StringIO

from rich.console import Console
from rich.table import Table


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _fmt_prediction(key: str, v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        if isinstance(v, dict) and all(isinstance(x, (int, float)) for x in v.values()) and "bytes" in key:
            return ", ".join(f"{a}: {_fmt_bytes(x)}" for a, x in v.items())
        return str(v)
    if "bytes" in key:
        return _fmt_bytes(v)
    if key.endswith("_s"):
        return f"{v * 1e3:.3f} ms"
    if key == "mfu" or key.endswith("bubble"):
        return f"{v:.1%}"
    return f"{v:g}"


def plan_text(pm) -> str:
    """The plan of a ParallelModel as a table: mesh, strategy per dimension, predictions, notes."""
    plan = pm.plan
    t = Table(title=f"autopar plan on mesh {plan.mesh}", show_header=True)
    t.add_column("dimension")
    t.add_column("choice")
    t.add_row("data parallel", f"{plan.dp_axis}={plan.dp}" if plan.dp_axis else "none")
    t.add_row("ZeRO stage", str(plan.zero_stage))
    t.add_row("gradient bucket", f"{plan.bucket_mb:g} MiB")
    t.add_row("micro-batches", str(plan.n_microbatches))
    t.add_row("tensor parallel", "none" if not plan.param_layouts else f"{len(plan.param_layouts)} sharded params")
    t.add_row("pipeline", "none" if not plan.split_points else f"{len(plan.split_points) + 1} stages, {plan.schedule}")
    ctx = plan.extra.get("context") or {}
    cp = plan.mesh.get(ctx.get("axis", "cp"), 1)
    t.add_row("context parallel", f"cp={cp}, {ctx.get('method')} exchange" if cp > 1 and ctx else "none")
    t.add_row("capture", str(pm.capture_info.get("path", "?")))
    n_params = sum(p.numel() for p in pm.program.module.parameters())
    t.add_row("parameters on a rank", f"{n_params:,}")
    for k, v in sorted(plan.predicted.items()):
        t.add_row(f"predicted {k}", _fmt_prediction(k, v))
    buf = StringIO()
    Console(file=buf, width=100, force_terminal=False, color_system=None).print(t)
    notes = "\n".join(f"  - {n}" for n in plan.notes)
    text = buf.getvalue().rstrip() + ("\nnotes:\n" + notes if notes else "")
    if plan.extra.get("planner"):  # the joint planner's view: predictions, reasons, alternatives
        from autopar.search.explain import render_plan  # noqa: PLC0415

        text += "\n\n" + render_plan(plan).rstrip()
    return text
