"""The vocab-parallel loss end to end on gloo (`parallelize(..., loss_parallel=True)` with
`autopar.cross_entropy` as loss_fn): the logits stay sharded over the vocabulary on tp and the
loss runs on the shards (runtime/vocab_loss.py), on tp2, dp2 x tp2, pp2 x tp2 and a transformers
Llama and cp2 x tp2 (context parallel: each rank a zigzag half of every sequence), against one
process's `F.cross_entropy` over the global batch.

Each cell: the loss of every step, `pm.evaluate`'s loss after them, the first step's gradients
and the parameters after three AdamW steps (sharded ones put together over tp), fp64, within
1e-9 (absolute and relative); the targets hold ignore_index tokens spread unevenly over the
data-parallel halves of the batch (one half has 3x more), so a mean per rank averaged over dp
would miss the one-process loss by far more than the tolerance; and the rank's program returns
logits of V / tp columns (not gathered). A loss_fn other than autopar.cross_entropy on the same plan gets the gathered
logits and matches one process computing what it computes (a mean per dp half, averaged).
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.models import get
from harness import capture_before_fork, world

TOL = dict(rtol=1e-9, atol=1e-9)
BATCH, SEQ, VOCAB = 8, 16, 128
LS = 0.1  # label smoothing in some cells


def _gpt():
    torch.manual_seed(0)
    return get("gpt-tiny").build().double()


def _llama():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False)).double()


MODELS = {"gpt-tiny": _gpt, "hf-llama": _llama}


def _batches(steps=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        drop = torch.rand(BATCH, SEQ, generator=g)
        y[: BATCH // 2][drop[: BATCH // 2] < 0.6] = -100  # the first dp half: ~60 % ignored
        y[BATCH // 2:][drop[BATCH // 2:] < 0.2] = -100  # the second: ~20 %
        out.append((x, y))
    return out


def _ref_loss(name, ls):
    def f(out, y):
        z = out["logits"] if name == "hf-llama" else out
        return F.cross_entropy(z.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, label_smoothing=ls)
    return f


def _halves(loss_fn):
    """What a per-rank mean averaged over dp=2 computes: the mean of the two halves' means."""
    h = BATCH // 2
    return lambda out, y: 0.5 * (loss_fn(out[:h], y[:h]) + loss_fn(out[h:], y[h:]))


@functools.cache
def _one_process(name, ls, halves=False):
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    loss_fn = _halves(_ref_loss(name, ls)) if halves else _ref_loss(name, ls)
    losses, grads = [], None
    for i, (x, y) in enumerate(_batches()):
        loss = loss_fn(model(x), y)
        loss.backward()
        if i == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    x, y = _batches()[0]
    with torch.no_grad():  # evaluate's reference: the trained model on the first batch
        losses.append(loss_fn(model(x), y).item())
    return losses, grads, {k: v.detach().clone() for k, v in model.named_parameters()}


def _loss_fn(name, ls, kind):
    if kind == "other":  # not autopar's loss: the program gathers the logits for it
        return _ref_loss(name, ls)
    kw = {"label_smoothing": ls} if ls else {}
    if name == "hf-llama":
        kw["output"] = "logits"
    return functools.partial(autopar.cross_entropy, **kw) if kw else autopar.cross_entropy


def _rank(rank, ws, cells):
    out = []
    for name, mesh_kw, ls, kind, opts in cells:
        model = MODELS[name]()
        batches = _batches()
        pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(batches[0][0],),
                                 loss_parallel=True, hardware="h100-sxm", **opts)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2, eps=1e-6)
        loss_fn = _loss_fn(name, ls, kind)
        prog = pm.program
        width = None
        if prog.pp == 1:  # the rank's program itself: what leaves its graph
            local_x = prog.local_batch((batches[0][0], batches[0][1]))[0]
            with torch.no_grad():
                raw = prog.module(local_x)
            width = (raw[prog.vocab_shard["output"]] if isinstance(raw, (tuple, list)) else raw).shape[-1] \
                if prog.vocab_shard else -1
        losses, grads = [], {}
        for i, (x, y) in enumerate(batches):
            loss = pm.step(((x,), y), loss_fn)
            if i == 0:
                grads = {k: p.grad.clone() for m in prog.stages.values() for k, p in m.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        losses.append(pm.evaluate(((batches[0][0],), batches[0][1]), loss_fn).item())  # no grad, same loss path
        params = {k: p.detach().clone() for m in prog.stages.values() for k, p in m.named_parameters()}
        layouts = {k: str(lay.get("tp")) for k, lay in pm.plan.param_layouts.items()}
        out.append(dict(losses=losses, grads=grads, params=params, layouts=layouts, coords=pm.mesh.coords(rank),
                        width=width, shard=prog.vocab_shard, loss_parallel=pm.plan.loss_parallel))
    return out


def _full(per_rank, key, what, layouts):
    pieces = sorted((r["coords"].get("tp", 0), r[what][key]) for r in per_rank  # one copy per tp index
                    if all(v == 0 for a, v in r["coords"].items() if a not in ("tp", "pp")) and key in r[what])
    place = layouts.get(key, "R")
    if place.startswith("S("):
        return torch.cat([p for _, p in pieces], dim=int(place[2:-1]))
    return pieces[0][1]


def _check(results, cells):
    for j, (name, mesh_kw, ls, kind, _opts) in enumerate(cells):
        what = f"{name} {mesh_kw} ls={ls} {kind}"
        # another loss_fn: gathered logits, F.cross_entropy per rank averaged over dp (the mean of
        # the dp halves' means, not the global mean: why autopar.cross_entropy counts tokens globally)
        ref_losses, ref_grads, ref_params = _one_process(name, ls, halves=kind == "other")
        per = [r[j] for r in results]
        tp = mesh_kw.get("tp", 1)
        layouts = per[0]["layouts"]
        head = "lm_head.weight"
        assert layouts.get(head) == "S(0)", f"{what}: the head is not vocab-sharded: {layouts.get(head)}"
        for r in per:
            assert r["loss_parallel"], what
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), **TOL,
                                       msg=lambda m: f"{what} losses: {m}")
            if r["width"] is not None and kind == "autopar":  # the program's logits: this rank's V / tp columns
                assert r["width"] == VOCAB // tp, f"{what}: the program returns {r['width']} columns"
        assert any(r["shard"] for r in per), f"{what}: no rank keeps the logits sharded"
        for key, ref in ref_grads.items():
            torch.testing.assert_close(_full(per, key, "grads", layouts), ref, **TOL,
                                       msg=lambda m: f"{what} grad {key}: {m}")
        for key, ref in ref_params.items():
            torch.testing.assert_close(_full(per, key, "params", layouts), ref, **TOL,
                                       msg=lambda m: f"{what} param {key} after 3 steps: {m}")


