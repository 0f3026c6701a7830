"""Hangs become errors, without fault_guard: a stuck or dead rank is named, with the collective
and the step, by every rank that waits for it.

* Stuck: 3 gloo ranks, collective timeout 5 s, an MLP under ZeRO-3 (dp=3). Rank 2 stops
  issuing collectives before step 2 (it sleeps until the others have failed); ranks 0 and 1
  raise CollectiveError within 5 s + the 1 s census + 4 s slack of the step's start, naming
  rank 2 as stopped, the all-gather on axis 'dp' with its ranks, and "step 2 > micro-batch
  1/1 forward > graph node ...".
* Dead: 2 ranks; rank 1's process ends after the first all-reduce; rank 0's next all-reduce
  fails (gloo: connection closed, at once) and names rank 1 within the same bound.
"""
import os
import time

import torch
import torch.distributed as dist

import autopar
from autopar.models import MLP, MLPConfig
from autopar.models.mlp import loss_fn
from autopar.runtime import collectives as C
from autopar.runtime.collective_errors import CollectiveError, where
from autopar.runtime.mesh import make_mesh
from autopar.runtime.launch import run_world

TIMEOUT_S = 5.0
BOUND_S = TIMEOUT_S + 1.0 + 4.0


def _warm_custom_ops():
    C.set_active_mesh(make_mesh(dp=1), rank=0)
    torch.ops.autopar.split(torch.ones(2), "dp", 0)
    C.set_active_mesh(None)


_warm_custom_ops()


def _stuck(rank, ws, flags):
    torch.manual_seed(0)
    x, y = torch.randn(6, 12), torch.randint(0, 5, (6,))
    pm = autopar.parallelize(MLP(MLPConfig(dim=12, hidden=16, n_classes=5)), autopar.mesh(dp=ws),
                             example_inputs=(x,), zero_stage=3)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    dist.barrier()  # start the steps together (capture times differ)
    for step in (1, 2, 3):
        if rank == 2 and step == 2:  # stops: no collective, until the others have failed
            deadline = time.monotonic() + 40
            while len(os.listdir(flags)) < ws - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            return {"stopped": True}
        t0 = time.monotonic()
        try:
            pm.step((x, y), loss_fn)
            opt.step()
            opt.zero_grad()
        except CollectiveError as e:
            open(os.path.join(flags, str(rank)), "w").close()
            return {"step": step, "seconds": time.monotonic() - t0, "error": str(e), "silent": e.silent,
                    "op": e.op, "axis": e.axis, "ranks": e.ranks}
    return {"finished": True}


def test_a_stuck_rank_is_named_with_the_collective_and_the_step_by_every_other_rank(tmp_path):
    res = run_world(3, _stuck, str(tmp_path), timeout_s=120, collective_timeout_s=TIMEOUT_S)
    assert res[2] == {"stopped": True}
    for r in (0, 1):
        got = res[r]
        assert "error" in got, got
        assert got["step"] == 2 and got["seconds"] < BOUND_S, got
        assert got["silent"] == [2] and (got["op"], got["axis"], got["ranks"]) == ("all_gather", "dp", [0, 1, 2])
        msg = got["error"]
        assert msg.startswith(f"rank {r}: collective all_gather on axis 'dp' #"), msg
        assert "(group ranks [0, 1, 2]) failed at step 2 > micro-batch 1/1 forward > graph node " in msg, msg
        assert "rank(s) [2] stopped" in msg and f"rank {1 - r} failed in all_gather" in msg, msg
        assert "Collectives wait at most 5 s" in msg and "Timed out" in msg, msg


def _dead(rank, ws, out):
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    C.all_reduce_(torch.ones(4), "dp")
    if rank == 1:
        return {"left": True}  # this process ends: its connections close
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        with where("step 7"):
            C.all_reduce_(torch.ones(4), "dp")
        result = {"no error": True}
    except CollectiveError as e:
        result = {"seconds": time.monotonic() - t0, "error": str(e), "silent": e.silent}
    with open(out, "w") as f:  # written before returning: the world may stop once rank 1 is gone
        f.write(repr(result))
    return result


def test_a_dead_rank_is_named_with_the_collective_and_the_step(tmp_path):
    out = str(tmp_path / "rank0.txt")
    res = run_world(2, _dead, out, timeout_s=60, collective_timeout_s=TIMEOUT_S)
    assert res[1] == {"left": True}
    got = res[0]
    assert "error" in got, got
    assert got["silent"] == [1] and got["seconds"] < BOUND_S, got
    msg = got["error"]
    assert msg.startswith("rank 0: collective all_reduce on axis 'dp' #1 (group ranks [0, 1]) failed at step 7: ")
    assert "rank(s) [1] stopped" in msg, msg
