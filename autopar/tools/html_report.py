"""One self-contained HTML page that shows a plan: what `autopar dump` writes as report.html.

Sections, each drawn here as inline SVG or a table (no scripts, styles or fonts fetched from
anywhere; the page opens from a file on a machine without a network):
  * summary: model, mesh, hardware, planner, predicted step time, MFU, peak memory per rank;
  * the graph with placements: rank 0's rewritten graph as a DAG, one box per op coloured by
    its output placement on the non-data axes (R grey, S(d) blue, P(sum) orange, inserted
    collectives red), hover for the node's key, strategy, shapes and module; layers identical
    to the first of their list are folded into it (the count is shown);
  * stage map: the pipeline units coloured by stage, with each stage's time and memory;
  * recompute and fusion decisions;
  * memory breakdown per rank: stacked bars (parameters, gradients, fp32 masters, optimizer
    state, buffers, activations, transient) against the device capacity;
  * the pipeline Gantt chart (`autopar.build.gantt`, simulated with the search's stage times);
  * the alternatives, per-layer costs, collectives and notes.

A ten-line script filters the node table and marks the page `data-ready`; a `window.onerror`
hook records script errors in `data-errors` on <body> (what the screenshot test reads).

Reads node.meta["autopar"] (layouts, shapes, module paths) through `passes.ir`; writes none.
Deterministic: equal inputs give byte-identical pages (no timestamps, ids or absolute paths).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from html import escape
from typing import Any

import torch.fx as fx

from autopar.passes import ir
from autopar.passes.plan import Plan
from autopar.runtime.placement import Partial, Shard

__all__ = ["ReportInput", "render_html", "graph_svg", "memory_svg", "stage_map_svg"]

MEMORY_PARTS = [("params", "parameters", "#4c78a8"), ("grads", "gradients", "#72b7b2"),
                ("master", "fp32 masters", "#9d755d"), ("optimizer", "optimizer state", "#f58518"),
                ("buffers", "buffers", "#bab0ac"), ("activations", "activations", "#54a24b"),
                ("transient", "transient", "#e45756"),
                ("unsplit", "states + activations (one figure)", "#8c8c8c")]
STAGE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
                "#9d755d", "#bab0ac"]
_LAYER_RE = re.compile(r"^(.*?)\.(\d+)(\.|$)")
_NOT_DRAWN = ("getitem", "sym_size.int", "_assert_tensor_metadata")  # plumbing, not computation


@dataclass
class ReportInput:
    title: str
    plan: Plan
    predicted: dict[str, Any]
    facts: list[tuple[str, str]]  # (what, value) rows of the summary
    rank_graph: fx.GraphModule | None = None  # rank 0's rewritten graph
    units: list[str] = field(default_factory=list)  # pipeline units in order
    memory: list[tuple[str, dict[str, float]]] = field(default_factory=list)  # (rank label, memory dict)
    capacity: float = 0.0
    gantt_svg: str = ""
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    layers: list[tuple[str, float, float, float, float]] = field(default_factory=list)  # name, fwd, bwd, comm, saved
    collectives: list[tuple[str, str, str, int, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------ small helpers
def _gib(b: float) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "?"
    return f"{b / 2**30:.2f} GiB" if abs(b) >= 2**28 else f"{b / 2**20:.2f} MiB"


def _ms(s: Any) -> str:
    return "?" if s is None else f"{float(s) * 1e3:.3f} ms"


def _f(x: float) -> str:
    return f"{x:.1f}"


def _op_name(n: fx.Node) -> str:
    t = n.target
    name = getattr(t, "__name__", None) or str(t)
    name = str(name).replace("aten.", "").replace("autopar.", "")
    return name[:-8] if name.endswith(".default") else name


def _is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "autopar" \
        and "leaf" not in str(n.target)


def _placement_color(layout, dp_axis: str | None) -> str:
    if layout is None:
        return "#dddddd"
    parts = [p for a, p in layout.axes if a != dp_axis]
    if any(isinstance(p, Partial) for p in parts):
        return "#f5a25d"
    if any(isinstance(p, Shard) for p in parts):
        return "#7aa6d6"
    return "#d9d9d9"


def _short_layout(layout) -> str:
    if layout is None:
        return ""
    return " ".join(f"{a}:{p}" for a, p in layout.axes)


# ------------------------------------------------------------------------ graph
def _fold_layers(gm: fx.GraphModule) -> tuple[set[fx.Node], dict[str, int]]:
    """Nodes to hide: those of layers `<list>.k`, k >= 1, whose op sequence equals `<list>.0`'s.
    Returns (hidden nodes, {list name: folded copies})."""
    seqs: dict[tuple[str, int], list[fx.Node]] = {}
    for n in gm.graph.nodes:
        i = ir.get_info(n)
        m = _LAYER_RE.match(i.module if i is not None else "")
        if m and n.op == "call_function":
            seqs.setdefault((m.group(1), int(m.group(2))), []).append(n)
    hidden: set[fx.Node] = set()
    folded: dict[str, int] = {}
    for (lst, k), nodes in seqs.items():
        first = seqs.get((lst, 0))
        if k == 0 or first is None:
            continue
        if [_op_name(a) for a in nodes] == [_op_name(a) for a in first]:
            hidden.update(nodes)
            folded[lst] = folded.get(lst, 0) + 1
    return hidden, folded


def graph_svg(gm: fx.GraphModule, plan: Plan, max_nodes: int = 400) -> tuple[str, list[dict[str, str]], str]:
    """(SVG of the graph's ops laid out by depth, one row per shown node for the table, a note)."""
    keys = ir.node_keys(gm)
    hidden, folded = _fold_layers(gm)
    shown = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function", "output") and n not in hidden
             and not (n.op == "call_function" and _op_name(n) in _NOT_DRAWN)]
    truncated = len(shown) > max_nodes
    shown = shown[:max_nodes]
    idx = {n: i for i, n in enumerate(shown)}
    weights: dict[fx.Node, list[str]] = {}
    for n in shown:
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                i = ir.get_info(a)
                weights.setdefault(n, []).append(f"{a.target}: {_short_layout(i.layout) if i else ''}")

    def src(a: fx.Node) -> fx.Node | None:  # look through getitem / hidden-free helpers
        seen = 0
        while a not in idx and a.op == "call_function" and a.all_input_nodes and seen < 4:
            a = a.all_input_nodes[0]
            seen += 1
        return a if a in idx else None

    depth: dict[fx.Node, int] = {}
    edges = []
    for n in shown:
        ins = [s for s in (src(a) for a in n.all_input_nodes) if s is not None]
        depth[n] = 1 + max((depth[s] for s in ins), default=-1)
        edges += [(s, n) for s in dict.fromkeys(ins)]
    rows: dict[int, list[fx.Node]] = {}
    for n in shown:
        rows.setdefault(depth[n], []).append(n)
    BW, BH, GX, GY, PAD = 150, 34, 14, 22, 12
    width = PAD * 2 + max(len(r) for r in rows.values()) * (BW + GX) if rows else 200
    height = PAD * 2 + (max(rows) + 1) * (BH + GY) if rows else 60
    pos = {}
    for d, ns in rows.items():
        for j, n in enumerate(ns):
            pos[n] = (PAD + j * (BW + GX), PAD + d * (BH + GY))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10" class="graph">']
    for s, t in edges:
        (x1, y1), (x2, y2) = pos[s], pos[t]
        out.append(f'<line x1="{_f(x1 + BW / 2)}" y1="{_f(y1 + BH)}" x2="{_f(x2 + BW / 2)}" y2="{_f(y2)}" '
                   'stroke="#9a9a9a" stroke-width="0.8"/>')
    table = []
    strategies = {k: v for axis_map in plan.strategies.values() for k, v in axis_map.items()}
    for n in shown:
        x, y = pos[n]
        i = ir.get_info(n)
        lay = i.layout if i is not None else None
        color = "#e45756" if _is_collective(n) else _placement_color(lay, plan.dp_axis)
        label = "input" if n.op == "placeholder" else ("output" if n.op == "output" else _op_name(n))
        key = keys.get(n, n.name)
        strat = strategies.get(key, "")
        tip = [f"{key}", f"op: {label}"]
        if i is not None:
            tip.append(f"shape {tuple(i.shape) if i.shape is not None else '?'} -> local "
                       f"{tuple(i.local_shape) if i.local_shape is not None else '?'}")
            tip.append(f"layout {_short_layout(lay) or 'none'}")
            tip.append(f"module {i.module or '(root)'}")
        if strat:
            tip.append(f"strategy {strat}")
        tip += [f"weight {w}" for w in weights.get(n, [])]
        out.append(f'<g class="node"><title>{escape(chr(10).join(tip))}</title>'
                   f'<rect x="{x}" y="{y}" width="{BW}" height="{BH}" rx="4" fill="{color}" stroke="#555" '
                   'stroke-width="0.6"/>'
                   f'<text x="{_f(x + BW / 2)}" y="{y + 13}" text-anchor="middle" font-weight="bold">'
                   f'{escape(label[:24])}</text>'
                   f'<text x="{_f(x + BW / 2)}" y="{y + 26}" text-anchor="middle">'
                   f'{escape(_short_layout(lay)[:28])}</text></g>')
        table.append({"key": key, "op": label, "layout": _short_layout(lay), "strategy": strat,
                      "module": (i.module if i is not None else "") or "(root)",
                      "weights": "; ".join(weights.get(n, []))})
    out.append("</svg>")
    note = ""
    if folded:
        note = "folded into the first layer of their list (identical ops): " + ", ".join(
            f"{k}.1..{v} ({v} layers)" for k, v in sorted(folded.items()))
    if truncated:
        note += f"{'; ' if note else ''}only the first {max_nodes} ops are drawn"
    return "\n".join(out), table, note


