"""The Plan: the contract between the brain (`autopar/`, which decides) and the hands
(`passes/`, which rewrite).

A Plan is plain data. It round-trips through JSON (`Plan.from_json(plan.to_json())`), it is
keyed by module and parameter names (never by fx node names, which change between captures),
and any field can be pinned by a user and the search solves the rest.

Fields that a pass does not understand yet are carried along untouched.

Reading a plan file checks it first (passes/plan_schema.py): malformed JSON, an unknown
field, or a field of the wrong type or out of range is a `PlanFormatError` (a ValueError)
naming the field and what it expects. A plan records the graph it was made for (`graph`: a
fingerprint and counts, `plan_schema.graph_stamp`); whether it fits a model is checked
against the captured graph by autopar/build/plan_check.py.

Precision is one truth here, read by the runtime (`engine_options`, what the ZeRO engine is
given) and by the cost model (autopar/cost/estimate.py) alike: `param_dtype` (compute and
model parameters), `master_dtype` (fp32 master copies the optimizer steps, or null),
`reduce_dtype` (gradient communication), `optim_dtype` (optimizer states), `offload`
(masters and optimizer states in CPU memory) and `loss_scale`. `precision_fields(name)`
spells the named recipes ("fp32", "bf16", "bf16-mixed", "fp16-mixed") as these fields.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from autopar.runtime.placement import Layout

from .plan_schema import PLAN_VERSION, PlanFormatError, parse_plan_json, precision_problems, validate_plan_dict

__all__ = ["Plan", "PlanFormatError", "PLAN_VERSION", "PRECISIONS", "PRECISION_FIELDS", "precision_fields",
           "default_precision", "engine_options", "torch_dtype"]

# name -> (param_dtype, master_dtype, reduce_dtype, optim_dtype, loss_scale). Gradient
# reduction under the mixed recipes is fp32: averaging k bf16/fp16 gradients in 16 bits
# rounds each partial sum to 8 (bf16) or 11 (fp16) mantissa bits and fp16 sums can overflow;
# fp32 gives the one-process result up to summation order, for twice the bytes (pin
# reduce_dtype "bf16" to halve them).
PRECISIONS: dict[str, tuple[str | None, str | None, str | None, str | None, str | None]] = {
    "fp32": ("fp32", None, None, "fp32", None),
    "bf16": ("bf16", None, None, "bf16", None),
    "bf16-mixed": ("bf16", "fp32", "fp32", "fp32", None),
    "fp16-mixed": ("fp16", "fp32", "fp32", "fp32", "dynamic"),
}
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a plan dtype name ("bf16" -> torch.bfloat16); None for None."""
    return None if name is None else _TORCH[name]


PRECISION_FIELDS = ("param_dtype", "master_dtype", "reduce_dtype", "optim_dtype", "offload", "loss_scale")


def default_precision(trained_dtypes: set[torch.dtype]) -> str | None:
    """The recipe a model trains with when none is named: "bf16-mixed" ("fp16-mixed") when every
    trained floating parameter is bf16 (fp16), as Megatron and DeepSpeed do; else None (the
    model's own dtype, pure). `autopar.parallelize` and the planner both read it."""
    if trained_dtypes == {torch.bfloat16}:
        return "bf16-mixed"
    if trained_dtypes == {torch.float16}:
        return "fp16-mixed"
    return None


def precision_fields(precision: str | None, offload: bool | None = None) -> dict[str, Any]:
    """The Plan fields of a named precision recipe (and `offload` when given), to pin.

    None pins nothing: a plan without precision fields trains the model's own dtype, pure (no
    master copies, optimizer states and gradient reduction in the parameters' dtype);
    `autopar.parallelize` with precision=None pins "bf16-mixed" / "fp16-mixed" for a model
    whose trained parameters are all bf16 / fp16. "bf16" / "fp32" are pure as well; "bf16-mixed" and "fp16-mixed"
    compute in 16 bits with fp32 masters, fp32 optimizer states and fp32 gradient reduction,
    "fp16-mixed" with dynamic loss scaling."""
    out: dict[str, Any] = {}
    if precision is not None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)} (or None: the "
                             "model's own dtype, pure)")
        param, master, reduce, optim, scale = PRECISIONS[precision]
        out = {"param_dtype": param, "master_dtype": master, "reduce_dtype": reduce, "optim_dtype": optim,
               "loss_scale": scale}
    if offload is not None:
        if not isinstance(offload, bool):
            raise ValueError(f"offload must be True or False, got {offload!r}")
        out["offload"] = offload
    return out


