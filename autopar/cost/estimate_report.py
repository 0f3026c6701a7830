"""The step estimate's result: `Estimate` (step time, memory and communication per rank), its
rows per layer (`LayerReport`) and per collective (`CommReport`), and how it prints.

`estimate.estimate` fills it; `to_json()` round-trips through `json.loads`; `collectives()`
keys and sorts calls and payloads as `runtime.collectives.COUNTER.snapshot()` does; `table()`
folds identical consecutive layers into one row (`fold_layers`). Reads no node.meta.
Deterministic: no ids, no timestamps (the analysis time is left out of `to_dict`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LayerReport", "CommReport", "Estimate", "fold_layers"]


@dataclass
class LayerReport:
    name: str
    nodes: int
    fwd_flops: float
    bwd_flops: float
    fwd_s: float
    bwd_s: float
    comm_s: float  # collectives issued for this layer (ZeRO-3 gathers, graph collectives)
    saved_bytes: float
    param_bytes: float  # this rank's parameter bytes of the layer


@dataclass
class CommReport:
    op: str
    axis: str
    phase: str  # forward | backward | step | attention (the context-parallel exchange)
    calls: int
    payload_bytes: float  # summed payloads, as runtime.collectives.COUNTER counts them
    bytes_sent: float  # bytes this rank puts on the wire (ring formulas in comm.py)
    time_s: float
    exposed_s: float


@dataclass
class Estimate:
    hardware: str
    mesh: dict[str, int]
    zero_stage: int
    sizes: dict[str, int]
    world_size: int
    step_s: float  # fwd_s + bwd_s + optimizer_s + exposed communication after the step (ZeRO 1/2 gather)
    fwd_s: float  # all micro-batches' forward, including communication it waits for
    bwd_s: float  # all micro-batches' backward, including communication it waits for
    optimizer_s: float
    comm_s: float  # every collective's time
    comm_exposed_s: float  # the part not hidden behind compute (with the compute slowdown it causes)
    comm_overlapped_s: float
    fwd_flops: float  # per rank, FlopCounterMode convention
    bwd_flops: float
    mfu: float
    memory: dict[str, float]
    bytes_per_axis: dict[str, dict[str, float]]
    comm: list[CommReport]
    layers: list[LayerReport]
    unknown_ops: dict[str, int]
    unknown_saved: dict[str, int]
    notes: list[str] = field(default_factory=list)
    ranks: str = "every rank alike (data parallel); figures are rank 0's, the largest ZeRO chunk"
    analysis_s: float = 0.0
    recompute_s: float = 0.0  # forward ops run again in backward (inside bwd_s and step_s)
    contention_s: float = 0.0  # compute slowed by overlapped collectives (inside comm_exposed_s and step_s)
    # the graph's compute per kind of work ("matmul", "attention", "other": pointwise, norms, reductions, copies,
    # embedding, loss), forward + backward of every micro-batch, without collectives, replays (recompute_s) or
    # a pipeline's split (the whole graph's): what `autopar.tools.op_kinds` sets against a profiled step
    compute_by_kind: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("analysis_s")
        return d

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=float)

    @property
    def fits(self) -> bool:
        return self.memory["peak"] <= self.memory["capacity"]

    def collectives(self, phase: str | None = None) -> dict[str, dict[str, int]]:
        """Calls and payload bytes per collective and axis, summed over phases (or of one
        phase: "forward", "backward", "step"), keyed and sorted as
        `runtime.collectives.COUNTER.snapshot()`: {"all_reduce@dp": {"calls": 3, "bytes": 1234}}."""
        out: dict[str, dict[str, int]] = {}
        for r in self.comm:
            if phase is not None and r.phase != phase:
                continue
            row = out.setdefault(f"{r.op}@{r.axis}", {"calls": 0, "bytes": 0})
            row["calls"] += r.calls
            row["bytes"] += int(round(r.payload_bytes))
        return dict(sorted(out.items()))

    def summary(self) -> dict[str, Any]:
        """The headline figures (for Plan.predicted): times in s, memory in bytes, per rank."""
        return {"hardware": self.hardware, "sizes": dict(self.sizes), "step_s": self.step_s, "fwd_s": self.fwd_s,
                "bwd_s": self.bwd_s, "optimizer_s": self.optimizer_s, "comm_s": self.comm_s,
                "comm_exposed_s": self.comm_exposed_s, "mfu": self.mfu, "peak_bytes": self.memory["peak"],
                "recompute_s": self.recompute_s, "contention_s": self.contention_s,
                "capacity_bytes": self.memory["capacity"], "fits": self.fits,
                "bytes_sent_per_axis": {a: b["sent"] for a, b in self.bytes_per_axis.items()}}

    # --- printing ----------------------------------------------------------------------
    def table(self):
        """A rich renderable: summary, memory and the per-layer table (identical consecutive
        layers folded into one row)."""
        from rich.console import Group
        from rich.table import Table

        summary = Table(title=f"autopar estimate: {self.hardware}, mesh {self.mesh}, ZeRO-{self.zero_stage}, "
                              f"sizes {self.sizes}", show_header=False)
        summary.add_column("what")
        summary.add_column("value", justify="right")
        for k, v in [("step", _ms(self.step_s)), ("forward", _ms(self.fwd_s)), ("backward", _ms(self.bwd_s)),
                     ("optimizer", _ms(self.optimizer_s)), ("communication", _ms(self.comm_s)),
                     ("  exposed", _ms(self.comm_exposed_s)), ("  overlapped", _ms(self.comm_overlapped_s)),
                     ("  compute slowed by it", _ms(self.contention_s)),
                     ("FLOPs fwd+bwd / rank", f"{self.fwd_flops + self.bwd_flops:.3e}"), ("MFU", f"{self.mfu:.1%}")]:
            summary.add_row(k, v)
        for k in ("params", "grads", "master", "optimizer", "buffers", "activations", "transient", "peak",
                  "capacity"):
            summary.add_row(f"memory {k}", _gb(self.memory[k]))
        for axis, b in self.bytes_per_axis.items():
            summary.add_row(f"bytes sent on {axis}", _gb(b["sent"]))
        if self.unknown_ops:
            summary.add_row("ops costed by fallback", ", ".join(f"{k} x{v}" for k, v in self.unknown_ops.items()))
        layers = Table(title="per layer, one rank: time in ms, forward GFLOP, MiB")
        for col in ("layer", "fwd", "bwd", "comm", "GFLOP", "saved", "params"):
            layers.add_column(col, justify="left" if col == "layer" else "right", no_wrap=True)
        for name, rep, n in fold_layers(self.layers):
            if not (rep.fwd_s or rep.bwd_s or rep.comm_s or rep.saved_bytes or rep.param_bytes):
                continue  # nothing to show (e.g. index arithmetic at the root); still in to_json()
            layers.add_row(name if n == 1 else f"{name} (x{n})", f"{rep.fwd_s * 1e3:.3f}", f"{rep.bwd_s * 1e3:.3f}",
                           f"{rep.comm_s * 1e3:.3f}", f"{rep.fwd_flops / 1e9:.2f}", f"{rep.saved_bytes / 2**20:.1f}",
                           f"{rep.param_bytes / 2**20:.1f}")
        return Group(summary, layers)

    def __rich__(self):
        return self.table()

    def print(self, console=None) -> None:
        from rich.console import Console

        (console or Console()).print(self.table())


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _gb(b: float) -> str:
    return f"{b / 2**30:.3f} GiB" if b >= 2**27 else f"{b / 2**20:.3f} MiB"


def fold_layers(layers: list[LayerReport]):
    """Consecutive layers with equal figures as one row: ('layers.0..79', rep, 80)."""
    out = []
    for rep in layers:
        sig = (round(rep.fwd_s, 12), round(rep.bwd_s, 12), rep.fwd_flops, rep.saved_bytes, rep.param_bytes, rep.nodes)
        if out and out[-1][3] == sig and rep.name.split(".")[:-1] == out[-1][1].name.split(".")[:-1]:
            out[-1][2] += 1
            out[-1][4] = rep.name
        else:
            out.append([rep.name, rep, 1, sig, rep.name])
    return [(f"{first}..{last.split('.')[-1]}" if n > 1 else first, rep, n) for first, rep, n, _sig, last in out]

