"""Mesh axis groups inherit the job's collective timeout (torch's new_group would wait 30 minutes).

A world started with a 5 s collective timeout: ranks 2 and 3 share a tp group; rank 3 never
joins the second all-reduce, and rank 2 must get an error within the timeout's order of
magnitude (not hang), while ranks 0 and 1 finish normally.
"""
import time

import torch
import torch.distributed as dist

import autopar
from autopar.runtime.launch import run_world


def _rank(rank, ws):
    m = autopar.mesh(dp=2, tp=2)
    t = torch.ones(1)
    dist.all_reduce(t, group=m.group("tp"))
    if rank == 3:
        time.sleep(8)
        return ("slept", 0.0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=m.group("tp"))
        return ("ok", time.monotonic() - t0)
    except RuntimeError:
        return ("timed out", time.monotonic() - t0)


def test_axis_groups_time_out_like_the_default_group():
    out = run_world(4, _rank, timeout_s=90, collective_timeout_s=5.0)
    assert out[0][0] == "ok" and out[1][0] == "ok"
    status, waited = out[2]
    assert status == "timed out" and 4.0 <= waited < 15.0, out[2]
