"""Compute efficiency tables: the fraction of peak a kernel of a given shape reaches.

A flat "efficiency": {"matmul": 0.7} says every GEMM runs at 70 % of peak, a 64 x 64 one as
a 8192 x 8192 one. A profile's optional "compute" section replaces it by shape:

  "compute": {
    "sources": ["where each figure comes from", ...],
    "matmul": {"knee": 128, "rows": [
        {"dtype": ["bf16", "fp16"], "shape": [m, n, k], "efficiency": 0.72}, ...]},
    "attention": {"dtype": ["bf16", "fp16"], "rows": [
        {"seq": 2048, "head_dim": 128, "causal": true, "efficiency": 0.40, "bwd_efficiency": 0.33}, ...]},
    "floor_s": {"matmul": 5e-6, "attention": 8e-6, "vector": 2e-6},
    "power": {"rows": [[0.86, 1.0], [1.0, 0.861]]}
  }

Matmul: a row is one measured (or published) GEMM shape. A GEMM of FLOPs f = 2mnk takes the
efficiency interpolated linearly in log(f) between the rows of its dtype (clamped at the
ends: below the smallest row the launch floor takes over), times a penalty for a skinny
GEMM, (min(m, n, k) / knee) ** 0.5 when min(m, n, k) < knee: cuBLAS tiles are 64-256 wide,
a dimension under the tile wastes the rest of it (tile quantisation, NVIDIA's "Matrix
Multiplication Background" guide, DU-09799-001 section 3), softened because the library
switches to narrower, less efficient tiles. Rows must not be skinny themselves (their
smallest dim is at least the knee), so the penalty is never counted twice. The set
{m, n, k} of a linear's forward GEMM is the set of both its backward GEMMs, so one lookup
serves forward and backward.

Attention: rows by (seq, head_dim, causal), efficiency of the forward (and optionally the
backward) kernel against `causal_fraction` x the full FLOPs (the FlashAttention papers'
convention for causal TFLOP/s). Lookup: the rows of the same causality (all rows if none),
the nearest head_dim in log2, interpolated in log(seq), clamped. Only the dtypes the table
names use it (fused attention runs in 16-bit); others take the flat factor.

floor_s: the shortest time a kernel of that kind takes on the device (launch latency, tail
of one wave); a node's time is max(roofline, floor) + the profile's kernel_overhead_s.

power: throughput under sustained load. The rows above are bursts; a GPU at its power limit
lowers its clock once GEMMs keep its tensor cores busy (an H100 SXM at 700 W: 8192^3 bf16 GEMMs
alone fall from 789 to 671 TFLOP/s within a second, the SM clock from 1980 to about 1350 MHz).
How far depends on the GEMM duty of the work: the share of a step's device compute in GEMMs and
attention (`cost.power.graph_duty`: the graph's matmul and attention node seconds over all its
node seconds, at burst rates). Rows are (duty, ratio): the sustained / burst throughput of
GEMMs and attention at that duty, interpolated linearly, clamped; no rows: 1 (bursts hold).
`cost.power.sustained` applies the ratio to a Hardware (`Hardware.power_ratio`, a factor on
`matmul_eff` and `attention_eff`) for the graph being costed.

`refit_matmul` / `refit_attention` / `with_floor` are what `autopar tune` applies: measured
rows replace the rows of the same shape, and every other row of the dtype is scaled by the
measured / tabled ratio interpolated at its size, so a machine 10 % slower than the table
moves the whole table, not just the shapes it measured.

Reads and writes no node.meta keys. Guarantees: `table_from_dict` returns a validated,
frozen table or raises ValueError naming the bad row and what to fix; lookups are pure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

__all__ = ["AttentionRow", "ComputeTable", "GemmRow", "FLOOR_KINDS", "table_from_dict", "refit_matmul",
           "refit_attention"]

FLOOR_KINDS = ("matmul", "attention", "vector")
SKINNY_EXPONENT = 0.5


@dataclass(frozen=True)
class GemmRow:
    dtype: str
    shape: tuple[int, int, int]  # (m, n, k)
    efficiency: float

    @property
    def flops(self) -> float:
        m, n, k = self.shape
        return 2.0 * m * n * k


@dataclass(frozen=True)
class AttentionRow:
    seq: int
    head_dim: int
    causal: bool
    efficiency: float  # forward
    bwd_efficiency: float


@dataclass(frozen=True)
class ComputeTable:
    matmul: tuple[GemmRow, ...] = ()  # sorted by (dtype, flops)
    knee: int = 128
    attention: tuple[AttentionRow, ...] = ()
    attention_dtypes: tuple[str, ...] = ("bf16", "fp16")
    floor_s: Mapping[str, float] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    power: tuple[tuple[float, float], ...] = ()  # (GEMM duty, sustained / burst throughput), sorted by duty

    # ---------------------------------------------------------------- lookups
    def matmul_dtypes(self) -> set[str]:
        return {r.dtype for r in self.matmul}

    def matmul_efficiency(self, dtype: str, m: float, n: float, k: float) -> float | None:
        """Fraction of `dtype`'s peak a (m, n, k) GEMM reaches; None when the table has no rows
        for `dtype` (the caller uses the flat factor)."""
        rows = [r for r in self.matmul if r.dtype == dtype]
        if not rows:
            return None
        m, n, k = max(float(m), 1.0), max(float(n), 1.0), max(float(k), 1.0)
        eff = _interp(math.log(2.0 * m * n * k), [(math.log(r.flops), r.efficiency) for r in rows])
        d = min(m, n, k)
        if d < self.knee:
            eff *= (d / self.knee) ** SKINNY_EXPONENT
        return eff

    def attention_efficiency(self, dtype: str, seq: float, head_dim: float, causal: bool,
                             backward: bool = False) -> float | None:
        """Fraction of `dtype`'s peak fused attention reaches (against causal_fraction x FLOPs);
        None without rows or for a dtype the table does not cover."""
        if not self.attention or dtype not in self.attention_dtypes:
            return None
        rows = [r for r in self.attention if r.causal == causal] or list(self.attention)
        hd = min({r.head_dim for r in rows}, key=lambda h: (abs(math.log2(h) - math.log2(max(head_dim, 1))), h))
        rows = [r for r in rows if r.head_dim == hd]
        pts = [(math.log(r.seq), r.bwd_efficiency if backward else r.efficiency) for r in rows]
        return _interp(math.log(max(float(seq), 1.0)), pts)

    def floor(self, kind: str) -> float:
        return float(self.floor_s.get(kind, 0.0))

    def sustained_ratio(self, duty: float) -> float:
        """Sustained / burst throughput of GEMMs and attention when they take `duty` of the
        device's compute time (the power rows, interpolated, clamped); 1 without rows."""
        return _interp(float(duty), list(self.power)) if self.power else 1.0

    # ---------------------------------------------------------------- edits
    def without(self, kind: str) -> "ComputeTable":
        """The table with its `kind` ("matmul" / "attention") rows dropped (a flat factor rules)."""
        return replace(self, **{kind: ()})

    def with_floor(self, **floor_s: float) -> "ComputeTable":
        bad = {k: v for k, v in floor_s.items() if k not in FLOOR_KINDS or not v >= 0}
        if bad:
            raise ValueError(f"floor_s keys must be among {FLOOR_KINDS} with seconds >= 0, got {bad}")
        return replace(self, floor_s={**self.floor_s, **floor_s})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sources": list(self.sources)}
        if self.matmul:
            out["matmul"] = {"knee": self.knee, "rows": [
                {"dtype": r.dtype, "shape": list(r.shape), "efficiency": r.efficiency} for r in self.matmul]}
        if self.attention:
            out["attention"] = {"dtype": list(self.attention_dtypes), "rows": [
                {"seq": r.seq, "head_dim": r.head_dim, "causal": r.causal, "efficiency": r.efficiency,
                 "bwd_efficiency": r.bwd_efficiency} for r in self.attention]}
        out["floor_s"] = dict(self.floor_s)
        if self.power:
            out["power"] = {"rows": [list(r) for r in self.power]}
        return out


