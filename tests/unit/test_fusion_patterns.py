"""The fusion table on real graphs: how many times each pattern matches in the reference models
and in transformers' Llama, Mistral, Qwen2, GPT-2 and BERT, and that the graph the fuse pass
rewrites computes what the original computes.

Models are built small (2 blocks, width 32-64, use_cache=False, dropout off so that two runs
see the same values) and captured once per module (`autopar.capture`, dynamic batch). The
transformers models are captured with `labels`, so their loss is in the graph.

Tolerances:
- fp32 on CPU (the rewritten program runs each kernel's torch reference): every output and
  every parameter gradient within atol = rtol = 1e-5 of the original graph's.
- bf16: against an fp32 oracle (the same model and rounded weights in fp32), the fused graph's
  error is at most twice the original bf16 graph's error plus 1e-5 * max|oracle|, for the
  loss and for every parameter gradient (the kernels' own bf16 criterion).
- Triton interpreter (child process, TRITON_INTERPRET=1): the fused graph running the Triton
  kernels equals the original graph within 1e-5 (outputs and parameter gradients).
"""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autopar.models as M
from autopar.capture import capture
from autopar.models.gpt import loss_fn
from autopar.passes.fuse import fuse
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.rules.fusion_table import RULE_NAMES, find_matches
from autopar.runtime.kernels import DISPATCH_COUNTS

VOCAB = 128


class WithLoss(nn.Module):
    """A model and its loss in one forward: the logits feed only the loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.model(idx), targets)


def _hf(name: str, **extra) -> nn.Module:
    T = pytest.importorskip("transformers")
    llama_like = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, **extra)
    if name == "hf-llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**llama_like))
    if name == "hf-mistral":
        return T.MistralForCausalLM(T.MistralConfig(**llama_like))
    if name == "hf-qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**llama_like))
    if name == "hf-gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **extra))
    if name == "hf-bert":
        return T.BertForMaskedLM(T.BertConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra))
    raise ValueError(name)


@functools.cache
def captured(name: str, dtype: torch.dtype = torch.float32):
    """(graph, flat inputs) of a model, captured once per test module."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    kwargs = {}
    if name in ("gpt-tiny", "vit-tiny"):
        spec = M.get(name)
        model = spec.build()
        (x,), _ = spec.example_batch(2, generator=g)
        args = (x,)
    elif name == "gpt-tiny+loss":
        spec = M.get("gpt-tiny")
        model = WithLoss(spec.build())
        (x,), y = spec.example_batch(2, generator=g)
        args = (x, y)
    else:
        extra = {"attn_implementation": "eager"} if name == "hf-llama-eager" else {}
        model = _hf(name.replace("-eager", ""), **extra)
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        args, kwargs = (ids,), {"labels": torch.randint(0, VOCAB, (2, 16), generator=g)}
    model = model.to(dtype).eval()  # eval: dropout off (configs set it to 0 as well)
    gm = capture(model, args, example_kwargs=kwargs)
    return gm, list(args) + list(kwargs.values())


def fused_copy(gm: fx.GraphModule, fusions: list[str]) -> fx.GraphModule:
    """The fuse pass on a copy of `gm` (same parameters), run by the pass manager, which checks
    the graph and that every node keeps its autopar annotation."""
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    plan = Plan(mesh={"dp": 1}, fusions=fusions)
    return PassManager([fuse]).run(out, PassContext(plan=plan, mesh_sizes={"dp": 1}))


