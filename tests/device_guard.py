"""A CPU stand-in for NCCL's device rule: catch a host tensor sent over a device group.

On a GPU the default group and the mesh's groups run NCCL, which rejects a CPU tensor ("No
backend type associated with device type cpu"); host-side values (step times, flags, plain
objects) must travel over a gloo group made for them (`runtime.mesh.host_group`, or a group
declared with `mark_host_group`). On a CPU machine every tensor is a CPU tensor, so the
device alone cannot show the mistake. `DeviceGuard` shows it by where a tensor came from:

* "host-born" tensors: made by a torch factory (`torch.tensor`, `zeros`, `arange`,
  `from_numpy`, ...) without a device, outside any `with torch.device(...)`, and what
  `clone`/`float`/`contiguous`/`*_like`/`cat`/`stack` make of them. On a GPU these are exactly
  the tensors that stay on the CPU. Placing one explicitly (`t.to(mesh.device)`,
  `torch.zeros(n, device=d)`) makes it a device tensor.
* every collective called from outside torch's own package (autopar's code, the test's) is
  checked: on a host group its tensors must be CPU tensors; on any other group (a device
  group: the default group, mesh axis groups) they must be on the guard's device type and
  not host-born. torch's internals (object collectives, DCP) are torch's business and only
  counted.

`with DeviceGuard("cpu") as g:` patches torch.distributed's collectives and the factories in
this process (a rank of a forked world); `g.violations` lists each offence with its call
site; `g.calls` counts (op, "host" | "device") for the test to check that both kinds ran.
Guarantees: everything patched is restored on exit. Reads and writes no node.meta keys.
"""
from __future__ import annotations

import collections
import inspect
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils import _device as torch_device_ctx

from autopar.runtime.mesh import is_host_group

HOST_BORN = "_autopar_host_born"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                      "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                      "all_to_all_single", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
                      "batch_isend_irecv", "barrier", "monitored_barrier")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")
FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "randperm", "eye", "linspace", "empty_strided", "from_numpy", "frombuffer")
LIKE = ("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like")
JOINS = ("cat", "stack")
METHODS = ("clone", "contiguous", "float", "double", "long", "int", "detach", "to")


def _plain(t: Any) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def is_host_born(t: torch.Tensor) -> bool:
    return bool(t.__dict__.get(HOST_BORN, False)) if _plain(t) else False


def _mark(t: Any, host: bool) -> None:
    if _plain(t) and not torch.compiler.is_compiling():
        if host:
            setattr(t, HOST_BORN, True)
        else:
            t.__dict__.pop(HOST_BORN, None)


def _device_given(args: tuple, kwargs: dict, first: int) -> bool:
    """Whether a factory call names a device (keyword, or a device / string positional from
    index `first`, as in Tensor.to(device))."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[first:first + 1])


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dist.P2POp):
        return [obj.tensor]
    return []


class DeviceGuard:
    """See the module docstring. `device_type`: what the job's device groups run on."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.violations: list[str] = []
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    # --- patching ------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, wrapper) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def __enter__(self) -> "DeviceGuard":
        originals = {}
        for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            originals[fn] = wrapper = self._collective(name, fn)
            self._patch(c10d, name, wrapper)
            if getattr(dist, name, None) is fn:
                self._patch(dist, name, wrapper)
        # aliases bound at import time (`_all_gather_single = dist.all_gather_into_tensor`)
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith("autopar"):
                continue
            for attr, val in list(vars(mod).items()):
                if callable(val) and val in originals and not attr.startswith("__"):
                    self._patch(mod, attr, originals[val])
        for name in FACTORIES:
            if hasattr(torch, name):
                self._patch(torch, name, self._factory(getattr(torch, name), first=None))
        for name in LIKE:
            if hasattr(torch, name):
                self._patch(torch, name, self._derived(getattr(torch, name), device_arg=True))
        for name in JOINS:
            self._patch(torch, name, self._derived(getattr(torch, name), device_arg=False))
        for name in METHODS:
            self._patch(torch.Tensor, name, self._method(getattr(torch.Tensor, name), name))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    # --- tagging -------------------------------------------------------------------------
    @staticmethod
    def _factory(fn, first):
        def factory(*args, **kwargs):
            out = fn(*args, **kwargs)
            placed = _device_given((), kwargs, 0) or torch_device_ctx.CURRENT_DEVICE is not None
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None  # as_tensor(t)
            _mark(out, (not placed) and (src is None or is_host_born(src)))
            return out

        factory.__wrapped__ = fn
        return factory

    @staticmethod
    def _derived(fn, device_arg: bool):
        def derived(*args, **kwargs):
            out = fn(*args, **kwargs)
            if device_arg and _device_given((), kwargs, 0):
                _mark(out, False)
                return out
            srcs = _tensors(args[0]) if args else []
            _mark(out, bool(srcs) and all(is_host_born(s) for s in srcs))
            return out

        derived.__wrapped__ = fn
        return derived

    @staticmethod
    def _method(fn, name: str):
        def method(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            if name == "to" and (_device_given(args, kwargs, 0) or (args and isinstance(args[0], torch.Tensor))):
                _mark(out, False)  # placed explicitly: on a GPU this is a device tensor now
            elif out is not self:
                _mark(out, is_host_born(self))
            return out

        method.__wrapped__ = fn
        return method

    # --- checking ------------------------------------------------------------------------
    def _collective(self, name: str, fn):
        sig = inspect.signature(fn)
        guard = self

        def collective(*args, **kwargs):
            caller = sys._getframe(1)
            if not caller.f_code.co_filename.startswith(_TORCH_DIR):
                guard._check(name, sig, args, kwargs, caller)
            return fn(*args, **kwargs)

        collective.__wrapped__ = fn
        return collective

    def _check(self, name: str, sig, args, kwargs, frame) -> None:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return  # torch will raise its own error
        params = bound.arguments
        if name == "batch_isend_irecv":
            pairs = [(op.group, [op.tensor]) for op in params.get("p2p_op_list", [])]
        else:
            tensors = [] if name in OBJECT_COLLECTIVES else [
                t for k, v in params.items() if k not in ("group",) for t in _tensors(v)]
            pairs = [(params.get("group"), tensors)]
        where = f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
        for group, tensors in pairs:
            host = is_host_group(group)
            with self._lock:
                self.calls[(name, "host" if host else "device")] += 1
            for t in tensors:
                bad = None
                if host and t.device.type != "cpu":
                    bad = f"a {t.device.type} tensor on a host (gloo) group"
                elif not host and t.device.type != self.device_type:
                    bad = f"a {t.device.type} tensor on a {self.device_type} group"
                elif not host and is_host_born(t):
                    bad = (f"a host tensor (made without a device) on a {self.device_type} group: NCCL rejects it "
                           "(\"No backend type associated with device type cpu\"); make it on the group's device "
                           "or send it over runtime.mesh.host_group()")
                if bad:
                    with self._lock:
                        self.violations.append(f"{name} at {where}: {bad}; shape {tuple(t.shape)} {t.dtype}")