def _interp(x: float, pts: list[tuple[float, float]]) -> float:
    """Piecewise-linear y(x) through `pts` (points at the same x averaged: two GEMM shapes of
    equal FLOPs), clamped outside them."""
    same: dict[float, list[float]] = {}
    for x_, y_ in pts:
        same.setdefault(round(x_, 9), []).append(y_)
    pts = sorted((x_, sum(ys) / len(ys)) for x_, ys in same.items())
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]  # unreachable: x lies within the points


# -------------------------------------------------------------------- parsing and validation
def _eff(v: Any, where: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    if not 0 < f <= 1:
        raise ValueError(f"{where}: efficiency must be in (0, 1], got {v!r}")
    return f


def _dtypes(v: Any, where: str) -> tuple[str, ...]:
    ds = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else ()
    if not ds or not all(isinstance(d, str) and d for d in ds):
        raise ValueError(f"{where}: dtype must be a dtype name or a list of them (\"bf16\", [\"bf16\", \"fp16\"]), "
                         f"got {v!r}")
    return ds


def table_from_dict(d: Mapping[str, Any], profile: str = "?") -> ComputeTable:
    """Parse and validate a profile's "compute" section (format in the module docstring)."""
    where = f"profile {profile!r} compute"
    if not isinstance(d, Mapping):
        raise ValueError(f"{where} must be an object with matmul / attention / floor_s / sources, got {d!r}")
    unknown = set(d) - {"matmul", "attention", "floor_s", "sources", "note", "power"}
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known: matmul, attention, floor_s, power, "
                         "sources")
    mm = d.get("matmul") or {}
    knee = mm.get("knee", 128)
    if not isinstance(knee, int) or knee < 1:
        raise ValueError(f"{where}.matmul.knee must be a positive integer (the tile width, 128), got {knee!r}")
    gemm: list[GemmRow] = []
    for i, r in enumerate(mm.get("rows", [])):
        w = f"{where}.matmul.rows[{i}]"
        shape = r.get("shape") if isinstance(r, Mapping) else None
        if not (isinstance(shape, (list, tuple)) and len(shape) == 3
                and all(isinstance(s, int) and s > 0 for s in shape)):
            raise ValueError(f"{w}: shape must be [m, n, k], three positive integers, got {shape!r}")
        if min(shape) < knee:
            raise ValueError(f"{w}: shape {list(shape)} has a dim under the knee {knee}; table rows must be "
                             "non-skinny (the skinny penalty applies on top of them): measure a wider shape")
        eff = _eff(r.get("efficiency"), w)
        for dt in _dtypes(r.get("dtype"), w):
            gemm.append(GemmRow(dt, tuple(shape), eff))
    seen = {}
    for g in gemm:
        if (g.dtype, g.shape) in seen:
            raise ValueError(f"{where}.matmul: two rows for dtype {g.dtype!r} and shape {list(g.shape)} "
                             f"({seen[(g.dtype, g.shape)]} and {g.efficiency}); keep one")
        seen[(g.dtype, g.shape)] = g.efficiency
    att = d.get("attention") or {}
    att_rows: list[AttentionRow] = []
    for i, r in enumerate(att.get("rows", [])):
        w = f"{where}.attention.rows[{i}]"
        if not isinstance(r, Mapping) or not all(isinstance(r.get(k), int) and r[k] > 0 for k in ("seq", "head_dim")) \
                or not isinstance(r.get("causal"), bool):
            raise ValueError(f"{w}: needs seq and head_dim (positive integers) and causal (true/false), got {r!r}")
        eff = _eff(r.get("efficiency"), w)
        att_rows.append(AttentionRow(r["seq"], r["head_dim"], r["causal"], eff,
                                     _eff(r.get("bwd_efficiency", eff), w + " bwd")))
    keys = [(a.seq, a.head_dim, a.causal) for a in att_rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{where}.attention: repeated (seq, head_dim, causal) rows {sorted(keys)}; keep one of each")
    floor = d.get("floor_s", {})
    bad = {k: v for k, v in floor.items() if k not in FLOOR_KINDS or not isinstance(v, (int, float)) or not v >= 0}
    if bad:
        raise ValueError(f"{where}.floor_s: keys must be among {FLOOR_KINDS} with seconds >= 0, got {bad}")
    sources = d.get("sources", [])
    if isinstance(sources, str):
        sources = [sources]
    power = _power_rows(d.get("power"), f"{where}.power")
    return ComputeTable(
        matmul=tuple(sorted(gemm, key=lambda g: (g.dtype, g.flops))), knee=knee, attention=tuple(att_rows),
        attention_dtypes=_dtypes(att.get("dtype", ["bf16", "fp16"]), f"{where}.attention"),
        floor_s={k: float(v) for k, v in floor.items()}, sources=tuple(str(s) for s in sources), power=power)


def _power_rows(d: Any, where: str) -> tuple[tuple[float, float], ...]:
    if d is None:
        return ()
    rows = d.get("rows") if isinstance(d, Mapping) else None
    ok = isinstance(rows, (list, tuple)) and rows and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(v, (int, float)) for v in r)
        and 0 <= r[0] <= 1 and 0 < r[1] <= 1 for r in rows)
    if not ok:
        raise ValueError(f"{where} must be {{\"rows\": [[duty, ratio], ...]}}: duty (the GEMM share of compute) in "
                         f"[0, 1], ratio (sustained / burst throughput) in (0, 1], at least one row; got {d!r}")
    duties = [float(r[0]) for r in rows]
    if len(set(duties)) != len(duties):
        raise ValueError(f"{where}: repeated duties {sorted(duties)}; keep one row per duty")
    return tuple(sorted((float(r[0]), float(r[1])) for r in rows))


