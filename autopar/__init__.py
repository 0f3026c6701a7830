"""autopar: make any PyTorch model train on many devices.

    mesh = autopar.mesh(dp=4)
    model = autopar.parallelize(model, mesh, example_inputs=(tokens,))
    opt = autopar.optimizer(model, torch.optim.AdamW, lr=3e-4)
    loss = model.step((tokens, targets), loss_fn); opt.step(); opt.zero_grad()

The public names are loaded on first use (PEP 562 `__getattr__`): `import autopar`, or importing
one of its modules (`autopar.runtime.launch`, `autopar.tools.cli` for `autopar --help`), costs no
more than that module needs; the first access to any public name imports them all, the same
modules an eager `__init__` imported (measured on the loaded 2-core machine: `python -m autopar
--help` 2.9 CPU-s with an eager `__init__`, 0.1 now; `import autopar` 0.09, with a public name
2.5-2.9, torch alone 1.4). A submodule import never hides a public name of the same
name: `autopar.capture` is the function, also after `import autopar.capture` (the module stays in
sys.modules). Code that uses autopar's custom ops (`torch.ops.autopar.*`) without touching a public
name first imports the runtime module that defines them (`autopar.runtime.collectives`, ...), as
the tests' conftest.py loads the public names. Reads and writes no node.meta keys.
"""
import sys as _sys
import types as _types

__all__ = ["mesh", "parallelize", "optimizer", "sampler", "capture", "CaptureError", "Plan", "ParallelModel",
           "ModuleInit", "save_pretrained", "WeightSource", "PlanFormatError", "PlanMismatchError",
           "CheckpointSaveError", "CollectiveError", "cross_entropy"]
__all__ += ["save", "load", "latest_checkpoint", "verify_checkpoint", "export_state_dict", "import_state_dict",
            "fault_guard", "bounded_mesh", "init_restartable", "CheckpointError", "RankUnresponsiveError"]
__version__ = "0.1.0"


def _load() -> dict:
    """Import every public name (what `import autopar` imported eagerly before) into this module."""
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
    from autopar.checkpoint_api import (CheckpointError, RankUnresponsiveError, bounded_mesh, export_state_dict,
                                        fault_guard, import_state_dict, init_restartable, latest_checkpoint, load,
                                        save, verify_checkpoint)

    names = {"mesh": mesh, "parallelize": parallelize, "optimizer": optimizer, "sampler": sampler, "capture": capture,
             "CaptureError": CaptureError, "Plan": Plan, "ParallelModel": ParallelModel, "ModuleInit": ModuleInit,
             "save_pretrained": save_pretrained, "WeightSource": WeightSource, "PlanFormatError": PlanFormatError,
             "PlanMismatchError": PlanMismatchError, "CheckpointSaveError": CheckpointSaveError,
             "CollectiveError": CollectiveError, "cross_entropy": cross_entropy, "save": save, "load": load,
             "latest_checkpoint": latest_checkpoint, "verify_checkpoint": verify_checkpoint,
             "export_state_dict": export_state_dict, "import_state_dict": import_state_dict, "fault_guard": fault_guard,
             "bounded_mesh": bounded_mesh, "init_restartable": init_restartable, "CheckpointError": CheckpointError,
             "RankUnresponsiveError": RankUnresponsiveError}
    assert set(names) == set(__all__), sorted(set(__all__) ^ set(names))
    globals().update(names)  # straight into the module's dict: _Package.__setattr__ is not involved
    return names


def __getattr__(name: str):
    if name in __all__:
        return _load()[name]
    if not name.startswith("__"):  # `autopar.models`, `autopar.api`: the submodule, as after an eager import
        import importlib

        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """The package module: importing a submodule named like a public name (autopar.capture) does
    not replace the public name (the import system sets the submodule as an attribute)."""

    def __setattr__(self, name: str, value) -> None:
        if name in __all__ and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