# ------------------------------------------------------------------------ stage map, memory
def stage_map_svg(units: list[str], plan: Plan) -> str:
    """Pipeline units in a row, coloured by stage; a legend with each stage's time and memory."""
    if not units:
        return ""
    starts = set(plan.split_points)
    stage_of, s = [], 0
    for u in units:
        if u in starts and stage_of:
            s += 1
        stage_of.append(s)
    pipe = plan.extra.get("pipeline") or {}
    n_stages = s + 1
    W = max(6.0, min(48.0, 900.0 / len(units)))
    width, height = max(int(40 + W * len(units) + 20), 760), 60 + 18 * n_stages
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10" class="stages">']
    for i, (u, st) in enumerate(zip(units, stage_of)):
        out.append(f'<g><title>{escape(u)}: stage {st}</title><rect x="{_f(40 + i * W)}" y="10" width="{_f(W)}" '
                   f'height="24" fill="{STAGE_COLORS[st % len(STAGE_COLORS)]}" stroke="white"/></g>')
    for st in range(n_stages):
        y = 50 + 18 * st
        t = pipe.get("stage_time_s", [None] * n_stages)
        members = [u for u, k in zip(units, stage_of) if k == st]
        span = members[0] if len(members) == 1 else f"{members[0]} .. {members[-1]}"
        extra = f", {_ms(t[st])} per micro-batch" if st < len(t) and t[st] is not None else ""
        out.append(f'<rect x="40" y="{y - 9}" width="10" height="10" fill="{STAGE_COLORS[st % len(STAGE_COLORS)]}"/>'
                   f'<text x="56" y="{y}">stage {st}: {escape(span)} ({len(members)} units{extra})</text>')
    out.append("</svg>")
    return "\n".join(out)


