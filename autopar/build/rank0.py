"""Work every rank would do identically, done once on rank 0 and broadcast to the others.

`on_rank0(fn, what=...)` runs `fn()` on rank 0 and gives its return value (plain, picklable
data) to every rank over the planning group (`runtime.mesh.planning_group`: host-side, with the
planning timeout, as the sharding search and the pipeline's stage search use it). Without
torch.distributed, or in a world of one rank, it simply returns `fn()`. A world of n ranks on
fewer cores than ranks (the test worlds: 4 ranks on 2 cores) pays the work once instead of n
times, and a cluster's ranks wait for one rank's answer instead of each computing it.

When `fn` raises on rank 0 every rank raises, so that no rank walks on into a collective the
others never reach: rank 0 its own exception, the other ranks, when it was a ValueError (a user's
error, reported alike everywhere), the same exception (its class and message, through pickle; a
plain ValueError with the message where it does not pickle), else a RuntimeError naming `what` and
the exception's type.

Only for functions whose answer depends on nothing rank-specific (the captured graph, the plan,
the mesh's shape, the hardware profile): the fusion search, the expert plan, the router
statistics and the global cost prediction (build/plan_complete.py, build/predict.py), and the
recompute choice on a rank's rewritten graph where `graph_signature` shows it equal to rank 0's
(build/program.py). Collective: every rank of the default group calls it
at the same point.

Reads node.meta["autopar"] (graph_signature); writes no node.meta.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable

import torch.distributed as dist
import torch.fx as fx

from autopar.passes import ir
from autopar.runtime.mesh import planning_group

__all__ = ["graph_signature", "on_rank0"]


def on_rank0(fn: Callable[[], Any], *, what: str) -> Any:
    """`fn()` computed on rank 0, returned on every rank (see the module docstring).

    Args:
        fn: a function of no arguments whose result is picklable and the same for every rank.
        what: a few words naming the work, for the error the other ranks raise.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box = [{"value": pickle.dumps(fn())}]  # pickled here: an answer that does not pickle is an error too
        except Exception as e:  # noqa: BLE001 - raised on every rank below, not only here
            error = e
            box = [{"error": str(e), "value_error": isinstance(e, ValueError), "type": type(e).__name__,
                    "same": _pickled(e) if isinstance(e, ValueError) else None}]
    dist.broadcast_object_list(box, src=0, group=planning_group())
    got = box[0]
    if error is not None:
        raise error
    if "error" in got:
        if got["value_error"]:
            same = _unpickled(got["same"])  # the same class (a PlanMismatchError stays one), else a ValueError
            raise same if isinstance(same, ValueError) else ValueError(got["error"])
        raise RuntimeError(f"{what} failed on rank 0: {got['type']}: {got['error']}")
    return pickle.loads(got["value"])  # rank 0 too: every rank holds its own copy of one answer


def _pickled(e: BaseException) -> bytes | None:
    try:
        return pickle.dumps(e)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its message
        return None


def _unpickled(b: bytes | None) -> BaseException | None:
    try:
        return pickle.loads(b) if b is not None else None
    except Exception:  # noqa: BLE001 - a class this rank cannot rebuild: the message alone
        return None


def graph_signature(gm: fx.GraphModule) -> str:
    """A digest of `gm`'s structure as the cost model sees it: every node's name, op, target and
    annotation (shapes, local shapes, dtypes, module, layout). Two ranks whose rewritten graphs
    have equal signatures get equal answers from a search over them, so one rank's answer
    serves both (`build.program`: the recompute choice)."""
    h = hashlib.sha1()
    for n in gm.graph.nodes:
        h.update(repr((n.name, n.op, str(n.target), ir.get_info(n))).encode())
    return h.hexdigest()
