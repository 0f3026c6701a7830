"""Per-unit costs of a pipeline chain: what the stage search (`search.stages`) splits.

`layer_costs(gm, hardware, ...)` costs every pipeline unit of a captured graph
(`passes.split_pipeline.pipeline_units`: `tok_emb`, `layers.0` ... `lm_head`) once with
`autopar.cost` (`analyze` + `estimate`, identical layers costed once): forward and backward
seconds per micro-batch, bytes saved for backward, the model states of the parameters it reads
(under the plan's ZeRO stage and dp degree), the bytes that cross each unit boundary, and
what a pipeline rank holds besides: the logits the loss reads, each parameter's flat gradient
bucket (dp below ZeRO-3) and its optimizer update's temporary. `count_chain(gm)` is the
fallback for graphs the cost model cannot cost (node counts). `cross_bytes` is shared with the
joint planner's tables; with `boundary_divisors` it counts one tp rank's shard of a sharded
boundary tensor.

Reads what `autopar.cost` and `passes.split_pipeline` read; writes no node.meta.
Deterministic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.cost import GraphCost, analyze, estimate, evaluate, load_profile
from autopar.cost.memory import OptimizerSpec, device_resident, loss_output_bytes, plan_states, resolve_precision
from autopar.passes.plan import Plan
from autopar.passes.split_pipeline import Unit, pipeline_units

__all__ = ["LayerCost", "Chain", "layer_costs", "count_chain", "cross_bytes", "boundary_divisors"]


@dataclass(frozen=True)
class LayerCost:
    """One unit of the chain, per micro-batch."""

    name: str
    fwd_s: float
    bwd_s: float
    act_bytes: float  # saved for backward
    params: tuple[str, ...] = ()  # names of the parameters (and buffers) it reads


@dataclass
class Chain:
    """The costed chain: units, state bytes per parameter, bytes across each boundary."""

    layers: list[LayerCost]
    state_bytes: dict[str, float]  # parameter or buffer name -> bytes on a rank that holds it
    cross_bytes: list[float]  # entry i: bytes from units <= i to units > i (len(layers) - 1)
    sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    loss_bytes: float = 0.0  # the graph's outputs that get a gradient (the logits the loss reads)
    bucket_bytes: dict[str, float] = field(default_factory=dict)  # parameter -> its gradient bucket bytes
    step_bytes: dict[str, float] = field(default_factory=dict)  # parameter -> its optimizer update's temporary

    def __post_init__(self):
        if len(self.cross_bytes) != max(len(self.layers) - 1, 0):
            raise ValueError(f"a chain of {len(self.layers)} units has {len(self.layers) - 1} boundaries, "
                             f"got {len(self.cross_bytes)} cross_bytes")


def layer_costs(gm: fx.GraphModule, hardware: Any = "h100-sxm", *, gc: GraphCost | None = None,
                microbatch: int | None = None, optimizer: Any = "adamw", zero_stage: int = 0, dp: int = 1,
                master_dtype: Any = "auto", seq: int | None = None) -> Chain:
    """Cost every pipeline unit of `gm` for one micro-batch.

    Args:
        gm: the captured graph (global shapes).
        hardware: profile name or Hardware.
        gc: its `analyze` result, when already computed.
        microbatch: rows of one micro-batch (on one dp rank). With a dynamic batch dim the graph
            is re-costed at b = microbatch; with a static one, times and activations scale by
            microbatch / captured rows. None: as captured.
        optimizer, zero_stage, dp, master_dtype: the model-state accounting (`model_states`).
        seq: tokens of each sequence on one rank, for a graph captured with a symbolic sequence
            (under context parallelism the captured length / cp); None: as captured.
    """
    t0 = time.perf_counter()
    hw = load_profile(hardware)
    gc = gc if gc is not None else analyze(gm, hw)
    units = pipeline_units(gm)
    unit_of = {name: i for i, u in enumerate(units) for name in u.nodes}
    sizes: dict[str, int] = {}
    scale = 1.0
    symbols = {str(k) for k in gc.values()}
    if seq is not None and "s" in symbols:
        sizes["s"] = int(seq)
    if microbatch is not None:
        if "b" in symbols:
            sizes["b"] = int(microbatch)
        else:
            rows = _captured_rows(gm)
            if rows:
                scale = microbatch / rows
    est = estimate(gc, Plan(mesh={"dp": 1}), hw, sizes=sizes or None, optimizer=optimizer)
    # cost layers -> units, by where their nodes went (the root's nodes join a neighbour)
    votes: dict[str, dict[int, int]] = {}
    for n in gc.nodes:
        u = unit_of.get(n.name)
        if u is not None:
            d = votes.setdefault(n.layer, {})
            d[u] = d.get(u, 0) + 1
    fwd = [0.0] * len(units)
    bwd = [0.0] * len(units)
    act = [0.0] * len(units)
    for rep in est.layers:
        d = votes.get(rep.name)
        u = max(sorted(d), key=d.__getitem__) if d else 0
        fwd[u] += rep.fwd_s * scale
        bwd[u] += rep.bwd_s * scale
        act[u] += rep.saved_bytes * scale
    # parameters each unit reads, directly or through input-free computation (a weight cast)
    key_name = {p.key: p.name for p in gc.params if p.key is not None}
    through: dict[Any, frozenset] = {}
    reads: list[set[str]] = [set() for _ in units]
    top = {n.name for n in gm.graph.nodes}
    cur = 0
    for n in gc.nodes:
        got: set[str] = set()
        for k in n.uses:
            if k in key_name:
                got.add(key_name[k])
            got |= through.get(k, frozenset())
        u = unit_of.get(n.name)
        if u is None and n.name not in top:
            u = cur  # a node inlined from a higher-order op: its caller's unit
        if u is None:  # input-free: hand its parameters on to whoever reads its outputs
            for k in n.new_storages:
                through[k] = frozenset(got)
            for t in n.outputs:
                through[t.key] = frozenset(got)
            continue
        cur = u
        reads[u] |= got
    states = _state_bytes(gc, optimizer, zero_stage, dp, master_dtype)
    cross = cross_bytes(gm, gc, units, sizes, scale)
    layers = [LayerCost(u.name, fwd[i], bwd[i], act[i], tuple(sorted(reads[i]))) for i, u in enumerate(units)]
    values = gc.values(sizes or None)
    loss = loss_output_bytes(gc, lambda x: evaluate(x, values)) * scale
    return Chain(layers, states, cross, sizes, time.perf_counter() - t0, loss,
                 _bucket_bytes(gc, optimizer, zero_stage, dp, master_dtype),
                 _step_bytes(gc, hw, optimizer, zero_stage, dp, master_dtype))


def count_chain(gm: fx.GraphModule) -> Chain:
    """A chain costed without the cost model, for graphs it cannot cost: time = the unit's
    compute nodes (forward 1, backward 2 each), state = 16 bytes per parameter element (fp32
    parameter, gradient, two Adam moments), no activations or transfers. Balances node counts."""
    units = pipeline_units(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    layers = []
    state: dict[str, float] = {}
    for u in units:
        reads: set[str] = set()
        stack = [by_name[x] for x in u.nodes]
        seen: set = set()
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a in seen or a.op == "placeholder" or a.name in u.nodes:
                    continue
                seen.add(a)
                if a.op == "get_attr":
                    t = gm.get_parameter(str(a.target)) if _is_param(gm, str(a.target)) else None
                    if t is not None:
                        reads.add(str(a.target))
                        state[str(a.target)] = float(t.numel() * 16)
                elif not _depends_on_input(a):
                    stack.append(a)
        work = sum(1 for x in u.nodes if by_name[x].op == "call_function")
        layers.append(LayerCost(u.name, float(work), 2.0 * work, 0.0, tuple(sorted(reads))))
    return Chain(layers, state, [0.0] * (len(units) - 1))


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _depends_on_input(n: fx.Node) -> bool:
    seen, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m.op == "placeholder":
            return True
        for a in m.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return False


def _captured_rows(gm: fx.GraphModule) -> int | None:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(v.shape[0], int):
            return int(v.shape[0])
    return None


def _state_bytes(gc: GraphCost, optimizer, zero_stage: int, dp: int, master_dtype,
                 precision: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Device bytes of each parameter's states (`cost.memory.plan_states`, as the engine keeps
    them; with offload only what stays on the device). `precision`: Plan fields; None: the
    model's default recipe ("auto"; master_dtype None: no masters, the captured dtypes)."""
    prec = resolve_precision(gc.params, precision)
    if precision is None and master_dtype is None:
        prec.update(param_dtype=None, master_dtype=None, reduce_dtype=None, optim_dtype=None, loss_scale=None)
    z = zero_stage if dp > 1 else 0
    sb = plan_states(gc.params, optimizer, precision=prec, zero_stage=z, dp=dp, rank=0)
    out = {name: float(sum(device_resident(row, prec["offload"], z)[0].values())) for name, row in sb.per_param.items()}
    for p in gc.params:
        if p.is_buffer:
            out[p.name] = float(p.numel * p.dtype.itemsize)
    return out


