"""autopar::sync_batch_norm and the sync_batchnorm pass.

* On one process (no batch axis) the op is aten.batch_norm in training mode: output, input /
  weight / bias gradients and the running statistics, in fp64 to 1e-12, for (N, C), (N, C, L)
  and (N, C, H, W), with and without affine parameters and running statistics; bf16 input
  accumulates in fp32 (within bf16's own rounding of the reference).
* The pass replaces exactly the batch norms whose input is batch-sharded on an axis of size
  > 1, leaves eval-mode ones and a dp=1 graph alone, and can be switched off by the plan.
Parity on a dp mesh (statistics over the whole batch) is the ResNet-50 rows of tests/dist/test_zoo.py.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.split_batch import split_batch
from autopar.passes.sync_batchnorm import sync_batchnorm
from autopar.runtime import sync_bn  # noqa: F401


@pytest.mark.parametrize("shape", [(6, 4), (5, 3, 7), (8, 5, 3, 3)])
@pytest.mark.parametrize("affine,track", [(True, True), (False, True), (True, False)])
def test_op_equals_batch_norm_on_one_process(shape, affine, track):
    g = torch.Generator().manual_seed(0)
    c = shape[1]
    x = torch.randn(*shape, dtype=torch.float64, generator=g) * 3 + 5
    w = torch.randn(c, dtype=torch.float64, generator=g) if affine else None
    b = torch.randn(c, dtype=torch.float64, generator=g) if affine else None
    dy = torch.randn(*shape, dtype=torch.float64, generator=g)
    stats = (torch.randn(c, dtype=torch.float64, generator=g), torch.rand(c, dtype=torch.float64, generator=g) + 0.5)
    inputs = [t for t in (x, w, b) if t is not None]

    def fresh():
        return [t.clone().requires_grad_() for t in inputs], [s.clone() for s in stats] if track else [None, None]

    (ins, (rm, rv)) = fresh()
    xi, wi, bi = ins[0], (ins[1] if affine else None), (ins[2] if affine else None)
    y = F.batch_norm(xi, rm, rv, wi, bi, True, 0.1, 1e-5)
    ref = torch.autograd.grad(y, ins, dy)
    (ins2, (rm2, rv2)) = fresh()
    xi2, wi2, bi2 = ins2[0], (ins2[1] if affine else None), (ins2[2] if affine else None)
    out = torch.ops.autopar.sync_batch_norm(xi2, wi2, bi2, 1e-5, "")
    torch.ops.autopar.update_running_stats(rm2, rv2, out[1], out[3], 0.1)
    got = torch.autograd.grad(out[0], ins2, dy)
    torch.testing.assert_close(out[0], y, atol=1e-12, rtol=0)
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0)
    if track:
        torch.testing.assert_close(rm2, rm, atol=1e-14, rtol=0)
        torch.testing.assert_close(rv2, rv, atol=1e-14, rtol=0)


def test_bf16_accumulates_in_fp32():
    x = torch.randn(16, 4, 5, 5) * 2 + 3
    ref = F.batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    plain = F.batch_norm(x.bfloat16(), None, None, None, None, True, 0.1, 1e-5).float()
    got = torch.ops.autopar.sync_batch_norm(x.bfloat16(), None, None, 1e-5, "")[0]
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() <= 2 * (plain - ref).abs().max() + 1e-2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.bn_eval = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4)
        self.bn_eval.eval()

    def forward(self, x):
        return self.bn_eval(self.bn(self.conv(x))).mean()


def _rewritten(dp: int, **extra):
    gm = autopar.capture(_Net(), (torch.randn(8, 3, 6, 6),))
    plan = Plan(mesh={"dp": dp}, dp_axis="dp")
    plan.extra.update(extra)
    ctx = PassContext(plan=plan, mesh_sizes={"dp": dp}, coords={"dp": 0})
    return PassManager([split_batch, sync_batchnorm]).run(gm, ctx, tag="t")


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_replaces_training_batch_norms_on_a_batch_axis_only():
    t = _targets(_rewritten(2))
    assert t.count("autopar.sync_batch_norm.default") == 1
    assert t.count("autopar.update_running_stats.default") == 1
    assert sum("batch_norm" in x and "sync" not in x for x in t) == 1  # the eval-mode one stays
    assert "autopar.sync_batch_norm.default" not in _targets(_rewritten(1))
    assert "autopar.sync_batch_norm.default" not in _targets(_rewritten(2, sync_batchnorm=False))
