"""A Gantt chart of a simulated pipeline schedule, as plain SVG text.

One row per pipeline rank, one box per action placed at its simulated start and end
(`runtime.schedules.simulate`), coloured by kind (F forward, B full backward, I input
backward, W weight backward) and labelled with its micro-batch (with the stage too when a rank
holds several stages, whose boxes are also shaded by stage), a time axis, and a title with the
predicted step time, bubble fraction and peak activations in flight. Hovering a box shows its
action and times (`<title>`).

The output depends only on the simulation: no ids, timestamps or randomness, numbers printed
with fixed precision, so equal inputs give byte-identical files (dumps diff cleanly). Reads and
writes no `node.meta` keys.
"""
from __future__ import annotations

import math
import os
from xml.sax.saxutils import escape

from autopar.runtime.schedules import Kind, SimResult

__all__ = ["gantt_svg", "write_gantt_svg", "COLORS"]

COLORS = {Kind.F: "#4c78a8", Kind.B: "#54a24b", Kind.I: "#72b7b2", Kind.W: "#f58518"}
_NAMES = {Kind.F: "F forward", Kind.B: "B backward", Kind.I: "I input backward", Kind.W: "W weight backward"}

_LEFT, _RIGHT, _TOP, _ROW, _GAP, _PLOT_W = 72, 24, 48, 26, 8, 960


def _f(x: float) -> str:
    return f"{x:.2f}"


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def gantt_svg(sim: SimResult) -> str:
    """The SVG text of `sim`'s per-rank timelines. Raises ValueError for a deadlocked run."""
    if not sim.ok:
        raise ValueError("cannot draw a schedule that deadlocks: " + "; ".join(map(str, sim.deadlock))
                         + ". Fix the schedule (see SimResult.deadlock) first")
    sch = sim.schedule
    P = sch.n_ranks
    span = sim.makespan if sim.makespan and sim.makespan > 0 else 1.0
    scale = _PLOT_W / span
    height = _TOP + P * (_ROW + _GAP) + 70
    width = _LEFT + _PLOT_W + _RIGHT
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>']
    title = (f"{sch.name}: {P} ranks, {sch.n_stages} stages, {sch.n_microbatches} micro-batches; "
             f"step time {sim.makespan:.4g}, bubble {sim.bubble_fraction:.1%}, "
             f"peak activations in flight {max(sim.peak_in_flight)}")
    out.append(f'<text x="{_LEFT}" y="20" font-size="13" font-weight="bold">{escape(title)}</text>')
    axis_y = _TOP + P * (_ROW + _GAP)
    step = _nice_step(span)
    t = 0.0
    while t <= span * (1 + 1e-9):
        x = _LEFT + t * scale
        out.append(f'<line x1="{_f(x)}" y1="{_TOP - 4}" x2="{_f(x)}" y2="{axis_y}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{_f(x)}" y="{axis_y + 14}" text-anchor="middle">{t:.4g}</text>')
        t = round(t + step, 12)
    out.append(f'<line x1="{_LEFT}" y1="{axis_y}" x2="{_LEFT + _PLOT_W}" y2="{axis_y}" stroke="#444"/>')
    out.append(f'<text x="{_LEFT + _PLOT_W / 2:.2f}" y="{axis_y + 30}" text-anchor="middle">time</text>')
    for r in range(P):
        y = _TOP + r * (_ROW + _GAP)
        stages = sch.stages_of(r)
        chunk = {s: k for k, s in enumerate(stages)}
        out.append(f'<text x="{_LEFT - 8}" y="{_f(y + _ROW / 2 + 4)}" text-anchor="end">rank {r}</text>')
        for ta in sim.timelines[r]:
            a = ta.action
            x, w = _LEFT + ta.start * scale, max((ta.end - ta.start) * scale, 0.5)
            opacity = 1.0 if len(stages) == 1 else 1.0 - 0.45 * chunk[a.stage] / (len(stages) - 1)
            label = str(a.mb) if len(stages) == 1 else str(a)
            out.append(f'<g><title>{a} [{ta.start:.4g}, {ta.end:.4g})</title>'
                       f'<rect x="{_f(x)}" y="{y}" width="{_f(w)}" height="{_ROW}" fill="{COLORS[a.kind]}" '
                       f'fill-opacity="{opacity:.2f}" stroke="white" stroke-width="0.5"/>')
            if w >= 7 * len(label):
                out.append(f'<text x="{_f(x + w / 2)}" y="{_f(y + _ROW / 2 + 4)}" text-anchor="middle" '
                           f'fill="white">{label}</text>')
            out.append("</g>")
    lx = _LEFT
    ly = axis_y + 46
    for k in (Kind.F, Kind.B, Kind.I, Kind.W):
        out.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{COLORS[k]}"/>')
        out.append(f'<text x="{lx + 16}" y="{ly + 10}">{_NAMES[k]}</text>')
        lx += 150
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_gantt_svg(sim_result: SimResult, path: str | os.PathLike) -> str:
    """Write `gantt_svg(sim_result)` to `path` (parent folders created); returns the path."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(gantt_svg(sim_result))
    return path
