"""The one-process reference the parity tests compare a parallel run with: `model` trained one
AdamW step per (inputs, targets) batch, `zero_grad` after each step."""
import torch


def adamw_steps(model, batches, loss_fn, *, lr: float) -> tuple[list[float], torch.nn.Module]:
    """Train `model` in place, one AdamW step (lr `lr`, torch's other defaults) per batch of
    `batches`; returns (every step's loss, the trained model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model
