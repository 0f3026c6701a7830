"""Sustained load: the GEMM duty of a graph, and the hardware as it runs that graph for minutes.

A profile's compute tables are bursts. Under sustained GEMM load a GPU meets its power limit and
lowers its clock: on an H100 SXM (700 W) 8192^3 bf16 GEMMs alone ran at 789 TFLOP/s for the first
30 ms and 671 TFLOP/s after a few seconds, SM clock 1980 -> about 1350 MHz (scripts/gpu_power.py,
2026-11-27). Memory-bound kernels draw less, so how far a training step slows depends on how much
of it is GEMMs: its duty. The compute table's power rows map duty to the sustained / burst
throughput ratio (`ComputeTable.sustained_ratio`; format in cost/compute_tables.py).

`graph_duty(gc, hw, compute_dtype)`: the share of the graph's node seconds (forward and
backward, burst rates, no tensor-parallel divisor) spent in matmul and attention nodes, at the
graph's example sizes: a property of the model, its compute dtype and the device, the same for
every plan of it (tensor parallelism divides GEMMs and the rest alike; the pipeline split and
ZeRO do not change the mix), so the planner's tables and `cost.estimate` apply one ratio to one
graph and agree. The optimizer step, communication and bubbles are left out: the power limiter
acts over tens of milliseconds (the ramp above fell within 45 ms), within a block's forward or
backward, where the duty is the graph's.

`sustained(hw, gc, compute_dtype)`: `hw` with `power_ratio` set from its table's power rows at
that duty, and `power_duty` (unchanged when the table has none). Idempotent: the duty is always taken at bursts.

Reads no node.meta. Deterministic.
"""
from __future__ import annotations

from .graph import GraphCost
from .hardware import Hardware
from .node_time import NodeTimer

__all__ = ["graph_duty", "sustained"]


def graph_duty(gc: GraphCost, hw: Hardware, compute_dtype: str | None = None) -> float:
    """The share of the graph's compute seconds in matmul and attention nodes, at burst rates."""
    timer = NodeTimer(hw.with_power_ratio(1.0), gc.values(), compute_dtype=compute_dtype)
    gemm = total = 0.0
    for n in gc.nodes:
        f, b = timer.node(n)
        total += f + b
        if n.cost.kind in ("matmul", "attention"):
            gemm += f + b
    return gemm / total if total > 0 else 0.0


def sustained(hw: Hardware, gc: GraphCost, compute_dtype: str | None = None) -> Hardware:
    """`hw` running `gc` under sustained load: GEMMs and attention at the power rows' ratio for
    the graph's duty (`hw` itself when its compute table has no power rows)."""
    if hw.compute is None or not hw.compute.power:
        return hw
    duty = graph_duty(gc, hw, compute_dtype)
    return hw.with_power_ratio(hw.compute.sustained_ratio(duty), duty)
