"""cp x tp on a model that computes its norms in fp32 inside an fp64 model, as transformers'
LlamaRMSNorm and Qwen3RMSNorm do (`hidden.to(float32)`, statistics, `.to(input_dtype)`).

Under cp the sequence dim is symbolic, so tp cannot shard it (no sequence parallelism) and the
row-parallel projections' outputs stay P(sum) until something needs them whole. Before the fix
the sharding rule of `aten.to.dtype` let P(sum) pass through the norm's fp64 -> fp32 cast, and
the planner, finding an fp32 all-reduce half the bytes of an fp64 one, summed the partials
*after* rounding each to fp32: round(a) + round(b) instead of one process's round(a + b), an
error of fp32's eps times the partials' magnitude in every norm's input. The plan fuzz saw it as
transformers Llama / Qwen3 under cp2 x tp2 ending 2e-5 off after 3 AdamW steps (issue 21).
A cast lets P(sum) through only when it is exact (same dtype or a widening one).

Checks, one 4-rank gloo world: a small decoder of that kind (attention through SDPA, an fp32
`rms_norm` between fp64 casts, fp64 everywhere else, an odd hidden size so that tp keeps the
residual stream whole or P(sum) as in the search's plan for transformers Llama) under cp=2 x tp=2
(ring and Ulysses) trains two SGD steps (lr 1, so a parameter's error is its gradient's error)
equal to one process: the loss of each step and every parameter within 1e-12 (fp64). With the
old rule (P(sum) through every cast) the same world was 8.5e-9 off in the loss and 9.9e-9 in
the parameters: fp32 rounding of the norms' inputs. Without a world: the cast's rule offers
P(sum) for a widening cast and not for a narrowing one, nor for a cast to an integer.
"""
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from harness import world

# DIM is odd: tp cannot split the residual stream, which then stays whole or P(sum) between the
# row-parallel projections and the norms, as in the plan the search makes for transformers Llama
BATCH, SEQ, VOCAB, DIM, HEADS, HEAD_DIM, STEPS, TOL = 4, 16, 64, 33, 4, 8, 2, 1e-12


class Fp32RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalised in fp32 whatever the model's dtype. (As one
    `aten.rms_norm`, which keeps its feature dim whole: written out as pow / mean / rsqrt, tp may
    shard the mean over features, a legitimate reordering of an fp32 sum that no fp64 tolerance
    survives; the transformers models here are planned without it, see tests/fuzz/plans.py.)"""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = F.rms_norm(x.to(torch.float32), (x.size(-1),), eps=1e-6)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = Fp32RMSNorm(DIM), Fp32RMSNorm(DIM)
        self.q, self.k, self.v = (nn.Linear(DIM, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.up, self.down = nn.Linear(DIM, 64, bias=False), nn.Linear(64, DIM, bias=False)

    def forward(self, x):  # (B, T, C)
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, H, T, D)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(a)  # row-parallel under tp: P(sum) until the next norm
        return x + self.down(F.silu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = Fp32RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):  # (B, T) -> (B, T, V)
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _build():
    torch.manual_seed(0)
    net = Decoder().double()
    with torch.no_grad():  # norm weights away from 1, so that their gradients matter
        for m in net.modules():
            if isinstance(m, Fp32RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return net


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _reference():
    net = _build()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    losses = []
    for x, y in _batches():
        loss = _loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _cells(rank, ws, out_dir):
    results = {}
    for method in ("ring", "ulysses"):
        net = _build()
        data = _batches()
        pm = autopar.parallelize(net, autopar.mesh(cp=2, tp=2), example_inputs=(data[0][0],),
                                 context_method=method, hardware="h100-sxm", pins={"fusions": []})
        opt = autopar.optimizer(pm, torch.optim.SGD, lr=1.0)
        losses = []
        for x, y in data:
            losses.append(pm.step(((x,), y), _loss).item())
            opt.step()
            opt.zero_grad()
        sd = autopar.export_state_dict(pm, os.path.join(out_dir, f"{method}.pt"), like=net)
        results[method] = (losses, {k: v.detach().clone() for k, v in sd.items()})
    return results if rank == 0 else None


def test_cp2_tp2_fp32_norm_decoder_matches_one_process_after_two_sgd_steps():
    ref_losses, ref_sd = _reference()
    with tempfile.TemporaryDirectory() as d:
        got = world(4, _cells, d)[0]
    for method, (losses, sd) in got.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL,
                                   msg=lambda m: f"{method}: losses: {m}")
        assert set(sd) == set(ref_sd), f"{method}: exported keys {sorted(sd)} != {sorted(ref_sd)}"
        for k, v in ref_sd.items():
            torch.testing.assert_close(sd[k], v, rtol=0, atol=TOL, msg=lambda m: f"{method}: {k}: {m}")


def test_a_cast_passes_a_partial_sum_only_when_it_is_exact():
    from autopar.passes.rules.sharding import PS, strategies_for

    class Casts(nn.Module):
        def forward(self, x32, x64):
            return x32.to(torch.float64), x64.to(torch.float32), x64.to(torch.bfloat16), x64.to(torch.int64)

    gm = autopar.capture(Casts(), (torch.randn(4, 8), torch.randn(4, 8).double()))
    casts = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "call_function" and isinstance(v, torch.Tensor) and n.all_input_nodes and \
                n.all_input_nodes[0].op == "placeholder":
            casts[(str(n.all_input_nodes[0].meta["val"].dtype), str(v.dtype))] = n
    assert set(casts) == {("torch.float32", "torch.float64"), ("torch.float64", "torch.float32"),
                          ("torch.float64", "torch.bfloat16"), ("torch.float64", "torch.int64")}, casts
    offers = {k: any(s.out == PS for s in strategies_for(n, "tp", 2).strategies) for k, n in casts.items()}
    assert offers == {("torch.float32", "torch.float64"): True, ("torch.float64", "torch.float32"): False,
                      ("torch.float64", "torch.bfloat16"): False, ("torch.float64", "torch.int64"): False}, offers
