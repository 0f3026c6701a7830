"""Reference models: shapes, gradients, export parity, published sizes, MoE routing, registry.

Single process, CPU, fp32; tolerances are torch.testing.assert_close's fp32 defaults
(rtol 1.3e-6, atol 1e-5) unless a test says otherwise. The comparisons against
Hugging Face transformers (Llama, Mixtral) import transformers (~6 s), so they run only
with AUTOPAR_HF_TESTS=1.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

import autopar.models as models
from autopar.models import MLP, GPTConfig, MLPConfig, MoE, MoEConfig, ViT, ViTConfig
from autopar.models.gpt import loss_fn as gpt_loss_fn
from autopar.models.moe import MoEFeedForward

TINY = ["gpt-tiny", "gpt-tiny-tied", "moe-tiny", "moe-tiny-capacity", "mlp-tiny", "vit-tiny"]


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, tuple, torch.Tensor]:
    spec = models.get(name)
    torch.manual_seed(seed)
    model = spec.build()
    inputs, targets = spec.example_batch(2, generator=torch.Generator().manual_seed(seed + 1))
    return model, inputs, targets


# ----------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_forward_loss_and_backward_reach_every_parameter(name):
    spec = models.get(name)
    model, inputs, targets = build(name)
    out = model(*inputs)
    logits = out[0] if isinstance(out, tuple) else out
    cfg = spec.config
    if isinstance(cfg, (GPTConfig, MoEConfig)):
        assert inputs[0].shape == (2, cfg.max_seq_len) and targets.shape == (2, cfg.max_seq_len)
        assert logits.shape == (2, cfg.max_seq_len, cfg.vocab_size)
    else:
        assert logits.shape == (2, cfg.n_classes) and targets.shape == (2,)
    loss = spec.loss_fn(out, targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # random init, random targets: the loss is near log(classes), nowhere near 0
    n_classes = cfg.vocab_size if hasattr(cfg, "vocab_size") else cfg.n_classes
    assert abs(loss.item() - math.log(n_classes)) < 0.5
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no (finite) gradient for {missing}"
    zero = [n for n, p in model.named_parameters() if not p.grad.any()]
    assert not zero, f"all-zero gradient for {zero}"


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_exported_non_strict_matches_eager(name):
    model, inputs, _ = build(name)
    eager = model(*inputs)
    exported = torch.export.export(model, inputs, strict=False).module()(*inputs)
    torch.testing.assert_close(exported, eager)


def test_exported_gpt_keeps_high_level_ops_whole():
    model, inputs, _ = build("gpt-tiny")
    ep = torch.export.export(model, inputs, strict=False)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for op in ["embedding", "linear", "rms_norm", "silu", "scaled_dot_product_attention"]:
        assert f"aten.{op}.default" in targets, f"aten.{op} missing from {sorted(targets)}"
    assert not any("complex" in t or "view_as_real" in t for t in targets)


def test_gpt_accepts_a_shorter_sequence_and_rejects_a_longer_one():
    model, _, _ = build("gpt-tiny")
    (idx,), _ = models.get("gpt-tiny").example_batch(3, seq_len=8, generator=torch.Generator().manual_seed(0))
    assert model(idx).shape == (3, 8, 128)
    # causal: the first 8 positions of a longer sequence give the same logits
    longer = torch.cat([idx, torch.randint(0, 128, (3, 4), generator=torch.Generator().manual_seed(1))], dim=1)
    torch.testing.assert_close(model(longer)[:, :8], model(idx))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


# ----------------------------------------------------------------------------- real sizes

PUBLISHED = {
    "llama2-7b": 6.74e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "mixtral-8x7b": 46.7e9,
    "vit-b16": 86.6e6,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_size_model_builds_on_meta_with_the_published_parameter_count(name):
    with torch.device("meta"):
        model = models.get(name).build()
    assert all(p.is_meta for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(PUBLISHED[name], rel=0.01)


def test_real_size_example_batch_on_meta_draws_nothing():
    (idx,), targets = models.get("llama3-70b").example_batch(4, seq_len=4096, device="meta")
    assert idx.is_meta and targets.is_meta and idx.shape == targets.shape == (4, 4096)
    assert idx.dtype == torch.long


# ----------------------------------------------------------------------------- init


@pytest.mark.parametrize("name", TINY)
def test_two_builds_after_the_same_seed_are_equal_and_another_seed_differs(name):
    a, b, c = build(name, seed=3)[0], build(name, seed=3)[0], build(name, seed=4)[0]
    torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)
    assert any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_gpt_init_is_normal_002_with_unit_norms():
    model, _, _ = build("gpt-tiny")
    assert model.layers[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(model.layers[1].ffn_norm.weight, torch.ones(64))


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "vit-tiny", "mlp-tiny"])
def test_meta_model_materialised_with_reset_parameters_equals_a_reset_eager_model(name):
    spec = models.get(name)
    with torch.device("meta"):
        meta = spec.build()
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.reset_parameters()
    eager, inputs, _ = build(name)
    torch.manual_seed(7)
    eager.reset_parameters()
    torch.testing.assert_close(meta.state_dict(), eager.state_dict(), rtol=0, atol=0)
    for (n, x), (_, y) in zip(meta.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=n)  # RoPE tables recomputed
    torch.testing.assert_close(meta(*inputs), eager(*inputs))


def test_rope_tables_are_non_persistent_buffers():
    model, _, _ = build("gpt-tiny")
    assert {n for n, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
    assert not any(k.startswith("rope") for k in model.state_dict())


def test_tied_embeddings_share_one_parameter_and_both_uses_feed_its_gradient():
    tied, inputs, targets = build("gpt-tiny-tied")
    untied, _, _ = build("gpt-tiny")
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 128 * 64
    assert "lm_head.weight" not in dict(tied.named_parameters())
    # the shared gradient is the sum of the embedding's and the head's contributions
    untied.load_state_dict({**tied.state_dict(), "lm_head.weight": tied.tok_emb.weight.detach().clone()})
    gpt_loss_fn(tied(*inputs), targets).backward()
    gpt_loss_fn(untied(*inputs), targets).backward()
    torch.testing.assert_close(tied.tok_emb.weight.grad, untied.tok_emb.weight.grad + untied.lm_head.weight.grad)


# ----------------------------------------------------------------------------- MoE routing


def moe_pair(capacity_factor: float) -> tuple[MoE, MoE, torch.Tensor]:
    """A dropless MoE and a capacity-limited one with the same weights, and a batch."""
    torch.manual_seed(0)
    dropless = MoE(MoEConfig.tiny())
    capped = MoE(MoEConfig.tiny(capacity_factor=capacity_factor))
    capped.load_state_dict(dropless.state_dict())
    (idx,), _ = models.get("moe-tiny").example_batch(2, generator=torch.Generator().manual_seed(1))
    return dropless, capped, idx


def reference_moe(layer: MoEFeedForward, x: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """Token-by-token MoE: sum over kept choices of weight * expert(token). x (N, D), dropped (N, K)."""
    probs = torch.softmax(layer.gate(x), dim=-1)
    weight, expert = probs.topk(layer.top_k, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(layer.top_k):
            if not dropped[n, k]:
                out[n] += weight[n, k] * layer.experts[int(expert[n, k])](x[n])
    return out


def test_dropless_moe_drops_nothing():
    dropless, _, idx = moe_pair(1.0)
    dropped = dropless.dropped_assignments(idx)
    assert dropped.shape == (2, 2 * 32, 2) and dropped.dtype == torch.bool
    assert not dropped.any()


def test_small_capacity_drops_assignments_and_changes_the_output():
    dropless, capped, idx = moe_pair(0.5)
    dropped = capped.dropped_assignments(idx)
    # C = ceil(0.5 * 64 * 2 / 4) = 16 slots per expert for 128 assignments: at least half dropped
    assert dropped.sum(dim=(1, 2)).min() >= 64
    assert not torch.allclose(capped(idx)[0], dropless(idx)[0])


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0])
def test_moe_drop_report_agrees_with_the_forward(capacity_factor):
    torch.manual_seed(0)
    model = MoE(MoEConfig.tiny(capacity_factor=capacity_factor))
    (idx,), _ = models.get("moe-tiny").example_batch(2, generator=torch.Generator().manual_seed(1))
    seen = []
    hooks = [
        layer.moe.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out[0])))
        for layer in model.layers
    ]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    dropped = model.dropped_assignments(idx)
    if capacity_factor is None:
        assert not dropped.any()
    if capacity_factor == 0.5:
        assert dropped.any()
    for layer_dropped, (moe_layer, x, y) in zip(dropped, seen):
        x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        with torch.no_grad():
            torch.testing.assert_close(y, reference_moe(moe_layer, x, layer_dropped))


def test_capacity_keeps_the_first_assignments_in_token_major_order():
    _, capped, idx = moe_pair(0.5)
    _, _, routings = capped.forward_with_routing(idx)
    for r in routings:
        C = r.capacity
        assert C == 16
        order = r.expert.reshape(-1)  # token-major: (n, k) row-major
        keep = r.keep.reshape(-1)
        for e in range(4):
            mine = (order == e).nonzero().flatten()
            expected = torch.zeros(len(mine), dtype=torch.bool)
            expected[:C] = True  # the first C assignments to e, in token-major order, are kept
            assert torch.equal(keep[mine], expected), f"expert {e}"
            assert torch.equal(r.position.reshape(-1)[mine], torch.arange(len(mine)))


def test_moe_aux_loss_is_top_k_times_coef_per_layer_for_a_uniform_router():
    torch.manual_seed(0)
    model = MoE(MoEConfig.tiny())
    with torch.no_grad():
        for layer in model.layers:
            layer.moe.gate.weight.zero_()  # every expert equally likely
    (idx,), _ = models.get("moe-tiny").example_batch(2, generator=torch.Generator().manual_seed(1))
    _, aux = model(idx)
    cfg = model.config
    # E * sum_e f_e * (1/E) = sum_e f_e = top_k, whichever experts the ties pick
    torch.testing.assert_close(aux, torch.tensor(cfg.aux_loss_coef * cfg.n_layers * cfg.top_k))


def test_moe_aux_loss_reaches_n_experts_when_the_router_collapses_onto_top_k_experts():
    torch.manual_seed(0)
    layer = MoEFeedForward(MoEConfig.tiny())  # E = 4, K = 2
    x = torch.randn(1, 64, 64).abs()  # positive features: the gate below sends all to experts 0, 1
    with torch.no_grad():
        layer.gate.weight.copy_(torch.tensor([5.0, 5.0, -5.0, -5.0])[:, None].expand(4, 64))
        _, collapsed, r = layer(x)
        layer.gate.weight.zero_()
        _, uniform, _ = layer(x)
    assert (r.expert.sort(dim=-1).values == torch.tensor([0, 1])).all()
    # collapsed: f = (1, 1, 0, 0), P = (1/2, 1/2, 0, 0) -> 4 * 1 = E; uniform: sum_e f_e = K
    torch.testing.assert_close(collapsed, torch.tensor(4.0))
    torch.testing.assert_close(uniform, torch.tensor(2.0))


# ----------------------------------------------------------------------------- registry and configs


def test_registry_names_and_unknown_name_error():
    assert models.names() == [
        "gpt-tiny", "gpt-tiny-tied", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b",
        "moe-tiny", "moe-tiny-capacity", "mixtral-8x7b", "mlp-tiny", "vit-tiny", "vit-b16",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown model 'gpt-huge'.*gpt-tiny, gpt-tiny-tied"):
        models.get("gpt-huge")
    assert models.get("moe-tiny-capacity").config.capacity_factor == 1.0
    assert models.get("moe-tiny").config.capacity_factor is None


def test_example_batch_is_reproducible_from_a_generator_and_targets_are_next_tokens():
    spec = models.get("gpt-tiny")
    (a,), ta = spec.example_batch(2, seq_len=16, generator=torch.Generator().manual_seed(5))
    (b,), tb = spec.example_batch(2, seq_len=16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and torch.equal(ta, tb)
    assert torch.equal(a[:, 1:], ta[:, :-1])
    with pytest.raises(ValueError, match="seq_len=33"):
        spec.example_batch(2, seq_len=33)
    with pytest.raises(ValueError, match="batch_size=0"):
        spec.example_batch(0)
    (x,), y = models.get("vit-tiny").example_batch(3)
    assert x.shape == (3, 3, 16, 16) and y.shape == (3,) and y.max() < 10


def test_configs_reject_inconsistent_sizes():
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        dataclasses.replace(GPTConfig.tiny(), n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads=5"):
        dataclasses.replace(GPTConfig.tiny(), n_heads=5)
    with pytest.raises(ValueError, match="top_k=5"):
        dataclasses.replace(MoEConfig.tiny(), top_k=5)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoEConfig.tiny(capacity_factor=0)
    with pytest.raises(ValueError, match="patch_size=5"):
        dataclasses.replace(ViTConfig.tiny(), patch_size=5)


def test_vit_patch_embedding_equals_a_strided_convolution():
    torch.manual_seed(0)
    model = ViT(ViTConfig.tiny())
    (images,), _ = models.get("vit-tiny").example_batch(2, generator=torch.Generator().manual_seed(1))
    conv = torch.nn.Conv2d(3, 32, kernel_size=4, stride=4)
    with torch.no_grad():
        conv.weight.copy_(model.patch_emb.weight.view(32, 3, 4, 4))
        conv.bias.copy_(model.patch_emb.bias)
    from autopar.models.vit import patchify

    expected = conv(images).flatten(2).transpose(1, 2)  # (B, P, D)
    torch.testing.assert_close(model.patch_emb(patchify(images, 4)), expected)


def test_mlp_has_n_layers_blocks_and_a_head():
    model = MLP(MLPConfig(dim=5, hidden=7, n_layers=3, n_classes=2))
    assert [tuple(layer.fc.weight.shape) for layer in model.layers] == [(7, 5), (7, 7), (7, 7)]
    assert model(torch.randn(4, 5)).shape == (4, 2)


# ----------------------------------------------------------------------------- against transformers

hf = pytest.mark.skipif(os.environ.get("AUTOPAR_HF_TESTS") != "1", reason="set AUTOPAR_HF_TESTS=1 (imports transformers)")


def _hf_decoder_state(model, moe: bool) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": model.tok_emb.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}  # fmt: skip
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = layer.attn
        sd |= {p + "self_attn.q_proj.weight": a.wq.weight, p + "self_attn.k_proj.weight": a.wk.weight,
               p + "self_attn.v_proj.weight": a.wv.weight, p + "self_attn.o_proj.weight": a.wo.weight,
               p + "input_layernorm.weight": layer.attn_norm.weight,
               p + "post_attention_layernorm.weight": layer.ffn_norm.weight}  # fmt: skip
        if moe:
            experts = layer.moe.experts
            sd[p + "mlp.gate.weight"] = layer.moe.gate.weight
            sd[p + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            sd[p + "mlp.experts.down_proj"] = torch.stack([e.w2.weight for e in experts])
        else:
            sd |= {p + "mlp.gate_proj.weight": layer.ffn.w1.weight, p + "mlp.up_proj.weight": layer.ffn.w3.weight,
                   p + "mlp.down_proj.weight": layer.ffn.w2.weight}  # fmt: skip
    return {k: v.detach() for k, v in sd.items()}


@hf
def test_gpt_matches_hugging_face_llama_with_the_same_weights():
    from transformers import LlamaConfig, LlamaForCausalLM

    model, (idx,), _ = build("gpt-tiny")
    c = model.config
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, intermediate_size=c.ffn_dim, max_position_embeddings=c.max_seq_len,
        rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    ref = LlamaForCausalLM(hf_cfg).eval()
    ref.load_state_dict(_hf_decoder_state(model, moe=False))
    torch.testing.assert_close(model(idx), ref(idx).logits)


@hf
def test_dropless_moe_matches_hugging_face_mixtral_with_the_same_weights():
    from transformers import MixtralConfig, MixtralForCausalLM

    model, (idx,), _ = build("moe-tiny")
    c = model.config
    hf_cfg = MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, intermediate_size=c.ffn_dim, max_position_embeddings=c.max_seq_len,
        rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps, num_local_experts=c.n_experts,
        num_experts_per_tok=c.top_k, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
        sliding_window=None,
    )  # fmt: skip
    ref = MixtralForCausalLM(hf_cfg).eval()
    ref.load_state_dict(_hf_decoder_state(model, moe=True))
    torch.testing.assert_close(model(idx)[0], ref(idx).logits)