def outputs_and_grads(gm: fx.GraphModule, inputs: list,
                      params: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every floating output, then every parameter's gradient of a fixed random weighting of
    the outputs (so each output's backward is exercised). `params` replaces gm's parameters."""
    if params is None:
        out = gm(*inputs)
        leaves = [p for p in gm.parameters() if p.requires_grad]
    else:
        out = torch.func.functional_call(gm, params, tuple(inputs))
        leaves = list(params.values())
    outs = [o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()]
    g = torch.Generator().manual_seed(1)
    total = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [o.detach() for o in outs] + [gr for gr in grads if gr is not None]


# ---------------------------------------------------------------------------- counts

L = 2  # blocks in every model here
LLAMA_LIKE = {"rms_norm": 1, "add_rms_norm": 2 * L, "rope": 2 * L, "swiglu": L, "cross_entropy": 1}
EXPECTED = {
    # first norm on the embeddings alone; every later norm follows a residual add
    "gpt-tiny": {"rms_norm": 1, "add_rms_norm": 2 * L, "rope": 2 * L, "swiglu": L},
    # the loss in the graph and the logits read by nothing else: linear + CE in chunks
    "gpt-tiny+loss": {"rms_norm": 1, "add_rms_norm": 2 * L, "rope": 2 * L, "swiglu": L,
                      "linear_cross_entropy": 1},
    # norm1 of block 0 and the final norm (on the class token) follow no add
    "vit-tiny": {"layer_norm": 2, "add_layer_norm": 2 * L - 1, "bias_gelu": L},
    # HF returns the logits beside the loss, so linear + CE cannot fuse; CE alone does
    "hf-llama": LLAMA_LIKE,
    "hf-mistral": LLAMA_LIKE,
    "hf-qwen2": LLAMA_LIKE,
    # eager attention computes an explicit softmax (fp32, cast back) per block
    "hf-llama-eager": {**LLAMA_LIKE, "softmax": L},
    # ln_1 of block 0 follows dropout(emb + pos); GeLU is the tanh formula spelled out, its bias
    # inside Conv1D's addmm
    "hf-gpt2": {"layer_norm": 1, "add_layer_norm": 2 * L, "bias_gelu": L, "cross_entropy": 1},
    # post-norm: both norms of a block follow a residual add; the MLM head has a biased GeLU
    # and a LayerNorm of its own; the embeddings' sum broadcasts (positions), so it is not fused
    "hf-bert": {"layer_norm": 2, "add_layer_norm": 2 * L, "bias_gelu": L + 1, "cross_entropy": 1},
}
MODELS = list(EXPECTED)


@pytest.mark.parametrize("name", MODELS)
def test_fusion_table_matches_each_pattern_the_expected_number_of_times(name):
    gm, _ = captured(name)
    counts = Counter(m.rule for m in find_matches(gm))
    assert dict(counts) == EXPECTED[name]


@pytest.mark.parametrize("name", MODELS)
def test_fused_graph_matches_original_outputs_and_parameter_gradients_in_fp32(name):
    gm, inputs = captured(name)
    fused = fused_copy(gm, list(RULE_NAMES))
    made = Counter(f["rule"] for f in fused.meta["autopar_fusions"])
    assert made == Counter(EXPECTED[name])
    assert not any(n.op == "call_function" and n.target is torch.ops.aten.rms_norm.default
                   for n in fused.graph.nodes)
    before = sum(v for (op, path), v in DISPATCH_COUNTS.items() if path == "reference")
    got = outputs_and_grads(fused, inputs)
    # on CPU every fused call ran its torch reference
    assert sum(v for (op, path), v in DISPATCH_COUNTS.items() if path == "reference") - before \
        == sum(made.values())
    want = outputs_and_grads(gm, inputs)
    assert len(got) == len(want) > 1
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"[{i}] {m}")


def test_fused_bf16_llama_is_within_twice_the_original_error_against_fp32():
    gm16, inputs = captured("hf-llama", torch.bfloat16)
    fused = fused_copy(gm16, list(RULE_NAMES))
    rules = Counter(f["rule"] for f in fused.meta["autopar_fusions"])
    assert rules == Counter(LLAMA_LIKE)
    # the fp32 oracle: the fp32 graph run on the same bf16-rounded weights
    gm32, _ = captured("hf-llama")
    rounded = {n: p.detach().float().requires_grad_() for n, p in gm16.named_parameters()}
    # CE absorbed HF's fp32 copy of the logits: the kernel reads the bf16 logits
    ce = [n for n in fused.graph.nodes if n.op == "call_function"
          and getattr(n.target, "__name__", "") == "cross_entropy"]
    assert len(ce) == 1 and ce[0].args[0].meta["val"].dtype == torch.bfloat16
    oracle = outputs_and_grads(gm32, inputs, rounded)
    low = outputs_and_grads(gm16, inputs)
    got = outputs_and_grads(fused, inputs)
    for i, (g, r, o) in enumerate(zip(got, low, oracle)):
        err_fused = (g.float() - o).abs().max().item()
        err_ref = (r.float() - o).abs().max().item()
        floor = 1e-5 * max(1.0, o.abs().max().item())
        assert err_fused <= 2 * err_ref + floor, f"[{i}] {err_fused:.3g} > 2 x {err_ref:.3g} + {floor:.1g}"


class GeGLU(nn.Module):
    """A GeGLU feed-forward (as in T5 v1.1 / Gemma) with both GeLU forms."""

    def __init__(self, dim: int = 16, hidden: int = 24):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        erf = nn.functional.gelu(self.gate(x)) * self.up(x)
        tanh = nn.functional.gelu(self.gate(x), approximate="tanh") * self.up(x)
        return self.down(erf + tanh)


def test_geglu_in_erf_and_tanh_forms_is_fused_and_matches():
    torch.manual_seed(0)
    model = GeGLU()
    x = torch.randn(2, 5, 16)
    gm = capture(model, (x,))
    matches = find_matches(gm)
    assert Counter(m.rule for m in matches) == {"geglu": 2}
    assert sorted(m.kwargs["approximate"] for m in matches) == ["none", "tanh"]
    fused = fused_copy(gm, ["geglu"])
    for a, b in zip(outputs_and_grads(fused, [x]), outputs_and_grads(gm, [x])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class DowncastRMSNorm(nn.Module):
    """transformers' RMSNorm: the variance in fp32 whatever the input dtype, then back."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def test_a_norm_that_casts_down_to_fp32_is_not_fused_and_one_that_casts_up_is():
    # found by the plan fuzz (tests/fuzz): in an fp64 model the cast down to fp32 was taken for
    # an fp32 upcast and dropped, so the fused norm computed in fp64 and moved parameters by
    # 3e-5 in 3 AdamW steps; the fused kernels compute in fp32 from inputs no wider than fp32
    torch.manual_seed(0)
    model = DowncastRMSNorm(16)
    for dtype, want in ((torch.float64, {}), (torch.float32, {"rms_norm": 1}), (torch.bfloat16, {"rms_norm": 1})):
        x = torch.randn(2, 5, 16, dtype=dtype)
        gm = capture(model.to(dtype), (x,))
        assert dict(Counter(m.rule for m in find_matches(gm))) == want, dtype


def test_an_intermediate_read_elsewhere_blocks_the_match():
    class Leaky(nn.Module):  # silu(a) is returned too: fusing it away would lose it
        def forward(self, a, b):
            s = nn.functional.silu(a)
            return s * b, s

    gm = capture(Leaky(), (torch.randn(2, 8), torch.randn(2, 8)))
    assert find_matches(gm, ["swiglu"]) == []


def test_a_match_that_would_move_a_random_op_is_refused():
    class DropBetween(nn.Module):  # the dropout reads the sum and sits between add and norm
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(8)

        def forward(self, a, b):
            s = a + b
            d = nn.functional.dropout(s, 0.5, training=True)
            return self.norm(s), d

    gm = capture(DropBetween(), (torch.randn(2, 8), torch.randn(2, 8)))
    assert Counter(m.rule for m in find_matches(gm)) == {"rms_norm": 1}


def test_on_a_tensor_parallel_rank_patterns_see_local_shapes_and_never_span_a_collective():
    from autopar.passes.shard import shard
    from autopar.runtime.placement import Layout, parse_placement
    from autopar.search.shard_ilp import solve_sharding

    gm, inputs = captured("gpt-tiny")
    mesh = {"tp": 2}
    plan = Plan(mesh=mesh, dp_axis=None)
    sol = solve_sharding(gm, "tp", 2, mesh=mesh, hardware="h100-sxm")
    plan.strategies["tp"] = sol.strategies()
    for name, p in sol.param_placements().items():
        plan.param_layouts[name] = Layout.replicated(("tp",)).replace("tp", parse_placement(str(p)))
    local = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    local = PassManager([shard]).run(local, PassContext(plan=plan, mesh_sizes=mesh, coords={"tp": 0}))
    collectives = [n for n in local.graph.nodes if getattr(n.target, "namespace", None) == "autopar"]
    assert collectives, "the plan shards something"
    matches = find_matches(local)
    for m in matches:
        assert not set(m.nodes) & set(collectives), m.describe()
    # heads are split over tp: rope sees 2 of 4 query heads and 1 of 2 kv heads on this rank
    ropes = sorted(m.outputs[0].meta["autopar"].local_shape[2] for m in matches if m.rule == "rope")
    assert ropes == [1, 1, 2, 2]
    rules = Counter(m.rule for m in matches)
    assert rules["rope"] == 2 * L and rules["swiglu"] == L
    # with the residual sums reduced across tp after the add, a norm reads a collective's result:
    # no add + norm pattern exists on this rank, and each norm is fused alone
    assert rules["rms_norm"] + rules["add_rms_norm"] == 2 * L + 1


# ---------------------------------------------------------------------------- Triton, interpreted or compiled

CHILD = textwrap.dedent('''
    import copy, os, sys
    DEVICE = {device!r}
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"      # before anything imports triton
        os.environ["AUTOPAR_TRITON"] = "interpret"
    import torch, torch.fx as fx
    sys.path.insert(0, os.path.dirname({path!r}))
    from test_fusion_patterns import WithLoss, fused_copy, outputs_and_grads
    from autopar.capture import capture
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.models.vit import ViT, ViTConfig
    from autopar.passes.rules.fusion_table import RULE_NAMES
    from autopar.runtime.kernels import DISPATCH_COUNTS
    torch.manual_seed(0)
    gpt = WithLoss(GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                 max_seq_len=8)))
    tokens = torch.randint(0, 64, (2, 9))
    vit = ViT(ViTConfig(image_size=8, patch_size=4, in_chans=3, dim=24, n_layers=2, n_heads=2, mlp_dim=40,
                        n_classes=5))
    for model, inputs in ((gpt, [tokens[:, :-1], tokens[:, 1:]]), (vit, [torch.randn(2, 3, 8, 8)])):
        model, inputs = model.to(DEVICE), [t.to(DEVICE) for t in inputs]
        gm = capture(model.eval(), tuple(inputs))
        fused = fused_copy(gm, list(RULE_NAMES))
        got, want = outputs_and_grads(fused, inputs), outputs_and_grads(gm, inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # fp32, another summation order
    print(sorted(op for (op, path), n in DISPATCH_COUNTS.items() if path == "triton" and n))
''')


def test_fused_graphs_run_the_triton_kernels_and_match():
    """Compiled on a GPU where one is (where the kernels really run), under Triton's CPU
    interpreter elsewhere."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOPAR_TRITON", "TRITON_INTERPRET")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    proc = subprocess.run([sys.executable, "-c", CHILD.format(path=__file__, device=device)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ran = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's list of names
    assert ran == sorted(["add_layer_norm", "add_rms_norm", "bias_gelu", "layer_norm",
                          "linear_cross_entropy", "rms_norm", "rope", "swiglu"])
