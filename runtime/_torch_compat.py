"""The one home of private PyTorch APIs that autopar uses, each with the reason.

Everything else in autopar imports only public torch APIs. When a torch release moves one
of these, this file is the only one to change.
"""
from __future__ import annotations

import torch

# Fake tensors: capture and the opaque-leaf shape inference run modules on fake tensors.
# torch exposes no public constructor for a fake mode (torch.export uses it internally).
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: F401

__all__ = ["FakeTensorMode", "unset_fake_temporarily"]

# pytree: flattening nested inputs/outputs with a spec that round-trips. torch ships no public
# module for it in 2.11-2.13 (torch.utils.pytree does not exist there).
import torch.utils._pytree as pytree  # noqa: E402,F401

__all__ += ["pytree"]


# The default process group's timeout: mesh groups inherit it (new_group would otherwise wait
# torch's 30-minute default). torch has no public getter for a group's timeout.
def default_group_timeout(device_type: str):
    """The collective timeout (a datetime.timedelta) the default process group was created with,
    or None when this torch does not expose it. `new_group` without a timeout falls back to
    torch's 30-minute default, not to this one."""
    try:
        import torch.distributed.distributed_c10d as c10d

        pg = c10d._get_default_group()
        dev = torch.device("cuda" if device_type == "cuda" else "cpu")
        return pg._get_backend(dev).options._timeout
    except Exception:  # noqa: BLE001 - private API: absent or changed in this torch
        return None

__all__ += ["default_group_timeout"]


# The default process group's store: after a collective fails, the surviving ranks post to it
# to find out which ranks stopped (runtime/collective_errors.py). torch has no public getter.
def default_store():
    """The store the default process group was created with, or None (no group, or this torch
    does not expose it)."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API: absent or changed in this torch
        return None

__all__ += ["default_store"]
