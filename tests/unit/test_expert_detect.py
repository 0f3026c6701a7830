"""Expert parallelism in one process: detection from the graph's structure, the rewrite at
ep=1 (a local permute / un-permute, no communication) against eager, the dispatcher's
capacity rule against models/moe.py's, and the ep plan priced by `cost.estimate`.

Tolerances: the rewrite computes each expert on exactly its rows instead of on padded slots;
per-row results are the same computation, so outputs and gradients agree to 1e-6.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.build.program import rank_copy
from autopar.models import get
from autopar.models.moe import MoEConfig, MoEFeedForward
from autopar.passes.expert import expert
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.split_batch import split_batch
from autopar.runtime import moe
from autopar.runtime.collectives import set_active_mesh
from autopar.runtime.mesh import Mesh
from autopar.runtime._torch_compat import pytree
from autopar.search.expert import MoEDetectError, detect_moe, plan_experts, router_stats

TOL = 1e-6


@functools.lru_cache(maxsize=None)
def _captured(name: str):
    """moe-tiny / moe-tiny-capacity / gpt-tiny captured once at batch 2 (detection only reads it)."""
    spec = get(name)
    torch.manual_seed(0)
    return autopar.capture(spec.build(), spec.example_batch(2)[0])


def _hf(kind: str, aux: bool = False):
    import transformers

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32, use_cache=False, num_experts_per_tok=2)
    if aux:
        kw.update(output_router_logits=True, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, **kw))
    if kind == "qwen2-moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, **kw))
    if kind == "llama4":  # dense experts: every expert on every token, scaled by scattered top-k scores
        return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, head_dim=16, **kw))
    if kind == "gpt-oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(intermediate_size=32, num_local_experts=4,
                                                                        head_dim=16, sliding_window=8, **kw))
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(intermediate_size=32, num_experts=4,
                                                                  pad_token_id=0, eos_token_id=1, **kw))


class Blob(nn.Module):
    """A mixture of experts with nothing of the reference's names: router `r`, experts `f`
    (Linear-GELU-Linear with biases), no capacity. `mix_rows` makes expert 1 subtract the
    mean over its rows, which no expert-parallel split can reproduce."""

    def __init__(self, D=16, E=4, K=2, mix_rows=False):
        super().__init__()
        self.E, self.K, self.mix_rows = E, K, mix_rows
        self.inp = nn.Linear(D, D)
        self.r = nn.Linear(D, E, bias=False)
        self.f = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(E))

    def forward(self, x):  # (B, D)
        x = self.inp(x)
        N, D = x.shape
        E, K = self.E, self.K
        w, e = self.r(x).softmax(-1).topk(K, -1)
        onehot = (e.reshape(N * K, 1) == torch.arange(E)).long()
        pos = (onehot.cumsum(0) - 1).gather(1, e.reshape(N * K, 1)).view(N, K)
        slot = (e * N + pos).reshape(-1)
        buf = x.new_zeros(E * N, D).index_add(0, slot, x[:, None].expand(N, K, D).reshape(N * K, D)).view(E, N, D)
        outs = []
        for i, f in enumerate(self.f):
            h = f(buf[i])
            outs.append(h - h.mean(0) if self.mix_rows and i == 1 else h)
        out = torch.stack(outs).reshape(E * N, D)
        return (out.index_select(0, slot).view(N, K, D) * w[..., None]).sum(1)


# --- detection -----------------------------------------------------------------------------------
def test_reference_moe_blocks_are_found_with_router_experts_and_combine():
    gm = _captured("moe-tiny")
    blocks = detect_moe(gm)
    assert [b.module for b in blocks] == ["layers.0.moe", "layers.1.moe"]
    b = blocks[0]
    assert (b.idiom, b.n_experts, b.top_k, b.hidden, b.dropless) == ("slots", 4, 2, 64, True)
    assert b.gate == "layers.0.moe.gate.weight" and b.router == "layers.0.moe:topk#0"
    assert len(b.entries) == len(b.exits) == 4 and b.combine.endswith("index_select#0")
    for e in range(4):
        assert {n for n, x in b.expert_params.items() if x == e} == \
            {f"layers.0.moe.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3")}
    assert b.flops_per_row == 2 * 3 * 64 * 128
    assert router_stats(gm, blocks) == ["layers.0.moe:sum#2", "layers.0.moe:mean#0",
                                        "layers.1.moe:sum#2", "layers.1.moe:mean#0"]


def test_capacity_mode_is_found_with_its_capacity_expression():
    gm = _captured("moe-tiny-capacity")
    b = detect_moe(gm)[0]
    assert not b.dropless and b.keep == "layers.0.moe:lt#0"
    cap = {k: n for n, k in autopar.passes.ir.node_keys(gm).items()}[b.capacity]
    assert isinstance(cap.meta["val"], torch.SymInt)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe", "olmoe"])
def test_transformers_moe_blocks_are_found_with_grouped_mm_experts(kind):
    gm = autopar.capture(_hf(kind), (torch.randint(0, 128, (2, 8)),))
    blocks = detect_moe(gm)
    assert [b.module for b in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    b = blocks[0]
    assert (b.idiom, b.n_experts, b.top_k, b.dropless) == ("sorted", 4, 2, True)
    # the grouped parameters only: qwen2-moe's shared expert is dense, not an expert
    assert b.expert_params == {"model.layers.0.mlp.experts.gate_up_proj": "dim0",
                               "model.layers.0.mlp.experts.down_proj": "dim0"}
    assert sorted(g["per"] for g in b.gathers) == ["assignment", "token"]
    assert b.offsets.endswith("cumsum#0") and b.side_row_bytes == 4


def test_gpt_oss_expert_biases_gathered_by_sorted_expert_ids_are_expert_rows():
    """gpt-oss adds per-expert biases after each grouped matmul, gathered by the sorted expert
    ids (`out += bias[expert_ids]`): each gather is a row operand of the experts (row r reads its
    expert's bias) and the biases are expert parameters, sliced over ep like the weights."""
    gm = autopar.capture(_hf("gpt-oss"), (torch.randint(0, 128, (2, 8)),))
    blocks = detect_moe(gm)
    assert [b.module for b in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    b = blocks[0]
    assert (b.idiom, b.n_experts, b.top_k) == ("sorted", 4, 2)
    assert b.expert_params == {f"model.layers.0.mlp.experts.{w}": "dim0"
                               for w in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    assert sorted(d["param"] for d in b.expert_gathers) == ["model.layers.0.mlp.experts.down_proj_bias",
                                                            "model.layers.0.mlp.experts.gate_up_proj_bias"]
    assert all(":index#" in d["node"] for d in b.expert_gathers)


def test_transformers_aux_loss_statistics_are_router_stats():
    gm = autopar.capture(_hf("mixtral", aux=True), (torch.randint(0, 128, (2, 8)),))
    # per layer: the expert counts (histc; transformers 5.17 counts by bincount, then casts to
    # float) and the summed router probabilities
    assert router_stats(gm) in ([":histc#0", ":sum#0", ":histc#1", ":sum#1"], [":to#1", ":sum#0", ":to#4", ":sum#1"])
    gm = autopar.capture(_hf("mixtral"), (torch.randint(0, 128, (2, 8)),))
    assert router_stats(gm) == []  # no aux loss: the histograms feed only the grouped matmul offsets


def test_detection_reads_structure_not_names_and_rejects_experts_that_mix_rows():
    torch.manual_seed(0)
    gm = autopar.capture(Blob(), (torch.randn(6, 16),))
    (b,) = detect_moe(gm)
    assert b.module == "" and b.idiom == "slots" and b.keep is None and b.dropless
    assert set(b.expert_params) == {f"f.{e}.{i}.{w}" for e in range(4) for i in (0, 2) for w in ("weight", "bias")}
    torch.manual_seed(0)
    gm = autopar.capture(Blob(mix_rows=True), (torch.randn(6, 16),))
    with pytest.raises(MoEDetectError, match="expert 1.*not a row-wise op"):
        detect_moe(gm)


def test_dense_model_has_no_moe_and_an_ep_mesh_is_refused():
    gm = _captured("gpt-tiny")
    assert detect_moe(gm) == []
    assert plan_experts(gm, {"dp": 2}) == {}
    with pytest.raises(ValueError, match="no mixture-of-experts block"):
        plan_experts(gm, {"ep": 2})


def test_ep_degree_that_does_not_divide_the_experts_is_refused():
    gm = _captured("moe-tiny")
    with pytest.raises(ValueError, match="4 experts, which do not divide over ep=3"):
        plan_experts(gm, {"ep": 3})


# --- the rewrite at ep=1 against eager ------------------------------------------------------------
def _rewrite_ep1(model, x):
    gm = autopar.capture(model, (x,))
    mesh = Mesh({"ep": 1})
    plan = Plan(mesh={"ep": 1}, dp_axis=None)
    plan.extra["expert"] = plan_experts(gm, mesh)
    set_active_mesh(mesh, rank=0)
    return PassManager([split_batch, expert]).run(rank_copy(gm), PassContext(plan, {"ep": 1}, {"ep": 0})), gm


def _grads(model):
    out = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


@pytest.mark.parametrize("name", ["moe-tiny", "moe-tiny-capacity", "hf-mixtral", "hf-gpt-oss", "blob"])
def test_rewritten_graph_at_ep1_matches_eager_output_and_gradients(name):
    torch.manual_seed(0)
    if name == "hf-mixtral":
        model = _hf("mixtral", aux=True)
        x, y = torch.randint(0, 128, (4, 8)), torch.randint(0, 128, (4, 8))
        loss_fn = lambda o, y: F.cross_entropy(o["logits"].flatten(0, 1), y.flatten()) + o["aux_loss"]  # noqa: E731
    elif name == "hf-gpt-oss":  # expert biases gathered by the local expert ids of the dispatched rows
        model = _hf("gpt-oss")
        x, y = torch.randint(0, 128, (4, 8)), torch.randint(0, 128, (4, 8))
        loss_fn = lambda o, y: F.cross_entropy(o["logits"].flatten(0, 1), y.flatten())  # noqa: E731
    elif name == "blob":
        model, x, y = Blob(), torch.randn(6, 16), torch.randn(6, 16)
        loss_fn = lambda o, y: (o - y).pow(2).mean()  # noqa: E731
    else:
        spec = get(name)
        model = spec.build()
        (x,), y = spec.example_batch(4, generator=torch.Generator().manual_seed(1))
        loss_fn = spec.loss_fn
    local, gm = _rewrite_ep1(model, x)
    code = local.code
    assert "moe_route" in code and "moe_combine" in code and "index_add" not in code
    if name == "hf-gpt-oss":
        assert code.count("moe_local_expert_ids") == 4  # two biases in each of two layers
    spec_out = gm.meta["autopar_out_spec"]
    with moe.recording() as routes:
        out = pytree.tree_unflatten(list(local(x)), spec_out)
    assert routes and all(r.ep == 1 for r in routes)
    ref = model(x)
    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    loss_fn(out, y).backward()
    got = _grads(model)  # the rewritten graph shares the model's parameters
    loss_fn(ref, y).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=TOL, atol=TOL, msg=lambda m: f"{name} grad {k}: {m}")
    if name == "moe-tiny-capacity":
        assert any((~r.keep).any() for r in routes), "the capacity case dropped nothing: it checks nothing"


@pytest.mark.parametrize("name", ["dense-block", "hf-llama4"])
def test_dense_experts_rewritten_at_ep1_match_eager_output_and_gradients(name):
    """Dense experts (every expert on every token, Llama 4) at ep=1: the tokens and scores pass
    through `moe.dense_dispatch`, the sum over experts through `moe.dense_combine` (identities
    without an ep axis), and the rewritten graph computes what eager does."""
    from test_moe_detect_properties import DenseRouted

    torch.manual_seed(0)
    if name == "hf-llama4":
        model = _hf("llama4")
        x, y = torch.randint(0, 128, (4, 8)), torch.randint(0, 128, (4, 8))
        loss_fn = lambda o, y: F.cross_entropy(o["logits"].flatten(0, 1), y.flatten())  # noqa: E731
    else:
        model, x, y = DenseRouted(K=2), torch.randn(6, 8), torch.randn(6, 8)
        loss_fn = lambda o, y: (o - y).pow(2).mean()  # noqa: E731
    local, gm = _rewrite_ep1(model, x)
    assert {b.idiom for b in detect_moe(gm)} == {"dense"}
    code = local.code
    n_blocks = 2 if name == "hf-llama4" else 1
    assert code.count("moe_dense_dispatch(") == 2 * n_blocks and code.count("moe_dense_combine(") == n_blocks
    assert "moe_route" not in code and "[4, 1]" in code  # ep=1 keeps all 4 experts
    out = pytree.tree_unflatten(list(local(x)), gm.meta["autopar_out_spec"])
    ref = model(x)
    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    loss_fn(out, y).backward()
    got = _grads(model)
    loss_fn(ref, y).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=TOL, atol=TOL, msg=lambda m: f"{name} grad {k}: {m}")


def test_dense_experts_rewritten_for_ep2_keep_this_ranks_experts_and_reduce_scatter_the_sum():
    """The rank-1 program of a dense block at ep=2 (built without processes; the collectives run
    in tests/dist/test_moe_families.py): experts 2 and 3 of the weight, the scores' columns 2:4 of
    the gathered (N, E) scores, repeats and views over 2 experts, and the combine over 'ep'."""
    from test_moe_detect_properties import DenseRouted

    torch.manual_seed(0)
    model = DenseRouted(K=2)
    gm = autopar.capture(model, (torch.randn(6, 8),))
    plan = Plan(mesh={"ep": 2}, dp_axis=None)
    plan.extra["expert"] = plan_experts(gm, {"ep": 2})
    mesh = Mesh({"ep": 2})
    set_active_mesh(mesh, rank=1)
    try:
        local = expert(rank_copy(gm), PassContext(plan, {"ep": 2}, {"ep": 1}))
    finally:
        set_active_mesh(None)
    local.recompile()
    torch.testing.assert_close(dict(local.named_parameters())["w"], model.w.detach()[2:4], rtol=0, atol=0)
    code = local.code
    assert "moe_dense_dispatch(x, 'ep')" in code and "aten.slice.Tensor(dense_dispatch_1, 1, 2, 4)" in code
    assert "repeat.default(dense_dispatch, [2, 1])" in code and code.count("[2, -1, 8]") == 2
    assert "moe_dense_combine(sum_1, 'ep')" in code and "grad_scale(w, 0.5)" in code


# --- the dispatcher in one process ----------------------------------------------------------------
def test_dispatch_round_trip_locally_returns_input_and_gradient():
    g = torch.Generator().manual_seed(0)
    N, K, E, D = 9, 2, 4, 3
    idx = torch.rand(N, E, generator=g).topk(K, -1).indices
    r = moe.route(idx, E)
    t = torch.randn(N * K, D, generator=g, requires_grad=True)
    rows = moe.dispatch(t, r, "assignment")
    experts = idx.reshape(-1)[r.order]
    assert torch.equal(experts, experts.sort(stable=True).values)  # grouped by expert
    assert r.local_counts == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    back = moe.combine(rows, r)
    up = torch.randn(N * K, D, generator=g)
    (back * up).sum().backward()
    torch.testing.assert_close(back, t, rtol=0, atol=0)
    torch.testing.assert_close(t.grad, up, rtol=0, atol=0)


def test_capacity_drops_are_those_of_the_reference_routing():
    torch.manual_seed(0)
    for cf in (0.5, 1.0, 1.25):
        ffn = MoEFeedForward(MoEConfig.tiny(capacity_factor=cf))
        x = torch.randn(40, 64)
        ref = ffn.route(x)
        r = moe.route(ref.expert, 4, capacity=ref.capacity)
        assert torch.equal(r.keep, ref.keep), f"cf={cf}"
        assert (~ref.keep).any() or cf > 1
        r2 = moe.route(ref.expert, 4, capacity_factor=cf)
        assert r2.capacity == ref.capacity and torch.equal(r2.keep, ref.keep)


# --- cost ------------------------------------------------------------------------------------------
def test_an_ep_plan_is_priced_by_the_one_cost_model():
    """No second ep time model: the plan entry carries no figure of its own, and `cost.estimate`
    prices the dispatch and combine all-to-alls (and their reverses) at N * K kept rows a rank
    (at most cf * N * K with a capacity), balanced; tests/dist/test_cost_counter_ep.py checks
    them against what the runtime sends."""
    from autopar.cost import estimate

    spec = get("moe-tiny")
    gm = autopar.capture(spec.build(), spec.example_batch(8)[0])  # 8 x 32 tokens: 64 a rank on ep4
    blocks = detect_moe(gm)
    got = {}
    for cf in (None, 0.5):
        plan = Plan(mesh={"dp": 1, "ep": 4})
        plan.extra["expert"] = plan_experts(gm, {"dp": 1, "ep": 4}, capacity_factor=cf)
        assert "predicted" not in plan.extra["expert"]
        got[cf] = estimate(gm, plan, "cpu-gloo", batch_is_global=True).collectives()["all_to_all@ep"]
    row = blocks[0].hidden * 4  # fp32 rows, no side data in the dense-slot idiom
    rows = 64 * blocks[0].top_k
    # per block: dispatch + combine forward, their reverses backward: (sent + received) x 2 rows' bytes
    assert got[None] == {"calls": 4 * len(blocks), "bytes": len(blocks) * (rows + rows) * 2 * row}
    assert got[0.5]["bytes"] == got[None]["bytes"] / 2


def test_plan_entry_is_plain_json_and_round_trips_with_the_plan():
    spec = get("moe-tiny")
    gm = autopar.capture(spec.build(), spec.example_batch(8)[0])
    plan = Plan(mesh={"dp": 2, "ep": 2})
    plan.extra["expert"] = plan_experts(gm, {"dp": 2, "ep": 2})
    back = Plan.from_json(plan.to_json())
    assert back.extra["expert"] == plan.extra["expert"]
    e = back.extra["expert"]
    assert e["tokens_per_rank"] == 8 * 32 / 4 and set(e["blocks"]) == {"layers.0.moe", "layers.1.moe"}
