"""The modules' own initialization replayed on a meta model (autopar/build/init_replay.py)
gives exactly the values of one process's `torch.manual_seed(s); build()` on the CPU, one full
tensor at a time, keeping only the requested pieces; what it cannot reproduce is named."""
import warnings

import pytest
import torch
import torch.nn as nn

from autopar.build.init_replay import replay_init
from autopar.models import get


def _tensors(m):
    return dict(list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)))


def _half_rows(t):
    """The second half of dim 0 (the whole tensor when it has fewer than 2 rows)."""
    if t.dim() and t.shape[0] >= 2:
        h = t.shape[0] // 2
        return ((h,) + (0,) * (t.dim() - 1), (t.shape[0] - h,) + tuple(t.shape[1:]))
    return ((0,) * t.dim(), tuple(t.shape))


def _check_exact(build, budget_bytes=None):
    torch.manual_seed(3)
    ref = _tensors(build())
    with torch.device("meta"):
        meta = build()
    keep = {n: [_half_rows(t)] for n, t in ref.items()}
    before = torch.get_rng_state()
    res = replay_init(meta, keep, seed=3, budget_bytes=budget_bytes)
    assert torch.equal(torch.get_rng_state(), before), "the replay changed the caller's RNG state"
    assert res.untouched == [] and res.inexact == []
    for n, t in ref.items():
        (off, shape), = keep[n]
        want = t.detach()[tuple(slice(o, o + s) for o, s in zip(off, shape))]
        assert torch.equal(res.pieces[n][0], want), n
    assert all(t.is_meta for t in _tensors(meta).values()), "the meta model itself must stay on meta"
    return res


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "vit-tiny"])
def test_reference_models_replay_bitwise_equal_to_a_seeded_cpu_build(name):
    _check_exact(lambda: get(name).build())


def test_one_tensor_at_a_time_budget_still_gives_exact_pieces():
    # budget 1 byte: every full tensor is cut to its kept piece as soon as another is touched
    _check_exact(lambda: get("gpt-tiny").build(), budget_bytes=1)


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama_replays_post_init_and_ties_as_the_real_build(tied):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, use_cache=False, tie_word_embeddings=tied)
    res = _check_exact(lambda: transformers.LlamaForCausalLM(cfg), budget_bytes=1)
    assert res.steps[0] == "clear _is_hf_initialized" and "<root>.initialize_weights" in res.steps


def test_transformers_qwen3_moe_replays_exactly():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128, num_experts=4, num_experts_per_tok=2, use_cache=False)
    _check_exact(lambda: transformers.Qwen3MoeForCausalLM(cfg))


class _RawDraw(nn.Module):
    """Draws in its constructor without a reset_parameters: cannot be replayed on meta."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_parameter_no_init_step_writes_is_named_as_not_reproduced():
    with torch.device("meta"):
        m = _RawDraw()
    res = replay_init(m, {n: [((0,) * t.dim(), tuple(t.shape))] for n, t in _tensors(m).items()}, seed=0)
    assert res.untouched == ["scale"]
    assert torch.equal(res.pieces["scale"][0], torch.zeros(4))  # zeros, the same on every rank
    assert set(res.pieces) >= {"lin.weight", "lin.bias"}


def test_parallelize_warns_naming_what_the_init_cannot_reproduce():
    import autopar

    with torch.device("meta"):
        m = _RawDraw()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pm = autopar.parallelize(m, autopar.mesh(dp=1), example_inputs=(torch.randn(2, 4),))
    assert any("scale" in str(x.message) and "NOT" in str(x.message) for x in w), [str(x.message) for x in w]
    assert any("NOT reproduced" in n and "scale" in n for n in pm.plan.notes), pm.plan.notes
    assert not any(t.is_meta for t in pm.program.parameters())


def test_constructors_that_draw_outside_reset_parameters_are_named():
    transformers = pytest.importorskip("transformers")
    from autopar.build.init_replay import constructor_draws

    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                    bos_token_id=0, eos_token_id=0))
        raw = _RawDraw()
        ours = get("gpt-tiny").build()
    assert constructor_draws(gpt2) == ["Conv1D.__init__ (normal_)"]  # transformers' Conv1D draws in __init__
    assert constructor_draws(raw) == ["_RawDraw.__init__ (torch.randn)"]
    assert constructor_draws(ours) == []
