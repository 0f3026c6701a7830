"""pm.train() / pm.eval() switch dropout and batch norm as PyTorch does, in every form of the program.

Models: a small MLP with BatchNorm1d and Dropout (defined here), and gpt-tiny with dropout 0.1.
Meshes (2 gloo ranks each, one world): dp=2 (one stage, batch norm synchronised over dp),
dp=2 with ZeRO-3, tp=2 (planned for an H100 so that it shards), pp=2 (a pipeline rank's stages).
The program with experts (ep=2) on moe-tiny with dropout 0.1 in its attention blocks.

Checks, per mesh:
  * eval outputs (`pm(x)` under no_grad after `pm.eval()`) and `pm.evaluate(batch, loss_fn)`
    equal one process in eval mode;
  * eval is repeatable (two calls give identical outputs) and leaves the running statistics
    (and num_batches_tracked) untouched;
  * in train mode dropout is on again (two forwards of one input differ) and batch norm uses
    batch statistics: with dropout 0, training steps after an eval match one process's
    training (loss every step), and the eval loss after them matches one process's eval loss
    (running statistics moved in training exactly as one process moves them).
Tolerances: fp32; 1e-5 absolute on outputs and losses (tp and the dp batch-norm all-reduce
change the order of sums: a few ulps), 1e-4 on losses after AdamW steps (as the tp tests).
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.gpt import loss_fn as gpt_loss
from harness import world

OUT_TOL, STEP_TOL = 1e-5, 1e-4
H100 = {"hardware": "h100-sxm"}


class Net(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


def _mse(out, y):
    return (out - y).pow(2).mean()


def _net(p):
    torch.manual_seed(0)
    return Net(p)


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    cfg.dropout = 0.1
    return GPT(cfg)


def _data(name, n, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        return torch.randint(0, 128, (n, 16), generator=g), torch.randint(0, 128, (n, 16), generator=g)
    return torch.randn(n, 8, generator=g) * 3 + 1, torch.randn(n, 4, generator=g)


def _stats(module):
    return {k: v.detach().clone() for k, v in module.named_buffers() if "running" in k or "num_batches" in k}


def _one_process_eval(model, x, y, loss_fn):
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        out = ref(x)
    return out, loss_fn(out, y)


MESHES = [({"dp": 2}, {}), ({"dp": 2}, {"zero_stage": 3}), ({"tp": 2}, H100), ({"pp": 2}, {})]


def _run(rank, ws):
    res = []
    for mesh_kw, opts in MESHES:
        for name in ("net", "gpt"):
            model = _net(0.3) if name == "net" else _gpt()
            loss_fn = _mse if name == "net" else gpt_loss
            x, y = _data(name, 8, 1)
            ref_out, ref_loss = _one_process_eval(model, x, y, loss_fn)
            pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(x,), **opts)
            before = _stats(pm.program.module)
            pm.eval()
            with torch.no_grad():
                out1, out2 = pm(x), pm(x)
            loss = pm.evaluate((x, y), loss_fn)
            after = _stats(pm.program.module)
            pm.train()
            with torch.no_grad():
                t1, t2 = pm(x), pm(x)
            res.append(dict(tag=f"{name} {mesh_kw} {opts}", out=out1, again=out2, ref_out=ref_out, loss=loss,
                            ref_loss=ref_loss, before=before, after=after, train_differs=not torch.equal(t1, t2),
                            kind=(type(pm.program).__name__, pm.program.pp)))
        # train after eval, with parity: batch norm only (dropout 0)
        model = _net(0.0)
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(_data("net", 8, 1)[0],), **opts)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2, eps=1e-6)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
        losses, ref_losses = [], []
        for i in range(3):
            x, y = _data("net", 8, 10 + i)
            pm.eval()
            ev = pm.evaluate((x, y), _mse)
            ref.eval()
            with torch.no_grad():
                ref_ev = _mse(ref(x), y)
            pm.train()
            losses += [ev.item(), pm.step((x, y), _mse).item()]
            opt.step()
            opt.zero_grad()
            ref.train()
            rl = _mse(ref(x), y)
            rl.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses += [ref_ev.item(), rl.item()]
        x, y = _data("net", 8, 99)
        pm.eval()
        ref.eval()
        with torch.no_grad():
            ref_last = _mse(ref(x), y).item()
        last = pm.evaluate((x, y), _mse).item()
        res.append(dict(tag=f"net-train-after-eval {mesh_kw} {opts}", losses=losses + [last],
                        ref_losses=ref_losses + [ref_last]))
    return res


def _check_eval(r):
    tag = r["tag"]
    torch.testing.assert_close(r["out"], r["ref_out"], rtol=0, atol=OUT_TOL, msg=lambda m: f"{tag} eval output: {m}")
    torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=0, atol=OUT_TOL, msg=lambda m: f"{tag} evaluate: {m}")
    assert torch.equal(r["out"], r["again"]), f"{tag}: two eval forwards of one input differ"
    assert r["before"].keys() == r["after"].keys()
    for k in r["before"]:
        assert torch.equal(r["before"][k], r["after"][k]), f"{tag}: eval changed buffer {k}"
    assert r["train_differs"], f"{tag}: in train mode after eval, dropout is off (two forwards are equal)"


def test_eval_matches_one_process_and_train_after_eval_matches_under_dp_zero3_tp_pp():
    results = world(2, _run)
    for per_rank in results:
        kinds = set()
        for r in per_rank:
            if "losses" in r:
                torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=0,
                                           atol=STEP_TOL, msg=lambda m, t=r["tag"]: f"{t} losses: {m}")
            else:
                _check_eval(r)
                kinds.add(r["kind"])
        assert kinds == {("Program", 1), ("Program", 2)}, kinds  # pp=1 (one stage) and pp=2: the same program kind
        assert any(r["before"] for r in per_rank if "before" in r), "no batch-norm statistics were checked"


def _run_moe(rank, ws):
    from autopar.models import MoE, MoEConfig
    from autopar.models import moe as moe_mod

    torch.manual_seed(0)
    cfg = MoEConfig.tiny()
    cfg.dropout = 0.1  # read by the attention block it shares with gpt.py
    model = MoE(cfg)
    x, y = _data("gpt", 8, 1)
    ref_out, ref_loss = _one_process_eval(model, x, y, moe_mod.loss_fn)
    pm = autopar.parallelize(model, autopar.mesh(ep=2), example_inputs=(x,))
    pm.eval()
    with torch.no_grad():
        out, again = pm(x), pm(x)
    loss = pm.evaluate((x, y), moe_mod.loss_fn)
    pm.train()
    with torch.no_grad():
        differs = not torch.equal(pm(x)[0], pm(x)[0])
    return (type(pm.program).__name__, pm.program.ep), out, again, ref_out, loss, ref_loss, differs


def test_expert_program_eval_matches_one_process():
    for kind, out, again, ref_out, loss, ref_loss, differs in world(2, _run_moe):
        assert kind == ("Program", 2)  # the one program kind, its batch split over ep=2
        assert differs, "train mode after eval: dropout is off"
        torch.testing.assert_close(again, out, rtol=0, atol=0)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=OUT_TOL)  # (logits, aux loss)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=OUT_TOL)
