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

# Dispatch modes: init_replay records the ops that fill a meta model's tensors. torch exposes
# TorchDispatchMode only from this private module (2.11-2.13).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401

__all__ += ["TorchDispatchMode"]


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


# Attention blocks with their log-sum-exp (runtime/context_attention.py): ring attention merges
# per-block results through the log-sum-exp, which public F.scaled_dot_product_attention does not
# return; the fused SDPA kernels that do are underscore aten ops. Dropout is always 0 here.
def sdpa_block_kernel(q: torch.Tensor) -> str | None:
    """Which fused SDPA-with-lse kernel fits a (B, H, T, D) block of `q`'s device and dtype:
    "cpu_flash", "cuda_flash" (fp16/bf16, D % 8 == 0, D <= 256), or None (use plain math)."""
    aten = torch.ops.aten
    if q.device.type == "cpu" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu_flash" if q.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16) else None
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) % 8 == 0
            and q.size(-1) <= 256 and hasattr(aten, "_scaled_dot_product_flash_attention")):
        return "cuda_flash"
    return None


def sdpa_block_forward(q, k, v, is_causal: bool, scale: float):
    """(out in q's dtype, lse (B, H, Tq): fp32, fp64 for fp64 on the CPU) of one block; q, k, v
    (B, H, T, D) with equal heads; causal is the top-left lower triangle (square blocks)."""
    aten = torch.ops.aten
    if sdpa_block_kernel(q) == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=None, scale=scale)
    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return r[0], r[1]


def sdpa_block_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """(dq, dk, dv) of one block given the output and log-sum-exp of the whole row (the kernel
    forms P = exp(S * scale - lse) and rowsum(dout * out) from them, so a block's share of the
    gradient comes out when they are the merged ones)."""
    aten = torch.ops.aten
    if sdpa_block_kernel(q) == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal,
                                                                          attn_mask=None, scale=scale)
    # no dropout: the kernel does not read the rng state; no varlen: no cumulative lengths
    # (empty, not zeros: uint64 has no fill kernel on every device)
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, None, None, q.size(2), k.size(2),
                                                             0.0, is_causal, rng, unused, scale=scale)

__all__ += ["sdpa_block_kernel", "sdpa_block_forward", "sdpa_block_backward"]


# An op overload's schema (argument names and defaults): OpOverload has no public accessor;
# `_schema` is what torch's own passes read.
def op_schema(target):
    """The torch._C.FunctionSchema of an op overload, or None for any other callable."""
    return getattr(target, "_schema", None)


__all__ += ["op_schema"]


# Lazy GraphModules: `fx.GraphModule(...)` and `gm.recompile()` generate and exec the graph's
# Python code at once (fx `_exec_with_source` and its code generation: 15 % of the ranks' CPU in
# the test worlds, 2026-11-26), mostly for graphs that never run: the capture memo's copy, the
# rank copy, each pass's intermediate graph, other pipeline ranks' stages. torch.fx's lazy
# variant (private, used by inductor) generates it at the first call or `.code` read instead.
try:
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
except ImportError:  # a torch without it: modules compile eagerly, as before
    _Lazy = None


def lazy_graph_module(root, graph, class_name: str = "GraphModule"):
    """`fx.GraphModule(root, graph, class_name)` whose code is generated when first needed (its
    first call, `.code`, printing, pickling); a plain, eagerly compiled GraphModule on a torch
    without lazy graph modules. `recompile()` on it only marks the code stale."""
    if _Lazy is None:
        import torch.fx as fx  # noqa: PLC0415

        return fx.GraphModule(root, graph, class_name)
    return _Lazy(root, graph, class_name)


def compile_graph_modules(module) -> None:
    """Generate now the code of every lazy GraphModule in `module` (itself and its submodules)
    whose code is stale. Call it on a module about to run: the lazy forward's first call re-enters
    `__call__`, so hooks registered on the module would run twice on that call."""
    if _Lazy is None:
        return
    for m in module.modules():
        if isinstance(m, _Lazy):
            m.real_recompile()

__all__ += ["lazy_graph_module", "compile_graph_modules"]
