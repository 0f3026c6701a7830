"""Naming a collective that failed: which op, on which axis and ranks, at which point of the
training step, and which ranks stopped.

A collective fails when a peer dies (gloo: "Connection closed by peer", at once) or stops
issuing collectives (every rank that waits for it fails after the group's timeout,
runtime/timeouts.py: 60 s by default). torch's error names neither the collective nor the
rank. The runtime issues its collectives through `failed(...)` (collective_calls, the
pipeline's transfers) and hands out `NamedWork` handles whose `wait()` does the same, so a
communication failure is re-raised as `CollectiveError` (a RuntimeError, chained to torch's
error) whose message names:

- this rank, the op, the mesh axis, the global ranks of its group, the call number on the
  axis (`collective_check.COUNTER.seq`) and the peer of a point-to-point transfer;
- where in the step: the labels the programs push with `where(...)` ("step 3", "micro-batch
  1/2 backward", "pipeline action 1F0", "optimizer step") and, for a collective of the
  rewritten graph, the graph node (in forward read from the frame of the graph's generated
  code, `graph_node_here`; in backward recorded when the forward ran);
- which ranks stopped: the failing rank posts a one-line report to the job's store (the
  default process group's) and waits up to `report_grace_s` for the reports of its group's
  other ranks. A rank that never reports is stuck outside any collective or dead, and is
  named; a rank that did report is quoted (where it failed). Inside `faults.FaultGuard` this
  census is skipped: the guard's probe names the silent ranks itself.

Errors that are not communication failures (shapes, dtypes, a mismatch found by
`collective_check`) pass unchanged. It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import contextlib
import json
import linecache
import re
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ._torch_compat import default_store
from .active_mesh import active_mesh_or_none
from .timeouts import group_timeout


class CollectiveError(RuntimeError):
    """A collective failed (it timed out, or a peer closed the connection). Attributes:
    `op`, `axis`, `ranks` (the group, global numbers), `rank` (this one), `silent` (ranks of
    the group that reported no failure of their own: stuck or dead; None when unknown)."""

    def __init__(self, message: str, *, op: str, axis: str | None, ranks: list[int] | None, rank: int,
                 silent: list[int] | None):
        super().__init__(message)
        self.op, self.axis, self.ranks, self.rank, self.silent = op, axis, ranks, rank, silent


# --- where in the step ---------------------------------------------------------------------
_LOCAL = threading.local()


def _labels() -> list[str]:
    s = getattr(_LOCAL, "labels", None)
    if s is None:
        s = _LOCAL.labels = []
    return s


@contextlib.contextmanager
def where(label: str):
    """Name the part of the step that runs inside (nested labels read outermost first)."""
    s = _labels()
    s.append(label)
    try:
        yield
    finally:
        s.pop()


def current_where() -> tuple[str, ...]:
    return tuple(_labels())


_ASSIGN = re.compile(r"^\s*(\w+)\s*=")


def graph_node_here(max_depth: int = 64) -> str | None:
    """The name of the graph node that the innermost running fx GraphModule is executing, or
    None outside one. fx generates `node_name = op(...)` per node into a source file named
    `<eval_with_key>...` that it registers with linecache."""
    f = sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return None
        name = f.f_code.co_filename
        if name.startswith("<eval_with_key>"):
            m = _ASSIGN.match(linecache.getline(name, f.f_lineno))
            return m.group(1) if m else None
        f = f.f_back
    return None


# --- which failures ------------------------------------------------------------------------
_COMM = re.compile(r"timed? ?out|timeout|connection (closed|reset|refused)|closed by peer|broken pipe|"
                   r"abort|watchdog|nccl error|socket|peer", re.I)


def is_comm_failure(err: BaseException) -> bool:
    """Whether `err` is a communication failure of a collective (not a usage error)."""
    if isinstance(err, CollectiveError) or not isinstance(err, RuntimeError):
        return False
    backend = getattr(dist, "DistBackendError", None)
    if backend is not None and isinstance(err, backend):
        return True
    return bool(_COMM.search(str(err)))


# --- the census: who else failed -------------------------------------------------------------
_KEY = "autopar/collective_failure/"
_GUARDS = 0  # FaultGuards entered and not left


@contextlib.contextmanager
def guarded():
    """Inside: a FaultGuard finds the silent ranks; the census is skipped."""
    global _GUARDS
    _GUARDS += 1
    try:
        yield
    finally:
        _GUARDS -= 1


def _timeout_s() -> float | None:
    """The mesh groups' timeout (timeouts.group_timeout), None without a process group."""
    if not dist.is_initialized():
        return None
    try:
        return group_timeout(getattr(active_mesh_or_none(), "device_type", "cpu")).total_seconds()
    except Exception:  # noqa: BLE001 - naming must never hide the original failure
        return None


