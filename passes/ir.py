"""Node annotations: the one place that reads and writes `node.meta["autopar"]`.

Each node of a captured or rewritten graph carries a frozen `NodeInfo`: its global shape and
dtype, the module path it came from, the parameter or buffer it is (for `get_attr` nodes),
and — once a plan is applied — its layout over the mesh and local shape. Passes update it
with `set_info(node, replace(info, ...))`, never by writing the dict directly, and copy it
onto every node they create (`copy_meta`).

Reads: node.meta["val"], node.meta["nn_module_stack"] (set by torch.export / make_fx).
Writes: node.meta["autopar"].
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.runtime.placement import Layout

KEY = "autopar"


@dataclass(frozen=True)
class NodeInfo:
    """What autopar knows about one node.

    shape: global shape (ints, or strings for symbolic dims such as "s0"); None if not a tensor.
    dtype: torch dtype name ("float32"); None if not a tensor.
    module: dotted module path the node belongs to ("layers.0.attn"); "" for the root.
    param: parameter/buffer name for get_attr nodes ("layers.0.attn.wq.weight"), else None.
    kind: "param" | "buffer" | "input" | "op" | "output" | "constant" | "collective".
    layout: output layout over the mesh (None until a plan is applied).
    local_shape: shape on one rank under `layout` (None until a plan is applied).
    """

    shape: tuple | None
    dtype: str | None
    module: str
    param: str | None = None
    kind: str = "op"
    layout: Layout | None = None
    local_shape: tuple | None = None

    def describe(self) -> str:
        parts = []
        if self.shape is not None:
            parts.append(f"{self.dtype}{list(self.shape)}")
        if self.layout is not None:
            parts.append(str(self.layout))
        if self.local_shape is not None and self.local_shape != self.shape:
            parts.append(f"local {list(self.local_shape)}")
        if self.module:
            parts.append(f"in {self.module}")
        return " ".join(parts)


def get_info(node: fx.Node) -> NodeInfo | None:
    return node.meta.get(KEY)


def info(node: fx.Node) -> NodeInfo:
    i = node.meta.get(KEY)
    if i is None:
        raise KeyError(f"node has no autopar annotation: {node.format_node()}")
    return i


def set_info(node: fx.Node, value: NodeInfo) -> None:
    if not isinstance(value, NodeInfo):
        raise TypeError(f"node.meta[{KEY!r}] must hold a NodeInfo, got {type(value).__name__}")
    node.meta[KEY] = value


def update(node: fx.Node, **changes: Any) -> NodeInfo:
    new = replace(info(node), **changes)
    node.meta[KEY] = new
    return new


def copy_meta(src: fx.Node, dst: fx.Node) -> None:
    """Copy every meta entry (annotation included) from `src` onto a node built to replace it."""
    for k, v in src.meta.items():
        dst.meta.setdefault(k, v)


def _shape_of(val) -> tuple | None:
    if isinstance(val, torch.Tensor):
        # SymInts print as their symbol ("s0"); never int() them (that would add a guard)
        return tuple(s if isinstance(s, int) else str(s) for s in val.shape)
    return None


def module_path(node: fx.Node) -> str:
    """Innermost module path from torch's nn_module_stack ("" at the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    best = ""
    for v in stack.values():
        path = v[0] if isinstance(v, tuple) else v
        if not isinstance(path, str) or path.startswith("_empty"):
            continue
        path = _clean_path(path)
        if len(path) >= len(best):
            best = path
    return best


def _clean_path(path: str) -> str:
    # torch.export writes "L['self'].layers[0].attn" in some versions, "layers.0.attn" in others
    path = path.replace("L['self'].", "").replace("L['self']", "")
    out = []
    for part in path.replace("]", "").replace("[", ".").split("."):
        part = part.strip("'\"")
        if part and not part.startswith("_modules"):
            out.append(part)
    return ".".join(out)


def annotate_graph(gm: fx.GraphModule, model: nn.Module | None = None) -> None:
    """Give every node of a freshly captured graph its NodeInfo."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    buffers = {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = _shape_of(val)
        dtype = str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else None
        kind, param = "op", None
        if node.op == "get_attr":
            param = str(node.target)
            kind = "param" if param in params else "buffer" if param in buffers else "constant"
            if shape is None:
                t = _fetch_attr(gm, param)
                if isinstance(t, torch.Tensor):
                    shape, dtype = tuple(t.shape), str(t.dtype).replace("torch.", "")
        elif node.op == "placeholder":
            kind = "input"
        elif node.op == "output":
            kind = "output"
        elif node.target is torch.ops.autopar.leaf.default if hasattr(torch.ops.autopar, "leaf") else False:
            kind = "leaf"
        mod = module_path(node)
        if param is not None:
            mod = param.rpartition(".")[0]
        set_info(node, NodeInfo(shape=shape, dtype=dtype, module=mod, param=param, kind=kind))


def _fetch_attr(gm: nn.Module, target: str):
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def unannotated_ops(gm: fx.GraphModule) -> list[str]:
    return [n.format_node() for n in gm.graph.nodes if KEY not in n.meta]


def node_keys(gm: fx.GraphModule, skip=None) -> dict[fx.Node, str]:
    """Stable names for a graph's nodes, the same across captures of one model (fx node
    names are not): parameters and buffers by their name, inputs by position
    (`input:<i>`), the output as `output`, and every call as `<module path>:<op>#<k>` (the
    k-th call of that op in that module, in graph order) — the convention of the Plan's
    `node_layouts` and of the cost model's NodeCost.key. `skip(node)`: calls that get no key
    and are not counted (nodes a pass inserted), so the other keys stay those of the capture."""
    keys: dict[fx.Node, str] = {}
    count: dict[tuple[str, str], int] = {}
    n_in = 0
    for n in gm.graph.nodes:
        if skip is not None and n.op == "call_function" and skip(n):
            continue
        if n.op == "placeholder":
            keys[n] = f"input:{n_in}"
            n_in += 1
        elif n.op == "get_attr":
            keys[n] = str(n.target)
        elif n.op == "output":
            keys[n] = "output"
        else:
            i = get_info(n)
            mod = i.module if i is not None else module_path(n)
            short = _short_op(n.target)
            k = count.get((mod, short), 0)
            count[(mod, short)] = k + 1
            keys[n] = f"{mod}:{short}#{k}"
    return keys


def _short_op(target) -> str:
    name = getattr(target, "__name__", str(target))  # OpOverload: "linear.default"
    return name.split(".")[0] if hasattr(target, "overloadpacket") else name
