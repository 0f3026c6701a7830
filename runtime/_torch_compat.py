"""The one home of private PyTorch APIs that autopar uses, each with the reason.

Everything else in autopar imports only public torch APIs. When a torch release moves one
of these, this file is the only one to change.
"""
from __future__ import annotations

# Fake tensors: capture and the opaque-leaf shape inference run modules on fake tensors.
# torch exposes no public constructor for a fake mode (torch.export uses it internally).
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: F401

__all__ = ["FakeTensorMode", "unset_fake_temporarily"]

# pytree: flattening nested inputs/outputs with a spec that round-trips. torch ships no public
# module for it in 2.11-2.13 (torch.utils.pytree does not exist there).
import torch.utils._pytree as pytree  # noqa: E402,F401

__all__ += ["pytree"]
