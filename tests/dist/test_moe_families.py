"""Expert parallelism on the MoE families people train, through `autopar.parallelize` with
`autopar.mesh(ep=2)` on 2 gloo ranks against the same model in one process (same seed, same
batches): the losses of three AdamW steps agree to 1e-5 and every parameter after them (the
parallel run's gathered by `autopar.export_state_dict`) to 1e-4 (fp32; the rewrite computes every
expert on exactly its rows, so only summation order differs; see PARAM_TOL).

Models: the hand-written DeepSeek-V3-style block of tests/unit/test_moe_detect_properties.py
(sigmoid router, correction bias, group-limited top-k, scaled renormalised weights, shared
experts with their own gate, clamped activations, router z-loss, a dense layer first), and
tiny configs of transformers' DeepSeek-V3, Glm4-MoE, Dots1, Qwen3-MoE, OLMoE, GraniteMoE,
GraniteMoE-shared, Ernie-4.5-MoE, Jamba (a Mamba layer, replicated, before the MoE layer),
gpt-oss (expert biases gathered by the sorted expert ids) and Llama 4 text (dense experts: every
expert on every token, each rank running its half of the experts on both ranks' tokens) built from
their config classes (no network), each with a dense layer before the first MoE layer where the family has one. All run
in one spawned world, each family captured once before it forks (harness.capture_before_fork).
The families that cannot get ep and why: docs/moe_zoo.md.
"""
import os
import sys

import torch
import torch.nn.functional as F

import autopar
from harness import capture_before_fork, world

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_moe_detect_properties import DenseThenMoE  # noqa: E402

LOSS_ATOL = 1e-5
# every parameter after the steps, absolute and relative (fp32, as autopar/tools/zoo_check.py): Adam
# divides by sqrt(v), so a gradient element near zero turns summation-order noise into ~2e-5 of
# movement (measured: 1 element of 512 in the DeepSeek block); a wrong expert, bias or gradient
# scale moves parameters by ~lr = 1e-2
PARAM_TOL = 1e-4
BATCH, SEQ, VOCAB = 4, 8, 128


def _hf(kind):
    import transformers as T

    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
              use_cache=False, num_experts_per_tok=2)
    if kind == "deepseek_v3":
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4, **kw))
    if kind == "glm4_moe":
        return T.Glm4MoeForCausalLM(T.Glm4MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, num_key_value_heads=2,
            head_dim=8, **kw))
    if kind == "dots1":
        return T.Dots1ForCausalLM(T.Dots1Config(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, num_key_value_heads=2,
            head_dim=8, **kw))
    if kind == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                                      num_key_value_heads=2, head_dim=8, **kw))
    if kind == "olmoe":
        return T.OlmoeForCausalLM(T.OlmoeConfig(intermediate_size=16, num_experts=4, num_key_value_heads=2,
                                                pad_token_id=0, eos_token_id=1, **kw))
    if kind == "granitemoe":
        return T.GraniteMoeForCausalLM(T.GraniteMoeConfig(intermediate_size=16, num_local_experts=4,
                                                          num_key_value_heads=2, **kw))
    if kind == "granitemoeshared":
        return T.GraniteMoeSharedForCausalLM(T.GraniteMoeSharedConfig(
            intermediate_size=16, num_local_experts=4, num_key_value_heads=2, shared_intermediate_size=16, **kw))
    if kind == "ernie4_5_moe":
        kw.pop("num_experts_per_tok")
        return T.Ernie4_5_MoeForCausalLM(T.Ernie4_5_MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
            moe_layer_start_index=1, num_key_value_heads=2, **kw))
    if kind == "jamba":  # layer 0 attention + dense MLP, layer 1 Mamba (replicated, its torch path) + MoE
        return T.JambaForCausalLM(T.JambaConfig(
            intermediate_size=16, num_experts=4, num_key_value_heads=2, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=2, attn_layer_offset=0, mamba_d_state=4, mamba_dt_rank=4, **kw))
    if kind == "gpt_oss":
        return T.GptOssForCausalLM(T.GptOssConfig(intermediate_size=16, num_local_experts=4, num_key_value_heads=2,
                                                  head_dim=8, sliding_window=8, **kw))
    if kind == "llama4":  # dense experts: top-k scores scattered into (N, E), every expert on every token
        return T.Llama4ForCausalLM(T.Llama4TextConfig(intermediate_size=16, intermediate_size_mlp=64,
                                                      num_local_experts=4, num_key_value_heads=2, head_dim=8, **kw))
    raise KeyError(kind)


def _lm_loss(out, y):
    return F.cross_entropy(out["logits"].flatten(0, 1), y.flatten())