def engine_options(plan: "Plan", model_dtypes: set[torch.dtype]) -> dict[str, Any]:
    """The ZeRO engine options (runtime/zero.py `make_engine`) that run the plan's precision
    fields, for a model whose floating parameters have `model_dtypes`.

    Mixed precision casts the parameters to `param_dtype` and keeps fp32 masters made from
    their values before the cast (an fp16/bf16 model gets exact fp32 copies). A pure
    `param_dtype` must be the model's own dtype: the engine does not convert the model
    without masters (ValueError saying how to convert it)."""
    opts: dict[str, Any] = {}
    param = torch_dtype(plan.param_dtype)
    if plan.master_dtype is not None:
        opts["param_dtype"] = param
        opts["loss_scale"] = plan.loss_scale  # None or "dynamic"
    elif param is not None and model_dtypes and model_dtypes != {param}:
        names = sorted(str(d).replace("torch.", "") for d in model_dtypes)
        raise ValueError(f"plan param_dtype {plan.param_dtype!r} without masters (pure precision) trains the model "
                         f"in its own parameters, but they are {names}; convert the model first "
                         f"(model.to({param})) or use precision '{plan.param_dtype}-mixed'"
                         if plan.param_dtype in ("bf16", "fp16") else
                         f"plan param_dtype {plan.param_dtype!r} without masters (pure precision) trains the model "
                         f"in its own parameters, but they are {names}; convert the model first (model.to({param}))")
    if plan.reduce_dtype is not None:
        opts["reduce_dtype"] = torch_dtype(plan.reduce_dtype)
    if plan.offload:
        opts["offload"] = True
    return opts


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
    extra: what passes and searches record beyond the fields above (carried along untouched).
    loss_parallel (a property over extra["loss_parallel"]): the logits stay vocab-sharded on tp
        and the loss runs vocab-parallel (runtime/vocab_loss.py).
    graph: the graph the plan was made for (`plan_schema.graph_stamp`: fingerprint, counts);
        empty for a plan written by hand, which is then checked name by name only.
    param_dtype: "fp32" | "bf16" | "fp16" | "fp64": compute dtype of the parameters; None:
        the model's own dtype.
    master_dtype: "fp32": master copies of 16-bit parameters the optimizer steps; None: none.
    reduce_dtype: dtype of gradient reduction; None: the gradients' (parameters') dtype.
    optim_dtype: dtype of optimizer states: the master's, else the parameters' (None: so).
    offload: masters and optimizer states in CPU memory, the update on the CPU.
    loss_scale: "dynamic" (fp16 with fp32 masters) or None.
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
    graph: dict[str, Any] = field(default_factory=dict)
    param_dtype: str | None = None
    master_dtype: str | None = None
    reduce_dtype: str | None = None
    optim_dtype: str | None = None
    offload: bool = False
    loss_scale: str | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, dict) or not self.mesh:
            raise PlanFormatError(f"a Plan needs a mesh, e.g. {{'dp': 4}}; got {self.mesh!r}")
        for axis, size in self.mesh.items():
            if not _is_int(size) or size < 1:
                raise PlanFormatError(f"mesh axis {axis!r} has size {size!r}; sizes must be positive integers")
        if self.dp_axis is not None and self.dp_axis not in self.mesh:
            raise PlanFormatError(f"dp_axis {self.dp_axis!r} is not a mesh axis {list(self.mesh)}; "
                                  "name an axis of the mesh or pass dp_axis=None")
        if not _is_int(self.zero_stage) or self.zero_stage not in (0, 1, 2, 3):
            raise PlanFormatError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if not _is_int(self.n_microbatches) or self.n_microbatches < 1:
            raise PlanFormatError(f"n_microbatches must be an integer >= 1, got {self.n_microbatches!r}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise PlanFormatError(f"bucket_mb must be a positive number (MiB), got {self.bucket_mb!r}")
        bad = precision_problems({f: getattr(self, f) for f in ("param_dtype", "master_dtype", "reduce_dtype",
                                                              "optim_dtype", "offload", "loss_scale")})
        if bad:
            raise PlanFormatError("; ".join(bad))

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.mesh.values():
            n *= s
        return n

    @property
    def loss_parallel(self) -> bool:
        """The logits stay sharded over the vocabulary on tp (the head's weight sharded on its
        out dim) and the loss runs vocab-parallel (runtime/vocab_loss.py) when `step` is given
        `autopar.cross_entropy`; read by passes/shard.py, the runtime and the cost model
        (cost/loss_memory.py). Stored as `extra["loss_parallel"]` (JSON round trip)."""
        return bool(self.extra.get("loss_parallel", False))

    @loss_parallel.setter
    def loss_parallel(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise PlanFormatError(f"loss_parallel must be True or False, got {on!r}")
        if on:
            self.extra["loss_parallel"] = True
        else:
            self.extra.pop("loss_parallel", None)

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
    def from_dict(d: dict[str, Any], source: str = "the plan") -> "Plan":
        """The Plan of JSON data `d`, checked first (PlanFormatError naming every bad field;
        `source` names the data in messages, e.g. the file)."""
        validate_plan_dict(d, source)
        d = dict(d)
        d.pop("version", None)
        for key in ("param_layouts", "node_layouts"):
            if key in d:
                d[key] = {k: Layout.from_json(v) for k, v in d[key].items()}
        for key in ("strategies", "recompute", "predicted", "extra", "graph"):
            if key in d:
                d[key] = dict(d[key])
        for key in ("split_points", "fusions", "notes"):
            if key in d:
                d[key] = list(d[key])
        return Plan(**d)

    @staticmethod
    def from_json(text: str, source: str = "the plan") -> "Plan":
        """The Plan in JSON `text` (as `to_json` writes it); PlanFormatError naming the line
        and column of malformed JSON, or every field of the wrong type or out of range."""
        return Plan.from_dict(parse_plan_json(text, source), source)

    @staticmethod
    def load(path: str) -> "Plan":
        """The Plan in the file at `path`; a missing or unreadable file is a ValueError naming it."""
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            raise PlanFormatError(f"there is no plan file at {path!r}; write one with Plan.to_json() or "
                                  "`autopar plan ... --out plan.json`") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlanFormatError(f"cannot read the plan file {path!r}: {e}") from None
        return Plan.from_json(text, source=path)

    def pin(self, **pins: Any) -> "Plan":
        """A copy with the given fields replaced (validated)."""
        d = asdict(self)
        d["param_layouts"] = dict(self.param_layouts)
        d["node_layouts"] = dict(self.node_layouts)
        d["strategies"] = {a: dict(t) for a, t in self.strategies.items()}
        for k, v in pins.items():
            if k not in d:
                raise PlanFormatError(f"cannot pin unknown plan field {k!r}; the fields are {sorted(d)}")
            d[k] = v
        return Plan(**d)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy integers too


def _json_default(o: Any):
    if hasattr(o, "to_json"):
        return o.to_json()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"cannot serialise {type(o).__name__} in a plan")
