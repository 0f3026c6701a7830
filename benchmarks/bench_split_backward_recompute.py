"""Why a zero-bubble stage holding checkpoint regions runs its backward whole (runtime/pipeline.py).

One process, one pipeline stage of checkpointed MLP blocks (`torch.utils.checkpoint`, plain
non-reentrant: the only kind that can be walked twice; a selective checkpoint raises on a
second backward). Contestants, each seeded with the same output gradient:

  fused   one full backward (what the executor runs at the stage's I: `fuse_backward`)
  split   `runtime.pipeline_split.backward_input` then `backward_weight` (the zero-bubble I/W)

and the same two without checkpointing, for scale. Printed per contestant: I and W seconds
(best of the repeats), the block forwards a step costs (forward + recomputes, counted with a
hook) and the ratio split / fused. Through a plain checkpoint every `W` autograd call (one per
parameter group) recomputes its region again: 4 blocks give 16 block forwards a step against 8,
which costs more than the pipeline bubble a W can fill. The gradients of every contestant are
checked equal to the unsplit, uncheckpointed reference.

    python benchmarks/bench_split_backward_recompute.py --dim 256 --tokens 1024 --blocks 4
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autopar.runtime.pipeline_split import backward_input, backward_weight


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):  # (T, C)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(a.dim) for _ in range(a.blocks))
    params = list(blocks.parameters())
    forwards = [0]
    for b in blocks:
        b.register_forward_pre_hook(lambda m, args: forwards.__setitem__(0, forwards[0] + 1))

    def run(split: bool, ckpt: bool):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(a.tokens, a.dim, generator=gen).requires_grad_()
        g = torch.randn(a.tokens, a.dim, generator=gen)
        for p in params:
            p.grad = None
        forwards[0] = 0
        y = x
        for b in blocks:
            y = checkpoint(b, y, use_reentrant=False) if ckpt else b(y)
        t0 = time.perf_counter()
        if split:
            (gx,), state = backward_input([y], [g], [x], params)
            t1 = time.perf_counter()
            backward_weight(state)
        else:
            torch.autograd.backward([y], [g])
            gx = x.grad
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, forwards[0], gx, [p.grad.clone() for p in params]

    _i, _w, _n, ref_x, ref_p = run(False, False)
    total = {}
    for ckpt in (False, True):
        for split in (False, True):
            runs = [run(split, ckpt) for _ in range(a.repeats)]
            i, w = min(r[0] for r in runs), min(r[1] for r in runs)
            last = runs[-1]
            ok = torch.allclose(last[3], ref_x) and all(torch.allclose(p, q) for p, q in zip(last[4], ref_p))
            total[(split, ckpt)] = i + w
            name = ("split" if split else "fused") + (" + checkpoint" if ckpt else "")
            print(f"{name:20s} I {i * 1e3:8.1f} ms  W {w * 1e3:8.1f} ms  block forwards {last[2]:3d}  "
                  f"gradients equal {ok}")
        print(f"  split / fused {'with' if ckpt else 'without'} checkpoint: "
              f"{total[(True, ckpt)] / total[(False, ckpt)]:.2f}")


if __name__ == "__main__":
    main()
