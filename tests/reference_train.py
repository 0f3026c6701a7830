"""The one-process reference the parity tests compare a parallel run with: `model` trained one
AdamW step per (inputs, targets) batch, `zero_grad` after each step; and the token batches those
tests feed both sides."""
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


def token_batches(steps: int, batch: int, seq: int, *, vocab: int = 128, seed: int = 1) -> list[tuple]:
    """`steps` (inputs, next-token targets) pairs of (batch, seq) int64 token ids below `vocab`,
    the same for a given seed (one generator drawn in order)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out
