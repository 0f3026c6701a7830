"""The Plan: the contract between the brain (`autopar/`, which decides) and the hands
(`passes/`, which rewrite).

A Plan is plain data. It round-trips through JSON (`Plan.from_json(plan.to_json())`), it is
keyed by module and parameter names (never by fx node names, which change between captures),
and any field can be pinned by a user and the search solves the rest.

Fields that a pass does not understand yet are carried along untouched.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autopar.runtime.placement import Layout

PLAN_VERSION = 1


@dataclass
class Plan:
    """What to do with a model on a mesh.

    mesh: axis name -> size, in mesh order (e.g. {"dp": 2, "tp": 2}). The product is the world size.
    dp_axis: the axis over which the batch is split and gradients are reduced.
    zero_stage: 0 (plain data parallel), 1, 2 or 3.
    bucket_mb: gradient bucket size for reduction (and ZeRO-3 gather prefetch).
    param_layouts: parameter name -> layout over the mesh (missing = replicated).
    node_layouts: stable node key ("<module path>:<op>#<k>") -> output layout (missing = inferred).
    strategies: mesh axis -> stable node key -> sharding strategy on that axis, as text
        ("R,S(0)->S(2)": input placements -> output placement; see passes/rules/sharding.py).
        Missing nodes are replicated on the axis.
    split_points: module paths at which a new pipeline stage starts.
    schedule: pipeline schedule name ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1").
    n_microbatches: micro-batches per step (pipeline, or gradient accumulation without one).
    recompute: module path -> "none" | "full" | "selective".
    fusions: list of fusion rule names to apply.
    predicted: the cost model's predictions for this plan (step time, memory per rank ...).
    notes: human-readable reasons, one per decision.
    """

    mesh: dict[str, int]
    dp_axis: str | None = "dp"
    zero_stage: int = 0
    bucket_mb: float = 25.0
    param_layouts: dict[str, Layout] = field(default_factory=dict)
    node_layouts: dict[str, Layout] = field(default_factory=dict)
    strategies: dict[str, dict[str, str]] = field(default_factory=dict)
    split_points: list[str] = field(default_factory=list)
    schedule: str | None = None
    n_microbatches: int = 1
    recompute: dict[str, str] = field(default_factory=dict)
    fusions: list[str] = field(default_factory=list)
    predicted: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.mesh:
            raise ValueError("a Plan needs a mesh, e.g. {'dp': 4}")
        for axis, size in self.mesh.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis!r} has size {size!r}; sizes must be positive integers")
        if self.dp_axis is not None and self.dp_axis not in self.mesh:
            raise ValueError(f"dp_axis {self.dp_axis!r} is not a mesh axis {list(self.mesh)}; "
                             "name an axis of the mesh or pass dp_axis=None")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {self.n_microbatches}")

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.mesh.values():
            n *= s
        return n

    @property
    def dp(self) -> int:
        return self.mesh.get(self.dp_axis, 1) if self.dp_axis else 1

    # --- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"version": PLAN_VERSION}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("param_layouts", "node_layouts"):
                v = {k: lay.to_json() for k, lay in v.items()}
            d[f.name] = v
        return d

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False, default=_json_default)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        d = dict(d)
        version = d.pop("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise ValueError(f"plan version {version} is not supported (this autopar reads {PLAN_VERSION})")
        known = {f.name for f in fields(Plan)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown plan fields {sorted(unknown)}; known fields are {sorted(known)}")
        for key in ("param_layouts", "node_layouts"):
            if key in d:
                d[key] = {k: Layout.from_json(v) for k, v in d[key].items()}
        return Plan(**d)

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))

    def pin(self, **pins: Any) -> "Plan":
        """A copy with the given fields replaced (validated)."""
        d = asdict(self)
        d["param_layouts"] = dict(self.param_layouts)
        d["node_layouts"] = dict(self.node_layouts)
        d["strategies"] = {a: dict(t) for a, t in self.strategies.items()}
        for k, v in pins.items():
            if k not in d:
                raise ValueError(f"cannot pin unknown plan field {k!r}")
            d[k] = v
        return Plan(**d)


def _json_default(o: Any):
    if hasattr(o, "to_json"):
        return o.to_json()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"cannot serialise {type(o).__name__} in a plan")
