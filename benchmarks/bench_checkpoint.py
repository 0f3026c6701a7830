"""Checkpoint save and load throughput: autopar against plain DCP on FSDP2, same model.

    python benchmarks/bench_checkpoint.py [--world 2] [--rounds 5] [--dim 512] [--layers 4]

Spawns a gloo world (CPU). The same GPT (same seed) is trained one AdamW step twice: as
`autopar.parallelize(..., dp=world, zero_stage=3)` and as FSDP2 (`fully_shard` per block and
root, the reference). Then, for `--rounds` rounds (alternating which goes first), each
writes its model and optimizer state to a fresh directory and reads it back:

  reference   get_state_dict(model, opt) -> dcp.save; dcp.load -> set_state_dict
  autopar     autopar.checkpoint_api.save(model, path, optimizer=opt)  (DCP underneath, plus
              SHA-256 of every file, the manifest and the atomic rename); load with
              verify="full" (hashes checked before reading) and verify="size"; the
              asynchronous save's blocking part (copy to CPU memory) and its total

Prints the checkpoint's size, the median time of each operation and its throughput (MB of
checkpoint per second, MB = 2**20 bytes), and the ratio of each autopar throughput to the
reference's measured in the same run (> 1: faster than plain DCP).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _world(rank: int, ws: int, rounds: int, dim: int, layers: int, root: str):
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import autopar
    from autopar import checkpoint_api as ck
    from autopar.models import GPT, GPTConfig
    from autopar.models.gpt import loss_fn

    cfg = GPTConfig(vocab_size=8192, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_dim=4 * dim,
                    max_seq_len=64)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2 * ws, 33), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]

    pm = autopar.parallelize(copy.deepcopy(base), autopar.mesh(dp=ws), example_inputs=(x,), zero_stage=3)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    pm.step(((x,), y), loss_fn)
    opt.step()

    ref = copy.deepcopy(base)
    for layer in ref.layers:
        fully_shard(layer, mesh=pm.mesh.device_mesh)
    fully_shard(ref, mesh=pm.mesh.device_mesh)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    k = x.shape[0] // ws
    loss_fn(ref(x[rank * k:(rank + 1) * k]), y[rank * k:(rank + 1) * k]).backward()
    ropt.step()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in ("ref_save", "ref_load", "ap_save", "ap_load_full",
                                                     "ap_load_size", "ap_async_block", "ap_async_total")}
    def ref_round(r: int):
        rd = os.path.join(root, f"ref_{r}")
        sd_m, sd_o = get_state_dict(ref, ropt)
        times["ref_save"].append(timed(lambda: dcp.save({"model": sd_m, "optim": sd_o}, checkpoint_id=rd)))

        def ref_load():
            m, o = get_state_dict(ref, ropt)
            state = {"model": m, "optim": o}
            dcp.load(state, checkpoint_id=rd)
            set_state_dict(ref, ropt, model_state_dict=state["model"], optim_state_dict=state["optim"])

        times["ref_load"].append(timed(ref_load))
        return rd

    def ap_round(r: int):
        ad = os.path.join(root, f"ap_{r}")
        times["ap_save"].append(timed(lambda: ck.save(pm, ad, optimizer=opt)))
        times["ap_load_full"].append(timed(lambda: ck.load(pm, ad, optimizer=opt, verify="full")))
        times["ap_load_size"].append(timed(lambda: ck.load(pm, ad, optimizer=opt, verify="size")))
        hd = os.path.join(root, f"apa_{r}")
        dist.barrier()
        t0 = time.perf_counter()
        h = ck.save(pm, hd, optimizer=opt, async_save=True)
        block = time.perf_counter() - t0
        h.wait()
        dist.barrier()
        times["ap_async_block"].append(block)
        times["ap_async_total"].append(time.perf_counter() - t0)
        return ad, hd

    sizes = {}
    for r in range(rounds):  # alternate who goes first, so that drifting machine load hits both alike
        if r % 2 == 0:
            rd = ref_round(r)
            ad, hd = ap_round(r)
        else:
            ad, hd = ap_round(r)
            rd = ref_round(r)
        if rank == 0:
            sizes = {"ref": _dir_bytes(rd), "ap": _dir_bytes(ad)}
            for d in (rd, ad, hd):
                shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
    n_params = sum(p.numel() for p in base.parameters())
    return {"times": times, "sizes": sizes, "params": n_params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    from autopar.runtime.launch import run_world

    root = tempfile.mkdtemp(prefix="autopar_bench_ckpt_")
    try:
        res = run_world(a.world, _world, a.rounds, a.dim, a.layers, root, timeout_s=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r0 = res[0]
    med = {k: statistics.median(max(r["times"][k][i] for r in res) for i in range(a.rounds))
           for k in r0["times"]}  # the slowest rank's time per round, median over rounds
    mb_ref, mb_ap = r0["sizes"]["ref"] / 2**20, r0["sizes"]["ap"] / 2**20
    print(f"GPT dim={a.dim} layers={a.layers}: {r0['params'] / 1e6:.1f} M parameters; gloo, world {a.world}, "
          f"{a.rounds} rounds; model + AdamW state")
    print(f"checkpoint size: DCP on FSDP2 {mb_ref:.1f} MB, autopar {mb_ap:.1f} MB")
    print(f"{'operation':44s} {'median s':>9s} {'MB/s':>9s} {'vs DCP':>7s}")
    ref = {"save": mb_ref / med["ref_save"], "load": mb_ref / med["ref_load"]}
    rows = [("DCP on FSDP2: save", "ref_save", mb_ref, "save"),
            ("DCP on FSDP2: load", "ref_load", mb_ref, "load"),
            ("autopar save (hash, manifest, rename)", "ap_save", mb_ap, "save"),
            ("autopar async save: blocking part", "ap_async_block", mb_ap, "save"),
            ("autopar async save: until written", "ap_async_total", mb_ap, "save"),
            ("autopar load, verify=full (SHA-256)", "ap_load_full", mb_ap, "load"),
            ("autopar load, verify=size", "ap_load_size", mb_ap, "load")]
    for label, key, mb, kind in rows:
        tput = mb / med[key]
        print(f"{label:44s} {med[key]:9.3f} {tput:9.1f} {tput / ref[kind]:7.2f}")


if __name__ == "__main__":
    main()
