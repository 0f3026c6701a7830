"""Dense experts: the MoE idiom in which every expert runs on every token (transformers' Llama 4
text MoE), found by properties of the graph, for `search/expert_detect.py` (`idiom="dense"`).

* *Dense routing*: a router's (`expert_props.find_router`) top-k indices scatter the chosen
  scores into a dense (N, E) matrix (`scatter` / `scatter_` of the indices into an (N, E)
  tensor, -inf or 0 off the top-k), so every expert gets a score for every token.
* *The expert region*: the nodes between the token rows x (N, D) and the sum over experts,
  found by walking back from that sum. Every one of them is *expert-major*: shape (E, N, ...)
  or (E * N, ...), experts outermost. What enters it from outside is
  - the tokens repeated over the experts: `repeat(x, [E, 1, ...])` (x (N, ...));
  - the dense scores S (N, E) (computed from the scatter), transposed to (E, N)
    (`transpose(S, 0, 1)`, `t`, `permute(S, [1, 0])`);
  - parameters with E leading experts, read only by batched matmuls (`bmm`, `matmul`) of an
    (E, N, d) region tensor by the parameter (E, d, d');
  - token-free constants.
  Views keep every size an int and the expert dim leading (E, or -1); every other op keeps
  experts and tokens apart by its sharding rule (`expert_props.row_wise_failure`: S(0) -> S(0),
  and S(1) -> S(1) on (E, N, ...) tensors). Nothing outside reads a region node.
* *The combine*: `sum(y, [0])` of an (E, N, ...) region tensor y, giving (N, ...).

Because experts and tokens stay apart, the region can run on a slice of the experts (their
parameter rows and score columns) and on any number of tokens: `passes/expert.py` gives each
ep rank its E/ep experts on the ep group's tokens (all-gathered), and reduce-scatters the
partial sum over experts back to each rank's tokens.

API: `dense_scatter(idx, n_tokens, E) -> node | None`, `dense_experts(g, t, idx, E) ->
dict | str | None` (the block's dense fields; a str says why dense routing cannot be split;
None: not dense routing). Reads node.meta["autopar"] and node.meta["val"]; writes nothing.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autopar.search.expert_graph import MoEGraph, same_size, shape_of, sym
from autopar.search.expert_props import base_name, param_of, row_wise_failure, users_through

SCATTERS = ("aten.scatter", "aten.scatter_", "aten.scatter_add", "aten.scatter_add_")
BATCHED = ("aten.bmm", "aten.matmul")
VIEWS = ("aten.view", "aten.reshape", "aten._unsafe_view")
TRANSPOSES = ("aten.transpose", "aten.t", "aten.permute")
ASSERTS = ("aten._assert_tensor_metadata",)


def dense_scatter(idx: fx.Node, n_tokens, E: int) -> fx.Node | None:
    """A scatter of router scores into a (N, E) matrix by `idx` (through views): dense routing."""
    for m, u in users_through(idx):
        if base_name(u) in SCATTERS and len(u.args) > 2 and u.args[2] is m and shape_of(u) and \
                len(shape_of(u)) == 2 and same_size(shape_of(u)[0], n_tokens) and shape_of(u)[1] == E:
            return u
    return None


def _expert_param(a, E: int) -> fx.Node | None:
    p = param_of(a)
    s = shape_of(p) if p is not None else None
    return p if s and len(s) == 3 and s[0] == E else None


def _form(n, E: int, N) -> str | None:
    """"EN" for an (E, N, ...) tensor, "flat" for (E * N, ...), "tuple" for a tuple of either
    (chunk, split), None otherwise."""
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    if isinstance(val, (tuple, list)) and val and shape_of(n) is None:
        ok = all(isinstance(v, torch.Tensor) and v.dim() >= 1 and (
            (v.dim() >= 2 and v.shape[0] == E and same_size(str(v.shape[1]), N)) or
            same_size(str(v.shape[0]), sym(N) * E)) for v in val)
        return "tuple" if ok else None
    s = shape_of(n)
    if not s:
        return None
    if s[0] == E and len(s) >= 2 and same_size(s[1], N):
        return "EN"
    if same_size(s[0], sym(N) * E):
        return "flat"
    return None


def _sum_over_experts(n: fx.Node, E: int, N) -> bool:
    if base_name(n) != "aten.sum" or len(n.args) < 2 or list(n.args[1] or []) != [0]:
        return False
    if (len(n.args) > 2 and n.args[2]) or n.kwargs.get("keepdim") or n.kwargs.get("dtype") is not None:
        return False
    return _form(n.args[0], E, N) == "EN"


def dense_experts(g: MoEGraph, t: fx.Node, idx: fx.Node, E: int):
    """The dense fields of the MoE block of router top-k `t` (indices `idx`, E experts):
    {"hidden", "tokens", "combine", "combine_input", "dense_entries", "dense_sizes",
    "expert_params" (name -> node)}; a str saying why the dense experts cannot be
    split; None when `t` does not route densely (no scatter into (N, E) reaching a batched
    matmul by an (E, d, d') parameter)."""
    N = shape_of(t.args[0])[0]
    scat = dense_scatter(idx, N, E)
    if scat is None:
        return None
    down = g.descendants([scat])
    mm = next((m for m in sorted(down, key=g.order.get) if m.op == "call_function" and base_name(m) in BATCHED
               and any(_expert_param(a, E) is not None for a in m.args[:2])), None)
    if mm is None:
        return None
    k = g.keys
    ext = next((m for m in sorted(g.descendants([mm]), key=g.order.get) if _sum_over_experts(m, E, N)), None)
    if ext is None:
        return (f"the expert outputs of {k[mm]} never meet in a sum over the {E} experts (aten.sum over dim 0 of "
                f"an (E, N, ...) tensor)")
    region, params, entries, stack = set(), {}, [], [ext.args[0]]
    while stack:  # back from the combine to where tokens, scores and parameters come in
        m = stack.pop()
        if m in region:
            continue
        region.add(m)
        for a in g.tin(m):
            if a in region:
                continue
            p = _expert_param(a, E)
            if p is not None and base_name(m) in BATCHED and m.args[1] is a:
                params[str(p.target)] = p
            elif not g.dep[a] and param_of(a) is None:
                continue  # token-free constants
            elif _form(a, E, N) is not None and param_of(a) is None:
                stack.append(a)
            else:
                why = _entry_failure(m, a, E, N, down, k)
                if why:
                    return why
                entries.append({"node": k[m], "source": k[a], "per": "token" if base_name(m) == "aten.repeat"
                                else "score"})
    pers = {e["per"] for e in entries}
    if pers != {"token", "score"}:
        missing = "no tokens repeated over the experts" if "token" not in pers else "no dense scores"
        return (f"the experts before {k[ext]} read {missing} (expected repeat(x, [E, 1]) and the (N, E) scores "
                "transposed)")
    tokens = {e["source"] for e in entries if e["per"] == "token"}
    if len(tokens) != 1:
        return f"the experts repeat more than one token tensor: {sorted(tokens)}"
    sizes = []
    for m in sorted(region, key=g.order.get):
        why = _region_failure(m, region, ext, E, N, k)
        if why:
            return f"{k[m]} ({m.format_node()}) {why}"
        if base_name(m) in VIEWS + ("aten.repeat",) and m.args[1][0] == E:
            sizes.append(k[m])
    x = next(n for n, key in k.items() if key in tokens)
    return {"hidden": int(shape_of(x)[1]), "tokens": next(iter(tokens)), "combine": k[ext],
            "combine_input": k[ext.args[0]], "dense_entries": sorted(entries, key=lambda e: e["node"]),
            "dense_sizes": sizes, "expert_params": params}


def _entry_failure(m: fx.Node, a: fx.Node, E: int, N, down: set, k: dict) -> str | None:
    """None when region node `m` reading outside node `a` is a token or score entry."""
    b, sa = base_name(m), shape_of(a)
    if b == "aten.repeat" and m.args[0] is a and sa and same_size(sa[0], N):
        reps = list(m.args[1])
        if len(reps) == len(sa) and reps[0] == E and all(r == 1 for r in reps[1:]):
            return None
    if b in TRANSPOSES and m.args[0] is a and a in down and sa and len(sa) == 2 and same_size(sa[0], N) and \
            sa[1] == E and (b == "aten.t" or sorted(m.args[1:3]) in ([0, 1], [-2, -1], [-1, 0]) or
                            (b == "aten.permute" and list(m.args[1]) == [1, 0])):
        return None
    inner = next((i for i in a.all_input_nodes if _form(i, E, N) is not None and param_of(i) is None), None)
    if inner is not None:
        return (f"{k[a]} ({a.format_node()}) mixes experts or tokens: it turns the expert-major {k[inner]} "
                f"{tuple(shape_of(inner) or ())} into {tuple(sa or ())}, which {k[m]} reads")
    if param_of(a) is not None:
        return (f"{k[m]} ({m.format_node()}) reads the parameter {param_of(a).target} {tuple(sa or ())} other than "
                "as the right operand of a batched matmul over the experts")
    return (f"{k[m]} ({m.format_node()}) reads {k[a]} {tuple(sa or ())}, which is neither the token rows repeated "
            f"over the {E} experts (repeat(x, [{E}, 1])) nor the dense (N, {E}) scores transposed")


def _region_failure(m: fx.Node, region: set, ext: fx.Node, E: int, N, k: dict) -> str | None:
    """Why expert-major node `m` cannot run on a slice of the experts and other tokens, or None."""
    if m.op != "call_function":
        return "is not an op"
    for u in m.users:
        if u not in region and u is not ext and base_name(u) not in ASSERTS:
            return f"is read outside the experts by {k[u]} ({u.format_node()})"
    b = base_name(m)
    if b == "operator.getitem" or b == "aten.repeat" or b in TRANSPOSES and _form(m.args[0], E, N) is None:
        return None  # an element of a tuple op, or an entry (checked by _entry_failure)
    if b in VIEWS:
        sizes = list(m.args[1])
        ins = shape_of(m.args[0]) or ()
        if not all(isinstance(s, int) for s in sizes) or sizes[0] not in (E, -1) or \
                (sizes[0] == E and (len(sizes) < 2 or sizes[1] != -1)):
            return (f"reshapes to {sizes}: expert-major views keep int sizes with the experts ({E}, then -1 for "
                    "the tokens) or -1 leading")
        tail_in = ins[2:] if _form(m.args[0], E, N) == "EN" else ins[1:]
        tail_out = sizes[2:] if sizes[0] == E else sizes[1:]
        if not all(isinstance(s, int) for s in tail_in) or math.prod(tail_in) != math.prod(tail_out) or \
                -1 in tail_out:
            return f"reshapes {tuple(ins)} to {sizes}, mixing the experts or tokens with the feature dims"
        return None
    if b in BATCHED:
        if _form(m.args[0], E, N) != "EN" or _expert_param(m.args[1], E) is None:
            return "is a batched matmul that is not (E, N, d) tokens by an (E, d, d') expert parameter"
        return None
    ins = {a for a in m.all_input_nodes if a in region}
    why = row_wise_failure(m, ins, 0)
    if why is None and any(_form(a, E, N) == "EN" for a in ins):
        why = row_wise_failure(m, ins, 1)
    return None if why is None else f"mixes experts or tokens: {why}"
