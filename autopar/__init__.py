"""autopar: make any PyTorch model train on many devices.

    mesh = autopar.mesh(dp=4)
    model = autopar.parallelize(model, mesh, example_inputs=(tokens,))
    opt = autopar.optimizer(model, torch.optim.AdamW, lr=3e-4)
    loss = model.step((tokens, targets), loss_fn); opt.step(); opt.zero_grad()
"""
from autopar.api import ParallelModel, mesh, optimizer, parallelize, sampler
from autopar.capture import CaptureError, capture
from autopar.passes.plan import Plan

__all__ = ["mesh", "parallelize", "optimizer", "sampler", "capture", "CaptureError", "Plan", "ParallelModel"]
__version__ = "0.1.0"
