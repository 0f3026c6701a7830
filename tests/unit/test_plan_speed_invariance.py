"""The planner's fast paths give the answers of the plain ones (issue 25: planning DeepSeek-V3
671B for 256 GPUs in under a minute without changing the plan).

MoE detection walks the graph from each router by users, in graph order, instead of scanning
every later node (`search/expert_graph.py`), bounds a router's ancestor search by the first
linear map that could be its gate (`expert_props.RouterIndex`), keeps the descendants of the
dispatches along its walk, and memoises symbolic size comparisons. Each is checked here against
the plain walk it replaces (written out in this file) on a few-layer DeepSeek-V3-like model
(group-limited routing: a top-k over expert groups that is not a router) captured on meta, and
on the reference slots-idiom MoE; detection as a whole is run a second time with the plain walks
patched in and must give the same blocks. The sharding ILP shares what it reads of a graph
across the planner's solves for several tp degrees (`shard_ilp.GraphFacts`); solves that share
them must equal solves that find their own, and another analysis of the graph gets new facts.
"""
import functools

import pytest
import torch

import autopar
from autopar.models import get
from autopar.search import expert_detect, expert_graph
from autopar.search.expert_detect import detect_moe
from autopar.search.expert_graph import MoEGraph
from autopar.search.expert_props import base_name, find_router