# -------------------------------------------------------------------- refits (autopar tune)
def refit_matmul(table: ComputeTable, measured: Iterable[tuple[str, tuple[int, int, int], float]]) -> ComputeTable:
    """`measured`: (dtype, (m, n, k), efficiency reached). For each dtype measured: a measured
    non-skinny shape becomes (or replaces) a row; every other row is scaled by the ratio
    measured / tabled, interpolated in log(FLOPs) between the measured shapes (clamped), and
    capped at 1. A dtype without rows gets the measured non-skinny shapes as its rows."""
    by_dt: dict[str, list[tuple[tuple[int, int, int], float]]] = {}
    for dt, shape, eff in measured:
        if eff > 0 and math.isfinite(eff):
            by_dt.setdefault(dt, []).append((tuple(int(s) for s in shape), min(1.0, float(eff))))
    rows = list(table.matmul)
    for dt, pts in by_dt.items():
        old = [r for r in rows if r.dtype == dt]
        ratios = []
        for shape, eff in pts:
            was = table.matmul_efficiency(dt, *shape)
            if was is not None:
                ratios.append((math.log(2.0 * math.prod(shape)), eff / was))
        new_rows = {}
        for r in old:
            s = _interp(math.log(r.flops), ratios) if ratios else 1.0
            new_rows[r.shape] = GemmRow(dt, r.shape, min(1.0, r.efficiency * s))
        for shape, eff in pts:
            if min(shape) >= table.knee:
                new_rows[shape] = GemmRow(dt, shape, eff)
        rows = [r for r in rows if r.dtype != dt] + list(new_rows.values())
    return replace(table, matmul=tuple(sorted(rows, key=lambda g: (g.dtype, g.flops))))


