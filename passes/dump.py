"""Readable, deterministic dumps of graphs.

A dump file is the graph's Python code (`gm.code`, runnable as the module's forward) with
a header saying what made it, and each node's autopar annotation (global shape, layout,
local shape, module) as a comment above its line. No ids, addresses, timestamps or
absolute paths appear in the body, so two dumps of the same plan are byte-identical
(timings live only in the header's first line, which `strip_timings` removes for diffs).

Reads: node.meta["autopar"]. Writes: files only.
"""
from __future__ import annotations

import os
import re

import torch.fx as fx

from . import ir

_STACK_COMMENT = re.compile(r"^\s*# File: .*$")


def graph_text(gm: fx.GraphModule, header: str = "") -> str:
    """The graph as Python, each op line preceded by its annotation comment."""
    notes: dict[str, str] = {}
    for n in gm.graph.nodes:
        i = ir.get_info(n)
        if i is not None and n.op not in ("output",):
            d = i.describe()
            if d:
                notes[n.name] = d
    src = gm.graph.python_code("self", verbose=False).src
    out_lines = []
    for line in src.splitlines():
        if _STACK_COMMENT.match(line):
            continue  # torch's "# File: /abs/path..." comments are machine-specific
        m = re.match(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*)(: [^=]+)? = ", line)
        if m and m.group(2) in notes:
            out_lines.append(f"{m.group(1)}# {notes[m.group(2)]}")
        out_lines.append(line.rstrip())
    body = "\n".join(l for l in out_lines if l.strip() != "" or True)
    body = re.sub(r"\n\s*\n+", "\n", body)
    params = [f"#   {n.target}: {ir.info(n).describe()}" for n in gm.graph.nodes
              if n.op == "get_attr" and ir.get_info(n) is not None]
    head = [f"# {line}" for line in header.splitlines()] if header else []
    head.append(f"# nodes: {len(gm.graph.nodes)}")
    if params:
        head.append("# parameters and buffers:")
        head.extend(params)
    return "\n".join(head) + "\n" + body + "\n"


def write_graph(gm: fx.GraphModule, path: str, header: str = "") -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    text = graph_text(gm, header)
    with open(path, "w") as f:
        f.write(text)
    return path


def strip_timings(text: str) -> str:
    """The text with pass timings removed (for comparing two dumps)."""
    return re.sub(r"\(\d+ ms\)", "(? ms)", text)
