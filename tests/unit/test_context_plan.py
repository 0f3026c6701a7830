"""Context parallelism without processes: the choice of exchange (search/context.py), the cost
estimate under a cp axis, and the refusals of graphs that cannot run on a chunk of the
sequence (passes/context_positions.py)."""
import pytest
import torch
import torch.nn as nn

from autopar.capture import capture
from autopar.cost import estimate
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.context_positions import check_context_parallel
from autopar.passes.plan import Plan
from autopar.search.context import plan_context

SEQ = 256


def _gpt_graph(heads=4, kv=2, seq=SEQ, batch=2):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, dim=64, n_layers=2, n_heads=heads, n_kv_heads=kv, ffn_dim=128, max_seq_len=seq)
    return capture(GPT(cfg), (torch.zeros(batch, seq, dtype=torch.long),), dynamic_seq=True)


def test_auto_picks_the_cheaper_exchange_and_prices_both():
    gm = _gpt_graph()
    entry = plan_context(gm, {"cp": 2}, "auto", "h100-sxm")
    prices = entry["exposed_s"]
    assert entry["method"] == min(prices, key=lambda m: prices[m] if prices[m] is not None else float("inf"))
    assert entry["attention_calls"] == 2 and entry["layout"] == "zigzag"
    assert all(v is not None and v >= 0 for v in prices.values())
    assert entry["bytes"]["ring"] > 0 and entry["bytes"]["ulysses"] > 0
    assert "ring" in entry["notes"][0] and "ulysses" in entry["notes"][0]


def test_ulysses_needs_heads_that_divide_by_cp():
    gm = _gpt_graph(heads=4, kv=2)
    auto = plan_context(gm, {"cp": 8}, "auto", "h100-sxm")  # 4 heads over 8 ranks: only the ring
    assert auto["method"] == "ring" and auto["exposed_s"]["ulysses"] is None
    assert "not possible" in auto["notes"][0]
    with pytest.raises(ValueError, match="does not divide"):
        plan_context(gm, {"cp": 8}, "ulysses", "h100-sxm")
    with pytest.raises(ValueError, match="context_method"):
        plan_context(gm, {"cp": 2}, "zigzag", "h100-sxm")


def test_cost_estimate_under_cp_holds_a_chunk_of_the_activations_and_reduces_gradients_over_dp_x_cp():
    gm = _gpt_graph(seq=1024)
    one = estimate(gm, Plan(mesh={"dp": 2}, dp_axis="dp"), "h100-sxm")
    plan = Plan(mesh={"dp": 2, "cp": 4}, dp_axis="dp")
    plan.extra["context"] = plan_context(gm, dict(plan.mesh), "ring", "h100-sxm")
    cp = estimate(gm, plan, "h100-sxm")
    ratio = cp.memory["activations"] / one.memory["activations"]
    assert 0.2 < ratio < 0.3, ratio  # a quarter of the tokens (plus per-layer odds and ends)
    assert cp.memory["peak"] < one.memory["peak"]
    reduced_on = {r.axis for r in cp.comm if r.phase == "backward"}
    assert "dp+cp" in reduced_on, reduced_on
    assert any(r.axis == "cp" and r.phase == "attention" for r in cp.comm)


class _Cumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, x):
        return self.emb(x).cumsum(1)


class _Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, x):
        return self.emb(x).mean(1)


@pytest.mark.parametrize("model, words", [(_Cumsum, "scans along the sequence"),
                                          (_Pool, "reduces over the sequence")])
def test_graphs_that_mix_tokens_outside_attention_are_refused_naming_the_node(model, words):
    gm = capture(model(), (torch.zeros(2, 8, dtype=torch.long),), dynamic_seq=True)
    with pytest.raises(ValueError, match=words) as e:
        check_context_parallel(gm)
    assert "node " in str(e.value)


def _moe_graph(capacity_factor=None):
    from autopar.models import MoE, MoEConfig

    torch.manual_seed(0)
    return capture(MoE(MoEConfig.tiny(capacity_factor)), (torch.zeros(2, 16, dtype=torch.long),), dynamic_seq=True)


def test_a_dropless_moe_router_runs_on_a_chunk_and_a_capacity_router_is_refused_with_the_reason():
    # dropless: the queue positions (a cumsum over the tokens) only pick slots of a buffer that
    # holds every token, and the router statistics are averaged over cp by the plan
    check_context_parallel(_moe_graph())
    with pytest.raises(ValueError, match=r"node cumsum .* in layers\.0\.moe scans along the tokens: .*capacity "
                                         r".*depends on every token before them in the whole batch.*"
                                         r"capacity_factor=None"):
        check_context_parallel(_moe_graph(capacity_factor=1.0))


class _RouterScanIntoData(nn.Module):
    """A running count of top-k choices over the tokens added to the activations: it reads
    other tokens' routing, so it stays refused."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.gate = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        h = self.emb(x)  # (B, T, 8)
        B, T, _ = h.shape
        idx = self.gate(h.reshape(B * T, 8)).topk(2, dim=-1).indices  # (B*T, 2)
        pos = (idx.reshape(B * T * 2, 1) == torch.arange(4)).long().cumsum(0)  # (B*T*2, 4)
        return h + pos.to(h.dtype).view(B, T, 8)


def test_a_router_count_that_reaches_the_activations_is_still_refused():
    gm = capture(_RouterScanIntoData(), (torch.zeros(2, 8, dtype=torch.long),), dynamic_seq=True)
    with pytest.raises(ValueError, match=r"node cumsum .* scans along the sequence"):
        check_context_parallel(gm)


def test_the_pass_refuses_router_statistics_the_plan_does_not_average_over_cp():
    from autopar.passes.context_positions import context_positions
    from autopar.passes.pass_manager import PassContext

    plan = Plan(mesh={"cp": 2}, dp_axis=None)
    plan.extra["context"] = {"axis": "cp", "method": "ring"}
    ctx = PassContext(plan=plan, mesh_sizes={"cp": 2}, coords={"cp": 0})
    with pytest.raises(ValueError, match=r"MoE router statistic .* does not average it over the cp ranks"):
        context_positions(_moe_graph(), ctx)


def test_the_planner_proposes_and_plans_ep_with_cp_for_a_dropless_moe():
    # the runtime trains dropless ep x cp (tests/dist/test_moe_context_recompute.py), so the
    # joint planner proposes it (RUNTIME_SUPPORT["cp_with_ep"]) and a pinned one comes out whole
    from autopar.search.plan_cost import PlanCostModel
    from autopar.search.planner import RUNTIME_SUPPORT, candidates, clear_cache, plan_for

    gm = _moe_graph()
    both = {(c.ep, c.cp) for c in candidates(PlanCostModel(gm, "cpu-gloo", 4), 4, {}, RUNTIME_SUPPORT)}
    assert (2, 2) in both, sorted(both)
    clear_cache()
    plan, _ = plan_for(gm, 4, "cpu-gloo", pins={"ep": 2, "cp": 2})
    assert plan.mesh.get("ep") == 2 and plan.mesh.get("cp") == 2
    assert plan.extra["context"]["method"] in ("ring", "ulysses")


def test_a_static_sequence_is_refused_with_how_to_capture_it():
    gm = capture(_Cumsum(), (torch.zeros(2, 8, dtype=torch.long),))
    with pytest.raises(ValueError, match="symbolic"):
        check_context_parallel(gm)
