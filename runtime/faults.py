"""Faults in a running job: restartable start-up, groups that time out, and naming the rank
that stopped answering.

* `init_restartable()`: `init_process_group` for a torchrun job with `--max-restarts`; the
  restarted attempt gets its own rendezvous keys (plain env:// init of a restarted gloo job
  reads the dead attempt's addresses from torchrun's store and fails, measured on torch 2.13).
* `bounded_device_mesh(sizes, timeout_s)`: a DeviceMesh whose process groups time out, so that
  a collective waiting on a silent rank fails; DeviceMesh's own groups wait 30 minutes
  whatever timeout `init_process_group` was given.
* `FaultGuard(timeout_s)`: `with guard:` around a step. When a collective inside fails, every
  surviving rank pings every other rank over a separate gloo group (`probe_ranks`), from its
  main thread, and raises `RankUnresponsiveError` naming the ranks that did not answer within
  `timeout_s` — a dead process, or one whose main thread is stuck anywhere but in a
  collective that has failed. When every rank answers, the original error propagates.

Without a guard a hang is an error too: every collective of the runtime waits at most the job's
collective timeout (runtime/timeouts.py, 60 s by default) and then raises `CollectiveError`
naming the collective, the step and the ranks that stopped (runtime/collective_errors.py);
inside a guard that error is what the guard's probe starts from.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Mapping

import torch
import torch.distributed as dist

from .collective_errors import guarded
from .launch import init_job_process_group
from .timeouts import collective_timeout_s
from .mesh import device_mesh_with_timeout, mark_host_group


class RankUnresponsiveError(RuntimeError):
    """One or more ranks stopped answering; the message names them."""


def bounded_device_mesh(sizes: Mapping[str, int], timeout_s: float, device_type: str = "cpu"):
    """A DeviceMesh over the running job (row-major over `sizes`) whose process groups time out
    after `timeout_s` (collective: every rank calls it). Meshes built by autopar inherit the
    default group's timeout already; this one sets its own."""
    return device_mesh_with_timeout(sizes, datetime.timedelta(seconds=timeout_s), device_type)


def init_restartable(backend: str | None = None, timeout_s: float | None = None) -> None:
    """init_process_group for a torchrun job that may be restarted (--max-restarts): the
    rendezvous keys get a per-attempt prefix. Measured on torch 2.13 with --standalone: the
    plain env:// init of a restarted gloo job reads the dead attempt's addresses from the
    agent's store and fails with "Gloo connectFullMesh failed ... Connection refused".
    `timeout_s`: the job's collective timeout (None: $AUTOPAR_COLLECTIVE_TIMEOUT_S, else 60 s)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    timeout_s = collective_timeout_s(timeout_s)
    td = datetime.timedelta(seconds=timeout_s)
    if attempt is None or "MASTER_ADDR" not in os.environ:
        init_job_process_group(backend, timeout_s=timeout_s)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=td)
    init_job_process_group(backend, timeout_s=timeout_s, store=dist.PrefixStore(f"autopar/attempt_{attempt}", store),
                           rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def probe_ranks(group, timeout_s: float) -> list[int]:
    """Ranks of `group` (global numbers) whose main thread does not answer a ping within
    `timeout_s`. Every rank that is still running its program must call it at about the same
    time (each waits up to `timeout_s` for the others). `group` is a gloo group (the pings are
    CPU tensors): FaultGuard's own, or None where the default group is gloo."""
    me = dist.get_rank()
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    peers = [r for r in members if r != me]
    bufs = {p: torch.full((1,), -1, dtype=torch.int64) for p in peers}
    recvs = {p: dist.irecv(bufs[p], src=p, group=group) for p in peers}
    mine = torch.tensor([me], dtype=torch.int64)
    sends = [dist.isend(mine, dst=p, group=group) for p in peers]  # kept alive until we return
    deadline = time.monotonic() + timeout_s
    silent = []
    for p in peers:
        try:
            ok = recvs[p].wait(datetime.timedelta(seconds=max(0.05, deadline - time.monotonic())))
            if ok is False or int(bufs[p]) != p:
                silent.append(p)
        except RuntimeError:
            silent.append(p)
    del sends
    return silent


class FaultGuard:
    """`with guard:` around a training step: when a collective inside fails (a peer died or
    its group timed out), every surviving rank probes the others and raises
    RankUnresponsiveError naming the ranks that did not answer, within `timeout_s` after the
    failure. Create it on every rank (collective), before anything can fail."""

    def __init__(self, timeout_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        # a host-side group: its probes are CPU tensors, whatever the training's backend
        self.group = mark_host_group(dist.new_group(backend="gloo",
                                                    timeout=datetime.timedelta(seconds=2 * timeout_s + 5)))

    def __enter__(self) -> "FaultGuard":
        self._inside = guarded()  # a failed collective leaves finding the silent ranks to the probe
        self._inside.__enter__()
        return self

    def __exit__(self, et, ev, tb) -> bool:
        self._inside.__exit__(None, None, None)
        if ev is None or not isinstance(ev, RuntimeError) or isinstance(ev, RankUnresponsiveError):
            return False
        silent = probe_ranks(self.group, self.timeout_s)
        if silent:
            raise RankUnresponsiveError(
                f"rank {dist.get_rank()}: rank(s) {silent} stopped answering: a collective failed "
                f"({str(ev).splitlines()[0][:200]}) and they did not answer a probe within {self.timeout_s:.0f} s. "
                "Restart from the last checkpoint (torchrun --max-restarts) without them or once they are back") from ev
        return False
