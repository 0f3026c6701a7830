"""Fused Triton kernels with torch references, and the registry the fusion pass reads.

Every op has a public function that runs its Triton kernel (forward and backward through one
autograd Function) on CUDA tensors and its torch reference elsewhere, or as forced by
`AUTOPAR_TRITON` (`auto` | `off` | `interpret`) / `TRITON_INTERPRET=1` (see `_dispatch`).
Importing this package never imports Triton.

`KERNELS` maps an op name to `Kernel(fused, reference, description)`; `fused` and
`reference` take the same arguments and compute the same function.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ._dispatch import DISPATCH_COUNTS, reset_dispatch_counts, triton_mode
from .activations import (bias_gelu, bias_gelu_reference, geglu, geglu_reference, swiglu,
                          swiglu_reference)
from .cross_entropy import (cross_entropy, cross_entropy_reference, linear_cross_entropy,
                            linear_cross_entropy_reference)
from .norms import (add_layer_norm, add_layer_norm_reference, add_rms_norm,
                    add_rms_norm_reference, layer_norm, layer_norm_reference, rms_norm,
                    rms_norm_reference)
from .rope import rope, rope_reference
from .softmax import softmax, softmax_reference


class Kernel(NamedTuple):
    fused: Callable
    reference: Callable
    description: str


KERNELS: dict[str, Kernel] = {
    "rms_norm": Kernel(rms_norm, rms_norm_reference,
                       "RMSNorm over the last dim, optional weight"),
    "layer_norm": Kernel(layer_norm, layer_norm_reference,
                         "LayerNorm over the last dim, optional weight and bias"),
    "add_rms_norm": Kernel(add_rms_norm, add_rms_norm_reference,
                           "residual add + RMSNorm; returns (sum, normed)"),
    "add_layer_norm": Kernel(add_layer_norm, add_layer_norm_reference,
                             "residual add + LayerNorm; returns (sum, normed)"),
    "swiglu": Kernel(swiglu, swiglu_reference, "silu(a) * b"),
    "geglu": Kernel(geglu, geglu_reference, "gelu(a) * b, erf or tanh GeLU"),
    "bias_gelu": Kernel(bias_gelu, bias_gelu_reference,
                        "gelu(x + bias), bias over the last dim, erf or tanh GeLU"),
    "rope": Kernel(rope, rope_reference,
                   "rotary embedding, rotate-half, (B,H,T,D) or (B,T,H,D), cos/sin (T,D)"),
    "softmax": Kernel(softmax, softmax_reference, "softmax over the last dim"),
    "cross_entropy": Kernel(cross_entropy, cross_entropy_reference,
                            "mean cross-entropy over rows, ignore_index, fp32 loss"),
    "linear_cross_entropy": Kernel(linear_cross_entropy, linear_cross_entropy_reference,
                                   "x @ W.T (+b) then cross-entropy, chunked over rows: "
                                   "the full logits never exist"),
}

__all__ = [
    "DISPATCH_COUNTS", "KERNELS", "Kernel", "reset_dispatch_counts", "triton_mode",
    *(name for name in KERNELS), *(f"{name}_reference" for name in KERNELS),
]
