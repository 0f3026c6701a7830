"""Host memory for the ZeRO engines: where masters live off the device, and copies that do not stall.

With `offload=True` the fp32 masters, their gradients and the optimizer states live in CPU
memory while the model computes on the GPU. Three things decide whether that costs a
fraction of a second per step or many seconds (measured on one H100 with a 1.1 B GPT, see
benchmarks/RESULTS.md):
  * pageable host memory: every device <-> host copy of it goes through a bounce buffer
    and blocks the host; page-locked (pinned) memory is copied by the DMA engines, async;
  * dtype conversion during a cross-device `copy_`: ATen converts on the source's device
    first (an fp32 CPU master becomes a pageable bf16 temporary, copied synchronously), so
    copies here move the tensor in its own dtype and convert on the device;
  * the update itself: torch's `fused=True` Adam/AdamW/SGD/Adagrad run one vectorised,
    multi-threaded kernel on the CPU (and one kernel on the GPU) instead of one op per
    tensor per step.

`host_copy` makes a master (pinned where a GPU is in use); `to_device` moves a host tensor to
the device without blocking; `GradStage` brings gradients to pinned host buffers without
blocking and waits once, before anything on the host reads them; `optimizer_kwargs` adds
`fused=True` where torch has a fused kernel and the caller chose no implementation.
Reads and writes no node.meta keys.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["host_copy", "to_device", "GradStage", "optimizer_kwargs", "FUSED_OPTIMIZERS"]

# torch optimizers with a fused kernel on the CPU and on CUDA (torch >= 2.4)
FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _pin(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.pin_memory()
    except RuntimeError:  # no CUDA runtime, or the host refused to lock more memory: stay pageable
        return t


def host_copy(t: torch.Tensor, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A CPU copy of `t` in `dtype`, page-locked when `pin` (a GPU computes on it)."""
    out = t.detach().to("cpu", dtype, copy=True)
    return _pin(out) if pin else out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` in its own dtype; async when it is pinned host memory (stream-ordered
    with every later kernel on the current stream, so the result is safe to use at once)."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=t.is_pinned())


class GradStage:
    """Device gradients -> host buffers, one persistent pinned buffer per tensor, copied
    without blocking; `wait()` before the host reads any of them (the optimizer, clipping,
    the loss scaler's inf check)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[int, torch.Tensor] = {}
        self.pending = False

    def to_host(self, key: int, v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped and typed like `like` holding `v`'s values. The copy may still
        be in flight: call `wait()` before reading it on the host."""
        v = v.reshape(like.shape)
        if not (self.pin and v.device.type == "cuda"):
            return v.to(like.device, like.dtype, copy=True)
        buf = self.buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.buffers[key] = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
        if v.dtype != like.dtype:
            v = v.to(like.dtype)  # convert on the device, then one DMA copy in the host's dtype
        buf.copy_(v, non_blocking=True)
        self.pending = True
        return buf

    def wait(self) -> None:
        if self.pending:
            torch.cuda.current_stream().synchronize()
            self.pending = False


def optimizer_kwargs(cls: type, kwargs: dict[str, Any], masters: list[torch.Tensor]) -> dict[str, Any]:
    """`kwargs` with `fused=True` when `cls` is one of torch's fused optimizers, the caller
    set none of fused / foreach / differentiable, and every master is a floating tensor on
    the CPU or on CUDA."""
    if cls not in FUSED_OPTIMIZERS or any(k in kwargs for k in ("fused", "foreach", "differentiable")):
        return kwargs
    if not masters or any(not m.is_floating_point() or m.device.type not in ("cpu", "cuda") for m in masters):
        return kwargs
    if len({m.device for m in masters}) != 1:
        return kwargs
    return {**kwargs, "fused": True}
