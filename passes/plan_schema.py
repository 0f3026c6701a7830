"""The schema of a plan file, and the fingerprint that ties a Plan to the graph it was made for.

`validate_plan_dict(d)` checks a plan's JSON data field by field before a Plan is built from
it: the version, every field's type, and the ranges a field can take (a mesh of positive
sizes, a ZeRO stage 0-3, placements that parse, a known schedule, recompute modes, fusion
rule names, precision fields the ZeRO engine can run: `precision_problems`). Every problem
is listed in one `PlanFormatError` (a ValueError), each naming the
field, what it expects and what it got:

    plan field 'zero_stage': expected an integer from 0 to 3, got '2' (a string)

`parse_plan_json(text, source)` turns malformed JSON into the same error class, naming the line
and column.

`graph_stamp(gm)` is what a plan records about its model (`Plan.graph`): a fingerprint of
the graph that stays the same between captures of one model at any batch or sequence length
(parameters and buffers by name and shape, and which names are tied; their dtypes apart; the
calls by their stable node keys, `ir.node_keys`), its two halves (`tensors`, `ops`) and counts for the explanation.
`explain_stamps(planned, actual)` says in words how two stamps differ (None when they agree).

It reads node.meta["autopar"] through `ir.node_keys` (module paths); writes nothing.
Guarantees: `validate_plan_dict` accepts every plan `Plan.to_dict` writes; it never raises
anything but PlanFormatError.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping

PLAN_VERSION = 1
RECOMPUTE_MODES = ("none", "full", "selective")


class PlanFormatError(ValueError):
    """A plan file (or dict) that is not a valid plan: malformed JSON, an unknown field, or a
    field of the wrong type or out of range. The message names every bad field."""


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, Mapping):
        return "an object"
    return f"a {type(v).__name__}"


def _got(v: Any) -> str:
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({_kind(v)})"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def parse_plan_json(text: str, source: str = "the plan") -> dict[str, Any]:
    """The JSON object in `text`; PlanFormatError naming the line and column when it is not
    JSON, or not an object."""
    import json  # noqa: PLC0415

    if not isinstance(text, str):
        raise PlanFormatError(f"{source}: expected the plan's JSON text, got {_kind(text)}")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"{source} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; "
                              "write it with Plan.to_json() or `autopar plan --out plan.json`") from None
    if not isinstance(d, dict):
        raise PlanFormatError(f"{source} holds {_kind(d)}, not a plan: a plan is a JSON object with "
                              "fields such as \"mesh\" and \"zero_stage\"")
    return d


def _check_layouts(field: str, v: Any, axes: set[str] | None, out: list[str]) -> None:
    from autopar.runtime.placement import parse_placement  # noqa: PLC0415

    if not isinstance(v, Mapping):
        out.append(f"plan field {field!r}: expected an object {{name: {{axis: placement}}}}, got {_got(v)}")
        return
    for name, lay in v.items():
        where = f"plan field {field!r}, entry {name!r}"
        if not isinstance(name, str) or not name:
            out.append(f"plan field {field!r}: names must be non-empty strings, got {_got(name)}")
            continue
        if not isinstance(lay, Mapping):
            out.append(f"{where}: expected a layout {{axis: placement}} such as {{\"tp\": \"S(0)\"}}, got {_got(lay)}")
            continue
        for axis, p in lay.items():
            if axes is not None and axis not in axes:
                out.append(f"{where}: axis {axis!r} is not an axis of the plan's mesh {sorted(axes)}")
            if not isinstance(p, str):
                out.append(f"{where}, axis {axis!r}: expected a placement string (R, S(<dim>), P(sum)), got {_got(p)}")
                continue
            try:
                pl = parse_placement(p)
            except ValueError:
                out.append(f"{where}, axis {axis!r}: {p!r} is not a placement; expected R, S(<dim>) or "
                           "P(sum|avg|max|min)")
                continue
            if getattr(pl, "dim", 0) < 0:
                out.append(f"{where}, axis {axis!r}: {p!r} shards a negative dim; use the dim counted from 0")


def _check_str_list(field: str, v: Any, out: list[str], unique: bool = False) -> None:
    if not isinstance(v, (list, tuple)):
        out.append(f"plan field {field!r}: expected a list of strings, got {_got(v)}")
        return
    bad = [x for x in v if not isinstance(x, str)]
    if bad:
        out.append(f"plan field {field!r}: expected a list of strings, but it holds {_got(bad[0])}")
    elif unique and len(set(v)) != len(v):
        dup = sorted({x for x in v if list(v).count(x) > 1})
        out.append(f"plan field {field!r}: names {dup} more than once; each may appear once")


def validate_plan_dict(d: Any, source: str = "the plan") -> None:
    """Check a plan's JSON data (see the module docstring); PlanFormatError listing every
    problem, each naming the field and the expected type or range."""
    from autopar.runtime.schedules import SCHEDULES  # noqa: PLC0415

    if not isinstance(d, Mapping):
        raise PlanFormatError(f"{source} is {_kind(d)}, not a plan (a JSON object with fields such as \"mesh\")")
    out: list[str] = []
    known = ("version", "mesh", "dp_axis", "zero_stage", "bucket_mb", "param_layouts", "node_layouts", "strategies",
             "split_points", "schedule", "n_microbatches", "recompute", "fusions", "predicted", "notes", "extra",
             "graph", *PRECISION_FIELDS)
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        out.append(f"unknown plan fields {unknown}; the fields are {sorted(known)}")
    if "version" in d:
        v = d["version"]
        if not _is_int(v):
            out.append(f"plan field 'version': expected an integer, got {_got(v)}")
        elif v != PLAN_VERSION:
            out.append(f"plan field 'version': {v} is not supported; this autopar reads version {PLAN_VERSION} "
                       "(re-plan with this version)")
    axes: set[str] | None = None
    if "mesh" not in d:
        out.append("plan field 'mesh' is missing: a plan needs its mesh, e.g. {\"dp\": 4}")
    else:
        mesh = d["mesh"]
        if not isinstance(mesh, Mapping) or not mesh:
            out.append(f"plan field 'mesh': expected a non-empty object {{axis: size}} such as {{\"dp\": 2, \"tp\": 2}}, "
                       f"got {_got(mesh)}")
        else:
            axes = set()
            for axis, size in mesh.items():
                if not isinstance(axis, str) or not axis:
                    out.append(f"plan field 'mesh': axis names must be non-empty strings, got {_got(axis)}")
                    continue
                axes.add(axis)
                if not _is_int(size) or size < 1:
                    out.append(f"plan field 'mesh', axis {axis!r}: expected a positive integer size, got {_got(size)}")
    if "dp_axis" in d:
        v = d["dp_axis"]
        if v is not None and not isinstance(v, str):
            out.append(f"plan field 'dp_axis': expected a mesh axis name or null, got {_got(v)}")
        elif v is not None and axes is not None and v not in axes:
            out.append(f"plan field 'dp_axis': {v!r} is not an axis of the plan's mesh {sorted(axes)}; name one or "
                       "use null")
    elif axes is not None and "dp" not in axes:
        out.append(f"plan field 'dp_axis' is missing and defaults to 'dp', which is not an axis of the mesh "
                   f"{sorted(axes)}; give \"dp_axis\": null or add a dp axis")
    if "zero_stage" in d and not (_is_int(d["zero_stage"]) and 0 <= d["zero_stage"] <= 3):
        out.append(f"plan field 'zero_stage': expected an integer from 0 to 3, got {_got(d['zero_stage'])}")
    if "bucket_mb" in d and not (_is_number(d["bucket_mb"]) and d["bucket_mb"] > 0):
        out.append(f"plan field 'bucket_mb': expected a positive number (MiB), got {_got(d['bucket_mb'])}")
    if "n_microbatches" in d and not (_is_int(d["n_microbatches"]) and d["n_microbatches"] >= 1):
        out.append(f"plan field 'n_microbatches': expected an integer >= 1, got {_got(d['n_microbatches'])}")
    for f in ("param_layouts", "node_layouts"):
        if f in d:
            _check_layouts(f, d[f], axes, out)
    if "strategies" in d:
        v = d["strategies"]
        if not isinstance(v, Mapping):
            out.append(f"plan field 'strategies': expected an object {{axis: {{node key: strategy}}}}, got {_got(v)}")
        else:
            for axis, table in v.items():
                if axes is not None and axis not in axes:
                    out.append(f"plan field 'strategies': axis {axis!r} is not an axis of the plan's mesh {sorted(axes)}")
                if not isinstance(table, Mapping):
                    out.append(f"plan field 'strategies', axis {axis!r}: expected an object {{node key: strategy}}, "
                               f"got {_got(table)}")
                    continue
                for key, s in table.items():
                    if not isinstance(s, str) or "->" not in s:
                        out.append(f"plan field 'strategies', axis {axis!r}, node {key!r}: expected a strategy "
                                   f"string such as \"R,S(0)->S(1)\", got {_got(s)}")
    if "split_points" in d:
        _check_str_list("split_points", d["split_points"], out, unique=True)
    if "schedule" in d:
        v = d["schedule"]
        if v is not None and not isinstance(v, str):
            out.append(f"plan field 'schedule': expected a schedule name or null, got {_got(v)}")
        elif isinstance(v, str) and v.lower().replace("-", "_") not in SCHEDULES:
            out.append(f"plan field 'schedule': unknown schedule {v!r}; choose one of {sorted(SCHEDULES)}")
    if "recompute" in d:
        v = d["recompute"]
        if not isinstance(v, Mapping):
            out.append(f"plan field 'recompute': expected an object {{module path: mode}}, got {_got(v)}")
        else:
            for k, mode in v.items():
                if mode not in RECOMPUTE_MODES:
                    out.append(f"plan field 'recompute', module {k!r}: expected one of {list(RECOMPUTE_MODES)}, "
                               f"got {_got(mode)}")
    if "fusions" in d:
        v = d["fusions"]
        _check_str_list("fusions", v, out)
        if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
            from autopar.passes.rules.fusion_table import parse_entry  # noqa: PLC0415

            for e in v:
                try:
                    parse_entry(e)
                except ValueError as err:
                    out.append(f"plan field 'fusions', entry {e!r}: {err}")
    out += precision_problems(d)
    for f in ("predicted", "extra", "graph"):
        if f in d and not isinstance(d[f], Mapping):
            out.append(f"plan field {f!r}: expected an object, got {_got(d[f])}")
    if "notes" in d:
        _check_str_list("notes", d["notes"], out)
    if isinstance(d.get("extra"), Mapping) and not isinstance(d["extra"].get("loss_parallel", True), bool):
        out.append("plan field 'extra', key 'loss_parallel': expected true or false, got "
                   f"{_got(d['extra']['loss_parallel'])}")
    g = d.get("graph")
    if isinstance(g, Mapping):
        for k in ("fingerprint", "tensors", "dtypes", "ops"):
            if k in g and not isinstance(g[k], str):
                out.append(f"plan field 'graph', key {k!r}: expected a string, got {_got(g[k])}")
    if out:
        more = f" (and {len(out) - 12} more)" if len(out) > 12 else ""
        raise PlanFormatError(f"{source} is not a valid plan: " + "; ".join(out[:12]) + more)


# ------------------------------------------------------------------------ precision fields
DTYPE_NAMES = ("fp32", "bf16", "fp16", "fp64")
PRECISION_FIELDS = ("param_dtype", "master_dtype", "reduce_dtype", "optim_dtype", "offload", "loss_scale")


def precision_problems(d: Mapping[str, Any]) -> list[str]:
    """What is wrong with the precision fields of plan data `d` (absent = default), each
    naming the field; the combinations are those the ZeRO engine runs (runtime/zero.py):
    masters only fp32 and only under 16-bit parameters, optimizer states in the master's
    dtype (the parameter's without masters)."""
    out: list[str] = []
    for f in ("param_dtype", "master_dtype", "reduce_dtype", "optim_dtype"):
        v = d.get(f)
        if v is not None and v not in DTYPE_NAMES:
            out.append(f"plan field {f!r}: expected null or one of {list(DTYPE_NAMES)}, got {_got(v)}")
    if "offload" in d and not isinstance(d["offload"], bool):
        out.append(f"plan field 'offload': expected true or false, got {_got(d['offload'])}")
    if d.get("loss_scale") not in (None, "dynamic"):
        out.append(f"plan field 'loss_scale': expected null or \"dynamic\", got {_got(d['loss_scale'])}")
    if out:
        return out
    param, master, optim = d.get("param_dtype"), d.get("master_dtype"), d.get("optim_dtype")
    if master is not None and (master != "fp32" or param not in ("bf16", "fp16")):
        out.append(f"plan fields 'master_dtype' {master!r} with 'param_dtype' {param!r}: master weights are fp32 "
                   "copies of bf16/fp16 parameters; use master_dtype null (pure) or param_dtype bf16/fp16 with "
                   "master_dtype fp32")
    if optim is not None and optim != (master or param or optim):
        out.append(f"plan field 'optim_dtype': {optim!r}, but the optimizer steps the "
                   f"{'masters' if master else 'parameters'} in {master or param!r}; set it to that or null")
    if d.get("loss_scale") == "dynamic" and not (param == "fp16" and master == "fp32"):
        out.append(f"plan field 'loss_scale': dynamic loss scaling is for fp16 parameters with fp32 masters "
                   f"(precision 'fp16-mixed'); got param_dtype {param!r}, master_dtype {master!r}")
    return out


# ------------------------------------------------------------------------ the model's stamp
def _sha(lines) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def graph_stamp(gm) -> dict[str, Any]:
    """What a plan records about the graph it was made for (see the module docstring):
    {"fingerprint", "tensors", "ops", "n_tensors", "n_elements", "n_ops"}. Independent of the
    batch and sequence length the graph was captured at; tied names count once per name."""
    from . import ir  # noqa: PLC0415

    tensors, dtypes = [], []
    n_elements = 0
    by_id: dict[int, list[str]] = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        tensors.append(f"{name}|{tuple(int(s) for s in t.shape)}")
        dtypes.append(f"{name}|{str(t.dtype).replace('torch.', '')}")
        n_elements += int(t.numel())
        by_id.setdefault(id(t), []).append(name)
    n_tensors = len(tensors)
    tensors += [f"tied|{'='.join(sorted(g))}" for g in by_id.values() if len(g) > 1]  # tying changes the model
    tensors.sort()
    dtypes.sort()
    keys = ir.node_keys(gm)
    ops = [keys[n] for n in gm.graph.nodes if n.op == "call_function" and n in keys]
    t_sha, d_sha, o_sha = _sha(tensors), _sha(dtypes), _sha(ops)
    return {"fingerprint": _sha([t_sha, d_sha, o_sha]), "tensors": t_sha, "dtypes": d_sha, "ops": o_sha,
            "n_tensors": n_tensors, "n_elements": n_elements, "n_ops": len(ops)}


def explain_stamps(planned: Mapping[str, Any], actual: Mapping[str, Any]) -> dict[str, str] | None:
    """How the graph a plan was made for (`planned`) differs from this one (`actual`): None
    when the fingerprints agree (or the plan has none), else {"tensors": why} when the
    parameters differ in name, shape or tying (another model), {"dtypes": why} when only their
    dtypes differ (the same model in another precision) and/or {"ops": why} when the calls
    differ (the same parameters captured differently, e.g. under another torch version)."""
    if not planned or not planned.get("fingerprint") or planned.get("fingerprint") == actual.get("fingerprint"):
        return None
    out = {}

    def counts(s: Mapping[str, Any]) -> str:
        return (f"{s.get('n_tensors', '?')} parameters and buffers ({_count(s.get('n_elements'))} elements), "
                f"{s.get('n_ops', '?')} ops")

    if planned.get("tensors") != actual.get("tensors"):
        out["tensors"] = (f"the plan was made for a model with {counts(planned)} (fingerprint {planned['fingerprint']}); "
                          f"this model has {counts(actual)} (fingerprint {actual['fingerprint']}): their parameters "
                          "differ in name, shape or tying")
    elif planned.get("dtypes") and planned.get("dtypes") != actual.get("dtypes"):
        out["dtypes"] = ("the plan was made for this model's parameters in other dtypes (its memory and time "
                         "predictions assumed those)")
    if planned.get("ops") != actual.get("ops"):
        out["ops"] = (f"the plan's graph had {planned.get('n_ops', '?')} ops, this capture has {actual.get('n_ops', '?')} "
                      "(same parameters captured differently: another torch or transformers version, or another "
                      "code path)")
    return out or None


def _count(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit, k in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return str(int(n))