def report_grace_s(timeout_s: float | None = None) -> float:
    """How long a failing rank waits for the reports of its group's other ranks: a fifth of
    the collective timeout, between 1 and 5 s (ranks that wait for the same silent peer fail
    within their arrival skew of each other)."""
    t = timeout_s if timeout_s is not None else (_timeout_s() or 60.0)
    return min(5.0, max(1.0, t / 5))


def census(me: int, members: Sequence[int], report: str, grace_s: float) -> dict[int, str] | None:
    """Post `report` for rank `me` and collect, for up to `grace_s`, the reports of the other
    `members`: {rank: report} of those that reported, or None when the store cannot be used.
    Runs on a helper thread, so a broken store costs at most `grace_s` + 2 s."""
    store = default_store()
    if store is None:
        return None
    out: dict[int, str] = {}
    done = threading.Event()
    stale_s = 600.0  # a report from an earlier failure of a rank that went on is ignored

    def run():
        try:
            store.set(f"{_KEY}{me}", json.dumps({"t": time.time(), "what": report}))
            pending = [r for r in members if r != me]
            deadline = time.monotonic() + grace_s
            while pending:
                for r in list(pending):
                    if store.check([f"{_KEY}{r}"]):
                        v = json.loads(store.get(f"{_KEY}{r}"))
                        if time.time() - float(v.get("t", 0)) < stale_s:
                            out[r] = str(v.get("what", ""))
                            pending.remove(r)
                if not pending or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            done.set()
        except Exception:  # noqa: BLE001 - the store is gone with its host: report nothing
            pass

    t = threading.Thread(target=run, name="autopar-census", daemon=True)
    t.start()
    t.join(grace_s + 2.0)
    return dict(out) if done.is_set() else None


# --- the error -------------------------------------------------------------------------------
def _group_ranks(axis: str | None, group) -> list[int] | None:
    try:
        if group is not None:
            return list(dist.get_process_group_ranks(group))
        mesh = active_mesh_or_none()
        if axis is not None and mesh is not None and axis in mesh.sizes and dist.is_initialized():
            return list(mesh.axis_ranks(axis, dist.get_rank()))
        if dist.is_initialized():
            return list(range(dist.get_world_size()))
    except Exception:  # noqa: BLE001 - naming must never hide the original failure
        return None
    return None


