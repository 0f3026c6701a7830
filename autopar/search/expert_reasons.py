"""Why a graph has no MoE block that expert parallelism can split: the message an ep mesh
gets instead of a bare "no mixture-of-experts block" (`search/expert.py` `plan_experts`).

For each expert selection in the graph, one line naming its node and what failed:

* a top-k that is no router (`expert_props.router_failure`: no linear map of token rows by a
  (E, D) parameter feeds its scores);
* a router whose indices go into an opaque leaf module (`autopar::leaf`: the experts kept
  whole by leaf_modules, e.g. DBRX's, whose data-dependent loop over experts does not trace);
* a router whose indices reach no dispatch / combine pair of token rows, nor a dense (N, E)
  score matrix feeding batched matmuls by all E experts' weights (a dense block,
  `search/expert_dense.py`: transformers' Llama 4 text MoE);
* an expert choice made by `max` / `argmax` over router scores instead of `aten.topk`
  (transformers' PhiMoE sparsemixer: two masked maxima), also naming a random op (Gumbel
  noise in training) the choice depends on, which no ep split can reproduce.

API: `no_moe_reasons(gm) -> [str]` ("<node key> (<node>): <reason>"; empty when the graph
selects no experts at all), re-exported by `search/expert_detect.py` and `search/expert.py`.
Reads node.meta["autopar"] and node.meta["val"]; writes nothing.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.passes.rules.sharding import op_name
from autopar.search.expert_graph import MoEGraph
from autopar.search.expert_props import base_name, find_router, param_of, router_failure, users_through

SELECTS = ("aten.topk", "aten.max", "aten.argmax")
RANDOM = ("aten.exponential", "aten.exponential_", "aten.rand", "aten.rand_like", "aten.uniform", "aten.uniform_",
          "aten.bernoulli", "aten.bernoulli_", "aten.multinomial", "aten.randn", "aten.randn_like", "aten.normal",
          "aten.normal_")


def _indices(n: fx.Node) -> fx.Node | None:
    """The expert indices a selection node gives: element 1 of topk / max.dim, argmax itself."""
    if base_name(n) == "aten.argmax":
        return n if n.users else None
    for u in n.users:
        if u.op == "call_function" and op_name(u.target) == "operator.getitem" and u.args[1] == 1:
            return u
    return None


def _opaque_user(idx: fx.Node) -> fx.Node | None:
    """An opaque leaf-module node (`autopar::leaf`, capture's leaf_modules) that reads `idx`."""
    return next((u for _, u in users_through(idx)
                 if u.op == "call_function" and op_name(u.target).startswith("autopar.leaf")), None)


def _random_source(g: MoEGraph, idx: fx.Node, tokens: fx.Node) -> fx.Node | None:
    """The first random op the choice `idx` depends on, leaving out what its token rows do (an
    earlier layer's noise reaches this one through the hidden states)."""
    for m in sorted(g.ancestors(idx) - g.ancestors(tokens), key=g.order.get):
        if m.op == "call_function" and base_name(m) in RANDOM:
            return m
    return None


def _why(g: MoEGraph, n: fx.Node, seen_routers: set) -> str | None:
    b = base_name(n)
    r = find_router(n)
    if b != "aten.topk":
        if r is None or (b == "aten.max" and "dim" not in op_name(n.target)) or r[0] in seen_routers:
            return None  # a max of something else, or a router already told about
        idx = _indices(n)
        if idx is None:
            return None
        seen_routers.add(r[0])
        more = sum(1 for m in g.nodes if m is not n and m.op == "call_function" and base_name(m) in SELECTS[1:]
                   and _indices(m) is not None and (find_router(m) or (None,))[0] is r[0])
        noise = _random_source(g, idx, r[1])
        return (f"chooses one of {r[2]} experts per token by {b} over router scores (weight "
                f"{param_of(r[0].args[1]).target}; {more} more max / argmax over them follow) instead of aten.topk "
                "(a chain of masked maxima, as PhiMoE's sparsemixer); expert parallelism takes its routing table "
                "from one top-k"
                + (f", and this choice depends on the random {g.keys[noise]} ({base_name(noise)}: sampled noise in "
                   "training), which ranks holding different tokens cannot draw as one process does"
                   if noise is not None else ""))
    if r is None:
        return f"not an expert router: {router_failure(n)}"
    idx = _indices(n)
    if idx is None:
        return "its indices are unused"
    weight = param_of(r[0].args[1]).target
    leaf = _opaque_user(idx)
    if leaf is not None:
        return (f"scores {r[2]} experts per token like a router (weight {weight}), but its indices go into the "
                f"opaque module {leaf.args[0]!r} ({leaf.name}: kept whole by leaf_modules, or by capture when it "
                "could not be traced): the experts are not in the graph, so nothing can be split over ep")
    return (f"scores {r[2]} candidates per token like a router (weight {weight}), but its indices reach no "
            "dispatch (an index / index_select / index_add of token rows by them) followed by a combine of the "
            "expert outputs, nor a dense (N, E) score matrix (a scatter by them) feeding batched matmuls by (E, d, d') "
            "expert weights")


def no_moe_reasons(gm: fx.GraphModule) -> list[str]:
    """Why each expert selection (top-k, or max / argmax over router scores) of a graph without
    MoE blocks is not one (for the error an ep mesh gets): "<node key> (<node>): <reason>";
    empty when the graph selects nothing."""
    g = MoEGraph(gm)
    out, seen_routers = [], set()
    for n in g.nodes:
        if n.op != "call_function" or base_name(n) not in SELECTS:
            continue
        why = _why(g, n, seen_routers)
        if why is not None:
            out.append(f"{g.keys[n]} ({n.format_node()}): {why}")
    return out
