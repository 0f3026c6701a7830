"""The cost model against measurements it did not compute: FLOPs against
torch.utils.flop_counter.FlopCounterMode and saved-activation bytes against
torch.autograd.graph.saved_tensors_hooks, on the reference models and on transformers'
GPT-2, Llama, Mixtral and BERT (small configs, random weights, train mode, CPU).

Where the measurement runs:
  * FLOPs: the eager model (independent of capture). Mixtral's eager run uses
    `experts_implementation="eager"`, a loop of per-expert linears that FlopCounterMode
    counts, because FlopCounterMode counts nothing for the grouped-mm op its graph holds;
    both compute the same products, so the count must be equal.
  * Saved bytes: the captured graph (`ep.module()`) run forward under the hooks: it is the
    program being costed. transformers' eager attention differs from its exported graph
    (mask vs is_causal, GQA), so eager is compared only for the reference models.
The cost model runs with the `cpu-gloo` profile, whose kernel choices are the CPU's
(flash attention unless dropout is on, composite RMSNorm, dtype-sized dropout masks).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import HF, REFERENCE, build, capture, captured, measure_flops, measure_saved_bytes  # noqa: E402

from autopar.cost import analyze, load_profile  # noqa: E402

ALL = REFERENCE + HF


def _flop_model(name):
    if name == "hf-mixtral":
        return build(name, experts="eager")  # same weights (same seed), FlopCounterMode-visible experts
    return captured(name)[:2]


@pytest.mark.parametrize("name", ALL)
def test_forward_and_backward_flops_equal_flop_counter_mode(name):
    _, args, gm = captured(name)
    gc = analyze(gm, "cpu-gloo")
    model, margs = _flop_model(name)
    fwd, bwd = measure_flops(model, margs)
    print(f"{name}: fwd {gc.flops} measured {fwd['Global']}, bwd {gc.bwd_flops} measured {bwd['Global']}")
    assert gc.flops > 0 and not gc.unknown_ops, gc.unknown_ops
    # matmul-class ops are counted exactly, so the totals (within 1% required) are equal
    assert gc.flops == fwd["Global"]
    assert gc.bwd_flops == bwd["Global"]
    # and by op class where FlopCounterMode saw an attention kernel
    measured_attention = sum(v for k, v in fwd["ops"].items() if "attention" in k)
    if measured_attention:
        ours = sum(n.cost.flops for n in gc.nodes if n.kind == "attention")
        assert ours == measured_attention


@pytest.mark.parametrize("name", REFERENCE)
def test_flops_per_layer_equal_flop_counter_mode_module_counts(name):
    model, args, gm = captured(name)
    gc = analyze(gm, "cpu-gloo")
    fwd, bwd = measure_flops(model, args)
    root = type(model).__name__
    layers = gc.layers()
    for layer, nodes in layers.items():
        assert sum(n.cost.flops for n in nodes) == fwd.get(f"{root}.{layer}", 0), layer
    # FlopCounterMode attributes backward FLOPs to modules through autograd hooks, which lose
    # some (the MoE's tuple outputs); compare per layer only where it attributed all of them
    attributed = sum(bwd.get(f"{root}.{layer}", 0) for layer in layers)
    if attributed == bwd["Global"]:
        for layer, nodes in layers.items():
            assert sum(n.bwd_flops for n in nodes) == bwd.get(f"{root}.{layer}", 0), layer
    else:
        assert name.startswith("moe"), f"FlopCounterMode attributed {attributed} of {bwd['Global']} backward FLOPs"


@pytest.mark.parametrize("name", ALL)
def test_saved_activation_bytes_match_saved_tensors_hooks(name):
    model, args, gm = captured(name)
    gc = analyze(gm, "cpu-gloo")
    measured = measure_saved_bytes(gm, args)
    print(f"{name}: saved {gc.saved_bytes} measured {measured}")
    assert not gc.unknown_saved, gc.unknown_saved
    torch.testing.assert_close(float(gc.saved_bytes), float(measured), rtol=0.05, atol=0)
    if name in REFERENCE:
        torch.testing.assert_close(float(gc.saved_bytes), float(measure_saved_bytes(model, args)), rtol=0.05, atol=0)


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "hf-gpt2"])
def test_bf16_saved_bytes_and_flops_match_measurements(name):
    # bf16 changes what is saved: composite RMSNorm keeps fp32 copies, CPU layer norm keeps
    # bf16 statistics, math attention upcasts
    model, args = build(name, dtype=torch.bfloat16)
    gm = capture(model, args)
    gc = analyze(gm, "cpu-gloo")
    torch.testing.assert_close(float(gc.saved_bytes), float(measure_saved_bytes(gm, args)), rtol=0.05, atol=0)
    fwd, bwd = measure_flops(model, args)
    assert (gc.flops, gc.bwd_flops) == (fwd["Global"], bwd["Global"])


@pytest.mark.parametrize("name,dtype", [("gpt-tiny", torch.float32), ("vit-tiny", torch.bfloat16),
                                        ("hf-llama", torch.float32), ("hf-llama", torch.bfloat16)])
def test_math_attention_flops_and_saved_bytes_match_when_torch_runs_the_math_kernel(name, dtype):
    # the math path materialises the score matrix and its backward is two bmm backwards
    model, args = build(name, dtype=dtype)
    gm = capture(model, args)
    gc = analyze(gm, "cpu-gloo", kernels={"sdpa": "math"})
    with sdpa_kernel(SDPBackend.MATH):
        fwd, bwd = measure_flops(model, args)
        measured = measure_saved_bytes(gm, args)
    assert (gc.flops, gc.bwd_flops) == (fwd["Global"], bwd["Global"])
    torch.testing.assert_close(float(gc.saved_bytes), float(measured), rtol=0.05, atol=0)


@pytest.mark.parametrize("name", ["hf-llama", "hf-bert", "hf-gpt2"])
def test_transformers_eager_attention_matmul_softmax_dropout_match_measurements(name):
    # attn_implementation="eager": explicit matmul / softmax / dropout(p=0.0) in the graph
    from cost_helpers import hf_model

    torch.manual_seed(0)
    cfg = hf_model(name).config
    cfg._attn_implementation = "eager"
    model, args = type(hf_model(name))(cfg).train(), (torch.randint(0, 128, (2, 16)),)
    gm = capture(model, args)
    gc = analyze(gm, "cpu-gloo")
    assert any(n.op == "aten.matmul.default" for n in gc.nodes)
    fwd, bwd = measure_flops(model, args)
    assert (gc.flops, gc.bwd_flops) == (fwd["Global"], bwd["Global"])
    torch.testing.assert_close(float(gc.saved_bytes), float(measure_saved_bytes(gm, args)), rtol=0.05, atol=0)


def test_convolution_flops_follow_flop_counter_mode_forward_and_backward():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.c2 = torch.nn.Conv2d(8, 8, 3, stride=2, groups=2)
            self.fc = torch.nn.Linear(8 * 7 * 7, 10)

        def forward(self, x):
            return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 3, 16, 16)
    gm = capture(net, (x,))
    gc = analyze(gm, "cpu-gloo")
    fwd, bwd = measure_flops(net, (x,))
    assert (gc.flops, gc.bwd_flops) == (fwd["Global"], bwd["Global"])
    torch.testing.assert_close(float(gc.saved_bytes), float(measure_saved_bytes(gm, (x,))), rtol=0.05, atol=0)


def test_grouped_query_attention_counts_every_query_head_as_flop_counter_mode_does():
    # enable_gqa: 4 query heads over 2 kv heads reach the CPU flash kernel unexpanded (as
    # transformers 5.17's Llama / Mixtral call SDPA); each query head still attends over all keys
    class GQA(torch.nn.Module):
        def __init__(self, D=64, H=4, KV=2):
            super().__init__()
            self.H, self.KV, self.d = H, KV, D // H
            self.q, self.kv = torch.nn.Linear(D, D), torch.nn.Linear(D, 2 * KV * (D // H))

        def forward(self, x):  # (B, T, D)
            B, T, _ = x.shape
            q = self.q(x).view(B, T, self.H, self.d).transpose(1, 2)  # (B, H, T, d)
            k, v = self.kv(x).view(B, T, 2, self.KV, self.d).permute(2, 0, 3, 1, 4)  # (B, KV, T, d) each
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return y.transpose(1, 2).reshape(B, T, -1)

    torch.manual_seed(0)
    net, x = GQA().train(), torch.randn(2, 16, 64)
    gm = capture(net, (x,))
    gc = analyze(gm, "cpu-gloo")
    fwd, bwd = measure_flops(net, (x,))
    assert (gc.flops, gc.bwd_flops) == (fwd["Global"], bwd["Global"])
    attn = [n for n in gc.nodes if n.kind == "attention"]
    B, H, T, d = 2, 4, 16, 16
    assert len(attn) == 1 and attn[0].cost.flops == 4 * B * H * T * T * d  # q k^T and p v over all 4 heads
    assert attn[0].cost.flops == sum(v for k, v in fwd["ops"].items() if "attention" in k)


@pytest.mark.parametrize("dropout_p", [0.1, 0.0])
def test_math_attention_backward_passes_over_the_score_matrix_match_torch_backward(dropout_p):
    # what the cost model times unfused attention's backward with (NodeTimer._bwd_bytes): its saved
    # score-sized tensors read once each, plus MATH_BWD_SCORE_PASSES passes over score-sized gradients;
    # measured: every score-sized tensor a non-view op of torch's math backward reads or writes
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from autopar.cost.node_time import MATH_BWD_SCORE_PASSES, NodeTimer
    from autopar.cost.symbolic import evaluate

    b, h, s, d = 2, 4, 512, 16  # large enough that the A100 timing below is memory-bound, not at its floor
    scores = b * h * s * s

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, d))  # q, k and v need gradients, as in a model

        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q * self.w[0], k * self.w[1], v * self.w[2],
                                                                    dropout_p=dropout_p)

    model = Attn()
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        out = model(q, k, v)

    class Passes(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            if not func._schema.is_mutable and not any(a.alias_info for a in func._schema.returns):  # views move nothing
                flat = tree_flatten((args, kwargs))[0] + tree_flatten(res)[0]
                self.n += sum(isinstance(t, torch.Tensor) and t.numel() == scores for t in flat)
            return res

    with Passes() as measured:
        out.backward(torch.ones_like(out))

    gm = capture(model, (q, k, v))
    hw = load_profile("a100-80gb")
    gc = analyze(gm, hw, kernels={"sdpa": "math"})
    (node,) = [n for n in gc.nodes if "scaled_dot_product_attention" in n.op]
    values = gc.values()
    saved = {tag: evaluate(nb, values) for _k, nb, tag in node.saved if tag.startswith("attn_")}
    assert saved.pop("attn_probs") == scores * 4  # fp32 probabilities
    assert saved == ({"attn_dropout_mask": scores, "attn_dropped": scores * 4} if dropout_p else {})  # bool mask
    saved = ["attn_probs", *saved]
    assert measured.n == len(saved) + MATH_BWD_SCORE_PASSES[dropout_p > 0]
    base = sum(evaluate(t.nbytes, values) for t in node.outputs + node.grad_inputs) + sum(
        evaluate(nb, values) for _k, nb, _t in node.saved)
    timer = NodeTimer(hw, values)

    def backward_s(nbytes):  # the node's backward with these bytes, through the public roofline
        return timer.seconds("attention", node.cost.dtype, evaluate(node.bwd_flops, values),
                             2 * evaluate(node.cost.other_flops, values), nbytes, shape=(s, d),
                             causal_fraction=node.cost.causal_fraction, backward=True)

    with_passes = backward_s(base + MATH_BWD_SCORE_PASSES[dropout_p > 0] * scores * 4)
    assert with_passes > backward_s(base)  # memory-bound here: the passes show in the time
    assert timer.node(node)[1] == with_passes
