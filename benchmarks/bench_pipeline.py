"""Step time of autopar's pipeline against torch.distributed.pipelining.

Three contestants: `autopar.parallelize(model, autopar.mesh(pp=N))` (capture, the split pass,
stage graphs, the executor: what a user runs; split points and schedule pinned to the same
ones), autopar's `PipelineExecutor` alone on hand-written stage modules, and torch. The last
two run the same hand split of a Llama-style GPT (embedding + blocks on the first stage,
blocks + norm + head on the last), the same micro-batches and the same schedule:
`PipelineExecutor` with `gpipe` / `one_f_one_b` against `PipelineStage` + `ScheduleGPipe` /
`Schedule1F1B`, on gloo with 2 or 4 local processes. One step is forward + backward of every
micro-batch (no optimizer). The two are measured alternately, step by step, in the same
world; a step's wall time is the slowest rank's, its CPU time the busiest rank's (on a
machine shared with other jobs the CPU time shows the executor's own cost more steadily);
the medians over the steps are reported, with the ratios ours / torch (target <= 1.0) and
the losses (they must agree).

    python benchmarks/bench_pipeline.py --ranks 2 --microbatches 8 --steps 20
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar.models.gpt import GPT, GPTConfig, loss_fn
from autopar.runtime.launch import run_world
from autopar.runtime.mesh import make_mesh
from autopar.runtime.pipeline import PipelineExecutor, split_microbatches
from autopar.runtime.schedules import gpipe, one_f_one_b


class Stage(nn.Module):
    """A contiguous run of GPT blocks; the first stage embeds, the last normalises and projects.
    Only the hidden state crosses stages (torch's PipelineStage wants float activations)."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb = copy.deepcopy(model.tok_emb)
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in range(lo, hi))
        if last:
            self.norm, self.lm_head = copy.deepcopy(model.norm), copy.deepcopy(model.lm_head)
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x)  # (B, T, C)
        T = x.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)) if self.last else x


def _bench(rank, ws, args):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    cfg = dataclasses.replace(GPTConfig.tiny(), dim=args.dim, n_heads=8, n_kv_heads=4, ffn_dim=4 * args.dim,
                              n_layers=args.layers, vocab_size=args.vocab, max_seq_len=args.seq)
    model = GPT(cfg)
    per = args.layers // ws
    stage_mod = Stage(model, rank * per, (rank + 1) * per, rank == 0, rank == ws - 1)
    mesh = make_mesh(pp=ws)
    group = mesh.group("pp")
    M = args.microbatches
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (M * args.mb_size, args.seq), generator=g)
    tgt = torch.randint(0, args.vocab, (M * args.mb_size, args.seq), generator=g)
    mbs, tgts = split_microbatches(idx, M), split_microbatches(tgt, M)
    first, last = rank == 0, rank == ws - 1
    rows = []
    cuts = [f"layers.{per * i}" for i in range(1, ws)]
    for name, ours_sched, torch_cls, sched in (("GPipe", gpipe(ws, M), ScheduleGPipe, "gpipe"),
                                               ("1F1B", one_f_one_b(ws, M), Schedule1F1B, "1f1b")):
        ours_mod, ref_mod = copy.deepcopy(stage_mod), copy.deepcopy(stage_mod)
        pm = autopar.parallelize(copy.deepcopy(model), autopar.mesh(pp=ws), example_inputs=idx, n_microbatches=M,
                                 pins={"split_points": cuts, "schedule": sched, "fusions": []})
        ours = PipelineExecutor(ours_mod, ours_sched, mesh, loss_fn)
        pstage = PipelineStage(ref_mod, rank, ws, torch.device("cpu"), group=group)
        ref = torch_cls(pstage, n_microbatches=M, loss_fn=loss_fn)

        def run_ours():
            return ours.step(mbs if first else None, tgts if last else None)

        def run_par():
            return pm.step((idx, tgt), loss_fn)

        def run_torch():
            losses: list = []
            if first:
                ref.step(idx)
            elif last:
                ref.step(target=tgt, losses=losses)
            else:
                ref.step()
            out = torch.stack(losses).mean() if last else torch.zeros(())
            dist.broadcast(out, src=mesh.axis_ranks("pp", rank)[-1], group=group)
            return out

        who_all = ("par", "ours", "torch")
        wall = {w: [] for w in who_all}
        cpu = {w: [] for w in who_all}
        loss = {}
        runs = (("par", run_par), ("ours", run_ours), ("torch", run_torch))
        for k in range(args.warmup + args.steps):
            for who, fn in runs if k % 2 == 0 else runs[::-1]:
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                loss[who] = fn().item()
                dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if k >= args.warmup:
                    wall[who].append(dt[0].item())
                    cpu[who].append(dt[1].item())
            for m in (ours_mod, ref_mod):
                m.zero_grad(set_to_none=True)
            pm.engine.zero_grad(set_to_none=True)
        med = {f"{kind}_{who}": statistics.median(d[who]) for kind, d in (("wall", wall), ("cpu", cpu))
               for who in who_all}
        rows.append((name, med, loss["par"], loss["ours"], loss["torch"]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2, choices=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process")
    args = ap.parse_args(argv)
    if args.layers % args.ranks:
        raise SystemExit(f"--layers {args.layers} must be divisible by --ranks {args.ranks}")
    rows = run_world(args.ranks, _bench, args, threads=args.threads, timeout_s=1200)[0]
    print(f"pipeline step time, gloo, {args.ranks} ranks, {args.microbatches} micro-batches of "
          f"{args.mb_size}x{args.seq} tokens, GPT dim {args.dim} x {args.layers} layers; median of {args.steps} steps")
    print("wall: step time of the slowest rank; cpu: CPU seconds of the busiest rank (robust to a shared machine)")
    print("parallelize: autopar.parallelize(pp=N) end to end; executor: PipelineExecutor on hand-written stages")
    print(f"{'schedule':<8} {'wall parallelize':>16} {'ratio':>6} {'wall executor':>13} {'ratio':>6} {'wall torch':>10} "
          f"{'cpu parallelize':>15} {'ratio':>6} {'cpu executor':>12} {'ratio':>6} {'cpu torch':>9}  "
          "loss parallelize / executor / torch")
    for name, d, lp, lo, lt in rows:
        print(f"{name:<8} {d['wall_par'] * 1e3:>13.1f} ms {d['wall_par'] / d['wall_torch']:>6.3f} "
              f"{d['wall_ours'] * 1e3:>10.1f} ms {d['wall_ours'] / d['wall_torch']:>6.3f} {d['wall_torch'] * 1e3:>7.1f} ms "
              f"{d['cpu_par'] * 1e3:>12.1f} ms {d['cpu_par'] / d['cpu_torch']:>6.3f} "
              f"{d['cpu_ours'] * 1e3:>9.1f} ms {d['cpu_ours'] / d['cpu_torch']:>6.3f} {d['cpu_torch'] * 1e3:>6.1f} ms  "
              f"{lp:.5f} / {lo:.5f} / {lt:.5f}")


if __name__ == "__main__":
    main()
