"""MoE detection by properties on small hand-written modules: a DeepSeek-V3-style router
(sigmoid scores, per-expert correction bias, group-limited top-k, renormalised weights times
a routed scaling factor, router z-loss) with shared experts (with and without their own gate)
after a dense layer is a block; a clamping expert activation is row-wise because clamp's
sharding rule says so; an op that mixes rows, or a top-k that is no router, gets an error
naming the node, the rule and what to do. So do the routings expert parallelism cannot split
(autopar/search/expert_reasons.py): an expert choice by max with sampled noise (PhiMoE), experts
kept opaque (DBRX's loop). Top-k scores scattered into a dense matrix with every expert on every
token (Llama 4) are a dense block (autopar/search/expert_dense.py), refused when an expert op
mixes tokens. (ep parity of the same block: tests/dist/test_moe_families.py.)
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.search.expert import MoEDetectError, detect_moe, plan_experts
from autopar.search.expert_props import row_wise_failure


class SwiGLU(nn.Module):
    def __init__(self, D, H, clamp=False, mix_rows=False):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False), nn.Linear(H, D)
        self.clamp, self.mix_rows = clamp, mix_rows

    def forward(self, x):  # (rows, D)
        g, u = self.gate(x), self.up(x)
        if self.clamp:  # gpt-oss-style limits on the activation's inputs
            g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
        h = F.silu(g) * u
        if self.mix_rows:
            h = torch.cumsum(h, 0)  # each row sums the rows before it
        return self.down(h)


class DeepSeekBlock(nn.Module):
    """Sigmoid router with correction bias and group-limited top-k (G groups, the best TG of
    them, then top-K experts inside), weights renormalised and scaled; shared experts beside
    the routed ones; dropless slots dispatch (a loop over experts)."""

    def __init__(self, D=16, E=8, K=2, G=4, TG=2, clamp=False, shared_gate=False, z_loss=False, mix_expert=None):
        super().__init__()
        self.E, self.K, self.G, self.TG, self.scale, self.z = E, K, G, TG, 2.5, z_loss
        self.router = nn.Linear(D, E, bias=False)
        self.register_buffer("correction", torch.linspace(-0.05, 0.05, E))
        self.experts = nn.ModuleList(SwiGLU(D, 2 * D, clamp, mix_rows=e == mix_expert) for e in range(E))
        self.shared = SwiGLU(D, 2 * D)
        self.shared_gate = nn.Linear(D, 1, bias=False) if shared_gate else None

    def forward(self, x):  # (N, D)
        N, D = x.shape
        E, K, G = self.E, self.K, self.G
        logits = self.router(x)  # (N, E)
        scores = logits.sigmoid()
        choice = scores + self.correction
        group = choice.view(N, G, E // G).topk(2, -1)[0].sum(-1)  # (N, G)
        gmask = torch.zeros_like(group).scatter(1, group.topk(self.TG, -1)[1], 1.0)
        smask = gmask.unsqueeze(-1).expand(N, G, E // G).reshape(N, E)
        e = choice.masked_fill(smask == 0, float("-inf")).topk(K, -1)[1]  # (N, K)
        w = scores.gather(1, e)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale
        onehot = (e.reshape(N * K, 1) == torch.arange(E)).long()
        pos = (onehot.cumsum(0) - 1).gather(1, e.reshape(N * K, 1)).view(N, K)
        slot = (e * N + pos).reshape(-1)
        buf = x.new_zeros(E * N, D).index_add(0, slot, x[:, None].expand(N, K, D).reshape(N * K, D)).view(E, N, D)
        out = torch.stack([f(buf[i]) for i, f in enumerate(self.experts)]).reshape(E * N, D)
        y = (out.index_select(0, slot).view(N, K, D) * w[..., None]).sum(1)
        s = self.shared(x)
        y = y + (s * torch.sigmoid(self.shared_gate(x)) if self.shared_gate is not None else s)
        if self.z:  # router z-loss, returned for the training loss to add (as transformers' aux losses are)
            return y, torch.logsumexp(logits, -1).square().mean()
        return y


class DenseThenMoE(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.dense = SwiGLU(16, 32)  # a dense layer before the first MoE layer
        self.moe = DeepSeekBlock(**kw)

    def forward(self, x):
        x = x + self.dense(x)
        y = self.moe(x)
        return (x + y[0], y[1]) if isinstance(y, tuple) else x + y


def _capture(**kw):
    torch.manual_seed(0)
    return autopar.capture(DenseThenMoE(**kw), (torch.randn(6, 16),))


@pytest.mark.parametrize("kw", [dict(), dict(shared_gate=True, z_loss=True), dict(clamp=True)],
                         ids=["plain", "shared-gate-z-loss", "clamp"])
def test_sigmoid_bias_group_topk_router_with_shared_experts_is_a_block(kw):
    gm = _capture(**kw)
    (b,) = detect_moe(gm)
    assert (b.module, b.idiom, b.n_experts, b.top_k, b.hidden) == ("moe", "slots", 8, 2, 16)
    assert b.gate == "moe.router.weight" and b.dropless
    # the experts' weights, and neither the shared experts' nor the dense layer's
    assert set(b.expert_params) == {f"moe.experts.{e}.{p}" for e in range(8)
                                    for p in ("gate.weight", "up.weight", "down.weight", "down.bias")}
    assert {b.expert_params[f"moe.experts.{e}.down.weight"] for e in range(8)} == set(range(8))
    # the group top-k (over 4 groups) and the top-2 inside groups are not routers
    topks = [n for n in gm.graph.nodes if "topk" in str(n.target)]
    assert len(topks) == 3 and b.router.endswith("topk#2")


def test_clamp_is_row_wise_by_its_rule_and_a_mean_over_rows_is_not():
    gm = _capture(clamp=True)
    clamps = [n for n in gm.graph.nodes if "clamp" in str(n.target)]
    assert len(clamps) == 2 * 8 and all(row_wise_failure(n, set(n.all_input_nodes)) is None for n in clamps)
    # the same probe on a reduction over rows names the rule that fails
    torch.manual_seed(0)
    m = autopar.capture(nn.Sequential(nn.Linear(4, 4)), (torch.randn(3, 4),))
    lin = next(n for n in m.graph.nodes if "linear" in str(n.target))
    assert row_wise_failure(lin, {lin.args[0]}) is None
    assert "no strategy S(0)" in row_wise_failure(lin, {lin.args[0], lin.args[1]})  # rows times rows mixes


def test_an_in_place_elementwise_op_is_row_wise_by_its_functional_rule():
    """gpt-oss adds its experts' biases in place after the grouped matmul (`out += bias[...]`):
    an in-place op is row-wise exactly when its functional form is."""
    class AddInPlace(nn.Module):
        def forward(self, x, y):
            z = x * 2
            z.add_(y)
            return z.mul_(3.0)

    m = autopar.capture(AddInPlace(), (torch.randn(3, 4), torch.randn(3, 4)))
    ops = {str(n.target): n for n in m.graph.nodes if n.op == "call_function"}
    add_, mul_ = ops["aten.add_.Tensor"], ops["aten.mul_.Tensor"]
    assert row_wise_failure(add_, set(add_.all_input_nodes)) is None  # rows + rows, elementwise
    assert row_wise_failure(mul_, set(mul_.all_input_nodes)) is None
    assert "no strategy S(0)" in row_wise_failure(add_, {add_.args[0]})  # rows + a replicated (3, 4): mixes


def test_an_expert_op_that_mixes_rows_is_named_with_its_rule_and_what_to_do():
    gm = _capture(mix_expert=3)
    with pytest.raises(MoEDetectError) as err:
        detect_moe(gm)
    msg = str(err.value)
    assert "expert 3" in msg and "cumsum" in msg and "not a row-wise op" in msg
    assert "its rule for aten.cumsum.default has no strategy S(0)" in msg and "leaf_modules" in msg


class TopkNoRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # keeps the 2 largest features of each row: a top-k, but over no experts
        h = self.lin(x)
        v, i = (h * h).topk(2, -1)
        return h + torch.zeros_like(h).scatter(1, i, v)


def test_an_ep_mesh_on_a_model_whose_topk_is_no_router_is_told_which_node_and_why():
    torch.manual_seed(0)
    gm = autopar.capture(TopkNoRouter(), (torch.randn(4, 8),))
    assert detect_moe(gm) == []
    with pytest.raises(ValueError) as err:
        plan_experts(gm, {"ep": 2})
    msg = str(err.value)
    assert ":topk#0" in msg and "its indices reach no dispatch" in msg and "lin.weight" in msg
    assert "topk" in msg and "leaf_modules" in msg and "mesh without the ep axis" in msg


class DenseRouted(nn.Module):
    """Llama-4-style routing: the top-k scores are scattered into a dense (N, E) matrix and every
    expert runs on every token (a batched matmul over (E, N, D)); no rows are dispatched.
    `mix_tokens` makes the experts subtract their mean over tokens, which no split of the
    tokens can reproduce."""

    def __init__(self, D=8, E=4, K=1, mix_tokens=False):
        super().__init__()
        self.E, self.K, self.mix_tokens = E, K, mix_tokens
        self.router = nn.Linear(D, E, bias=False)
        self.w = nn.Parameter(torch.randn(E, D, D) * 0.1)

    def forward(self, x):  # (N, D)
        logits = self.router(x)
        v, i = logits.topk(self.K, 1)
        s = torch.full_like(logits, float("-inf")).scatter_(1, i, v).sigmoid()  # (N, E), 0 off the top-k
        rows = x.repeat(self.E, 1) * s.t().reshape(-1, 1)  # (E * N, D)
        h = torch.bmm(rows.view(self.E, -1, x.shape[1]), self.w)  # (E, N, D)
        if self.mix_tokens:
            h = h - h.mean(1, keepdim=True)
        out = h.view(-1, x.shape[1])
        return out.view(self.E, -1, x.shape[1]).sum(0)


class SampledMax(nn.Module):
    """PhiMoE-style choice: one expert per token by a max over router scores plus Gumbel noise
    (training), then the experts' outputs through a gather of the chosen expert's weights."""

    def __init__(self, D=8, E=4):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w = nn.Parameter(torch.randn(E, D) * 0.1)

    def forward(self, x):  # (N, D)
        scores = self.router(x)
        noise = torch.empty_like(scores).exponential_().log()
        e = (scores - noise).max(dim=-1)[1]  # (N,)
        return x * self.w[e] * scores.softmax(-1).gather(1, e[:, None])


def test_dense_routed_experts_are_a_dense_block_with_tokens_scores_and_expert_sizes():
    """Every expert on every token (Llama 4): the block enters at the repeat of the tokens and
    the transpose of the dense scores (computed from the scatter), leaves at the sum over experts,
    and names the sizes that say E (the repeat, the (E, -1, D) views) for the rewrite."""
    torch.manual_seed(0)
    gm = autopar.capture(DenseRouted(), (torch.randn(6, 8),))
    (b,) = detect_moe(gm)
    assert (b.idiom, b.n_experts, b.top_k, b.hidden, b.gate) == ("dense", 4, 1, 8, "router.weight")
    assert b.expert_params == {"w": "dim0"} and b.tokens == "input:0" and b.combine == ":sum#0"
    assert b.dense_entries == [{"node": ":repeat#0", "source": "input:0", "per": "token"},
                               {"node": ":t#0", "source": ":sigmoid#0", "per": "score"}]
    assert b.dense_sizes == [":repeat#0", ":view#0", ":view#2"]
    assert b.flops_per_row == 2 * 8 * 8


def test_an_ep_mesh_on_dense_experts_that_mix_tokens_names_the_op_and_what_to_do():
    torch.manual_seed(0)
    gm = autopar.capture(DenseRouted(mix_tokens=True), (torch.randn(6, 8),))
    with pytest.raises(MoEDetectError) as err:
        plan_experts(gm, {"ep": 2})
    msg = str(err.value)
    assert ":topk#0" in msg and ":scatter_#0" in msg and "router.weight" in msg and ":mean#0" in msg
    assert "every expert runs on every token" in msg and "mixes experts or tokens" in msg
    assert "leaf_modules" in msg and "without the ep axis" in msg


def test_an_ep_mesh_on_a_max_with_sampled_noise_names_the_max_and_the_random_op():
    torch.manual_seed(0)
    gm = autopar.capture(SampledMax(), (torch.randn(6, 8),))
    assert detect_moe(gm) == []
    with pytest.raises(ValueError) as err:
        plan_experts(gm, {"ep": 2})
    msg = str(err.value)
    assert ":max#0" in msg and "instead of aten.topk" in msg and "router.weight" in msg
    assert ":exponential_#0" in msg and "leaf_modules" in msg


class LoopExperts(nn.Module):
    """DBRX-style experts: a Python loop over the experts that were hit (data-dependent)."""

    def __init__(self, D=8, E=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, D, D) * 0.1)

    def forward(self, x, idx, wts):  # (N, D), (N, K), (N, K)
        out = torch.zeros_like(x)
        for e in range(self.w.shape[0]):
            tok, k = torch.where(idx == e)
            out = out.index_add(0, tok, (x[tok] @ self.w[e]) * wts[tok, k, None])
        return out


class RoutedToLoop(nn.Module):
    def __init__(self, D=8, E=4):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = LoopExperts(D, E)

    def forward(self, x):
        w, i = self.router(x).softmax(-1).topk(2, -1)
        return self.experts(x, i, w)


def test_an_ep_mesh_on_experts_kept_opaque_names_the_leaf_module():
    torch.manual_seed(0)
    gm = autopar.capture(RoutedToLoop(), (torch.randn(6, 8),), leaf_modules=["experts"])
    assert detect_moe(gm) == []
    with pytest.raises(ValueError) as err:
        plan_experts(gm, {"ep": 2})
    msg = str(err.value)
    assert "topk#0" in msg and "opaque module 'experts'" in msg and "router.weight" in msg
    assert "the experts are not in the graph" in msg and "without the ep axis" in msg
