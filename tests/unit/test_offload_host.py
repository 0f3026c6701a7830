"""runtime/offload.py: the fused optimizer default, host gradient staging, and batches that
reach the mesh's device (runtime.mesh.Mesh.to_device)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import get
from autopar.runtime.offload import GradStage, host_copy, optimizer_kwargs


def _params(dtype=torch.float64, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 7, generator=g, dtype=dtype)) for _ in range(n)]


def test_fused_is_added_only_where_torch_has_it_and_the_caller_chose_nothing():
    ps = _params()
    assert optimizer_kwargs(torch.optim.AdamW, {"lr": 1e-3}, ps) == {"lr": 1e-3, "fused": True}
    assert optimizer_kwargs(torch.optim.SGD, {"lr": 1e-3}, ps)["fused"] is True
    for chosen in ({"foreach": True}, {"fused": False}, {"differentiable": True}):
        assert optimizer_kwargs(torch.optim.AdamW, {"lr": 1e-3, **chosen}, ps) == {"lr": 1e-3, **chosen}
    assert "fused" not in optimizer_kwargs(torch.optim.RMSprop, {"lr": 1e-3}, ps)  # no fused kernel there
    assert "fused" not in optimizer_kwargs(torch.optim.AdamW, {}, [torch.zeros(2, dtype=torch.int64)])
    assert "fused" not in optimizer_kwargs(torch.optim.AdamW, {}, [])


@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                                    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
                                    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True})])
def test_the_fused_default_steps_like_the_plain_optimizer(cls, kw):
    """What offload gets by default on the CPU (fused=True) is the same update as torch's
    for-each implementation, in fp64 to rounding, over several steps."""
    a, b = _params(), _params()
    oa = cls(a, **kw, foreach=True)
    ob = cls(b, **optimizer_kwargs(cls, kw, b))
    assert ob.defaults.get("fused") is True
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in a]
        for ps, opt in ((a, oa), (b, ob)):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            opt.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_grad_stage_without_a_gpu_copies_into_the_masters_dtype():
    master = host_copy(torch.ones(4, 3, dtype=torch.bfloat16), torch.float32, pin=False)
    assert master.dtype == torch.float32 and master.device.type == "cpu" and not master.is_pinned()
    stage = GradStage(pin=False)
    v = torch.full((12,), 0.5, dtype=torch.bfloat16)
    g = stage.to_host(id(master), v, master)
    assert g.shape == master.shape and g.dtype == torch.float32 and torch.equal(g, torch.full((4, 3), 0.5))
    assert g.data_ptr() != v.data_ptr() and not stage.pending
    stage.wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a CPU batch reaching a GPU program")
def test_a_cpu_batch_reaches_a_gpu_program():
    spec = get("gpt-tiny")
    (x,), y = spec.example_batch(4)
    torch.manual_seed(0)
    model = spec.build().cuda()
    pm = autopar.parallelize(model, autopar.mesh(dp=1, device_type="cuda"), example_inputs=(x.cuda(),))
    out_cpu_in, out_gpu_in = pm(x), pm(x.cuda())
    assert out_cpu_in.device.type == "cuda"
    torch.testing.assert_close(out_cpu_in, out_gpu_in, rtol=0, atol=0)
    from autopar.models.gpt import loss_fn

    a = pm.step(((x,), y), loss_fn)  # targets too
    b = pm.step(((x.cuda(),), y.cuda()), loss_fn)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tune_fits_the_host_link_and_host_memory_from_the_offload_microbenchmarks():
    """`autopar tune` measures what offload runs on (pinned copies, the CPU's fused AdamW) and
    the fitted profile then predicts those measurements (tools/microbench + tools/tune)."""
    from autopar.cost import load_profile
    from autopar.tools.microbench import compute_suite, predicted_seconds, run_compute
    from autopar.tools.tune import fit_profile

    base = load_profile("h100-sxm")
    items = []
    for n in (2**24, 2**26):
        for direction in ("h2d", "d2h"):
            items.append({"kind": "host_copy", "dtype": "fp32", "numel": n, "direction": direction,
                          "bytes": 4.0 * n, "seconds": 4.0 * n / 40e9 + 5e-6})
        items.append({"kind": "host_step", "dtype": "fp32", "numel": n, "bytes": 28.0 * n,
                      "seconds": 28.0 * n / 120e9})
    fitted, fits = fit_profile(base, items, [])
    assert fitted.host_bandwidth == pytest.approx(40e9, rel=2e-2)
    assert fitted.host_memory_bandwidth == pytest.approx(120e9, rel=1e-6)
    assert fits["host memory (CPU fused AdamW)"]["was"] == base.host_memory_bandwidth
    for it in items:
        assert predicted_seconds(it, fitted) == pytest.approx(it["seconds"], rel=3e-2)
    # on this machine: the CPU step item of the suite runs and is priced by the same formula
    step = [i for i in compute_suite("cpu", quick=True) if i["kind"] == "host_step"][0]
    got = run_compute(step, "cpu")
    assert got["seconds"] > 0 and got["bytes"] == 28.0 * step["numel"]
    assert predicted_seconds(got, base) == pytest.approx(got["bytes"] / base.host_memory_bandwidth)