def _bucket_bytes(gc: GraphCost, optimizer, zero_stage: int, dp: int, master_dtype) -> dict[str, float]:
    """Per trainable parameter, the flat gradient bucket bytes a stage's engine holds from its
    backward to its reduction (dp > 1 below ZeRO-3: the whole gradient, and at ZeRO-2 its
    reduce-scattered shard too), as `cost.estimate` counts them; 0 otherwise."""
    z = zero_stage if dp > 1 else 0
    if dp <= 1 or z >= 3:
        return {}
    prec = resolve_precision(gc.params, None)
    if master_dtype is None:
        prec.update(param_dtype=None, master_dtype=None, reduce_dtype=None, optim_dtype=None, loss_scale=None)
    sb = plan_states(gc.params, optimizer, precision=prec, zero_stage=0, dp=1, rank=0)  # unsharded gradients
    out = {}
    for name, row in sb.per_param.items():
        full = float(row.get("grads", 0) - row.get("master_grads", 0))
        out[name] = full * (1 + 1 / dp if z == 2 else 1)
    return out


def _step_bytes(gc: GraphCost, hw, optimizer, zero_stage: int, dp: int, master_dtype) -> dict[str, float]:
    """Per trainable parameter, the temporary its optimizer update allocates on the device
    (`OptimizerSpec.step_temporary`: a state's worth off the GPU's fused kernels; none offloaded)."""
    prec = resolve_precision(gc.params, None)
    if master_dtype is None:
        prec.update(param_dtype=None, master_dtype=None, reduce_dtype=None, optim_dtype=None, loss_scale=None)
    if prec["offload"]:
        return {}
    opt = OptimizerSpec.of(optimizer)
    sb = plan_states(gc.params, optimizer, precision=prec, zero_stage=zero_stage if dp > 1 else 0, dp=dp, rank=0)
    return {name: opt.step_temporary(row.get("optimizer", 0) - (4 if opt.step_tensor else 0), hw.device.kind)
            for name, row in sb.per_param.items()}


