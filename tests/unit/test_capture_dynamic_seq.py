"""Capture at the right shape and dtype (autopar/capture.py), without processes.

Shape: `capture_for_search` (what `autopar.parallelize` on `autopar.mesh(world_size=N)` and
`autopar plan --world-size N` capture) keeps the token sequence symbolic when the joint planner
could choose context parallelism, and captures static otherwise with the reason, which the
planner's cp explanation quotes: image inputs (dim 1 is channels), a sequence no cp splits, a
model without attention (its plan is the static capture's plan), a model whose code fixes the
length, cp pinned off. `dynamic_seq=True` marks dim 1 only on inputs as long as the token ids.

Dtype: `compute_dtype=torch.bfloat16` on an fp32 model captures the 16-bit program the engine
runs (parameters and floating inputs bf16, buffers as they are) on fake tensors; the graph holds
the model's own fp32 tensors, floating inputs keep their dtype as placeholders, and the graph
run with the engine's tensors (parameters cast to bf16, buffers not) equals the eager bf16 model
bit for bit (the same ops on the same values).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture import capture, capture_for_search, sequence_refusal
from autopar.models.gpt import GPT, GPTConfig
from autopar.search.planner import clear_cache, plan_for


def _gpt(seq: int = 16) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=seq))


def _ids(b: int = 4, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(0))


def _dim1(gm) -> list:
    return [n.meta["val"].shape[1] for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dim() > 1]


class _TokensAndImage(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 8)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, ids, image):
        return self.emb(ids).mean(1) + self.conv(image).mean((2, 3))  # (B, 8)


class _FixedLength(nn.Module):
    """Attention, then the sequence flattened into a Linear: its code fixes the length at 16."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 8)
        self.head = nn.Linear(16 * 8, 4)

    def forward(self, ids):
        h = self.emb(ids)[:, None]  # (B, 1, T, 8)
        a = F.scaled_dot_product_attention(h, h, h, is_causal=True)[:, 0]  # (B, T, 8)
        return self.head(a.flatten(1))  # (B, 4)


def test_sequence_refusal_names_images_indivisible_sequences_and_single_ranks():
    assert sequence_refusal((_ids(),), {}, 4) == ""
    image = sequence_refusal((torch.randn(4, 3, 8, 8),), {}, 4)
    assert "no integer (batch, sequence) tensor" in image and "(4, 3, 8, 8)" in image
    odd = sequence_refusal((_ids(t=10),), {}, 4)  # cp=2 needs 4 | T, cp=4 needs 8 | T
    assert "10 tokens" in odd and "2 x cp zigzag chunks" in odd
    assert "no cp degree" in sequence_refusal((_ids(),), {}, 1)
    assert sequence_refusal((), {"input_ids": _ids(t=12), "pixel_mask": torch.ones(4, 12)}, 2) == ""


def test_dynamic_seq_marks_the_token_length_and_never_an_image_channel_dim():
    gm = capture(_TokensAndImage(), (_ids(), torch.randn(4, 3, 5, 5)), dynamic_seq=True)
    ids_t, image_c = _dim1(gm)
    assert isinstance(ids_t, torch.SymInt) and image_c == 3


def test_capture_for_search_keeps_a_gpt_sequence_symbolic_and_the_planner_searches_cp():
    gm = capture_for_search(_gpt(), (_ids(),), 4)
    assert gm.meta["autopar_capture"]["sequence"] == {"dynamic": True, "why": ""}
    assert isinstance(_dim1(gm)[0], torch.SymInt)
    clear_cache()
    plan, _report = plan_for(gm, 4, "cpu-gloo")
    cp_notes = [n for n in plan.notes if n.startswith("cp=")]
    assert cp_notes and "cp=2" in cp_notes[0] and "not possible" not in cp_notes[0], cp_notes  # cp=2 was costed


@pytest.mark.parametrize("case", ["image", "no attention", "fixed length", "cp pinned off"])
def test_capture_for_search_captures_static_with_the_reason_the_planner_quotes(case):
    if case == "image":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
        gm, why = capture_for_search(model, (torch.randn(4, 3, 8, 8),), 4), "no integer (batch, sequence) tensor"
    elif case == "no attention":
        model = nn.Sequential(nn.Embedding(128, 16), nn.Linear(16, 16))
        gm, why = capture_for_search(model, (_ids(),), 4), "no attention"
    elif case == "fixed length":
        gm, why = capture_for_search(_FixedLength(), (_ids(),), 4), "captured as 16, not a free size"
    else:
        gm, why = capture_for_search(_gpt(), (_ids(),), 4, cp=False), "cp is pinned to 1"
    seq = gm.meta["autopar_capture"]["sequence"]
    assert seq["dynamic"] is False and why in seq["why"], seq
    assert all(isinstance(d, int) for d in _dim1(gm))
    clear_cache()
    plan, _ = plan_for(gm, 4, "cpu-gloo")
    assert plan.mesh.get("cp", 1) == 1
    if case != "cp pinned off":  # a pin removes cp from the search: no row to explain
        assert any(why in n and "cp=1" in n for n in plan.notes), plan.notes


def test_a_model_without_attention_gets_the_plan_of_its_static_capture():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(128, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 128))

    searched = capture_for_search(build(), (_ids(8),), 4)
    static = capture(build(), (_ids(8),))
    plans = []
    for gm in (searched, static):
        clear_cache()
        plan, _ = plan_for(gm, 4, "cpu-gloo")
        plans.append(plan)
    a, b = plans
    assert (a.mesh, a.zero_stage, a.n_microbatches, a.strategies, a.param_layouts, a.split_points) == \
        (b.mesh, b.zero_stage, b.n_microbatches, b.strategies, b.param_layouts, b.split_points)
    assert a.predicted["step_s"] == b.predicted["step_s"]


