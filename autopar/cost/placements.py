"""What changing a tensor's placement on one mesh axis costs, and the placement vocabulary.

The shard pass (passes/shard.py) turns a producer's placement `src` into what a consumer
needs, `dst`, with collectives: forward, and backward when the consumer's gradient comes back
partial (`partial_grad`). For k ranks on the axis and a global tensor of `nbytes`:

  src -> dst         collectives (forward + backward)
  S -> R             all-gather, + a reduce-scatter if partial_grad
  P -> R             all-reduce, + an all-reduce if partial_grad
  R -> S             an all-gather (the split is free forward; the gradient pieces are gathered)
  S(i) -> S(j)       two all-to-alls
  P -> S             a reduce-scatter and an all-gather
  S -> P             an all-gather;  R -> P: nothing
  x -> x             nothing, or an all-reduce when a partial gradient comes back into R

`conversion_time` prices those collectives on an axis link (`cost.comm.AxisLink`), with a
fixed launch cost per collective; `conversion_bytes` counts the bytes one rank sends (ring
collectives). The planner's tables and the sharding ILP share these formulas.

The vocabulary (`Placement`, `R`, `Replicate`, `Shard`, `Partial`, `Layout`,
`parse_placement`) is the runtime's (`runtime.placement`), re-exported here: `search/` takes
it from this file, so that it reaches the engine only through the cost model.

Reads and writes no node.meta. Pure functions of their arguments.
"""
from __future__ import annotations

from autopar.runtime.placement import Layout, Partial, Placement, R, Replicate, Shard, parse_placement

__all__ = ["Layout", "Partial", "Placement", "R", "Replicate", "Shard", "parse_placement", "conversion_time",
           "conversion_bytes"]

INF = float("inf")


def conversion_time(src: Placement | None, dst: Placement | None, partial_grad: bool, nbytes: float, link,
                    k: int, launch_s: float = 0.0) -> float:
    """Seconds of forward + backward communication to turn `src` into `dst` on one axis
    (the rewrite's conversions, passes/shard.py). nbytes: the global tensor's bytes;
    launch_s: fixed cost of issuing one collective (a kernel launch and its synchronisation),
    which is what makes one all-reduce cheaper than an all-gather plus a reduce-scatter of
    the same bytes at small sizes."""
    if dst is None or src is None:
        return 0.0
    shard = nbytes / k
    ar = link.time("all_reduce", nbytes) + launch_s
    ag = link.time("all_gather", shard) + launch_s
    rs = link.time("reduce_scatter", nbytes) + launch_s
    if src == dst:
        return ar if partial_grad and isinstance(dst, Replicate) else 0.0
    if isinstance(dst, Replicate):
        if isinstance(src, Shard):
            return ag + (rs if partial_grad else 0.0)
        if isinstance(src, Partial):
            return ar + (ar if partial_grad else 0.0)
    if isinstance(dst, Shard):
        if isinstance(src, Replicate):
            return ag  # split: free forward, all-gather of the gradient pieces backward
        if isinstance(src, Shard):
            return 2 * (link.time("all_to_all", shard) + launch_s)
        if isinstance(src, Partial):
            return rs + ag
    if isinstance(dst, Partial):
        if isinstance(src, Replicate):
            return 0.0
        if isinstance(src, Shard):
            return ag
    return INF


def conversion_bytes(src, dst, pg: bool, nbytes: float, k: int) -> float:
    """Bytes one rank sends for a conversion (forward and backward), ring collectives."""
    ar = 2 * (k - 1) / k * nbytes
    ag = (k - 1) / k * nbytes
    rs = (k - 1) / k * nbytes
    if src == dst:
        return ar if pg and isinstance(dst, Replicate) else 0.0
    if isinstance(dst, Replicate):
        if isinstance(src, Shard):
            return ag + (rs if pg else 0.0)
        if isinstance(src, Partial):
            return ar + (ar if pg else 0.0)
    if isinstance(dst, Shard):
        if isinstance(src, Replicate):
            return ag
        if isinstance(src, Shard):
            return 2 * (k - 1) / k * nbytes / k
        if isinstance(src, Partial):
            return rs + ag
    if isinstance(dst, Partial) and isinstance(src, Shard):
        return ag
    return 0.0