@functools.lru_cache(maxsize=None)
def _deepseek():
    """A 4-layer DeepSeek-V3 (first layer dense; 16 routed experts in 4 groups, top 4 in 2 groups,
    one shared expert, MLA attention) on meta, captured at batch 2 x 16 tokens."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=64,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_cache=False)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    return autopar.capture(model, (torch.empty(2, 16, dtype=torch.long, device="meta"),))


@functools.lru_cache(maxsize=None)
def _slots():
    spec = get("moe-tiny")
    torch.manual_seed(0)
    return autopar.capture(spec.build(), spec.example_batch(2)[0])


GRAPHS = {"deepseek-v3-like": _deepseek, "moe-tiny": _slots}


# --- the plain walks (as expert_graph.py had them before issue 25) --------------------------------
def plain_closure(g: MoEGraph, seeds) -> set:
    out = set(seeds)
    start = min(g.order[s] for s in seeds)
    for n in g.nodes[start:]:
        if n in out or n.op != "call_function":
            continue
        ins = g.tin(n)
        if ins and any(a in out for a in ins) and all(a in out or not g.dep[a] for a in ins):
            out.add(n)
    return out


def plain_descendants(g: MoEGraph, seeds, stop=None) -> set:
    out = set(seeds)
    start = min(g.order[s] for s in seeds)
    for n in g.nodes[start:]:
        if any(a in out for a in n.all_input_nodes):
            out.add(n)
    if stop is not None:
        out = {n for n in out if g.order[n] <= g.order[stop]}
    return out


def plain_ancestors(g: MoEGraph, n, within=None) -> set:
    out, stack = set(), [n]
    while stack:
        m = stack.pop()
        for a in m.all_input_nodes:
            if a not in out:
                out.add(a)
                stack.append(a)
    # the region's use: `within` holds descendants of a set, closed along every path to n
    return out if within is None else out & within


def _topks(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and base_name(n) == "aten.topk"]


@pytest.mark.parametrize("name", list(GRAPHS))
def test_walks_from_each_router_equal_the_plain_scans(name):
    gm = GRAPHS[name]()
    g = MoEGraph(gm)
    tops = _topks(gm)
    assert tops
    for t in tops:
        idx = next(u for u in t.users if u.args[1] == 1)
        assert g.closure([idx]) == plain_closure(g, [idx])
        assert g.closure([t]) == plain_closure(g, [t])
        assert g.descendants([idx]) == plain_descendants(g, [idx])
        later = g.nodes[min(len(g.nodes) - 1, g.order[idx] + 40)]
        assert g.descendants([idx], stop=later) == plain_descendants(g, [idx], stop=later)
        assert g.ancestors(t) == plain_ancestors(g, t)


def test_ancestors_within_a_region_are_those_reached_through_it():
    gm = _deepseek()
    g = MoEGraph(gm)
    for b in detect_moe(gm):
        by_key = {k: n for n, k in g.keys.items()}
        gathers = [by_key[d["node"]] for d in b.gathers]
        cdata = by_key[b.combine_input]
        below = g.descendants(gathers, stop=cdata)
        # the plain region: descendants of the gathers that are ancestors of cdata (or cdata)
        plain = (plain_descendants(g, gathers) & (plain_ancestors(g, cdata) | {cdata})) - set(gathers)
        fast = (g.ancestors(cdata, within=below) | ({cdata} & below)) - set(gathers)
        assert fast == plain and len(fast) > 5


@pytest.mark.parametrize("name", list(GRAPHS))
def test_router_search_bounded_by_the_router_index_finds_what_the_full_walk_finds(name):
    gm = GRAPHS[name]()
    g = MoEGraph(gm)
    found = [(t.name, find_router(t), g.router(t)) for t in _topks(gm)]
    assert all(plain == fast for _n, plain, fast in found), [(n, p, f) for n, p, f in found if p != f]
    routers = [n for n, plain, _f in found if plain is not None]
    assert routers
    if name == "deepseek-v3-like":  # 3 MoE layers, each a router and two top-ks of the groups that are not
        assert len(routers) == 3 and len(found) == 9


def test_memoised_size_comparison_equals_sympy_each_time():
    pairs = [("2*s0", "s0*2"), ("s0", "s1"), (4, 4), (4, "4"), ("8*s72", 8), ("s0*s1", "s1*s0")]
    for a, b in pairs * 2:
        assert expert_graph.same_size(a, b) == expert_graph._same_size.__wrapped__(a, b)
    assert expert_graph.same_size("2*s0", "s0*2") and not expert_graph.same_size("s0", "s1")


@pytest.mark.parametrize("name", list(GRAPHS))
def test_detection_with_the_plain_walks_gives_the_same_blocks(name, monkeypatch):
    gm = GRAPHS[name]()
    fast = [b.to_json() for b in detect_moe(gm)]
    assert fast
    monkeypatch.setattr(MoEGraph, "closure", plain_closure)
    monkeypatch.setattr(MoEGraph, "descendants", plain_descendants)
    monkeypatch.setattr(MoEGraph, "ancestors", plain_ancestors)
    monkeypatch.setattr(MoEGraph, "router", lambda self, t: find_router(t))
    monkeypatch.setattr(expert_graph, "same_size", expert_graph._same_size.__wrapped__)
    monkeypatch.setattr(expert_detect, "_same", expert_graph._same_size.__wrapped__)
    plain = [b.to_json() for b in detect_moe(gm)]
    assert fast == plain
    if name == "deepseek-v3-like":
        assert [b["idiom"] for b in fast] == ["sorted"] * 3 and fast[0]["n_experts"] == 16


def _answer(sol):
    return ({sol.keys[n]: str(s) for n, s in sol.chosen.items()}, round(sol.objective_s, 12), sol.n_vars,
            sol.n_constraints, sol.n_groups, sol.repeated_layers, round(sol.recounted_comm_s, 12))


def test_sharding_solves_sharing_one_graphs_facts_equal_fresh_solves(monkeypatch):
    from autopar.cost import analyze
    from autopar.search import shard_ilp

    gm = _deepseek()
    gc = analyze(gm, "h100-sxm")
    # tp=2 fills the facts, tp=4 and tp=2 again read them (the planner's order)
    shared = [shard_ilp.solve_sharding(gm, "tp", k, mesh={"dp": 8 // k, "tp": k}, gc=gc) for k in (2, 4, 2)]
    assert shard_ilp.facts_for(gm, gc) is shard_ilp.facts_for(gm, gc)
    monkeypatch.setattr(shard_ilp, "facts_for", lambda gm, gc: None)  # every solve finds its own
    fresh = [shard_ilp.solve_sharding(gm, "tp", k, mesh={"dp": 8 // k, "tp": k}, gc=gc) for k in (2, 4)]
    assert _answer(shared[0]) == _answer(fresh[0]) == _answer(shared[2])
    assert _answer(shared[1]) == _answer(fresh[1])
    assert shared[1].repeated_layers >= 1  # the MoE layers are tied: the facts' layer table is used


def test_facts_of_a_changed_graph_are_not_reused():
    from autopar.cost import analyze
    from autopar.search import shard_ilp

    gm = _slots()
    gc = analyze(gm, "cpu-gloo")
    f = shard_ilp.facts_for(gm, gc)
    assert shard_ilp.facts_for(gm, gc) is f
    assert shard_ilp.facts_for(gm, analyze(gm, "cpu-gloo")) is not f  # another analysis: new facts