def test_a_bf16_capture_of_an_fp32_gpt_is_the_16_bit_program_on_the_models_own_tensors():
    model = _gpt()
    x = _ids()
    gm = capture(model, (x,), compute_dtype=torch.bfloat16)
    assert gm.meta["autopar_capture"]["compute_dtype"] == "bfloat16"
    own = dict(model.named_parameters())
    assert all(t is own[n] for n, t in gm.named_parameters())  # no copies: the engine's masters come from these
    assert gm.rope_cos is model.rope_cos and gm.rope_cos.dtype == torch.float32
    params = {str(n.target): n.meta["val"].dtype for n in gm.graph.nodes if n.op == "get_attr"}
    assert params["tok_emb.weight"] == torch.bfloat16 and params["rope_cos"] == torch.float32
    sdpa = [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert {a.meta["val"].dtype for n in sdpa for a in n.args[:3]} == {torch.bfloat16}
    # run it with the engine's tensors (parameters cast to bf16, buffers kept) against eager bf16
    run, low = copy.deepcopy(gm), copy.deepcopy(model)
    for m in (run, low):
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16)
    torch.testing.assert_close(run(x)[0], low(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError):  # the fp32 capture asserts fp32 activations: issue 21's crash
        plain = copy.deepcopy(capture(model, (x,)))
        for p in plain.parameters():
            p.data = p.data.to(torch.bfloat16)
        plain(x)


def test_a_bf16_capture_keeps_floating_inputs_in_the_callers_dtype_and_casts_them_first():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(8, 16)
    gm = capture(model, (x,), compute_dtype=torch.bfloat16)
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    (first,) = ph.users
    assert ph.meta["val"].dtype == torch.float32 and first.target is torch.ops.aten._to_copy.default
    assert first.kwargs["dtype"] == torch.bfloat16 and first.meta["val"].dtype == torch.bfloat16
    low = copy.deepcopy(model).to(torch.bfloat16)
    run = copy.deepcopy(gm)
    for p in run.parameters():
        p.data = p.data.to(torch.bfloat16)
    torch.testing.assert_close(run(x)[0], low(x.to(torch.bfloat16)), rtol=0, atol=0)
    torch.testing.assert_close(run(x.to(torch.bfloat16))[0], low(x.to(torch.bfloat16)), rtol=0, atol=0)


def test_a_bf16_capture_of_a_meta_model_traces_on_fake_tensors_and_keeps_the_meta_ones():
    with torch.device("meta"):
        model = _gpt()
    gm = capture(model, (_ids(),), compute_dtype=torch.bfloat16, device="cpu")
    assert all(t.is_meta and t.dtype == torch.float32 for t in gm.parameters())
    vals = {n.meta["val"].dtype for n in gm.graph.nodes if n.op == "get_attr" and "weight" in str(n.target)}
    assert vals == {torch.bfloat16}


def test_an_unsupported_compute_dtype_is_refused_with_the_dtypes_that_run():
    with pytest.raises(ValueError, match="compute_dtype=torch.float64"):
        capture(_gpt(), (_ids(),), compute_dtype=torch.float64)


def test_the_model_is_left_as_it_was():
    model = _gpt()
    before = {n: (t.dtype, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    capture(model, (_ids(),), compute_dtype=torch.bfloat16)
    capture_for_search(model, (_ids(),), 4)
    after = {n: (t.dtype, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert after == before


def _long_gpt_source():
    import functools

    from autopar.models import token_batch
    from autopar.models.gpt import loss_fn
    from autopar.tools.model_source import ModelSource

    cfg = GPTConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256)
    return ModelSource("long-gpt", "long-gpt", "factory", lambda: GPT(cfg),
                       functools.partial(token_batch, vocab_size=128, max_seq_len=256), loss_fn, "cross-entropy", 256)


def test_autopar_plan_for_a_world_size_searches_cp_and_puts_it_on_a_long_sequence():
    from autopar.build.plan_check import check_plan_against_graph
    from autopar.tools.planning import capture_meta, plan_model, rank_graph

    source = _long_gpt_source()
    clear_cache()
    result = plan_model(source, world_size=4, hardware="cpu-gloo", batch=2, seq=256)
    plan = result.best.plan
    assert result.global_gm.meta["autopar_capture"]["sequence"] == {"dynamic": True, "why": ""}
    assert plan.mesh.get("cp", 1) > 1, plan.mesh  # 2 rows: dp splits them at most 2 ways
    method = plan.extra["context"]["method"]
    gm, _records = rank_graph(result.global_gm, plan, 0)  # what `autopar dump` writes: the exchange is in it
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any(f"{method}_attention" in t for t in targets), sorted(targets)
    assert "aten.scaled_dot_product_attention.default" not in targets
    # `autopar run` / `verify` check a plan file against the model captured again: a cp plan fits its graph
    check_plan_against_graph(plan, capture_meta(source, 2, 256, dynamic_seq=True), dict(plan.mesh))


def test_a_cp_axis_on_the_command_lines_mesh_points_at_world_size():
    from autopar.tools.planning import parse_mesh

    with pytest.raises(ValueError, match="give --world-size instead"):
        parse_mesh("dp=2,cp=2")
