"""The joint planner's pins: parts of a plan the user fixes, checked and put in one form.

Pins (`PIN_KEYS`): "tp", "pp", "dp", "ep", "cp", "mesh" ({axis: size}, merged into the axis pins),
"context_method" ("ring" | "ulysses" | "auto": the attention exchange of a cp plan),
"zero_stage" (0-3), "n_microbatches", "schedule" (a `cost.schedule.SCHEDULES` name, normalised
to lower case with underscores), "pp_virtual" (stages per pipeline rank: interleaved_1f1b's v,
searched otherwise; 2 admits zbv too, 1 the one-stage schedules), "split_points", "recompute" ("none",
"full", "selective" (`search.plan_selective`), "auto" or {module path: "full" | "selective" | "none"}),
"param_layouts" ({name: Layout, {axis: placement text} or a
tp placement}: normalised to the tp placement), "bucket_mb", "fusions", "loss_parallel" (True: the
logits stay vocabulary-sharded on tp and the loss runs on the shards, `Plan.loss_parallel`: the
head is pinned column-parallel and priced so, `search.shard_loss`).

`normalise_pins(pins, world)` raises ValueError naming a pin the planner does not know, a
value it cannot take, or a pin the fixed mesh contradicts; `world_size(world)` is the ranks
of a world given by size or by axis sizes. Reads and writes no node.meta.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from autopar.cost.placements import Layout, Placement, parse_placement
from autopar.cost.schedule import SCHEDULES
from autopar.search.context import METHODS

__all__ = ["AXES", "PIN_KEYS", "normalise_pins", "world_size"]

AXES = ("tp", "pp", "dp", "ep", "cp")  # the mesh axes the planner factorises the world into

PIN_KEYS = ("tp", "pp", "dp", "ep", "cp", "context_method", "mesh", "zero_stage", "n_microbatches", "schedule",
            "pp_virtual", "split_points",
            "recompute", "param_layouts", "bucket_mb", "fusions", "loss_parallel")


def world_size(w: int | Mapping[str, int]) -> int:
    """Ranks of a world given by its size or by its axis sizes."""
    if isinstance(w, Mapping):
        return math.prod(int(v) for v in w.values())
    if not isinstance(w, int) or w < 1:
        raise ValueError(f"world size must be a positive integer or a dict of mesh axis sizes, got {w!r}")
    return w


def normalise_pins(pins: Mapping[str, Any] | None, w) -> dict[str, Any]:
    """`pins` checked and in the planner's forms (see the module docstring); `w`: the world
    size or the fixed mesh's axis sizes, which become tp / pp / dp / ep / cp pins."""
    out = dict(pins or {})
    unknown = [k for k in out if k not in PIN_KEYS]
    if unknown:
        raise ValueError(f"unknown pins {unknown}; the planner accepts {list(PIN_KEYS)}")
    mesh = dict(out.pop("mesh", None) or {})
    if isinstance(w, Mapping):
        mesh = {**dict(w), **mesh}
    if mesh:
        bad = [a for a in mesh if a not in AXES]
        if bad:
            raise ValueError(f"mesh axes {bad} cannot be planned; use tp, pp, dp, ep, cp")
        for a in AXES:
            if a in mesh and a in out and out[a] != mesh[a]:
                raise ValueError(f"pins say {a}={out[a]} but the mesh says {a}={mesh[a]}")
            out.setdefault(a, int(mesh.get(a, 1)))
    for a in AXES + ("zero_stage", "n_microbatches", "pp_virtual"):
        if a in out and (not isinstance(out[a], int) or out[a] < (0 if a == "zero_stage" else 1)):
            raise ValueError(f"pin {a}={out[a]!r} must be a positive integer" + (" (0-3)" if a == "zero_stage" else ""))
    if "zero_stage" in out and out["zero_stage"] not in (0, 1, 2, 3):
        raise ValueError(f"pin zero_stage={out['zero_stage']} must be 0, 1, 2 or 3")
    if "schedule" in out:
        s = str(out["schedule"]).lower().replace("-", "_")
        if s not in SCHEDULES:
            raise ValueError(f"pinned schedule {out['schedule']!r} is unknown; choose one of {sorted(SCHEDULES)}")
        out["schedule"] = s
    if "param_layouts" in out:
        pp: dict[str, Placement] = {}
        for name, lay in dict(out["param_layouts"]).items():
            if isinstance(lay, Layout):
                p = lay.get("tp")
            elif isinstance(lay, Mapping):
                p = parse_placement(lay.get("tp", "R"))
            else:
                p = parse_placement(str(lay)) if isinstance(lay, str) else lay
            pp[name] = p
        out["param_layouts"] = pp
    if "context_method" in out and out["context_method"] not in METHODS:
        raise ValueError(f"pin context_method={out['context_method']!r} is unknown; choose one of {list(METHODS)}")
    if "loss_parallel" in out and not isinstance(out["loss_parallel"], bool):
        raise ValueError(f"pin loss_parallel={out['loss_parallel']!r} must be True or False")
    if out.get("loss_parallel") is False:
        out.pop("loss_parallel")  # the default: one cache key for both spellings
    rc = out.get("recompute")
    modes = set(rc.values()) if isinstance(rc, Mapping) else {rc}
    if rc is not None and not modes <= ({"none", "full", "selective"} if isinstance(rc, Mapping) else
                                        {"none", "full", "selective", "auto"}):
        raise ValueError(f"pin recompute={rc!r} must be 'none', 'full', 'selective', 'auto' or {{module path: "
                         f"'full'|'selective'|'none'}}")
    return out
