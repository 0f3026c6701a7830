"""The optimizer step's time: the bytes it moves on the device, or ZeRO-Offload's copies and CPU step.

`step_bytes` is what the device step reads and writes (it is memory bound), as the engines run
it (runtime/zero_engine.py): the update reads and writes the states it steps (the masters where
they are separate, else the parameters themselves, in place) and reads the gradients it steps
with; with separate masters (a 16-bit model trained "bf16-mixed") each gradient is first cast
into its master's gradient (read in the parameter's dtype, written in the master's), and after
the update each master is cast back into its parameter (read, written in the parameter's dtype).
From ZeRO 1 on the update touches this rank's rows of the parameters (`shard` = dp; at stage 3
`params` is already the rows).

`offload_step_seconds` is the offloaded step (see its docstring). Both `cost.estimate` and the
joint planner (`search.plan_cost`) call these, so both price the same bytes.
"""
from __future__ import annotations

from .hardware import DEFAULT_HOST_BANDWIDTH, DEFAULT_HOST_MEMORY_BANDWIDTH

__all__ = ["offload_step_seconds", "step_bytes"]


def step_bytes(master: float, optimizer: float, params: float, grads: float, master_grads: float,
               shard: float = 1.0) -> float:
    """Bytes one device optimizer step moves on a rank holding these model-state bytes (the
    `cost.memory.ModelStates` categories; `grads` includes `master_grads`); `shard`: the ranks
    the parameters' update is split over (dp at ZeRO 1 / 2, else 1)."""
    if master > 0:  # masters: cast the gradients in, update the masters, cast them back out
        return 2 * (master + optimizer) + grads + master_grads + master + params / shard
    return 2 * (params / shard + optimizer) + grads  # the parameters updated in place


def offload_step_seconds(opt_elems: float, master_opt_bytes: float, grad_item: int, master_item: int,
                         host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
                         host_memory_bandwidth: float = DEFAULT_HOST_MEMORY_BANDWIDTH, *,
                         zero_stage: int = 0) -> tuple[float, float]:
    """(host<->device copy seconds, CPU optimizer step seconds) of one offloaded step on one rank
    (ZeRO-Offload), as runtime/offload.py runs it: the rank's reduced gradient rows go to the
    host in the reduce dtype (`grad_item` bytes each, pinned, one DMA copy), the CPU steps the
    masters and states (read and written once, the gradients read: memory bound), and the
    masters come back in their own dtype (`master_item`, cast on the device): once per step
    at ZeRO 0-2, and twice at ZeRO-3, where the host shards are the parameters (the forward's
    gather and the backward's re-gather). The copies run on the compute stream: they overlap
    neither compute nor the step."""
    ups = 2 if zero_stage == 3 else 1
    copies = opt_elems * (grad_item + ups * master_item) / host_bandwidth
    step = (2 * master_opt_bytes + opt_elems * 4) / host_memory_bandwidth
    return copies, step
