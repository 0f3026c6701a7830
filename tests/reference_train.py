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


def assert_within_move(sd: dict, first: dict, ref: dict, bound: float, cell: str) -> dict[str, float]:
    """16-bit parity: every tensor of the recipe's final state `ref` is matched in `sd` to within
    `bound` times the distance the recipe moved it from `first` (its starting value). Prints the
    median and the worst three shares; returns {name: share}."""
    assert set(ref) <= set(sd), sorted(set(ref) - set(sd))
    rel = {}
    for k, want in ref.items():
        moved = (want - first[k]).norm().item()
        off = (sd[k].float() - want).norm().item()
        rel[k] = off / moved
        assert off <= bound * moved, f"{cell} {k}: {off:.3g} from the recipe, which moved it {moved:.3g}"
    order = sorted(rel, key=rel.get)
    print(f"{cell}: parameter tensors off the recipe by (share of their move) median {rel[order[len(order) // 2]]:.2%}, "
          f"worst {', '.join(f'{k} {rel[k]:.2%}' for k in order[-3:])}")
    return rel
