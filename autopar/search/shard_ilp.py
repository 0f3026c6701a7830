"""Sharding search: one strategy per node on one mesh axis, by integer linear programming.

Every node of the graph gets the strategies its rule allows (passes/rules/sharding.py); the
MILP picks one per node minimising

    sum  compute time of the node under its strategy (forward + backward, times `work`)
  + sum  resharding time where a producer's output placement differs from what a consumer
         strategy needs (forward collective + its backward conjugate),
  + sum  gradient all-reduces of replicated tensors consumed where their gradient is partial
         (a replicated input of a strategy whose output is sharded or partial: Megatron's "f"),

subject to the per-device memory limit (model states + saved activations, each divided by
the axis size where sharded). Every (producer, consumer) edge has transport variables
e[i, r] coupling the producer's output placement i with the consumer's requirement r
(row sums X_i, column sums Y_r: the marginal formulation, whose LP bound is tight — the
weaker h >= X + Y - 1 took HiGHS 10 s on a two-layer Llama, this takes 0.4 s); a conversion
is paid once per (producer, target) through h >= e over its consumers, as the rewrite
shares the collective (its time: `cost.placements.conversion_time`). `ShardSolution.recounted_comm_s` recounts the chosen plan's
communication conversion by conversion, as a check on the formulation. Identical
layers (same ops, shapes and strategies, found by module path `layers.N`) share their
variables, so an 80-layer model is solved as one layer plus what surrounds it, and each
shared term is weighted by how many layers use it. HiGHS (scipy.optimize.milp) solves it
and reports the proven relative gap.

Megatron's column/row split, sequence parallelism (all-gather / reduce-scatter pairs) and
Ulysses-style head/sequence all-to-alls are outcomes of this program, not cases in it.

Outputs are required replicated (the runtime gathers them), except the vocabulary head's
logits under `loss_parallel` (`search.shard_loss`): Shard(last dim), with the vocab-parallel
loss's all-reduces in that strategy's cost (`ShardSolution.loss_s`, in compute_s, not comm_s).

Sizes are evaluated at the size symbols' example values by `search.sym_size` (torch's own size
functions too: an MoE capacity `CeilToInt(FloatTrueDiv(...))`).

Reads node.meta["autopar"] and node.meta["val"]; writes nothing (the solution is returned
and goes into the Plan: `plan.strategies[axis]`).
"""
from __future__ import annotations

import functools
import re
import time
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
import torch.fx as fx
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import coo_matrix

from autopar.cost import analyze, load_profile
from autopar.cost.comm import axis_links
from autopar.cost.estimate import NodeTimer
from autopar.cost.symbolic import evaluate
from autopar.passes import ir
from autopar.passes.rules.sharding import (Strategy, is_tensor, is_tuple, partial_grad, requires_grad_nodes,
                                           strategies_for, value_shape)
from autopar.cost.placements import Placement, R, Replicate, Shard, conversion_time
from autopar.search.shard_loss import loss_seconds, vocab_output
from autopar.search.sym_size import numel

_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")
INF = float("inf")


@dataclass
class ShardSolution:
    """The chosen strategy of every node on one axis, and what the solver proved."""

    axis: str
    k: int
    chosen: dict[fx.Node, Strategy]
    keys: dict[fx.Node, str]
    objective_s: float
    compute_s: float
    comm_s: float
    gap: float | None
    status: str
    seconds: float
    n_vars: int
    n_constraints: int
    n_nodes: int
    n_groups: int
    repeated_layers: int
    memory_bytes: float
    unruled: Counter = field(default_factory=Counter)
    excluded: list[str] = field(default_factory=list)
    recounted_comm_s: float = 0.0  # communication of the chosen plan counted conversion by conversion
    loss_s: float = 0.0  # the vocab-parallel loss's all-reduces (loss_parallel), inside compute_s

    def strategies(self) -> dict[str, str]:
        """node key -> strategy text, for `plan.strategies[axis]`."""
        return {self.keys[n]: str(s) for n, s in self.chosen.items()}

    def param_placements(self) -> dict[str, Placement]:
        return {str(n.target): s.out for n, s in self.chosen.items()
                if n.op == "get_attr" and s.out is not None and not isinstance(s.out, Replicate)}

    def summary(self) -> str:
        gap = "n/a" if self.gap is None else f"{self.gap:.2%}"
        return (f"sharding search on {self.axis}={self.k}: {self.status}, gap {gap}, {self.n_nodes} nodes in "
                f"{self.n_groups} variable groups ({self.repeated_layers} repeated layers solved once), "
                f"{self.n_vars} variables, {self.n_constraints} constraints, {self.seconds:.2f} s; predicted "
                f"{self.compute_s * 1e3:.3f} ms compute + {self.comm_s * 1e3:.3f} ms communication per step")


