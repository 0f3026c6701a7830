"""Faults: a lost rank under torchrun, and a rank that stops answering.

* Kill and resume: `ckpt_train_worker.py` under `torchrun --nproc-per-node 4 --max-restarts 1`
  (gloo, dp=2 x tp=2, ZeRO-3, AdamW, asynchronous checkpoints every 3 steps). Rank 1 dies
  before step 7 of the first attempt; torchrun restarts the job, which resumes from the last
  complete checkpoint (step 6) and finishes. Its loss at every step equals, exactly, the loss
  of an uninterrupted run of the same job (the first attempt's reference trajectory).
* A rank that stops answering (its main thread stops issuing collectives and answering in the
  middle of training): on a mesh whose groups time out after 6 s
  (`autopar.checkpoint_api.bounded_mesh`) and inside `fault_guard(6 s)`, every other rank
  fails with RankUnresponsiveError naming that rank within 2 x 6 + 8 s of the step's start,
  instead of waiting (torch's default for DeviceMesh groups is 30 minutes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar import checkpoint_api as ckpt
from autopar import models
from harness import capture_before_fork, world

HERE = os.path.dirname(os.path.abspath(__file__))


def test_torchrun_job_killed_at_one_rank_resumes_from_last_checkpoint_with_identical_losses(tmp_path):
    root = str(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "--max-restarts", "1", "--monitor-interval", "0.5", os.path.join(HERE, "ckpt_train_worker.py"),
           "--root", root, "--steps", "10", "--every", "3", "--kill-rank", "1", "--kill-step", "7"]
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT; once in CI, rank 3 of the resumed job,
    # "terminate called without an active exception", cause not found) prints every thread's
    # Python stack in the output below, so the next occurrence says where it was
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + _tracebacks(proc.stderr) + proc.stderr[-6000:]
    events = [json.loads(line) for line in open(os.path.join(root, "log.jsonl"))]
    ref = {e["step"]: e["loss"] for e in events if e["what"] == "ref"}
    assert sorted(ref) == list(range(10))
    assert {e["attempt"] for e in events if e["what"] == "ref"} == {0}
    # the first attempt died before step 7; the second resumed from step 6
    first = {e["step"]: e["loss"] for e in events if e["what"] == "run" and e["attempt"] == 0}
    assert sorted(first) == list(range(7)), sorted(first)
    resumes = [e for e in events if e["what"] == "resume"]
    assert [(r["attempt"], r["from"], r["path"]) for r in resumes] == [(1, 6, "step_0006")]
    second = {e["step"]: e["loss"] for e in events if e["what"] == "run" and e["attempt"] == 1}
    assert sorted(second) == list(range(6, 10))
    # the trajectory with the fault equals the uninterrupted one, step by step, exactly
    trajectory = {**first, **second}
    assert [trajectory[i] for i in range(10)] == [ref[i] for i in range(10)], (trajectory, ref)
    assert first[6] == second[6]  # step 6 ran twice (lost with the rank, redone after the restart)
    assert len(set(ref.values())) == 10  # the losses move: the comparison is not of constants
    assert sorted(os.listdir(os.path.join(root, "run"))) == ["step_0003", "step_0006", "step_0009"]


def _tracebacks(text: str, limit: int = 3) -> str:
    """The first `limit` Python tracebacks (and faulthandler dumps) in a job's output, 2,000
    characters each: a rank's own error can sit far above the last lines of four ranks' output."""
    out, at = [], 0
    while len(out) < limit:
        hits = [i for i in (text.find("Traceback (most recent call last)", at), text.find("Fatal Python error", at))
                if i >= 0]
        if not hits:
            break
        at = min(hits)
        out.append(text[at:at + 2000])
        at += 2000
    return "".join(f"\n--- {t}" for t in out) + ("\n--- last lines:\n" if out else "")


GROUP_TIMEOUT_S = 6.0  # above the skew of ordinary steps on a loaded CI machine
BOUND_S = 2 * GROUP_TIMEOUT_S + 8.0


def _hang(rank, ws, flags):
    mesh = ckpt.bounded_mesh(GROUP_TIMEOUT_S, dp=ws)
    spec = models.get("gpt-tiny")
    torch.manual_seed(0)
    (x,), y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(spec.build(), mesh, example_inputs=(x,))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    guard = ckpt.fault_guard(timeout_s=GROUP_TIMEOUT_S)
    dist.barrier()  # start the steps together (capture times differ by seconds)
    for step in range(3):
        if rank == 2 and step == 2:
            # stops answering: no collective, no reply, until every other rank has given up
            deadline = time.monotonic() + 90
            while len(os.listdir(flags)) < ws - 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            return {"rank": rank, "stopped": True}
        t0 = time.monotonic()
        try:
            with guard:
                pm.step(((x,), y), spec.loss_fn)
                opt.step()
                opt.zero_grad()
        except ckpt.RankUnresponsiveError as e:
            open(os.path.join(flags, str(rank)), "w").close()
            return {"rank": rank, "error": str(e), "seconds": time.monotonic() - t0, "step": step}
    return {"rank": rank, "finished": True}


def test_a_rank_that_stops_answering_is_named_by_every_other_rank_within_bounded_time(tmp_path):
    spec = models.get("gpt-tiny")
    (x,), _y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
    capture_before_fork(spec.build(), (x,))  # the ranks reuse this graph instead of each tracing it
    res = world(4, _hang, str(tmp_path), timeout_s=180)
    assert res[2] == {"rank": 2, "stopped": True}
    for r in (0, 1, 3):
        got = res[r]
        assert "error" in got, got
        assert got["step"] == 2 and "rank(s) [2] stopped answering" in got["error"], got
        assert got["seconds"] < BOUND_S, got