def raise_named(err: BaseException, op: str, *, axis: str | None = None, group=None, peer: int | None = None,
                seq: int | None = None, launched: tuple[str, ...] | None = None, node: str | None = None) -> None:
    """Raise `CollectiveError` for communication failure `err` of collective `op` (see the
    module docstring); `peer` is the global rank of a point-to-point transfer, `launched` the
    step labels at launch of an asynchronous collective, `node` its graph node."""
    me = dist.get_rank() if dist.is_initialized() else 0
    ranks = _group_ranks(axis, group)
    here = current_where()
    node = node or graph_node_here()
    what = op + (f" on axis {axis!r}" if axis else "") + (f" #{seq}" if seq is not None else "")
    if peer is not None:
        what += f" with rank {peer}"
    if ranks is not None:
        what += f" (group ranks {ranks})"
    here = here + ((f"graph node {node}",) if node else ())
    at = " > ".join(launched if launched is not None else here) or "outside a training step"
    if launched is not None and here and here != tuple(launched):
        at += f" (waited for in {' > '.join(here)})"
    report = f"{what} at {at}"
    silent = None
    others = [r for r in (ranks or []) if r != me] if peer is None else [peer]
    if _GUARDS:
        who = "fault_guard probes the ranks next"
    elif not others:
        who = "no other rank takes part"
    else:
        grace = report_grace_s()
        got = census(me, sorted(set(others) | {me}), report, grace)
        if got is None:
            who = f"could not ask the job's store which of ranks {others} stopped"
        else:
            silent = [r for r in others if r not in got]
            if silent:
                who = (f"rank(s) {silent} stopped: no failure report from them within {grace:.0f} s of this one "
                       "(stuck outside a collective, or dead)")
            else:
                who = "every other rank of the group failed too"
            if got:
                who += "; " + "; ".join(f"rank {r} failed in {got[r]}" for r in sorted(got)[:3])
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    timeout = _timeout_s()
    limit = f"{timeout:.0f} s" if timeout is not None else "the group's timeout"
    msg = (f"rank {me}: collective {what} failed at {at}: {who}. Collectives wait at most {limit} "
           f"(AUTOPAR_COLLECTIVE_TIMEOUT_S, or timeout_s where the job starts). torch says: {first}")
    raise CollectiveError(msg, op=op, axis=axis, ranks=ranks, rank=me, silent=silent) from err


@contextlib.contextmanager
def failed(op: str, *, axis: str | None = None, group=None, peer: int | None = None, seq: int | None = None):
    """Inside, a communication failure becomes a `CollectiveError` naming `op` (see
    `raise_named`); other errors pass unchanged."""
    try:
        yield
    except RuntimeError as e:
        if not is_comm_failure(e):
            raise
        raise_named(e, op, axis=axis, group=group, peer=peer, seq=seq)


class NamedWork:
    """A torch `Work` handle whose `wait()` names its collective when it fails."""

    __slots__ = ("work", "op", "axis", "group", "peer", "seq", "launched")

    def __init__(self, work, op: str, *, axis: str | None = None, group=None, peer: int | None = None,
                 seq: int | None = None):
        self.work, self.op, self.axis, self.group, self.peer, self.seq = work, op, axis, group, peer, seq
        self.launched = current_where()

    def wait(self, *args: Any) -> Any:
        try:
            return self.work.wait(*args)
        except RuntimeError as e:
            if not is_comm_failure(e):
                raise
            raise_named(e, self.op, axis=self.axis, group=self.group, peer=self.peer, seq=self.seq,
                        launched=self.launched)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def issue(what: str, call: Callable, /, *args: Any, axis: str | None = None, group=None, peer: int | None = None,
          seq: int | None = None, async_op: bool = False, **kwargs: Any):
    """`call(*args, group=group, async_op=async_op, **kwargs)` (a torch.distributed collective,
    named `what` in errors) with its failure named; an asynchronous handle comes back as a
    `NamedWork`. `axis`, `peer`, `seq` only describe the call."""
    try:
        work = call(*args, group=group, async_op=async_op, **kwargs)
    except RuntimeError as e:
        if not is_comm_failure(e):
            raise
        raise_named(e, what, axis=axis, group=group, peer=peer, seq=seq)
    if async_op and work is not None:
        return NamedWork(work, what, axis=axis, group=group, peer=peer, seq=seq)
    return work


def p2p(op: str, call: Callable, t, peer: int, group, axis: str | None = None) -> NamedWork:
    """`call(t, peer, group=group)` (dist.isend / dist.irecv to global rank `peer`) with its
    failure named; returns a `NamedWork`."""
    with failed(op, axis=axis, group=group, peer=peer):
        return NamedWork(call(t, peer, group=group), op, axis=axis, group=group, peer=peer)


__all__ = ["p2p", "CollectiveError", "where", "current_where", "graph_node_here", "is_comm_failure", "guarded",
           "report_grace_s", "census", "raise_named", "failed", "NamedWork", "issue"]
