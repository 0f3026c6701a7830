"""A plain multi-layer perceptron classifier: the smallest reference model.

`layers` is a stack of Linear + GELU blocks (`layers.{i}.fc`), then a Linear `head`.
Useful where a test needs a model with nothing but matmuls, biases and pointwise ops.
Default PyTorch Linear init, so `torch.manual_seed(s); MLP(cfg)` is deterministic and
`reset_parameters()` re-draws every weight in the same order as construction.

It reads and writes no `node.meta` keys (it is a model, not a pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPConfig:
    dim: int = 32  # input features
    hidden: int = 64  # width of every hidden layer
    n_layers: int = 2  # Linear + GELU blocks before the head
    n_classes: int = 8  # output logits


class MLPBlock(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.fc = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))  # (B, dim_out)


class MLP(nn.Module):
    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = config
        widths = [config.dim] + [config.hidden] * config.n_layers
        self.layers = nn.ModuleList(MLPBlock(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(widths[-1], config.n_classes)

    def reset_parameters(self) -> None:
        """Re-draw every weight from the current RNG (PyTorch's default Linear init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # (B, hidden)
        return self.head(x)  # (B, n_classes)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy. logits (B, n_classes), targets (B,) int64."""
    return F.cross_entropy(logits, targets)
