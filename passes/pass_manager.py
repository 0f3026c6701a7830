"""Runs passes over a graph: times them, verifies the graph after each, writes dumps.

A pass is a function `pass_name(gm, ctx) -> gm` that keeps no state between runs; one that
returns a new GraphModule returns it compiled (the constructor compiles it: edit the graph
before constructing the module, or call `recompile()`; a lazy GraphModule, `runtime._torch_compat.
lazy_graph_module`, compiles at its first call). A graph changed in place is recompiled by the
manager (for a lazy one, a mark: the code of the rank copy's intermediate graphs is never
generated, only the final graph's when it first runs). The manager runs a list of them in
order; after each that changed the graph (and after the first) it lints the graph, checks that
every node still carries its autopar annotation (an unchanged graph, equal fingerprint, is the one
verified before), and records a `PassRecord` (name, milliseconds, node counts
before and after, collectives added by kind). With a dump directory (`AUTOPAR_DUMP=dir` or
`dump_dir=`), it writes the captured graph and the graph after each pass that changed it as
numbered, readable, deterministic Python files (see `passes.dump`). When a pass raises, the
graph it was given is written as `NN_<pass>.FAILED.py` (a reproducer) and the error names
the pass.

Reads/writes: node.meta["autopar"] (verifies presence; passes write it through `passes.ir`).
"""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from . import dump as dump_mod
from . import ir

Pass = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass
class PassContext:
    """What passes may read: the plan, the mesh shape, this rank's coordinates, options."""

    plan: Any
    mesh_sizes: dict[str, int]
    coords: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PassRecord:
    name: str
    ms: float
    nodes_before: int
    nodes_after: int
    collectives_added: tuple[tuple[str, int], ...]
    changed: bool

    def header(self) -> str:
        coll = ", ".join(f"+{n} {k}" for k, n in self.collectives_added)
        return (f"made by {self.name} ({self.ms:.0f} ms); nodes {self.nodes_before} -> {self.nodes_after}"
                + (f"; {coll}" if coll else ""))


class PassError(RuntimeError):
    pass


def collective_counts(gm: fx.GraphModule) -> Counter:
    """Collective nodes in the graph by op name (ops in the `autopar` namespace)."""
    c: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "autopar":
            name = n.target._opname if hasattr(n.target, "_opname") else str(n.target)
            if name != "leaf":
                c[name] += 1
    return c


def verify(gm: fx.GraphModule, pass_name: str) -> None:
    try:
        gm.graph.lint()
    except Exception as e:  # noqa: BLE001
        raise PassError(f"pass {pass_name!r} left an invalid graph: {e}") from e
    missing = ir.unannotated_ops(gm)
    if missing:
        raise PassError(f"pass {pass_name!r} created {len(missing)} nodes without autopar annotations "
                        f"(use passes.ir.copy_meta/set_info), e.g. {missing[0]}")


def _fingerprint(gm: fx.GraphModule) -> list:
    """What the graph's code and its dump are made of, node by node: name, op, target, arguments
    and the annotation itself (a frozen `NodeInfo`: equal annotations print the same line in the
    dump, and comparing them is cheaper than printing them). A pass that only annotates (layouts)
    still counts as a change. The arguments are held as the node's own `args` / `kwargs` objects
    (immutable in fx: a pass that changes them sets new ones), and `same_graph` prints them (nodes
    by name) only for a node whose objects were replaced: building a fingerprint no longer prints
    every node's arguments (0.4 ms of hf-llama tiny's 228 nodes, ten times a build). Equal
    fingerprints give byte-identical dumps; building one costs a fraction of generating the code
    (~6 ms for those 228 nodes)."""
    return [(n.name, n.op, _target_name(n.target), n.args, n.kwargs, ir.get_info(n)) for n in gm.graph.nodes]


def same_graph(before: list, after: list) -> bool:
    """Whether two `_fingerprint`s describe the same code and annotations: node by node equal
    names, ops, targets and annotations, and arguments that are the same objects or print the
    same with nodes by name (a node renamed since `before` was taken differs in its own entry)."""
    if len(before) != len(after):
        return False
    for b, a in zip(before, after):
        if b[0] != a[0] or b[1] != a[1] or b[2] != a[2] or (b[5] is not a[5] and b[5] != a[5]):
            return False
        if (b[3] is not a[3] or b[4] is not a[4]) and _args_text(b) != _args_text(a):
            return False
    return True


def _args_text(entry: tuple) -> str:
    return repr(fx.node.map_arg((entry[3], entry[4]), _node_name))


_TARGET_NAMES: dict = {}  # str() of an op overload formats its name anew each time: a third of a fingerprint


def _target_name(target) -> str:
    if isinstance(target, str):  # get_attr / call_module / call_method targets: their own name
        return target
    try:
        name = _TARGET_NAMES.get(target)
    except TypeError:  # an unhashable target
        return str(target)
    if name is None:
        name = _TARGET_NAMES[target] = str(target)
    return name


def _node_name(a: fx.Node) -> str:
    return a.name


class PassManager:
    def __init__(self, passes: list[Pass], dump_dir: str | None = None):
        self.passes = passes
        self.dump_dir = dump_dir if dump_dir is not None else os.environ.get("AUTOPAR_DUMP") or None
        self.records: list[PassRecord] = []

    def run(self, gm: fx.GraphModule, ctx: PassContext, tag: str = "") -> fx.GraphModule:
        """Run every pass on `gm`; `tag` (e.g. "rank0") prefixes dump file names."""
        prefix = f"{tag}_" if tag else ""
        if self.dump_dir:
            dump_mod.write_graph(gm, os.path.join(self.dump_dir, f"{prefix}00_captured.py"),
                                 header="captured: " + str(gm.meta.get("autopar_capture", {}).get("path", "?")))
        after_src = None  # the last pass's output fingerprint is the next one's input fingerprint
        after_c = None  # and its collective counts
        for i, p in enumerate(self.passes, start=1):
            name = getattr(p, "__name__", repr(p))
            before_n = len(gm.graph.nodes)
            before_c = after_c if after_c is not None else collective_counts(gm)
            before_src = after_src if after_src is not None else _fingerprint(gm)
            t0 = time.perf_counter()
            try:
                out = p(gm, ctx)
            except Exception as e:
                if self.dump_dir:
                    dump_mod.write_graph(gm, os.path.join(self.dump_dir, f"{prefix}{i:02d}_{name}.FAILED.py"),
                                         header=f"input of {name}, which raised {type(e).__name__}: {e}")
                raise PassError(f"pass {name!r} failed: {type(e).__name__}: {e}") from e
            ms = (time.perf_counter() - t0) * 1e3
            if out is None:
                raise PassError(f"pass {name!r} returned None; a pass returns the graph module")
            after_src = _fingerprint(out)
            changed = not same_graph(before_src, after_src)
            if changed and out is gm:
                # the code is generated again only for a graph changed in place; a pass that returns
                # a new GraphModule returns it compiled, as fx.GraphModule's constructor leaves it
                # (recompiling it here generated the code of every submodule again too:
                # split_pipeline's stages)
                out.recompile()
            gm = out
            if changed or i == 1:  # an unchanged graph is the one verified after the pass before
                verify(gm, name)
            after_c = collective_counts(gm)
            added = after_c - before_c
            rec = PassRecord(name, ms, before_n, len(gm.graph.nodes), tuple(sorted(added.items())), changed)
            self.records.append(rec)
            if self.dump_dir and changed:
                dump_mod.write_graph(gm, os.path.join(self.dump_dir, f"{prefix}{i:02d}_{name}.py"),
                                     header=rec.header())
        return gm
