"""Expert parallelism on the MoE families people train, through `autopar.parallelize` with
`autopar.mesh(ep=2)` on 2 gloo ranks against the same model in one process (same seed, same
batches): the losses of three AdamW steps agree to 1e-5 (fp32; the rewrite computes every
expert on exactly its rows, so only summation order differs).

Models: the hand-written DeepSeek-V3-style block of tests/unit/test_moe_detect_properties.py
(sigmoid router, correction bias, group-limited top-k, scaled renormalised weights, shared
experts with their own gate, clamped activations, router z-loss, a dense layer first), and
tiny configs of transformers' DeepSeek-V3, Glm4-MoE, Dots1, Qwen3-MoE and OLMoE built from their
config classes (no network), each with a dense layer before the first MoE layer where the
family has one. All run in one spawned world.
"""
import os
import sys

import torch
import torch.nn.functional as F

import autopar
from harness import world

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_moe_detect_properties import DenseThenMoE  # noqa: E402

LOSS_ATOL = 1e-5
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
    model, loss_fn, batch = _build(kind)
    g = torch.Generator().manual_seed(1)
    if pm_of is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        x0, _ = batch(torch.Generator().manual_seed(1))
        model = pm_of(model, x0)
        opt = autopar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    losses = []
    for _ in range(steps):
        x, y = batch(g)
        if pm_of is None:
            loss = loss_fn(model(*x), y)
            loss.backward()
        else:
            loss = model.step((x, y), loss_fn)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, (None if pm_of is None else
                    sum(1 for n in model.graph_module.graph.nodes if "dispatch" in str(n.target)))


def _ranks(rank, ws, kinds):
    out = {}
    for kind in kinds:
        try:
            out[kind] = _train(kind, lambda m, x0: autopar.parallelize(m, autopar.mesh(ep=2), example_inputs=x0))
        except ValueError as e:  # reported per family, so one refusal does not hide the others
            out[kind] = f"{type(e).__name__}: {e}"
    return out


KINDS = ["deepseek_block", "deepseek_v3", "glm4_moe", "dots1", "qwen3_moe", "olmoe"]


def test_ep2_moe_families_match_one_process_after_three_adamw_steps():
    import transformers

    kinds = [k for k in KINDS if k == "deepseek_block" or hasattr(transformers, {
        "deepseek_v3": "DeepseekV3Config", "glm4_moe": "Glm4MoeConfig", "dots1": "Dots1Config",
        "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig"}[k])]
    per_rank = world(2, _ranks, kinds, timeout_s=480.0)
    failures = []
    for kind in kinds:
        ref, _ = _train(kind)
        for rank, out in enumerate(per_rank):
            got = out[kind]
            if isinstance(got, str):
                failures.append(f"{kind} rank {rank}: {got}")
                continue
            losses, n_dispatch = got
            if not n_dispatch:
                failures.append(f"{kind} rank {rank}: no expert dispatch in the program")
            try:
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=0, atol=LOSS_ATOL)
            except AssertionError as e:
                failures.append(f"{kind} rank {rank}: losses {losses} vs one process {ref}: {e}")
    assert not failures, "\n".join(failures)
