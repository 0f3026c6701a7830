"""Memory of a training step: model states per rank and the activation peak.

Model states (`model_states`), per rank, for each parameter (numel n after its layout in
`Plan.param_layouts`: a Shard over an axis of size k keeps n/k), ZeRO sharding over dp ranks
by dim-0 rows as `runtime.zero` shards them (torch.chunk of dim 0, as FSDP2): with R rows of
`rest` elements each, rank r keeps rows [min(R, r*c), min(R, (r+1)*c)), c = ceil(R/dp), so the
last ranks' pieces are short or empty; a 0-d parameter is one row. Shards are unpadded (the
padding to c rows exists only in communication buffers: `padded_numel`).
  params      n * param bytes              (stage 3: the rank's rows)
  grads       n * grad bytes, trainable    (stage >= 2: the rows)
  master      n * 4 when master weights are kept (16-bit params, fp32 master)   (stage >= 1: rows)
  optimizer   n * states * state bytes     (stage >= 1: rows); states: sgd 0, sgd_momentum 1
              (momentum_buffer), adam/adamw 2 (exp_avg, exp_avg_sq; 3 with amsgrad), plus
              torch's per-parameter `step` scalar (fp32, 4 bytes) for adam/adamw, on every
              rank, also for empty rows (the engine hands the optimizer every master, and
              torch.optim makes a `step` for each one that has a gradient)
  buffers     full size on every rank
State dtype = the master dtype when master weights are kept, else the parameter's dtype
(torch.optim keeps states like the parameter they update). With `as_engine`, separate
masters (fp32 masters of 16-bit parameters, or any master with `separate_masters`, as offload
keeps them) carry their own gradient, as the ZeRO engine keeps it: stages 0-1 the model's
full gradient plus the master's (n_opt elements, master dtype); stages 2-3 only the master's rows (the reducer
writes them and frees the full gradient). That part is also in `master_grads`. At stage 3 the
engine keeps no 16-bit shard: the module's parameter is the master's rows, counted as params
(in the master's dtype), master 0; the 16-bit copies exist only while a unit is gathered.

Under a Plan's precision (`plan_states`: parameters cast to `param_dtype`, masters when
`master_dtype` differs, as the engine keeps them; the one count `cost.estimate` and the
planner share; `resolve_precision` fills the fields a model trains with by default),
`device_resident` splits a rank's states into device and host bytes under offload, and
`offload_step_seconds` prices an offloaded step (host<->device copies, the CPU's update) at a
profile's host bandwidths.

Activation peak (`liveness`): a walk over the forward in graph order, then the backward in
reverse order. Forward: a node allocates the storages its outputs create (views allocate
nothing) and the buffers it saves; a storage is freed after its last reader unless autograd
saved it or it is a graph output. Backward (nodes with a grad_fn, reverse order): the node
allocates gradients for its inputs that require grad (parameters: the rank's gradient bytes,
once; accumulation into an existing gradient costs a temporary of its size; views, adds and
copies hand the output gradient on without allocating), then frees its output gradients and
every saved storage whose earliest saver is this node (autograd releases saved tensors when
that backward has run). The graph outputs get dense gradients, as a cross-entropy loss gives.
Kernel workspaces and the insides of composite ops are not modelled. Gradient buffers take
the storage divisor of the tensor they are the gradient of (a sharded activation's gradient
is sharded alike). Around the outputs, `loss` (a `LossModel`) adds what the loss function
computes: `CROSS_ENTROPY` (what `cost.estimate` uses, as `model.step` runs a loss_fn) keeps the
log-softmax output from the end of the forward to the loss's backward, where the gradient of
the log-softmax output and the outputs' gradient are alive together, and keeps the outputs
until backward ends (`step` holds them); the default `GRAPH_ONLY` is the graph alone, its
outputs dropped when backward starts.

It reads no `node.meta`. Guarantees: `model_states` is exact for the tensors torch.optim
creates (tests compare with state dicts after a step, and with the ZeRO engine's
`memory_bytes()` per rank in a gloo world); the walk's forward end equals
inputs + outputs + saved bytes.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from autopar.runtime.placement import Layout, local_shape

from .graph import GraphCost, ParamInfo
from .ops import packet_name
from .symbolic import evaluate

# ops whose backward passes the output gradient to (the first of) their inputs as it is
GRAD_PASSTHROUGH = {"aten.add", "aten.sub", "aten.to", "aten._to_copy", "aten.clone", "aten.contiguous",
                    "aten.dropout", "aten.alias", "aten.detach", "aten.type_as", "operator.getitem"}

OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
FUSED_UPDATES = ("sgd", "sgd_momentum", "adam", "adamw")  # torch has a fused CUDA kernel for these


@dataclass(frozen=True)
class OptimizerSpec:
    """What optimizer state exists per parameter."""

    name: str = "adamw"  # sgd | sgd_momentum | adam | adamw
    amsgrad: bool = False

    def __post_init__(self):
        if self.name not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {self.name!r}; known: {', '.join(OPTIMIZER_STATES)} "
                             "(or pass a torch.optim class or instance)")

    @property
    def states(self) -> int:
        return OPTIMIZER_STATES[self.name] + (1 if self.amsgrad and self.name in ("adam", "adamw") else 0)

    @property
    def step_tensor(self) -> bool:
        return self.name in ("adam", "adamw")

    def step_temporary(self, state_bytes: float, device_kind: str) -> float:
        """Transient device bytes of one update over parameters whose states (without the `step`
        scalars) total `state_bytes`. On a GPU the engines hand torch's fused kernel the update
        when the caller chose no implementation (runtime/zero_engine `make_optimizer`,
        runtime/offload `optimizer_kwargs`): one in-place pass, no temporaries (measured: the
        1.1 B GPT's bf16-mixed step with recompute peaks at 21.1 GiB on an H200, 24.7 GiB
        predicted with a state's worth of temporaries). Elsewhere torch's for-each or per-tensor
        update: one state's worth, the sqrt(v) temporary (an upper bound for the CPU's loop)."""
        if not self.states or (device_kind == "cuda" and self.name in FUSED_UPDATES):
            return 0.0
        return state_bytes / self.states

    @staticmethod
    def of(x: Any) -> "OptimizerSpec":
        """From a name ("adamw", "sgd_momentum" ...), a torch.optim class or an instance."""
        if isinstance(x, OptimizerSpec):
            return x
        if isinstance(x, str):
            return OptimizerSpec(x.lower())
        cls = x if isinstance(x, type) else type(x)
        defaults = getattr(x, "defaults", {}) if not isinstance(x, type) else {}
        name = cls.__name__.lower()
        if name == "sgd":
            return OptimizerSpec("sgd_momentum" if defaults.get("momentum", 0) else "sgd")
        if name in ("adam", "adamw"):
            return OptimizerSpec(name, bool(defaults.get("amsgrad", False)))
        raise ValueError(f"no memory model for optimizer {cls.__name__}; known: SGD, Adam, AdamW")


@dataclass
class StateBytes:
    """Per-rank bytes of the model states."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    buffers: int = 0
    per_param: dict[str, dict[str, int]] = field(default_factory=dict)
    master_grads: int = 0  # the part of `grads` held by separate masters (counted once, in grads)
    opt_elems: int = 0  # elements the optimizer steps on this rank (its rows from ZeRO 1 on)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer + self.buffers

    def to_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "master": self.master,
                "optimizer": self.optimizer, "buffers": self.buffers, "total": self.total}


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a parameter: dim 0 and the product of the rest; a 0-d
    tensor is one row of one element."""
    if not shape:
        return 1, 1
    rest = 1
    for d in shape[1:]:
        rest *= int(d)
    return int(shape[0]), rest


def row_shard_numel(shape: tuple[int, ...], parts: int, index: int) -> int:
    """Elements rank `index` of `parts` keeps of a tensor of `shape` sharded by dim-0 rows
    (torch.chunk convention: ceil(rows/parts) rows per rank, the tail short or empty)."""
    rows, rest = rows_of(shape)
    if parts <= 1:
        return rows * rest
    c = -(-rows // parts)
    start = min(rows, c * index)
    return (min(rows, start + c) - start) * rest


def padded_numel(shape: tuple[int, ...], parts: int) -> int:
    """Elements one rank contributes for this tensor to a ZeRO communication buffer: its rows
    padded to ceil(rows/parts) (runtime.zero_shard.FlatLayout)."""
    rows, rest = rows_of(shape)
    return -(-rows // max(parts, 1)) * rest


def model_states(params: list[ParamInfo], optimizer: Any = "adamw", *, zero_stage: int = 0, dp: int = 1,
                 rank: int = 0, master_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                 param_layouts: Mapping[str, Layout] | None = None, mesh: Mapping[str, int] | None = None,
                 dp_axis: str | None = "dp", separate_masters: bool = False,
                 as_engine: bool = False) -> StateBytes:
    """Bytes of parameters, gradients, master weights and optimizer states on one rank.

    Args:
        params: `GraphCost.params` (or ParamInfo built from a module with `params_of`).
        optimizer: name, torch.optim class or instance, or OptimizerSpec.
        zero_stage: 0-3; shards optimizer states (>=1), gradients (>=2), parameters (3) over dp.
        dp: data-parallel ranks; rank: this rank's index among them (dim-0 row pieces are
            uneven at the end: the last ranks' are short or empty).
        master_dtype: keep master weights in this dtype when it differs from the parameter's
            (e.g. torch.float32 for bf16 training with fp32 master weights).
        grad_dtype: gradient dtype (default: the parameter's).
        separate_masters: masters are separate tensors even without a dtype change (offload:
            copies in CPU memory); they cost master bytes (and gradients with as_engine).
        as_engine: count separate masters as the ZeRO engine keeps them (their gradients; at
            ZeRO-3 the master rows are the parameters; see the module docstring); False: the
            ZeRO paper's accounting (16-bit params and gradients, separate fp32 masters).
        param_layouts, mesh: tensor-parallel layouts from the Plan; a Shard over an axis other
            than `dp_axis` divides that dim by the axis size.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if dp < 1 or not 0 <= rank < dp:
        raise ValueError(f"need dp >= 1 and 0 <= rank < dp, got dp={dp}, rank={rank}")
    opt = OptimizerSpec.of(optimizer)
    out = StateBytes()
    for p in params:
        shape = tp_local_shape(p, param_layouts, mesh, dp_axis)
        rows, rest = rows_of(shape)
        numel = rows * rest
        item = p.dtype.itemsize
        if p.is_buffer:
            out.buffers += numel * item
            continue
        shard = row_shard_numel(shape, dp, rank)
        row = {"params": (shard if zero_stage == 3 else numel) * item}
        if p.requires_grad:
            g_item = (grad_dtype or p.dtype).itemsize
            n_opt = shard if zero_stage >= 1 else numel
            master = master_dtype is not None and master_dtype != p.dtype
            m_item = master_dtype.itemsize if master else item
            separate = master or separate_masters
            row["master"] = n_opt * m_item if separate else 0
            if separate and as_engine:
                row["master_grads"] = n_opt * m_item
                row["grads"] = (0 if zero_stage >= 2 else numel * g_item) + row["master_grads"]
            else:
                row["grads"] = (shard if zero_stage >= 2 else numel) * g_item
            row["optimizer"] = n_opt * opt.states * m_item + (4 if opt.step_tensor else 0)
            row["opt_elems"] = n_opt
            if separate and as_engine and zero_stage == 3:  # the engine's shard is the master
                row["params"], row["master"] = shard * m_item, 0
        for k, v in row.items():
            setattr(out, k, getattr(out, k) + v)
        out.per_param[p.name] = row
    return out


def with_param_dtype(params: list[ParamInfo], dtype: torch.dtype | None) -> list[ParamInfo]:
    """`params` as the engine holds them under a plan's `param_dtype`: every floating
    parameter (not buffers) cast to `dtype`; None: as captured."""
    if dtype is None:
        return list(params)
    return [dataclasses.replace(p, dtype=dtype) if not p.is_buffer and p.dtype.is_floating_point else p
            for p in params]


def plan_states(params: list[ParamInfo], optimizer: Any = "adamw", *, precision: Mapping[str, Any] | None = None,
                zero_stage: int = 0, dp: int = 1, rank: int = 0, param_layouts: Mapping[str, Layout] | None = None,
                mesh: Mapping[str, int] | None = None, dp_axis: str | None = "dp") -> StateBytes:
    """`model_states` under a Plan's precision fields, as the ZeRO engine keeps them: the one
    byte count of parameters, gradients, masters and optimizer states that `cost.estimate` and
    the planner (`search.plan_tables`) share.

    Args:
        precision: the Plan's fields ("param_dtype", "master_dtype", "offload"; names as in
            `passes.plan.PRECISIONS`); missing or None: the captured dtypes, no masters.
    """
    from autopar.passes.plan import torch_dtype  # noqa: PLC0415 - passes.plan imports nothing of cost

    prec = dict(precision or {})
    return model_states(with_param_dtype(params, torch_dtype(prec.get("param_dtype"))), optimizer,
                        zero_stage=zero_stage, dp=dp, rank=rank, master_dtype=torch_dtype(prec.get("master_dtype")),
                        param_layouts=param_layouts, mesh=mesh, dp_axis=dp_axis,
                        separate_masters=bool(prec.get("offload")), as_engine=True)


def resolve_precision(params: list[ParamInfo], precision: Mapping[str, Any] | None) -> dict[str, Any]:
    """The Plan precision fields a plan of this graph runs with: `precision` (Plan fields, as
    `passes.plan.precision_fields` spells them) over the default recipe of the graph's trained
    parameters (`passes.plan.default_precision`: bf16-mixed for a bf16 model), as
    `autopar.parallelize` runs them. `offload` None (the planner decides) reads as False here."""
    from autopar.passes.plan import PRECISION_FIELDS, default_precision, precision_fields  # noqa: PLC0415

    trained = {p.dtype for p in params if p.requires_grad and not p.is_buffer and p.dtype.is_floating_point}
    out = {f: None for f in PRECISION_FIELDS}
    out["offload"] = False
    given = dict(precision or {})
    if not any(given.get(f) is not None for f in ("param_dtype", "master_dtype")):
        out.update(precision_fields(default_precision(trained)))
    out.update({k: v for k, v in given.items() if k in PRECISION_FIELDS and (v is not None or k != "offload")})
    out["offload"] = bool(out.get("offload"))
    return out


def device_resident(row: Mapping[str, float], offload: bool, zero_stage: int) -> tuple[dict[str, float], float]:
    """Split one rank's model states (a `StateBytes.per_param` row, or `StateBytes.to_dict()`
    with "master_grads") into what stays in device memory and what offload keeps on the host:
    offload moves the masters, their gradients and the optimizer states to CPU memory (at
    ZeRO 3 the rank's shards, which are the masters, too). Returns (device bytes by category
    params / grads / master / optimizer / buffers, host bytes)."""
    get = lambda k: float(row.get(k, 0.0))  # noqa: E731
    dev = {"params": get("params"), "grads": get("grads"), "master": get("master"), "optimizer": get("optimizer"),
           "buffers": get("buffers")}
    if not offload:
        return dev, 0.0
    host_params = dev["params"] if zero_stage == 3 else 0.0
    host = dev["master"] + dev["optimizer"] + get("master_grads") + host_params
    dev.update(params=dev["params"] - host_params, grads=dev["grads"] - get("master_grads"), master=0.0, optimizer=0.0)
    return dev, host


def tp_local_shape(p: ParamInfo, param_layouts: Mapping[str, Layout] | None, mesh: Mapping[str, int] | None,
                   dp_axis: str | None = "dp") -> tuple[int, ...]:
    """Shape of `p` on one rank after its tensor-parallel layout (before ZeRO): a Shard over an
    axis other than the dp axis divides that dim (torch.chunk sizes, rank 0's piece)."""
    shape = tuple(int(d) for d in p.shape)
    if not shape and p.numel != 1:  # a ParamInfo built without a shape: one row of numel
        shape = (p.numel,)
    lay = (param_layouts or {}).get(p.name)
    if lay is None or not mesh or not shape:
        return shape
    tp = Layout(tuple((a, pl) for a, pl in lay.axes if a != dp_axis and a in mesh))
    coords = {a: 0 for a in mesh}
    return tuple(int(d) for d in local_shape(shape, tp, mesh, coords))


def local_numel(p: ParamInfo, param_layouts: Mapping[str, Layout] | None, mesh: Mapping[str, int] | None,
                dp_axis: str | None = "dp") -> int:
    """Elements of `p` on one rank after its tensor-parallel layout (before ZeRO)."""
    rows, rest = rows_of(tp_local_shape(p, param_layouts, mesh, dp_axis))
    return rows * rest


def params_of(module: torch.nn.Module) -> list[ParamInfo]:
    """ParamInfo for a module's parameters and buffers (shared tensors once), for
    `model_states` without a captured graph."""
    out, seen = [], set()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        is_buffer = not isinstance(t, torch.nn.Parameter)
        out.append(ParamInfo(name, t.numel(), t.dtype, t.requires_grad and not is_buffer, is_buffer, None, 0, "",
                             tuple(t.shape)))
    return out


# ------------------------------------------------------------------------ liveness
@dataclass(frozen=True)
class LossModel:
    """What the loss computed from the graph's outputs adds to the walk, as multiples of the
    bytes of the outputs that get a gradient (`loss_output_bytes`).

    `saved`: alive from the end of the forward to the loss's backward (cross-entropy's
    log-softmax output); `grad_temp`: alive while the loss's backward makes the outputs'
    gradient (the gradient of the log-softmax output, nll_loss's backward); `outputs_held`:
    the caller keeps the outputs until backward ends instead of dropping them once the loss
    is computed."""

    saved: float = 0.0
    grad_temp: float = 0.0
    outputs_held: bool = False


# the graph alone: its outputs dropped when backward starts, nothing around them
GRAPH_ONLY = LossModel()
# `F.cross_entropy` (log_softmax + nll_loss) on the outputs, as `model.step` runs a loss_fn (the
# reference models' and transformers' losses): the log-softmax output saved, its gradient and
# the outputs' gradient alive together, the outputs held in `step` (its `out`) until backward
# ends. Measured on gpt-tiny, 16 x 32 tokens a rank: the step's peak is in LogSoftmaxBackward,
# states + saved activations + 4x the logits (tests/dist/test_memory_truth.py).
CROSS_ENTROPY = LossModel(saved=1.0, grad_temp=1.0, outputs_held=True)
# a pipeline stage before the last: its outputs are sent on and kept for its backward, which
# starts from the gradient the next stage sends back
HELD_OUTPUTS = LossModel(outputs_held=True)


def loss_output_bytes(gc: GraphCost, ev) -> float:
    """Bytes of the graph's outputs that get a gradient (what the loss reads), on this rank:
    divided by their storage divisor when `ev` takes one (`ev(x, key)`, as the walks' do)."""
    keyed = len(inspect.signature(ev).parameters) > 1
    return float(sum(ev(t.nbytes, t.key) if keyed else ev(t.nbytes) for t in gc.outputs if t.rg and not t.is_state))


@dataclass
class Liveness:
    """Result of the forward/backward walk on one rank (bytes)."""

    inputs: float  # graph inputs (the batch), alive all step
    saved: float  # saved for backward at the end of the forward
    outputs: float
    peak: float  # activations + activation grads + parameter grads produced so far
    peak_phase: str  # "forward" | "backward"
    peak_node: str
    forward_end: float  # inputs + saved + outputs
    param_grads: float  # parameter gradient bytes allocated by the end of backward


class GradBuffers:
    """The backward pass's gradient memory, shared by `liveness` and `cost.timeline`:
    reference-counted gradient buffers (a view, an add or a cast hands its output gradient on
    to its input unchanged: no allocation) and the parameter gradients, each counted once
    (all of them from the start when `grads_preallocated`, as in later micro-batches)."""

    def __init__(self, gc: GraphCost, ev, param_grad_bytes: Mapping[Any, float] | None, grads_preallocated: bool):
        self.ev = ev
        self.pg = dict(param_grad_bytes or {})
        self.preallocated = grads_preallocated
        self.param_grads = 0.0
        if grads_preallocated:
            self.param_grads = sum(self.pg.values()) if self.pg else sum(p.nbytes for p in gc.params if p.requires_grad)
        self.live = 0.0  # bytes of activation gradients alive
        self._buf: dict[int, float] = {}
        self._refs: dict[int, int] = {}
        self._grads: dict[int, int] = {}  # id(TensorMeta) -> buffer id
        self._seen_param: set[Any] = set()
        self.order: list[Any] = []  # parameter keys in the order their gradients appear
        # storages of parameters and buffers: a gradient for a view of one (the transposed expert
        # weights a grouped matmul reads) is that parameter's gradient, not a new buffer
        # (measured: tests/unit/test_planner_moe_scale.py)
        self._state_bytes = {k: st.nbytes for k, st in gc.storages.items() if st.is_state}

    def _alloc(self, nbytes: float) -> int:
        b = len(self._buf) + 1
        self._buf[b], self._refs[b] = nbytes, 1
        self.live += nbytes
        return b

    def _unref(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            self.live -= self._buf[b]

    def seed(self, outputs) -> None:
        """The gradients of the graph's outputs: dense, as a loss such as cross-entropy gives."""
        for t in outputs:
            if t.rg:
                self._grads[id(t)] = self._alloc(self.ev(t.nbytes, t.key))

    def backward(self, n, observe) -> None:
        """Node `n`'s backward: its output gradients go to its inputs; `observe(transient)` sees
        the memory while both exist (transient: gradients accumulated into an existing one),
        then `n`'s output gradients are dropped. Nothing when `n` receives no gradient."""
        out_b = [self._grads.pop(id(t)) for t in n.outputs if id(t) in self._grads]
        if not out_b:
            return
        through = n.kind == "view" or packet_name(n.op) in GRAD_PASSTHROUGH
        out_numel = n.outputs[0].numel if n.outputs else None
        transient = 0.0
        for i, t in enumerate(n.grad_inputs):
            if t.is_state or t.key in self._state_bytes:
                if t.key not in self._seen_param:
                    self._seen_param.add(t.key)
                    self.order.append(t.key)
                    if not self.preallocated:
                        full = t.nbytes if t.is_state else self._state_bytes[t.key]
                        self.param_grads += self.pg.get(t.key, self.ev(full))
            else:
                transient += self.route(n, i, t, out_b, through, out_numel)
        observe(transient)
        for b in out_b:
            self._unref(b)

    def route(self, n, i: int, t, out_b: list[int], through: bool, out_numel) -> float:
        """Give `n`'s `i`-th gradient input `t` its gradient: accumulated (returns the temporary's
        bytes), `n`'s output gradient passed through (a same-size view / pass-through op), or new."""
        if id(t) in self._grads:
            return self.ev(t.nbytes, t.key)
        through = through and t.numel == out_numel and (i == 0 or not n.op.startswith("aten.sub"))
        self._grads[id(t)] = out_b[0] if through else self._alloc(self.ev(t.nbytes, t.key))
        self._refs[out_b[0]] += int(through)
        return 0.0


def liveness(gc: GraphCost, values: Mapping, *, param_grad_bytes: Mapping[Any, float] | None = None,
             grads_preallocated: bool = False, storage_divisor: Mapping[Any, int] | None = None,
             loss: LossModel = GRAPH_ONLY, trace: list | None = None) -> Liveness:
    """Walk forward then backward and return the peak (see the module docstring).

    Args:
        values: symbol values (GraphCost.values(sizes)).
        param_grad_bytes: storage key of a parameter -> its gradient bytes on this rank
            (default: the parameter's full bytes).
        grads_preallocated: gradients already exist (later micro-batches of accumulation).
        storage_divisor: storage key -> how many ranks share it (tensor-parallel layouts).
        loss: what the loss adds around the outputs (`CROSS_ENTROPY`: as `model.step` runs a
            cross-entropy loss_fn); default the graph alone.
        trace: a list that receives every point of the walk as (bytes without parameter
            gradients, how many parameter gradients exist by then), then the parameters' keys in
            the order their gradients appear: the peak under any `param_grad_bytes` is then
            max(bytes + the first n gradients) (`search.plan_rank.GradProfile`).
    """
    div = storage_divisor or {}

    def ev(x, key=None):
        v = evaluate(x, values)
        return v / div.get(key, 1) if key in div else v

    size: dict[Any, float] = {}
    for key, st in gc.storages.items():
        if not st.is_state:
            size[key] = ev(st.nbytes, key)
    last_use: dict[Any, int] = {}
    for n in gc.nodes:
        for k in n.new_storages:
            last_use.setdefault(k, n.index)
        for k in n.uses:
            last_use[k] = n.index
    saved_until: dict[Any, int] = {}
    new_saved: dict[int, list[Any]] = defaultdict(list)
    for n in gc.nodes:
        for key, nb, _tag in n.saved:
            st = gc.storages.get(key)
            if st is not None and st.is_state:
                continue
            if key not in size:  # a buffer created inside the op (tp-sharded as its node's output)
                size[key] = ev(nb, key)
                new_saved[n.index].append(key)
            saved_until[key] = min(saved_until.get(key, n.index), n.index)
    out_keys = {t.key for t in gc.outputs if not t.is_state}
    free_at: dict[int, list[Any]] = defaultdict(list)
    for key, st in gc.storages.items():
        if st.is_state or key in saved_until or key in out_keys or st.producer < 0:
            continue
        free_at[last_use.get(key, st.producer)].append(key)
    inputs = sum(size[k] for k, st in gc.storages.items() if st.producer < 0 and not st.is_state)

    gb = GradBuffers(gc, ev, param_grad_bytes, grads_preallocated)
    live = inputs
    peak, peak_phase, peak_node = live + gb.param_grads, "forward", "(inputs)"
    if trace is not None:
        trace.append((live, 0))
    for n in gc.nodes:
        for k in n.new_storages:
            if k in size and gc.storages[k].producer == n.index:
                live += size[k]
        for k in new_saved.get(n.index, ()):
            live += size[k]
        if trace is not None:
            trace.append((live, 0))
        if live + gb.param_grads > peak:
            peak, peak_phase, peak_node = live + gb.param_grads, "forward", n.name
        for k in free_at.get(n.index, ()):
            live -= size[k]
    saved_total = sum(size[k] for k in saved_until)
    outputs = sum(size.get(k, 0) for k in out_keys if k not in saved_until)
    forward_end = live

    # the loss: its saved tensor on top of the forward's end, then its backward makes the seed
    loss_out = loss_output_bytes(gc, ev)
    with_loss = loss != GRAPH_ONLY  # the graph alone: no points of its own (the walk as it always was)
    if trace is not None and with_loss:
        trace.append((live + loss.saved * loss_out, 0))
    if with_loss and live + loss.saved * loss_out + gb.param_grads > peak:
        peak, peak_phase, peak_node = live + loss.saved * loss_out + gb.param_grads, "forward", "(loss)"
    # backward: activations still alive (live) + gradient buffers + parameter gradients
    gb.seed(gc.outputs)
    if not loss.outputs_held:
        live -= outputs  # the loss has been computed from the outputs; only saved ones stay
    a = live + gb.live + (loss.saved + loss.grad_temp) * loss_out + gb.param_grads
    if trace is not None and with_loss:
        trace.append((a - gb.param_grads, len(gb.order)))
    if with_loss and a > peak:
        peak, peak_phase, peak_node = a, "backward", "(loss)"

    def observe(transient: float) -> None:
        nonlocal peak, peak_phase, peak_node
        a = live + gb.live + transient + gb.param_grads
        if trace is not None:
            trace.append((a - gb.param_grads, len(gb.order)))
        if a > peak:
            peak, peak_phase, peak_node = a, "backward", n.name

    for n in reversed(gc.nodes):
        if not n.has_grad_fn:
            continue
        gb.backward(n, observe)
        for key, _nb, _tag in n.saved:
            st = gc.storages.get(key)
            if saved_until.get(key) == n.index and not (st is not None and st.producer < 0):
                live -= size[key]
                saved_until[key] = -1
    if trace is not None:
        trace.append(list(gb.order))
    return Liveness(inputs=inputs, saved=saved_total, outputs=outputs, peak=peak, peak_phase=peak_phase,
                    peak_node=peak_node, forward_end=forward_end, param_grads=gb.param_grads)
