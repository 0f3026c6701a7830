"""autopar: make any PyTorch model train on many devices.

    mesh = autopar.mesh(dp=4)
    model = autopar.parallelize(model, mesh, example_inputs=(tokens,))
    opt = autopar.optimizer(model, torch.optim.AdamW, lr=3e-4)
    loss = model.step((tokens, targets), loss_fn); opt.step(); opt.zero_grad()
"""
from autopar.api import ParallelModel, mesh, optimizer, parallelize, sampler
from autopar.build.materialize import ModuleInit
from autopar.build.save_pretrained import save_pretrained
from autopar.build.weights import WeightSource
from autopar.capture import CaptureError, capture
from autopar.build.plan_check import PlanMismatchError
from autopar.passes.plan import Plan
from autopar.passes.plan_schema import PlanFormatError
from autopar.runtime.checkpoint import CheckpointSaveError
from autopar.runtime.collective_errors import CollectiveError
from autopar.runtime.vocab_loss import cross_entropy

__all__ = ["mesh", "parallelize", "optimizer", "sampler", "capture", "CaptureError", "Plan", "ParallelModel",
           "ModuleInit", "save_pretrained", "WeightSource", "PlanFormatError", "PlanMismatchError",
           "CheckpointSaveError", "CollectiveError", "cross_entropy"]
__version__ = "0.1.0"
from autopar.checkpoint_api import (CheckpointError, RankUnresponsiveError, bounded_mesh, export_state_dict,  # noqa: E402
                                    fault_guard, import_state_dict, init_restartable, latest_checkpoint, load, save,
                                    verify_checkpoint)

__all__ += ["save", "load", "latest_checkpoint", "verify_checkpoint", "export_state_dict", "import_state_dict",
            "fault_guard", "bounded_mesh", "init_restartable", "CheckpointError", "RankUnresponsiveError"]