def cross_bytes(gm: fx.GraphModule, gc: GraphCost, units: list[Unit], sizes: dict, scale: float,
                divisor: Mapping[str, float] | None = None) -> list[float]:
    """Bytes of the tensors that cross each unit boundary (made before it, read after it), on
    one rank: a tensor whose node is in `divisor` (node name -> how many ranks share it, from
    `boundary_divisors`) counts 1 / divisor of its bytes, the shard that rank sends and holds."""
    L = len(units)
    divisor = divisor or {}
    unit_of = {name: i for i, u in enumerate(units) for name in u.nodes}
    values = gc.values(sizes or None)
    diff = [0.0] * (L + 1)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            p = -1
        elif n.name in unit_of:
            p = unit_of[n.name]
        else:
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        last = p
        for u in n.users:
            last = max(last, L - 1 if u.op == "output" else unit_of.get(u.name, p))
        lo = max(p, 0)
        if last <= lo:
            continue
        numel = 1
        for d in gc.symbols.shape(v.shape):
            numel = numel * d
        nbytes = float(evaluate(numel * v.dtype.itemsize, values)) * scale / divisor.get(n.name, 1)
        diff[lo] += nbytes
        diff[last] -= nbytes
    out, run = [], 0.0
    for i in range(L - 1):
        run += diff[i]
        out.append(run)
    return out


def boundary_divisors(gc: GraphCost, storage_divisor: Mapping[Any, float]) -> dict[str, float]:
    """Node name -> the memory divisor of its first output's storage (`cost.node_time.
    layout_divisors`), for `cross_bytes`: under sequence parallelism the hidden state between
    two layers is S(seq) on tp, so each tp rank sends and keeps 2sbh / t bytes, not 2sbh
    (as Megatron's pipeline does: Narayanan et al. 2021, section 4.1, scatter/gather)."""
    out: dict[str, float] = {}
    for n in gc.nodes:
        if n.outputs:
            d = storage_divisor.get(n.outputs[0].key, 1)
            if d != 1:
                out[n.name] = d
    return out
