"""Dropout random numbers as Megatron's model-parallel RNG tracker gives them (runtime/rng.py,
passes/mark_random.py): dp ranks draw different masks; tp peers the same mask on a replicated
activation and different masks on a tp-sharded one; pp stages independent; one seed, one run.

Model: gpt-tiny with dropout 0.1 (on the embeddings and the residual branches), planned for an
H100 so that tp shards it, and a Megatron MLP (column-parallel fc1, dropout on its tp-sharded
output, row-parallel fc2) for the sharded case. Every rank seeds torch differently before
parallelize (`torch.manual_seed(100 + rank)`): the tracker still agrees across ranks (rank 0's
seed), which is what keeps replicated parameters equal.

Checks are exact (torch.equal): tp peers run the same ops on the same replicated values, so
their replicated parameters after AdamW steps are bitwise equal, and two runs from one seed
give bitwise equal losses.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.gpt import loss_fn as gpt_loss
from autopar.runtime import rng
from harness import world

H100 = {"hardware": "h100-sxm"}


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    cfg.dropout = 0.1
    return GPT(cfg)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n, 16), generator=g), torch.randint(0, 128, (n, 16), generator=g)


def _train(rank, mesh_kw, seed_all=None, steps=3):
    """gpt-tiny with dropout, 3 AdamW steps; returns losses, replicated params, a train-mode forward."""
    model = _gpt()
    torch.manual_seed(100 + rank if seed_all is None else seed_all)  # per-rank seeds unless told
    pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(_data(8, 1)[0],), **H100)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    losses = []
    for i in range(steps):
        x, y = _data(8, 10 + i)
        losses.append(pm.step((x, y), gpt_loss).item())
        opt.step()
        opt.zero_grad()
    layouts = pm.plan.param_layouts  # a parameter it does not name is replicated
    sharded = [k for k, lay in layouts.items() if any(type(p).__name__ == "Shard" for _a, p in lay.axes)]
    replicated = {k: v.detach().clone() for k, v in pm.program.module.named_parameters() if k not in sharded}
    with torch.no_grad():
        out = pm(_data(8, 5)[0])  # train mode: dropout on
    marks = [(n.target.__name__, n.args[-1]) for n in pm.graph_module.graph.nodes
             if n.op == "call_function" and n.target in (rng.dropout, rng.attention)]
    return dict(losses=losses, replicated=replicated, sharded=sharded, out=out, coords=pm.mesh.coords(rank),
                marks=marks)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 1024)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(1024, 256)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def _draws(tracker, axes):
    with tracker.fork(True):
        return rng.dropout(torch.ones(4096), 0.5, axes)


def _mlp_axes(rank):
    torch.manual_seed(0)
    pm = autopar.parallelize(MLP(), autopar.mesh(tp=2), example_inputs=(torch.randn(8, 16, 256),), **H100)
    marks = [n.args[2] for n in pm.graph_module.graph.nodes if n.op == "call_function" and n.target is rng.dropout]
    fc1 = {a: str(p) for a, p in pm.plan.param_layouts["fc1.weight"].axes}
    return marks, fc1, _draws(pm.program.rng, "tp"), _draws(pm.program.rng, "")


def _recompute_grads(rank):
    """One step of gpt-tiny with dropout, without and with recomputation of every block."""
    out = []
    for mode in (None, "full", "selective"):
        model = _gpt()
        torch.manual_seed(5)
        pins = {"recompute": {"layers.0": mode, "layers.1": mode}} if mode else None
        pm = autopar.parallelize(model, autopar.mesh(tp=2), example_inputs=(_data(8, 1)[0],), pins=pins, **H100)
        regions = [m for m in pm.program.module.modules() if type(m).__name__ == "CheckpointRegion"]
        assert len(regions) == (2 if mode else 0), (mode, regions)
        assert all(r.preserve_rng for r in regions)  # blocks with dropout replay their random draws
        loss = pm.step(_data(8, 2), gpt_loss)
        out.append((mode, loss, {k: p.grad.clone() for k, p in pm.program.module.named_parameters()}))
    return out


def _run_tp2(rank, ws):
    a = _train(rank, {"tp": 2})
    return a, _mlp_axes(rank), _recompute_grads(rank)


def test_tp2_replicated_parameters_stay_bitwise_equal_sharded_dropout_differs_and_recompute_replays_masks():
    (a0, (marks0, fc1, sh0, rep0), rec), (a1, (marks1, _fc1, sh1, rep1), _rec) = world(2, _run_tp2)
    assert a0["sharded"], "the plan shards nothing: tp would not be checked"
    assert a0["replicated"], "no replicated parameter to compare"
    for k, v in a0["replicated"].items():
        assert torch.equal(v, a1["replicated"][k]), f"replicated parameter {k} differs between tp ranks"
    assert a0["losses"] == a1["losses"]
    # every dropout of gpt-tiny was rewritten (embeddings, 2 x attention, 2 x 2 residual); attention
    # runs on heads sharded over tp, so its masks are drawn per tp rank
    assert len(a0["marks"]) == 7, a0["marks"]
    assert [ax for f, ax in a0["marks"] if f == "attention"] == ["tp", "tp"], a0["marks"]
    assert torch.equal(a0["out"], a1["out"]), "tp peers drew different masks on a replicated activation"
    # the Megatron MLP: fc1 column-parallel, so the dropout input is tp-sharded and marked so
    assert fc1.get("tp") == "S(0)", fc1
    assert marks0 == marks1 == ["tp"], marks0
    assert not torch.equal(sh0, sh1), "tp ranks drew the same mask on a tp-sharded activation"
    assert torch.equal(rep0, rep1), "tp ranks drew different masks on a replicated activation"


def _run_4(rank, ws):
    a = _train(rank, {"dp": 2, "tp": 2})
    b = _train(rank, {"dp": 2, "tp": 2})  # per-rank seeds again: the same run
    c = _train(rank, {"dp": 2, "tp": 2}, seed_all=7)  # another seed: another run
    torch.manual_seed(0)
    pm = autopar.parallelize(_gpt(), autopar.mesh(pp=2, tp=2), example_inputs=(_data(8, 1)[0],), **H100)
    pp = dict(coords=pm.mesh.coords(rank), rep=_draws(pm.program.rng, ""), sh=_draws(pm.program.rng, "tp"))
    return a, b, c, pp


    # recomputation replays the forward's masks: the same loss and gradients, bitwise
    _mode, loss, grads = rec[0]
    for mode, l2, g2 in rec[1:]:
        assert torch.equal(loss, l2), f"recompute {mode}: loss differs"
        for k, g in grads.items():
            assert torch.equal(g, g2[k]), f"recompute {mode}: gradient of {k} differs"


def test_dp2_tp2_dp_masks_differ_tp_equal_pp_independent_and_one_seed_one_run():
    res = world(4, _run_4)
    runs = [r[0] for r in res]
    by = {(r["coords"]["dp"], r["coords"]["tp"]): r for r in runs}
    for dp in (0, 1):
        for k, v in by[(dp, 0)]["replicated"].items():
            assert torch.equal(v, by[(dp, 1)]["replicated"][k]), f"dp {dp}: replicated {k} differs between tp ranks"
        assert torch.equal(by[(dp, 0)]["out"], by[(dp, 1)]["out"]), "tp peers drew different masks"
    for tp in (0, 1):  # same input, same parameters, train mode: only the masks differ between dp ranks
        assert not torch.equal(by[(0, tp)]["out"], by[(1, tp)]["out"]), "dp ranks drew the same masks"
    for a, b, c, _pp in res:
        assert a["losses"] == b["losses"], "two runs from one seed differ"
        assert a["losses"] != c["losses"], "another seed gave the same dropout (is dropout on at all?)"
    pp = {(r[3]["coords"]["pp"], r[3]["coords"]["tp"]): r[3] for r in res}
    for s in (0, 1):
        assert torch.equal(pp[(s, 0)]["rep"], pp[(s, 1)]["rep"]), "tp peers of a stage drew different masks"
        assert not torch.equal(pp[(s, 0)]["sh"], pp[(s, 1)]["sh"]), "tp ranks drew the same sharded mask"
    assert not torch.equal(pp[(0, 0)]["rep"], pp[(1, 0)]["rep"]), "the two pp stages drew the same masks"


def test_recomputed_dropout_draws_the_forward_mask():
    """Activation checkpointing replays the default generator, hence the tracker's draws."""
    from torch.utils.checkpoint import checkpoint

    tracker = rng.RNGTracker({"dp": 0}, seed=3)
    x = torch.randn(64, 32, requires_grad=True)
    with tracker.fork(True):
        y = checkpoint(lambda t: rng.dropout(t, 0.5, "tp") * 2, x, use_reentrant=False)
        y.sum().backward()
    kept = y.detach() != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(x.grad, kept.float() * 4.0, rtol=0, atol=0)  # 2 / (1 - p) where kept, else 0