CELLS_4 = [
    ("gpt-tiny", {"dp": 2, "tp": 2}, 0.0, "autopar", {}),
    ("gpt-tiny", {"pp": 2, "tp": 2}, LS, "autopar", {"n_microbatches": 2}),
    ("hf-llama", {"dp": 2, "tp": 2}, LS, "autopar", {}),
    ("gpt-tiny", {"dp": 2, "tp": 2}, 0.0, "other", {}),
    ("gpt-tiny", {"cp": 2, "tp": 2}, LS, "autopar", {}),  # each rank holds half of every sequence
]
CELLS_2 = [
    ("gpt-tiny", {"tp": 2}, LS, "autopar", {}),
]


def _capture(cells):
    for name, cp in dict.fromkeys((c[0], "cp" in c[1]) for c in cells):
        capture_before_fork(MODELS[name](), (_batches()[0][0],), cp=cp)


def test_tp2_vocab_parallel_loss_matches_one_process_after_three_adamw_steps():
    _capture(CELLS_2)
    _check(world(2, _rank, CELLS_2), CELLS_2)


def test_dp2_tp2_pp2_tp2_and_llama_vocab_parallel_loss_match_one_process():
    _capture(CELLS_4)
    _check(world(4, _rank, CELLS_4), CELLS_4)


def test_cross_entropy_refuses_what_it_does_not_compute():
    z, y = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    torch.testing.assert_close(autopar.cross_entropy(z, y), F.cross_entropy(z.reshape(-1, 5), y.reshape(-1)))
    with pytest.raises(ValueError, match="reduction='mean'"):
        autopar.cross_entropy(z, y, reduction="sum")
    with pytest.raises(ValueError, match="label_smoothing"):
        autopar.cross_entropy(z, y, label_smoothing=1.5)


# --- predicted = what runs: the step's peak memory with and without the vocab-parallel loss ----
MEM_V, MEM_B, MEM_T = 2048, 16, 32  # logits (16 x 32 x 2048 fp32: 4 MiB whole) dominate the step


def _mem_model():
    from autopar.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=MEM_V, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=MEM_T))


def _mem_rank(rank, ws):
    from autopar.cost import estimate
    from autopar.runtime.placement import Layout, Shard
    from memory_measure import step_peak

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, MEM_V, (MEM_B, MEM_T), generator=g), torch.randint(0, MEM_V, (MEM_B, MEM_T), generator=g))
               for _ in range(2)]
    out = {}
    for parallel in (False, True):
        pins = {"param_layouts": {"lm_head.weight": Layout.of({"tp": Shard(0)})}}
        pm = autopar.parallelize(_mem_model(), autopar.mesh(tp=2), example_inputs=(batches[0][0],), pins=pins,
                                 loss_parallel=parallel)
        loss_fn = autopar.cross_entropy if parallel else \
            (lambda z, y: F.cross_entropy(z.reshape(-1, MEM_V), y.reshape(-1)))
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)

        def one(i, pm=pm, opt=opt, loss_fn=loss_fn):
            pm.step(((batches[i][0],), batches[i][1]), loss_fn)
            opt.step()
            opt.zero_grad()

        one(0)  # the optimizer states
        measured = step_peak(lambda: one(1), pm, opt).peak
        est = estimate(pm.global_graph, pm.plan, "cpu-gloo", batch_is_global=True)
        out[parallel] = (measured, est.memory["peak"])
    return out


def test_predicted_step_peak_matches_the_measured_one_with_and_without_the_vocab_parallel_loss():
    """tp=2, the head column-parallel in both: gathered logits (F.cross_entropy) and the
    vocab-parallel loss; cost.estimate's peak within +-10 % of the measured step peak
    (tests/memory_measure.py, as tests/dist/test_memory_truth.py measures it), and the measured
    peak itself drops by more than the whole logits (4 MiB) with the parallel loss."""
    logits = MEM_B * MEM_T * MEM_V * 4
    for rank, r in enumerate(world(2, _mem_rank)):
        for parallel, (measured, predicted) in r.items():
            print(f"rank {rank} {'vocab-parallel' if parallel else 'gathered'}: measured {measured / 2**20:.3f} MiB, "
                  f"predicted {predicted / 2**20:.3f} MiB ({predicted / measured - 1:+.1%})")
            assert abs(predicted - measured) <= 0.10 * measured, (parallel, measured / 2**20, predicted / 2**20)
        assert r[False][0] - r[True][0] > logits, (r[False][0] / 2**20, r[True][0] / 2**20)