def layer_of(module: str) -> str | None:
    m = _LAYER.match(module or "")
    return m.group(1) if m else None


def solve_sharding(gm: fx.GraphModule, axis: str, k: int, *, mesh: Mapping[str, int] | None = None,
                   hardware: str = "h100-sxm", memory_limit: float | None = None, state_bytes_per_param: float = 16.0,
                   param_pins: Mapping[str, Placement] | None = None, node_pins: Mapping[str, Placement] | None = None,
                   time_limit_s: float = 60.0, tie_layers: bool = True, sizes: Mapping[str, int] | None = None,
                   gc: Any = None, loss_parallel: bool = False) -> ShardSolution:
    """Choose a strategy for every node of `gm` on mesh axis `axis` of size `k`.

    memory_limit: bytes per device for model states (`state_bytes_per_param` bytes per element
    of a parameter: 16 for fp32 AdamW) plus saved activations; None: no limit.
    param_pins / node_pins: placements fixed by the user (parameter name / node key -> placement).
    gc: `analyze(gm, hardware)` when the caller has it already (the joint planner solves one
        graph for several axis sizes); None: analysed here.
    loss_parallel: the vocabulary head's logits leave Shard(last dim) (module docstring).
    """
    t0 = time.perf_counter()
    mesh = dict(mesh or {axis: k})
    hw = load_profile(hardware)
    if k < 2:
        raise ValueError(f"axis {axis!r} has size {k}; sharding needs at least 2 ranks")
    link = axis_links(hw.with_nodes(-(-int(np.prod(list(mesh.values()))) // hw.gpus_per_node))
                      if np.prod(list(mesh.values())) > hw.world_size else hw, mesh)[axis]
    launch = hw.kernel_overhead_s
    facts = (facts_for(gm, gc) if gc is not None else None) or GraphFacts(gm)  # shared by one analysis' solves
    gc = gc if gc is not None else analyze(gm, hw)
    values = gc.values(sizes)
    timer = NodeTimer(hw, values)
    by_name = {nc.name: nc for nc in gc.nodes}
    sym_vals = _symbol_values(gm, gc, values)
    keys, rg = facts.keys, facts.rg
    param_pins, node_pins = dict(param_pins or {}), dict(node_pins or {})
    loss_s, loss_node = 0.0, None

    @functools.lru_cache(maxsize=None)
    def conv(src, dst, pg, nbytes):  # conversion_time with this solve's link, memoised
        return conversion_time(src, dst, pg, nbytes, link, k, launch)

    # --- strategies per node ------------------------------------------------------------------
    nodes: list[fx.Node] = []
    strats: dict[fx.Node, list[Strategy]] = {}
    unruled, excluded, rule_memo = Counter(), [], {}
    forbidden = facts.forbidden(axis)
    desc_memo, sig_memo = facts.desc_memo.setdefault(axis, {}), facts.sig_memo.setdefault(axis, {})
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr") and not is_tensor(n):
            continue
        if n.op == "placeholder":
            strats[n] = [Strategy((), R, 0.0)]
        elif n.op == "get_attr":
            shape = value_shape(n)
            strats[n] = [Strategy((), R, 0.0)] + [Strategy((), Shard(d), 0.0) for d in range(len(shape))
                                                  if isinstance(shape[d], int) and shape[d] % k == 0 and shape[d] >= k]
        elif n.op == "output":
            ins = [a for a in n.all_input_nodes if is_tensor(a)]
            strats[n] = [Strategy(tuple(R for _ in ins), None, 0.0)]
            head = vocab_output(gm, ins, k) if loss_parallel else None
            if head is not None:  # the logits stay vocab-sharded; the loss's all-reduces replace their gather
                j, a = head
                loss_s, loss_node = loss_seconds(a, facts.nbytes(a, sym_vals), link), n
                last = Shard(a.meta["val"].dim() - 1)
                strats[n] = [Strategy(tuple(last if i == j else R for i in range(len(ins))), None, 0.0)]
        elif n.op == "call_function":
            if not is_tensor(n) and not any(is_tensor(a) for a in n.all_input_nodes):
                continue
            # identical calls (the same op on the same shapes and arguments: the blocks of a
            # deep model) have the same strategies; the rule runs once per distinct call
            sig = sig_memo[n] if n in sig_memo else sig_memo.setdefault(n, _call_signature(n, forbidden, desc_memo))
            hit = rule_memo.get(sig) if sig is not None else None
            if hit is None:
                v = strategies_for(n, axis, k, forbidden)
                hit = (v.op, v.unruled, list(v.excluded), v.strategies, n.name)
                if sig is not None:
                    rule_memo[sig] = hit
                excluded += v.excluded
            else:  # the same reasons, named after this node
                excluded += [e.replace(f"{hit[4]}:", f"{n.name}:", 1) for e in hit[2]]
            op, was_unruled, _exc, strats[n], _first = hit
            if was_unruled:
                unruled[op] += 1
        else:
            continue
        key = keys.get(n)
        pin = param_pins.get(str(n.target)) if n.op == "get_attr" else node_pins.get(key)
        if pin is not None:
            keep = [s for s in strats[n] if s.out == pin]
            if not keep:
                raise ValueError(f"pinned placement {pin} of {key} is not valid here; valid: "
                                 f"{sorted({str(s.out) for s in strats[n]})}")
            strats[n] = keep
        nodes.append(n)
    inputs_of = {n: facts.inputs(n) for n in nodes}
    for n in nodes:
        for a in inputs_of[n]:
            if a not in strats:
                raise RuntimeError(f"sharding search: input {a.format_node()} of {n.name} has no strategies")

    # --- identical layers share variables --------------------------------------------------------
    gid, n_rep = _groups(nodes, strats, inputs_of, tie_layers, facts)
    # one tensor read under several names (tied embedding and LM head) has one placement
    owner: dict[int, Any] = {}
    for n in nodes:
        if n.op == "get_attr":
            t = _fetch(gm, str(n.target))
            if t is not None:
                gid[n] = owner.setdefault(id(t), gid[n])
    group_strats: dict[Any, list[Strategy]] = {}
    count: Counter = Counter()
    for n in nodes:
        group_strats.setdefault(gid[n], strats[n])
        count[gid[n]] += 1
    base: dict[Any, int] = {}
    nv = 0
    for g, ss in group_strats.items():
        base[g] = nv
        nv += len(ss)
    n_x = nv
    cost = defaultdict(float)
    mem = defaultdict(float)
    rows: list[tuple[list[int], list[float], float, float]] = []

    def x(g, i):
        return base[g] + i

    # one-hot per group
    for g, ss in group_strats.items():
        rows.append(([x(g, i) for i in range(len(ss))], [1.0] * len(ss), 1.0, 1.0))

    # compute and memory
    done_groups: set = set()
    for n in nodes:
        g = gid[n]
        if g in done_groups:
            continue
        done_groups.add(g)
        mult = count[g]
        nc = by_name.get(n.name)
        full = sum(timer.node(nc)) if nc is not None else 0.0
        saved = sum(evaluate(nb, values) for _k, nb, tag in nc.saved if tag != "state") if nc is not None else 0.0
        for i, s in enumerate(group_strats[g]):
            cost[x(g, i)] += mult * full * s.work
            if n.op == "get_attr" and n in rg:
                elems = numel(value_shape(n), sym_vals)
                mem[x(g, i)] += mult * elems * state_bytes_per_param / (k if isinstance(s.out, Shard) else 1)
            elif s.out is not None:
                mem[x(g, i)] += mult * saved * (s.work if s.work > 0 else 1.0)

    if loss_node is not None:  # a constant of the one output strategy, kept in the objective
        cost[x(gid[loss_node], 0)] += loss_s

    # resharding. For every (producer, consumer) edge, transport variables e[i, r] >= 0 couple
    # the producer's output placement i with the consumer's requirement r (sum over r = X_i,
    # sum over i = Y_r: the tight "marginal" formulation, whose LP relaxation is far stronger
    # than h >= X + Y - 1); a conversion i -> r is paid once per producer through
    # h[u, i, r] >= e[i, r] for every consumer edge, as the rewrite shares it.
    h_cost: dict[tuple, float] = {}
    h_index: dict[tuple, int] = {}
    comm_terms: list[tuple[int, float]] = []
    seen_edges: set = set()
    ub_zero: list[int] = []
    repeat: dict[tuple, list] = {}
    for u in nodes:
        cons = [v for v in u.users if v in inputs_of and u in inputs_of[v]]
        if not cons:
            continue
        gu = gid[u]
        nbytes = facts.nbytes(u, sym_vals)
        # a producer of a repeated layer whose consumers are the same groups as an earlier one's
        # adds the same conversion costs (the rows and variables exist already): reuse them
        rkey = (gu, frozenset((gid[v], inputs_of[v].index(u)) for v in cons), nbytes, u in rg)
        again = repeat.get(rkey)
        if again is not None:
            for sig, c in again:
                h_cost[sig] += c
            continue
        outs: dict[Placement, list[int]] = defaultdict(list)
        for i, s in enumerate(group_strats[gu]):
            outs[s.out].append(x(gu, i))
        edge_reqs: dict[Any, dict[tuple, list[int]]] = {}
        for v in cons:
            gv = gid[v]
            j = inputs_of[v].index(u)
            per: dict[tuple, list[int]] = defaultdict(list)
            for i, s in enumerate(group_strats[gv]):
                p = s.ins[j]
                per[(p, partial_grad(s, p, u, rg) if p is not None else False)].append(x(gv, i))
            edge_reqs[(gv, j)] = per
        consumer_sig = frozenset(edge_reqs)
        u_tuple = is_tuple(u)
        for (gv, j), per in edge_reqs.items():
            costs = {(src, r): (0.0 if r[0] is None else
                                INF if u_tuple and (src != r[0] or r[1]) else
                                conv(src, r[0], r[1], nbytes))
                     for src in outs for r in per}
            if all(c == 0.0 for c in costs.values()):
                continue
            first = (gu, gv, j) not in seen_edges
            seen_edges.add((gu, gv, j))
            if first:
                evar = {}
                for key in costs:
                    evar[key] = nv
                    nv += 1
                for src, xs_u in outs.items():
                    cols = [evar[(src, r)] for r in per]
                    rows.append((cols + xs_u, [1.0] * len(cols) + [-1.0] * len(xs_u), 0.0, 0.0))
                for r, ys in per.items():
                    cols = [evar[(src, r)] for src in outs]
                    rows.append((cols + ys, [1.0] * len(cols) + [-1.0] * len(ys), 0.0, 0.0))
            for (src, r), c in costs.items():
                if c == 0.0:
                    continue
                if c == INF:
                    if first:
                        ub_zero.append(evar[(src, r)])
                    continue
                sig = (gu, str(src), str(r[0]), r[1], consumer_sig)
                if sig not in h_index:
                    h_index[sig] = nv
                    nv += 1
                    h_cost[sig] = 0.0
                if first:
                    rows.append(([evar[(src, r)], h_index[sig]], [1.0, -1.0], -np.inf, 0.0))
        conversions: dict[tuple, tuple] = {}  # each conversion of u's value once, shared by its consumers
        for per in edge_reqs.values():
            for src in outs:
                for r in per:
                    conversions.setdefault((gu, str(src), str(r[0]), r[1], consumer_sig), (src, r[0], r[1]))
        added = []
        for sig, (src, dst, pg) in conversions.items():
            if sig in h_index:
                c = conv(src, dst, pg, nbytes)
                h_cost[sig] += c
                added.append((sig, c))
        repeat[rkey] = added
    for sig, hv in h_index.items():
        cost[hv] += h_cost.get(sig, 0.0)
        comm_terms.append((hv, h_cost.get(sig, 0.0)))
    # rows were added once per consumer group; multiplicity is in h_cost (one add per producer)
    if memory_limit is not None:
        idx = [i for i in range(n_x) if mem[i]]
        rows.append((idx, [mem[i] for i in idx], -np.inf, float(memory_limit)))

    # --- solve ----------------------------------------------------------------------------------
    scale = 1e6  # microseconds keep HiGHS's tolerances meaningful
    c_vec = np.zeros(nv)
    for i, v in cost.items():
        c_vec[i] = v * scale
    r_idx, c_idx, vals, lb, ub = [], [], [], [], []
    for r, (cols, coefs, lo, hi) in enumerate(rows):
        r_idx += [r] * len(cols)
        c_idx += cols
        vals += coefs
        lb.append(lo)
        ub.append(hi)
    A = coo_matrix((vals, (r_idx, c_idx)), shape=(len(rows), nv)).tocsr()
    integrality = np.zeros(nv)
    integrality[:n_x] = 1
    upper = np.ones(nv)
    upper[ub_zero] = 0.0
    res = milp(c_vec, integrality=integrality, bounds=(np.zeros(nv), upper),
               constraints=LinearConstraint(A, np.array(lb), np.array(ub)),
               options={"time_limit": time_limit_s, "disp": False, "mip_rel_gap": 1e-6})
    if res.x is None:
        why = "the memory limit cannot be met by any sharding" if memory_limit is not None else res.message
        raise ValueError(f"sharding search on {axis}={k} found no plan: {why} "
                         f"(limit {memory_limit} bytes; status {res.status}: {res.message})")
    sol = res.x
    chosen: dict[fx.Node, Strategy] = {}
    for n in nodes:
        g = gid[n]
        ss = group_strats[g]
        i = int(np.argmax([sol[x(g, j)] for j in range(len(ss))]))
        chosen[n] = ss[i]
    comm_s = sum(c * sol[hv] for hv, c in comm_terms if c != INF)
    total = float(c_vec @ sol) / scale
    memory = sum(mem[i] * sol[i] for i in range(n_x))
    check_comm = _recount_comm(nodes, chosen, inputs_of, rg, conv, lambda a: facts.nbytes(a, sym_vals))
    gap = getattr(res, "mip_gap", None)
    status = "optimal" if res.status == 0 else f"stopped ({res.message})"
    return ShardSolution(axis=axis, k=k, chosen=chosen, keys={n: keys[n] for n in chosen}, objective_s=total,
                         compute_s=total - comm_s, comm_s=comm_s, gap=None if gap is None else float(gap),
                         status=status, seconds=time.perf_counter() - t0, n_vars=nv, n_constraints=len(rows),
                         n_nodes=len(nodes), n_groups=len(group_strats), repeated_layers=n_rep, memory_bytes=memory,
                         unruled=unruled, excluded=excluded, recounted_comm_s=check_comm, loss_s=loss_s)


# --- helpers ------------------------------------------------------------------------------------
def _recount_comm(nodes, chosen, inputs_of, rg, conv, nbytes) -> float:
    """Communication seconds of a chosen plan, counted as the rewrite inserts conversions: one
    per (producer, target placement, partial gradient), shared by the consumers."""
    seen: set = set()
    total = 0.0
    for v in nodes:
        s = chosen[v]
        for a, p in zip(inputs_of[v], s.ins):
            if p is None:
                continue
            pg = partial_grad(s, p, a, rg)
            key = (a, str(p), pg)
            if key in seen:
                continue
            seen.add(key)
            total += conv(chosen[a].out, p, pg, nbytes(a))
    return total


def _groups(nodes, strats, inputs_of, tie: bool, facts: "GraphFacts | None" = None):
    """node -> variable group; identical layers map position-by-position onto the first."""
    gid = {n: ("node", n.name) for n in nodes}
    if not tie:
        return gid, 0
    layers, shapes = (facts or GraphFacts(None)).layers(nodes, inputs_of)
    reps: dict[tuple, str] = {}
    n_rep = 0
    strs: dict[int, tuple] = {}  # str of a strategy list, once per list (equal calls share one)
    for lay, members in layers.items():
        pos = {n: i for i, n in enumerate(members)}
        sig = []
        for n, (op, tgt, shape, ins) in zip(members, shapes[lay]):
            ss = strats[n]
            st = strs.get(id(ss))
            if st is None or st[0] is not ss:
                st = strs[id(ss)] = (ss, tuple(str(s) for s in ss))
            sig.append((op, tgt, shape, st[1], ins))
        sig = tuple(sig)
        rep = reps.setdefault(sig, lay)
        if rep != lay:
            n_rep += 1
        for n in members:
            gid[n] = ("layer", rep, pos[n])
    return gid, n_rep


class GraphFacts:
    """What the ILP reads of one graph that no axis size changes (node keys, nodes needing a
    gradient, per axis the dims sharded elsewhere and each call's signature, tensor inputs, bytes,
    the layers' descriptions), found once for the planner's solves for tp = 2, 4, 8 (`facts_for`):
    a third of each solve on a 61-layer MoE. Checked equal to fresh solves in
    tests/unit/test_plan_speed_invariance.py."""

    def __init__(self, gm: fx.GraphModule | None):
        self.gm, self.n_nodes = gm, (len(gm.graph.nodes) if gm is not None else 0)
        self.keys = ir.node_keys(gm) if gm is not None else {}
        self.rg = requires_grad_nodes(gm) if gm is not None else set()
        self.desc_memo: dict[str, dict] = {}  # per axis, as the solve's own memos
        self.sig_memo: dict[str, dict] = {}
        self._forbidden: dict[str, dict] = {}
        self._inputs, self._nbytes, self._layers = {}, {}, None

    def forbidden(self, axis: str) -> dict[fx.Node, set[int]]:
        if axis not in self._forbidden:
            self._forbidden[axis] = _forbidden(self.gm, axis)
        return self._forbidden[axis]

    def inputs(self, n: fx.Node) -> list[fx.Node]:
        if n not in self._inputs:
            self._inputs[n] = [a for a in n.all_input_nodes if is_tensor(a)]
        return self._inputs[n]

    def nbytes(self, n: fx.Node, sym_vals) -> float:
        memo = self._nbytes.setdefault(tuple(sorted(sym_vals.items())), {})
        if n not in memo:
            memo[n] = node_nbytes(n, sym_vals)
        return memo[n]

    def layers(self, nodes: list[fx.Node], inputs_of) -> tuple[dict[str, list[fx.Node]], dict[str, list[tuple]]]:
        """The nodes of each repeated layer (`layers.N`) and per node (op, target, shape, inputs
        by position in the layer or by shape): the layer signature less the strategies."""
        if self._layers is not None and self._layers[0] == nodes:
            return self._layers[1], self._layers[2]
        layers: dict[str, list[fx.Node]] = {}
        for n in nodes:
            lay = layer_of(ir.info(n).module) if ir.get_info(n) and n.op not in ("placeholder", "output") else None
            if lay is not None:
                layers.setdefault(lay, []).append(n)
        shapes: dict[str, list[tuple]] = {}
        for lay, members in layers.items():
            pos = {n: i for i, n in enumerate(members)}
            shapes[lay] = [(n.op, str(n.target) if n.op != "get_attr" else "get_attr:" + str(n.target).split(".")[-1],
                            str(value_shape(n)),
                            tuple(("L", pos[a]) if a in pos else ("X", str(value_shape(a))) for a in inputs_of[n]))
                           for n in members]
        self._layers = (list(nodes), layers, shapes)
        return layers, shapes


_FACTS: dict[int, tuple[Any, GraphFacts]] = {}


def facts_for(gm: fx.GraphModule, gc: Any) -> GraphFacts | None:
    """The `GraphFacts` of `gm` for every solve given the same analysis `gc` (one `cost.analyze`
    of one state of the graph: a rewritten graph is analysed anew, so never meets stale facts)."""
    hit = _FACTS.get(id(gc))
    if hit is not None and hit[0]() is gc and hit[1].gm is gm and hit[1].n_nodes == len(gm.graph.nodes):
        return hit[1]
    try:
        ref = weakref.ref(gc, lambda _r, key=id(gc): _FACTS.pop(key, None))
    except TypeError:  # no weak reference to it: nothing shared
        return None
    _FACTS[id(gc)] = (ref, GraphFacts(gm))
    return _FACTS[id(gc)][1]


def _fetch(gm: fx.GraphModule, target: str):
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _forbidden(gm: fx.GraphModule, axis: str) -> dict[fx.Node, set[int]]:
    """Dims already sharded on another mesh axis (the batch on dp) stay whole on this one."""
    out: dict[fx.Node, set[int]] = {}
    for n in gm.graph.nodes:
        i = ir.get_info(n)
        if i is None or i.layout is None:
            continue
        dims = {p.dim for a, p in i.layout.axes if a != axis and isinstance(p, Shard)}
        if dims:
            out[n] = dims
    return out


def _symbol_values(gm, gc, values) -> dict[str, int]:
    """Example value of every size symbol of the graph, by its name in NodeInfo shapes ("s0")."""
    out: dict[str, int] = {}
    for orig, renamed in gc.symbols.rename.items():
        if renamed in values:
            out[str(orig)] = int(values[renamed])
    return out


def _call_signature(n: fx.Node, forbidden, memo: dict) -> tuple | None:
    """What a sharding rule can see of a call: the op, its arguments with every node replaced
    by (position among the node's tensor inputs, shape, and dims sharded on other axes), the
    output's shape and whether it is a tuple. Equal signatures give equal strategies.
    None when an argument is something the signature cannot describe (then the rule runs)."""
    pos: dict[fx.Node, int] = {}

    def enc(a):
        if isinstance(a, fx.Node):
            if a not in pos:
                pos[a] = len(pos)
            return ("N", pos[a], _describe(a, forbidden, memo))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(enc(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, enc(v)) for k, v in sorted(a.items())))
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return (type(a).__name__, repr(a))
        raise _Unhashable

    try:
        return (str(n.target), enc(n.args), enc(n.kwargs), _describe(n, forbidden, memo), is_tuple(n))
    except _Unhashable:
        return None


def _describe(a: fx.Node, forbidden, memo: dict) -> tuple:
    d = memo.get(a)
    if d is None:
        info = ir.get_info(a)
        d = memo[a] = (str(value_shape(a)), info.dtype if info is not None else None,
                       tuple(sorted(forbidden.get(a, ()))), is_tensor(a))
    return d


class _Unhashable(Exception):
    pass


def node_nbytes(n: fx.Node, sym_vals) -> float:
    """Bytes of a node's value with the size symbols at `sym_vals` (fp32 when its dtype is unknown)."""
    i = ir.get_info(n)
    item = 4
    if i is not None and i.dtype:
        import torch  # noqa: PLC0415

        item = getattr(torch, i.dtype).itemsize
    return numel(value_shape(n), sym_vals) * item


__all__ = ["solve_sharding", "ShardSolution", "conversion_time", "requires_grad_nodes", "partial_grad", "layer_of",
           "node_nbytes"]
