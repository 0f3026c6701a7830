"""Capture once per model structure: a small in-process memo of captured graphs.

Capturing is the most expensive step before planning (torch.export with symbolic shapes: 2-5
CPU-s for a two-layer transformers model, 20 s for Llama-3-70B on meta). The same structure is
often captured again in one process: a model built on meta and the same model with real
weights, `parallelize` called for another mesh, a test's reference process and its forked
ranks. The graph depends only on what the model's code reads, so a capture is reused when all
of these are equal:

  * the class of every module (the type object itself), its `training` flag, its hooks (by
    identity) and its other attributes: plain values by value, configs (objects with `to_dict()`, a transformers `PretrainedConfig`) by all their fields,
    private ones included (`_attn_implementation_internal`), dataclasses (models.gpt
    `GPTConfig`) by their type and every field's value, a `functools.partial` by its function,
    arguments and keywords, anything else (functions,
    tensors held as plain attributes, other objects) by identity (a module-level function is one
    object in every instance, two lambdas are two), kept alive by the memo so an identity
    cannot be reused;
  * every parameter's and buffer's name, shape, dtype, device type and requires_grad, and which
    names share one tensor (tied weights);
  * the example inputs' pytree structure, every tensor's shape, dtype, device type and
    requires_grad, and every non-tensor leaf's value;
  * the capture options, torch's version, grad mode, default dtype and autocast state.

Captures with `leaf_modules` are never stored: an opaque leaf node names its module instance.
Values of parameters, buffers and inputs do not enter the graph (capture traces on fake
tensors), so a real model and its meta twin (traced on fake tensors of the run's device) share
one entry. Anything the key cannot see (a monkey-patched global function, a module attribute
changed through a property) is missed: set AUTOPAR_CAPTURE_CACHE=0 to turn the memo off, or
call `clear()`.

A hit returns a new GraphModule (lazy: its code is generated at its first call) holding a copy
of the stored graph (fresh node.meta dicts, so a pass
rewriting one graph never touches another; `NodeInfo` is frozen), bound to *this* model's
parameters and buffers by name, with the stored graph's own constants (tensor attributes, and
buffers the model does not have: export's lifted constants), registered as the first capture
registered them. `gm.meta["autopar_capture"]["cached"]` says it was a hit. The memo
keeps graphs, never the first model's weights (constants excepted), and the 16 newest entries;
`counts()` says how many lookups hit and missed.

Reads and writes node.meta only by copying it.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import os
from collections import OrderedDict
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.runtime._torch_compat import lazy_graph_module, pytree

__all__ = ["MAX_ENTRIES", "clear", "counts", "enabled", "key_of", "lookup", "store"]

# a test module captures up to ~8 structures (models x dtypes x cp or not) before its world forks,
# and the next module may capture the same ones again; an entry is a graph, no weights
MAX_ENTRIES = 16
_MEMO: "OrderedDict[tuple, _Entry]" = OrderedDict()
_COUNTS = {"hits": 0, "misses": 0}
# what the graph cannot depend on: tensors and submodules are keyed separately, state-dict hooks
# run only when saving or loading, transformers' `_is_hf_initialized` is read by its weight init only
_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_is_hf_initialized"}
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class _Entry:
    def __init__(self, graph: fx.Graph, gm_meta: dict, attrs: dict, keepalive: list):
        self.graph = graph
        self.gm_meta = gm_meta
        self.attrs = attrs  # get_attr target -> ("param" | "buffer" | "attr", constant tensor or None)
        self.keepalive = keepalive


def enabled() -> bool:
    return os.environ.get("AUTOPAR_CAPTURE_CACHE", "1") != "0"


def clear() -> None:
    """Forget every stored capture."""
    _MEMO.clear()


def counts() -> dict[str, int]:
    """Lookups in this process since it started (forked ranks inherit the parent's counts):
    {"hits", "misses", "entries"}."""
    return {**_COUNTS, "entries": len(_MEMO)}


def _value_key(v: Any, keep: list, depth: int = 0):
    if isinstance(v, _PLAIN):
        return (type(v).__name__, repr(v))
    if depth > 6:
        keep.append(v)
        return ("id", id(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x, keep, depth + 1) for x in v))
    if isinstance(v, (dict, OrderedDict)):
        return ("dict", tuple((repr(k), _value_key(x, keep, depth + 1)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(x) for x in v)))
    if hasattr(v, "to_dict") and hasattr(v, "__dict__") and not isinstance(v, (torch.Tensor, nn.Module)):
        # a config: every field, private ones too (transformers keeps the attention
        # implementation in `_attn_implementation_internal`, which to_dict() leaves out)
        keep.append(type(v))
        return ("config", id(type(v)), _value_key(dict(sorted(vars(v).items())), keep, depth + 1))
    if isinstance(v, enum.Enum):
        return ("enum", repr(v))
    if type(v) is functools.partial:
        # a partial is its function, arguments and keywords (transformers' GELUTanh holds
        # `partial(F.gelu, approximate="tanh")`, one new object per module instance)
        return ("partial", _value_key(v.func, keep, depth + 1), _value_key(v.args, keep, depth + 1),
                _value_key(dict(sorted(v.keywords.items())), keep, depth + 1))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        # a config dataclass (models.gpt GPTConfig): its type by identity and every field by
        # value, so two models built from two equal configs share a capture; attributes set
        # outside the fields (vars) count too, and a slots dataclass is read field by field
        keep.append(type(v))
        fields = vars(v) if hasattr(v, "__dict__") else {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        return ("dataclass", id(type(v)), type(v).__qualname__, _value_key(dict(sorted(fields.items())), keep, depth + 1))
    keep.append(v)  # identity: kept alive by the entry, so the id cannot be reused
    return ("id", type(v).__qualname__, id(v))


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), str(t.dtype), t.device.type, bool(t.requires_grad))


def key_of(model: nn.Module, args: tuple, kwargs: dict, options: dict) -> tuple[tuple, list]:
    """The memo key of one capture request and the objects it names by identity."""
    keep: list = []
    mods = []
    for name, m in model.named_modules(remove_duplicate=False):
        keep.append(type(m))
        attrs = tuple((k, _value_key(v, keep)) for k, v in sorted(vars(m).items()) if k not in _SKIP_ATTRS)
        mods.append((name, id(type(m)), type(m).__qualname__, bool(m.training), attrs))
    first: dict[int, str] = {}
    tensors = []
    for kind, items in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            tensors.append((kind, name, _tensor_key(t), first.setdefault(id(t), name)))
    flat, spec = pytree.tree_flatten((args, kwargs))
    inputs = tuple(("t",) + _tensor_key(x) if isinstance(x, torch.Tensor) else _value_key(x, keep) for x in flat)
    env = (torch.__version__, torch.is_grad_enabled(), str(torch.get_default_dtype()),
           torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda") if hasattr(torch, "cuda") else False)
    opts = tuple(sorted((k, _value_key(v, keep)) for k, v in options.items()))
    return (tuple(mods), tuple(tensors), str(spec), inputs, env, opts), keep


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        env[n] = new.node_copy(n, lambda x: env[x])
        env[n].meta = dict(n.meta)
    return new


def _copy_meta(meta: dict) -> dict:
    """gm.meta with its one mutable entry (the capture report) copied; pytree specs are immutable."""
    out = dict(meta)
    if "autopar_capture" in out:
        out["autopar_capture"] = copy.deepcopy(out["autopar_capture"])
    return out


def _owner(gm: nn.Module, target: str) -> tuple[nn.Module, str]:
    *path, field = target.split(".")
    m = gm
    for p in path:
        m = getattr(m, p)
    return m, field


def store(key: tuple, keep: list, gm: fx.GraphModule) -> None:
    """Remember `gm` (just captured) under `key`: its graph, gm.meta, and for every get_attr
    target how it is registered (constants are kept; the model's parameters and buffers are not).
    A buffer the model does not have under that name (a tensor constant torch.export lifted
    into the graph, `lifted_tensor_0`: Falcon's rotary code) is a constant of the graph: kept."""
    model_names = {name for _kind, name, *_rest in key[1]}  # key_of: every parameter and buffer name
    attrs = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        owner, field = _owner(gm, str(n.target))
        if field in owner._parameters:
            attrs[n.target] = ("param", None)
        elif field in owner._buffers:
            attrs[n.target] = ("buffer", None if n.target in model_names else owner._buffers[field])
        else:
            attrs[n.target] = ("attr", getattr(owner, field))
    _MEMO[key] = _Entry(_copy_graph(gm.graph), _copy_meta(gm.meta), attrs, keep)
    _MEMO.move_to_end(key)
    while len(_MEMO) > MAX_ENTRIES:
        _MEMO.popitem(last=False)


def lookup(key: tuple, model: nn.Module) -> fx.GraphModule | None:
    """A fresh GraphModule for `model` from the entry under `key`, or None. Stored constants
    not found on the model under the same name are taken from the entry."""
    entry = _MEMO.get(key)
    if entry is None:
        _COUNTS["misses"] += 1
        return None
    _MEMO.move_to_end(key)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    root = nn.Module()
    for target, (kind, const) in entry.attrs.items():
        *path, field = target.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        value = named.get(target, const)
        if value is None:  # a parameter the model no longer has: the key should have prevented this
            _COUNTS["misses"] += 1
            return None
        if kind == "param":
            m.register_parameter(field, value)
        elif kind == "buffer":
            m.register_buffer(field, value)
        else:
            setattr(m, field, value)
    # lazy: a hit is mostly copied (rank_copy) and described, seldom run; its code is generated
    # when first needed (runtime/_torch_compat.py)
    gm = lazy_graph_module(root, _copy_graph(entry.graph), class_name="CapturedGraph")
    gm.meta.update(_copy_meta(entry.gm_meta))
    gm.meta.setdefault("autopar_capture", {})["cached"] = True
    _COUNTS["hits"] += 1
    return gm