def refit_attention(table: ComputeTable, measured: Iterable[tuple[int, int, bool, float]]) -> ComputeTable:
    """`measured`: (seq, head_dim, causal, forward efficiency). A measured (seq, head_dim, causal)
    becomes (or replaces) a row, its backward efficiency scaled by the same ratio; every other
    row is scaled by the ratio measured / tabled of its causality (all measurements if none of
    it), interpolated in log(seq), capped at 1."""
    pts = [(int(s), int(h), bool(c), min(1.0, float(e))) for s, h, c, e in measured if e > 0 and math.isfinite(e)]
    if not pts:
        return table
    dt = table.attention_dtypes[0]
    ratio_pts = {}
    for s, h, c, e in pts:
        was = table.attention_efficiency(dt, s, h, c) if table.attention else None
        ratio_pts.setdefault(c, []).append((math.log(s), e / was if was else 1.0))
    everything = [p for v in ratio_pts.values() for p in v]

    def scale(seq: int, causal: bool) -> float:
        return _interp(math.log(seq), ratio_pts.get(causal) or everything)

    rows = {(r.seq, r.head_dim, r.causal): replace(r, efficiency=min(1.0, r.efficiency * scale(r.seq, r.causal)),
                                                   bwd_efficiency=min(1.0, r.bwd_efficiency * scale(r.seq, r.causal)))
            for r in table.attention}
    for s, h, c, e in pts:
        old = rows.get((s, h, c))
        bwd = old.bwd_efficiency if old else e
        rows[(s, h, c)] = AttentionRow(s, h, c, e, bwd)
    return replace(table, attention=tuple(sorted(rows.values(), key=lambda r: (r.causal, r.head_dim, r.seq))))