def memory_svg(rows: list[tuple[str, dict[str, float]]], capacity: float) -> str:
    """Stacked horizontal bars, one per rank (label), scaled to max(capacity, largest peak)."""
    if not rows:
        return ""
    used = max([sum(m.get(k, 0.0) for k, _, _ in MEMORY_PARTS) for _, m in rows] +
               [m.get("peak", 0.0) for _, m in rows]) or 1.0
    off_scale = capacity > 4 * used  # a tiny model on a big device: draw the bars, name the capacity
    top = used * 1.15 if off_scale else max(capacity, used)
    L, PW, RH = 110, 640, 22
    height = 30 + len(rows) * (RH + 6) + 40
    width = L + PW + 140
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10" class="memory">']
    for r, (label, m) in enumerate(rows):
        y = 20 + r * (RH + 6)
        out.append(f'<text x="{L - 6}" y="{y + 15}" text-anchor="end">{escape(label)}</text>')
        x = float(L)
        for k, name, color in MEMORY_PARTS:
            v = float(m.get(k, 0.0) or 0.0)
            if v <= 0:
                continue
            w = PW * v / top
            out.append(f'<g><title>{escape(label)} {name}: {_gib(v)}</title><rect x="{_f(x)}" y="{y}" '
                       f'width="{_f(max(w, 0.5))}" height="{RH}" fill="{color}"/></g>')
            x += w
        peak = m.get("peak")
        if peak:
            px = L + PW * peak / top
            out.append(f'<line x1="{_f(px)}" y1="{y - 2}" x2="{_f(px)}" y2="{y + RH + 2}" stroke="black" '
                       f'stroke-width="1.5"><title>peak {_gib(peak)}</title></line>')
            out.append(f'<text x="{_f(L + PW + 6)}" y="{y + 15}">peak {_gib(peak)}</text>')
    if capacity and off_scale:
        out.append(f'<text x="{L}" y="11" fill="#e45756">device capacity {_gib(capacity)}: off this scale '
                   f'({capacity / used:.0f}x the largest peak)</text>')
    elif capacity:
        cx = L + PW * capacity / top
        out.append(f'<line x1="{_f(cx)}" y1="10" x2="{_f(cx)}" y2="{20 + len(rows) * (RH + 6)}" stroke="#e45756" '
                   f'stroke-dasharray="4 3"/><text x="{_f(cx)}" y="9" text-anchor="middle" fill="#e45756">'
                   f'capacity {_gib(capacity)}</text>')
    lx, ly = L, 30 + len(rows) * (RH + 6)
    for _k, name, color in MEMORY_PARTS:
        out.append(f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="{ly + 9}">{name}</text>')
        lx += 96
    out.append("</svg>")
    return "\n".join(out)


# ------------------------------------------------------------------------ page
_CSS = """
body{font-family:sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.scroll{overflow:auto;max-height:720px;border:1px solid #eee}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #999;font-size:11px}
.note{color:#555;font-size:12px}
"""

_JS = """
window.onerror=function(m){var b=document.body;b.dataset.errors=(b.dataset.errors||'')+m+'\\n';};
document.addEventListener('DOMContentLoaded',function(){
  var f=document.getElementById('node-filter');
  if(f){f.addEventListener('input',function(){var q=f.value.toLowerCase();
    document.querySelectorAll('#node-table tbody tr').forEach(function(r){
      r.style.display=r.textContent.toLowerCase().indexOf(q)<0?'none':'';});});}
  document.body.dataset.ready='1';
});
"""


def _table(header: list[str], rows: list[list[Any]], num_cols: set[int] = frozenset(), attrs: str = "") -> str:
    out = [f"<table{attrs}><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(f'<td{" class=num" if i in num_cols else ""}>{escape(str(v))}</td>'
                                    for i, v in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render_html(r: ReportInput) -> str:
    """The report page (see the module docstring)."""
    p = r.plan
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{escape(r.title)}</title>"
             f"<style>{_CSS}</style><script>{_JS}</script></head><body>", f"<h1>{escape(r.title)}</h1>"]
    parts.append("<h2>Summary</h2>" + _table(["what", "value"], [list(f) for f in r.facts]))
    dims = [["mesh", ", ".join(f"{a}={s}" for a, s in p.mesh.items())],
            ["data parallel", f"{p.dp_axis}={p.dp}" if p.dp_axis else "none"], ["ZeRO stage", p.zero_stage],
            ["micro-batches", p.n_microbatches],
            ["tensor parallel", ", ".join(f"{a}: {len(t)} nodes with a strategy" for a, t in p.strategies.items())
             or "none"],
            ["sharded parameters", len(p.param_layouts)],
            ["pipeline", f"{len(p.split_points) + 1} stages, {p.schedule}, starts at {p.split_points}"
             if p.split_points else "none"]]
    parts.append(_table(["dimension", "choice"], dims))

    parts.append("<h2>Graph with placements (rank 0)</h2>")
    if r.rank_graph is not None:
        svg, nodes, note = graph_svg(r.rank_graph, p)
        parts.append('<p class="legend"><span style="background:#d9d9d9">replicated</span>'
                     '<span style="background:#7aa6d6">sharded S(d)</span>'
                     '<span style="background:#f5a25d">partial P(sum)</span>'
                     '<span style="background:#e45756">collective (inserted)</span>'
                     '<span class="note">colour: placement on the non-data axes; hover a box for details</span></p>')
        if note:
            parts.append(f'<p class="note">{escape(note)}</p>')
        parts.append(f'<div class="scroll">{svg}</div>')
        parts.append('<p>Filter ops: <input id="node-filter" type="search" placeholder="module, op or placement"></p>')
        parts.append('<div class="scroll">' + _table(["node key", "op", "layout", "strategy", "module", "weights"],
                                                     [[d["key"], d["op"], d["layout"], d["strategy"], d["module"],
                                                       d["weights"]] for d in nodes], attrs=' id="node-table"')
                     + "</div>")
    else:
        parts.append("<p>no graph</p>")

    parts.append("<h2>Stage map</h2>")
    parts.append(stage_map_svg(r.units, p) if r.units else "<p>no pipeline units</p>")
    if not p.split_points:
        parts.append('<p class="note">one stage: the plan has no pipeline parallelism</p>')

    parts.append("<h2>Recompute and fusion decisions</h2>")
    rec = [[m, mode] for m, mode in sorted(p.recompute.items())]
    parts.append(_table(["module", "recompute"], rec) if rec else
                 '<p class="note">recompute: none chosen (every activation is kept; give a memory budget to '
                 'let the search trade recomputation for memory)</p>')
    parts.append(_table(["fusion"], [[f] for f in p.fusions]) if p.fusions else
                 '<p class="note">fusions: none in this plan (ops run unfused)</p>')

    parts.append("<h2>Memory per rank</h2>")
    parts.append(memory_svg(r.memory, r.capacity) if r.memory else "<p>no memory figures</p>")
    if r.memory:
        keys = [k for k, _, _ in MEMORY_PARTS] + ["peak"]
        parts.append(_table(["rank"] + keys, [[lab] + [_gib(m.get(k, 0.0) or 0.0) for k in keys]
                                              for lab, m in r.memory], num_cols=set(range(1, len(keys) + 1))))

    parts.append("<h2>Pipeline schedule</h2>")
    parts.append(f'<div class="scroll">{r.gantt_svg}</div>' if r.gantt_svg else
                 '<p class="note">no pipeline: nothing to schedule</p>')

    if r.alternatives:
        parts.append("<h2>Alternatives</h2>")
        parts.append(_table(["#", "mesh", "ZeRO", "micro-batches", "schedule", "step", "peak / rank", "fits"],
                            [[i, ",".join(f"{a}={s}" for a, s in a_["mesh"].items()), a_["zero_stage"],
                              a_["n_microbatches"], a_["schedule"] or "-", _ms(a_["step_s"]),
                              _gib(a_["peak_bytes"]), "yes" if a_["fits"] else "NO"]
                             for i, a_ in enumerate(r.alternatives)], num_cols={0, 5, 6}))
    if r.layers:
        parts.append("<h2>Per layer (rank 0, one micro-batch)</h2>")
        parts.append(_table(["layer", "forward", "backward", "communication", "saved"],
                            [[n, _ms(f), _ms(b), _ms(c), _gib(s)] for n, f, b, c, s in r.layers],
                            num_cols={1, 2, 3, 4}))
    if r.collectives:
        parts.append("<h2>Collectives (rank 0, per step)</h2>")
        parts.append(_table(["op", "axis", "phase", "calls", "payload", "time"],
                            [[o, a, ph, c, _gib(b), _ms(t)] for o, a, ph, c, b, t in r.collectives],
                            num_cols={3, 4, 5}))
    if r.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{escape(n)}</li>" for n in r.notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