def _lm_batch(generator):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return (ids[:, :-1],), ids[:, 1:]


def _block_loss(out, y):
    pred, z_loss = out
    return F.mse_loss(pred, y) + 1e-3 * z_loss


def _block_batch(generator):
    return (torch.randn(BATCH * 2, 16, generator=generator),), torch.randn(BATCH * 2, 16, generator=generator)


def _build(kind):
    torch.manual_seed(0)
    if kind == "deepseek_block":
        return DenseThenMoE(clamp=True, shared_gate=True, z_loss=True), _block_loss, _block_batch
    return _hf(kind), _lm_loss, _lm_batch


def _train(kind, pm_of=None, steps=3):
    """Losses of `steps` AdamW steps, the number of expert dispatches in the program (None in one
    process) and the full state dict after the steps (the parallel run's from
    `autopar.export_state_dict`, gathered on rank 0, {} elsewhere)."""
    model, loss_fn, batch = _build(kind)
    g = torch.Generator().manual_seed(1)
    if pm_of is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        x0, _ = batch(torch.Generator().manual_seed(1))
        pm = pm_of(model, x0)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    losses = []
    for _ in range(steps):
        x, y = batch(g)
        if pm_of is None:
            loss = loss_fn(model(*x), y)
            loss.backward()
        else:
            loss = pm.step((x, y), loss_fn)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if pm_of is None:
        return losses, None, {k: v.detach().clone() for k, v in model.named_parameters()}
    n_dispatch = sum(1 for n in pm.graph_module.graph.nodes if "dispatch" in str(n.target))
    sd = autopar.export_state_dict(pm, like=model)
    return losses, n_dispatch, {k: v for k, v in sd.items() if k in dict(model.named_parameters())}


def _ranks(rank, ws, kinds):
    out = {}
    for kind in kinds:
        try:
            out[kind] = _train(kind, lambda m, x0: autopar.parallelize(m, autopar.mesh(ep=2), example_inputs=x0))
        except ValueError as e:  # reported per family, so one refusal does not hide the others
            out[kind] = f"{type(e).__name__}: {e}"
    return out


# kind -> the transformers config class it needs (the hand-written block needs none)
KINDS = {"deepseek_block": None, "deepseek_v3": "DeepseekV3Config", "glm4_moe": "Glm4MoeConfig",
         "dots1": "Dots1Config", "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig",
         "granitemoe": "GraniteMoeConfig", "granitemoeshared": "GraniteMoeSharedConfig",
         "ernie4_5_moe": "Ernie4_5_MoeConfig", "jamba": "JambaConfig", "gpt_oss": "GptOssConfig",
         "llama4": "Llama4TextConfig"}


def _mismatches(kind, got, ref) -> list[str]:
    """Why rank 0's result of `kind` differs from one process's, [] when it agrees: an expert
    dispatch in the program, the losses and every parameter after the steps."""
    if isinstance(got, str):
        return [f"{kind}: {got}"]
    (losses, n_dispatch, params), (ref_losses, _, ref_params) = got, ref
    out = [] if n_dispatch else [f"{kind}: no expert dispatch in the program"]
    try:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=LOSS_ATOL)
    except AssertionError as e:
        out.append(f"{kind}: losses {losses} vs one process {ref_losses}: {e}")
    if sorted(params) != sorted(ref_params):
        out.append(f"{kind}: parameters {sorted(set(params) ^ set(ref_params))[:4]} only on one side")
    for name in sorted(set(params) & set(ref_params)):
        try:
            torch.testing.assert_close(params[name], ref_params[name], rtol=PARAM_TOL, atol=PARAM_TOL)
        except AssertionError as e:
            out.append(f"{kind}: parameter {name} after {len(losses)} steps: {e}")
    return out


def test_ep2_moe_families_match_one_process_after_three_adamw_steps():
    import transformers

    kinds = [k for k, cfg in KINDS.items() if cfg is None or hasattr(transformers, cfg)]
    for kind in kinds:  # each family captured here once, not on each rank (the capture memo)
        model, _loss_fn, batch = _build(kind)
        capture_before_fork(model, batch(torch.Generator().manual_seed(1))[0])
    per_rank = world(2, _ranks, kinds, timeout_s=600.0)
    failures = []
    for kind in kinds:
        ref = _train(kind)
        failures += _mismatches(kind, per_rank[0][kind], ref)
        got1 = per_rank[1][kind]  # rank 1: the same losses (the export's parameters come back on rank 0)
        if isinstance(got1, str) or got1[0] != per_rank[0][kind][0]:
            failures.append(f"{kind} rank 1: {got1 if isinstance(got1, str) else got1[0]} vs rank 0")
    assert not failures, "\n".join(failures)
