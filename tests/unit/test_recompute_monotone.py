"""Recompute under a shrinking memory budget (issue 22, item 6).

`plan_recompute` recomputes a prefix of one ladder (`search.recompute.ladder`: cheapest seconds
per byte freed first, GEMMs last), so a smaller budget never recomputes less; and
`cost.estimate` (what `plan.predicted` is filled from) walks the checkpointed regions, so the
predicted peak falls and the predicted step grows by the recomputed forward ops.
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.cost import analyze, estimate
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.plan import Plan
from autopar.build.recompute_plan import plan_recompute
from autopar.search.recompute import build_chain, ladder, recompute_class

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

BUDGETS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32))


def _llama() -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return T.LlamaForCausalLM(cfg)


@functools.lru_cache(maxsize=None)
def captured(name: str):
    if name == "llama":
        pytest.importorskip("transformers")
    model = _gpt() if name == "gpt-tiny" else _llama()
    model.train()
    idx = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    return autopar.capture(model, (idx,))


@functools.lru_cache(maxsize=None)
def sweep(name: str):
    gm = captured(name)
    return [plan_recompute(gm, b)[1] for b in BUDGETS]


def _kept(rep) -> dict[str, frozenset | None]:
    """Per layer what stays kept: None = everything (not checkpointed), else the cached keys."""
    out = {}
    for layer, mode in rep.modes.items():
        out[layer] = None if mode == "none" else frozenset(rep.save.get(layer, ())) if mode == "selective" \
            else frozenset()
    return out


def _within(small, large) -> bool:
    """`small` keeps no more than `large`, layer by layer (None keeps everything)."""
    if large is None:
        return True
    return small is not None and small <= large


@pytest.mark.parametrize("name", ["gpt-tiny", "llama"])
def test_a_smaller_memory_budget_never_recomputes_less(name):
    reps = sweep(name)
    for big, small, b_big, b_small in zip(reps, reps[1:], BUDGETS, BUDGETS[1:]):
        assert small.fits and small.predicted_peak <= small.budget_bytes
        kb, ks = _kept(big), _kept(small)
        assert all(_within(ks[layer], kb[layer]) for layer in kb), (b_big, b_small, big.modes, small.modes)
        assert small.predicted_saved <= big.predicted_saved, (b_big, b_small)
        assert small.recompute_s >= big.recompute_s - 1e-15, (b_big, b_small)
        assert small.solver["steps"] >= big.solver["steps"]
    assert reps[0].recompute_s == 0 and all(m == "none" for m in reps[0].modes.values())
    assert reps[-1].recompute_s > 0 and reps[-1].predicted_peak < reps[0].predicted_peak
    print(name, [round(r.recompute_s * 1e6, 1) for r in reps], [int(r.predicted_saved) for r in reps])


@pytest.mark.parametrize("name", ["gpt-tiny", "llama"])
def test_the_ladder_recomputes_norms_activations_and_attention_before_any_gemm(name):
    gm = captured(name)
    gc = analyze(gm, "cpu-gloo")
    chain = build_chain(gm, gc, gc.values(), "cpu-gloo")
    flat = [idx for group in ladder(chain) for _layer, idx in group if idx >= 0]
    classes = [recompute_class(gc.nodes[i].op) for i in flat]
    assert 3 in classes and any(c < 3 for c in classes)
    first_gemm = classes.index(3)
    assert all(c == 3 for c in classes[first_gemm:]), classes
    # every saveable node of every layer is on the ladder once
    assert sorted(flat) == sorted(it.index for s in chain.candidates for it in s.items)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama"])
def test_predicted_peak_and_step_reflect_the_chosen_recompute(name):
    gm = captured(name)
    rep = sweep(name)[BUDGETS.index(0.3)]
    assert any(m != "none" for m in rep.modes.values())
    plain = estimate(gm, Plan(mesh={"dp": 1}), "cpu-gloo")
    rc = estimate(gm, rep.apply(Plan(mesh={"dp": 1})), "cpu-gloo")
    assert rc.memory["peak"] < plain.memory["peak"]
    assert rc.memory["activation_peak"] == pytest.approx(rep.predicted_peak, rel=1e-9)
    assert rc.recompute_s == pytest.approx(rep.recompute_s, rel=1e-9) and rc.recompute_s > 0
    assert rc.step_s - plain.step_s == pytest.approx(rc.recompute_s, rel=1e-6)
    assert rc.summary()["recompute_s"] == rc.recompute_s
    assert not any("recompute" in n and "not modelled" in n for n in rc.notes)


def test_parallelize_memory_budget_predicts_with_the_recompute_it_runs():
    x = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    preds = {}
    for b in (1.0, 0.0):
        pm = autopar.parallelize(_gpt(), autopar.mesh(dp=1), example_inputs=(x,), memory_budget=b,
                                 hardware="cpu-gloo")
        preds[b] = (pm.plan.predicted, dict(pm.plan.recompute))
    (p1, r1), (p0, r0) = preds[1.0], preds[0.0]
    assert all(v == "none" for v in r1.values()) and any(v != "none" for v in r0.values())
    assert p0["peak_bytes"] < p1["peak_bytes"]
    assert p0["recompute_s"] > 0 and p1["recompute_s"] == 0
    assert p0["step_s"] == pytest.approx(p1["step_s"] + p0["recompute_s"], rel=1e-6)
