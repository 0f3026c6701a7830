"""bf16-mixed on an fp32 model whose forward casts (`.to()`, `type_as`): issue 21.

The reference GPT (gpt-tiny, fp32) casts its fp32 RoPE tables to the activations' dtype
(`cos.to(x.dtype)`), which torch.export records as `aten._assert_tensor_metadata(dtype=...)`
plus `aten.to`. Captured in fp32, that graph run with the engine's bf16 parameters mixed fp32
and bf16 operands and crashed at the first step ("Expected query, key, and value to have the
same dtype"). `autopar.parallelize(..., precision="bf16-mixed")` now captures the 16-bit program
the engine runs (autopar/capture.py `compute_dtype`: parameters and floating inputs bf16,
buffers as they are, on fake tensors), keeping the model's fp32 tensors as the masters' source.

On a 2-rank gloo world: dp2 under ZeRO 0 and ZeRO 3, and pp2 (1f1b, 2 micro-batches), each
trained three AdamW steps and compared with one process running the recipe written out
(`_recipe`): fp32 masters; per step, a copy of the masters with its parameters cast to bf16
(its fp32 RoPE buffers kept, as the engine keeps buffers); per dp half, or per micro-batch with
its loss seeded 1/M and the bf16 gradients accumulated on `.grad` as the engine does, a bf16
forward and backward; gradients cast to fp32 and averaged over the halves; fp32 AdamW.

Tolerances: both sides run the same bf16 operations on the same shapes, so they agree up to
the order of fp32 sums (measured on CPU, torch 2.13: bit-equal losses and parameters in all
three cells); as tests/dist/test_pipeline_compose.py's bf16 cells: losses rtol 1e-5 / atol 1e-5
(the losses are bf16 values: any difference is at least one bf16 ulp, 3e-2 at 4.9), parameters
rtol 1e-5 / atol 1e-6.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig, loss_fn
from reference_train import token_batches
from harness import world

WS, BATCH, SEQ, STEPS, LR, M = 2, 4, 16, 3, 1e-2, 2
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)
CELLS = [  # (cell, mesh axes, parallelize keywords, how the reference splits a batch)
    ("dp2 x ZeRO-0", {"dp": 2}, dict(zero_stage=0), "halves"),
    ("dp2 x ZeRO-3", {"dp": 2}, dict(zero_stage=3), "halves"),
    ("pp2 (1f1b, 2 micro-batches)", {"pp": 2, "dp": 1}, dict(n_microbatches=M, pins={"schedule": "1f1b"}),
     "micro"),
]


def _build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny())  # fp32 parameters and RoPE buffers


def _batches():
    return token_batches(STEPS, BATCH, SEQ)


def _recipe(split: str):
    """One process, the bf16-mixed recipe written out (see the module docstring)."""
    masters = _build()
    opt = torch.optim.AdamW(masters.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        low = copy.deepcopy(masters)
        for p in low.parameters():  # parameters to bf16; buffers (RoPE) stay fp32, as the engine keeps them
            p.data = p.data.to(torch.bfloat16)
        parts = [slice(r * BATCH // WS, (r + 1) * BATCH // WS) for r in range(WS)] if split == "halves" else \
            [slice(0, BATCH)]
        step = []
        for rows in parts:
            xr, yr = x[rows], y[rows]
            if split == "halves":
                loss = loss_fn(low(xr), yr)
                loss.backward()
                step.append(loss.detach().float())
            else:  # micro-batches: each loss seeded 1/M, bf16 gradients accumulated on .grad
                for mb in range(M):
                    mrows = slice(mb * BATCH // M, (mb + 1) * BATCH // M)
                    loss = loss_fn(low(xr[mrows]), yr[mrows])
                    loss.backward(torch.full((), 1.0 / M, dtype=loss.dtype))
                    step.append(loss.detach().float())
            for m, p in zip(masters.parameters(), low.parameters()):
                g = p.grad.float() / len(parts)
                m.grad = g if m.grad is None else m.grad + g
            low.zero_grad()
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(step).mean())
    return torch.stack(losses), {k: v.detach().clone() for k, v in masters.named_parameters()}


def _cells(rank, ws):
    out = {}
    for cell, axes, kw, _split in CELLS:
        batches = _batches()
        pm = autopar.parallelize(_build(), autopar.mesh(**axes), example_inputs=batches[0][0],
                                 precision="bf16-mixed", **kw)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
        losses = []
        for x, y in batches:
            losses.append(pm.step((x, y), loss_fn).detach().float())
            opt.step()
            opt.zero_grad()
        src = pm.program if hasattr(pm.program, "gather_full_state_dict") else pm.engine  # a pipeline: every stage's
        full = {k: v.detach().clone() for k, v in src.gather_full_state_dict().items()}
        asserts = sorted({str(n.kwargs.get("dtype")) for n in pm.global_graph.graph.nodes
                          if "_assert_tensor_metadata" in str(n.target)})
        engines = list(getattr(pm.engine, "engines", {0: pm.engine}).values())
        masters = sorted({str(sl.master.dtype) for e in engines for sl in e.slots})
        out[cell] = (torch.stack(losses), full, pm.capture_info.get("compute_dtype"), asserts, masters,
                     (pm.plan.param_dtype, pm.plan.master_dtype))
    return out


@pytest.fixture(scope="module")
def results():
    # the 16-bit capture once here: the forked ranks find it in autopar's capture memo
    autopar.capture(_build(), (_batches()[0][0],), compute_dtype=torch.bfloat16)
    return world(WS, _cells, timeout_s=600)


@pytest.mark.parametrize("cell", [c[0] for c in CELLS])
def test_an_fp32_gpt_trains_bf16_mixed_like_the_one_process_recipe(results, cell):
    split = next(c[3] for c in CELLS if c[0] == cell)
    ref_losses, ref_params = _recipe(split)
    for rank, res in enumerate(results):
        losses, full, compute, asserts, masters, fields = res[cell]
        assert compute == "bfloat16" and fields == ("bf16", "fp32"), (rank, compute, fields)
        # the RoPE buffer stays fp32 and is cast to the bf16 activations: the graph asserts what it runs
        assert asserts == ["torch.float32"], asserts
        assert masters == ["torch.float32"], masters
        torch.testing.assert_close(losses, ref_losses, **LOSS_TOL, msg=lambda m: f"{cell} rank {rank}: {m}")
    full = {k: v for res in results for k, v in res[cell][1].items()}  # a pipeline: each rank has its stage's
    assert set(ref_params) <= set(full), sorted(set(ref_params) - set(full))
    assert {full[b].dtype for b in ("rope_cos", "rope_sin")} == {torch.float32}  # buffers are not cast
    for k, ref in ref_params.items():
        torch.testing.assert_close(full[k].float(), ref, **PARAM_TOL, msg=lambda m: f"{cell} {k}: {m}")
