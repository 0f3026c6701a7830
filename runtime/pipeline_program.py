"""The per-rank program of a pipeline-parallel plan: this rank's stages, a schedule, and
one data-parallel engine per stage.

`PipelineProgram` has the user API of `runtime.program.Program`:

  * `step(batch, loss_fn, n_microbatches)` takes the *global* batch `(inputs, targets)`,
    keeps this rank's part along the dp axis (dim 0), splits it into micro-batches, runs the
    schedule (`runtime.pipeline.PipelineExecutor`, built on the first step for each number of
    micro-batches: `loss_fn` arrives with the step), and returns the loss of the whole global
    batch on every rank (mean over micro-batches, then over dp). Gradients are left reduced
    over dp by the stage engines, and tied weights (an embedding and an LM head on two
    stages) hold the sum of their stages' gradients on the engines' masters, under every ZeRO
    stage and with fp32 masters of bf16 parameters (runtime/pipeline_tied.py), so the copies
    take identical optimizer steps. fp16 with dynamic loss scaling (`zero_optim.LossScaleGroup`):
    only the last stage scales the gradient of its outputs (the loss's), so the gradients sent
    back through the stages arrive scaled once; every stage's engine unscales its own gradients
    by the same scale, and the inf/NaN verdict is agreed over pp, dp and every other axis before
    any stage steps or skips, so the scale evolves identically on every rank.
  * with an ep axis (expert parallelism inside the stages, `ep_axis`): the dp piece of the
    batch is cut again in ep pieces, as `runtime.moe.ExpertProgram` cuts it (ep index j takes
    rows [j * b, (j + 1) * b)); each micro-batch is then a slice of every ep rank's piece, and
    the stage graphs' all-to-alls and router-statistic all-reduces run over the stage's ep
    group once per micro-batch (the ep peers of a stage run the same schedule, so their
    collectives pair up). Gradients leave the stage graphs already averaged over ep
    (`moe.grad_avg` / `moe.grad_scale` on parameter reads), so the engines reduce over dp
    only; `expert_params` (different on every ep rank) are marked ep-sharded for the global
    gradient norm, the other parameters are broadcast from ep index 0 when `sync_init`, and
    the reported loss is averaged over ep as over dp.
  * `forward(*inputs)` / `__call__` runs the stages in order for inference (no autograd
    across stages): the rank of stage 0 needs the inputs, every pp rank returns the output
    (sent on from the last stage's rank).
  * `train()` / `eval()` switch the stages' dropout and batch norm (each stage runs inside
    `self.rng.fork(self.training)`, runtime/rng.py; the stream is seeded per pp stage, so
    stages draw independent masks); `evaluate(batch, loss_fn)` is the no-grad loss of a global
    batch on every rank, averaged over dp.
  * `engine` is a `PipelineEngines`: `make_optimizer(cls, **kw)` builds one optimizer over
    every local stage's engine (what `autopar.optimizer` calls), plus `zero_grad`,
    `clip_grad_norm_` (norm over every stage, pp rank and dp shard; a tied weight counted
    once), `finish_backward`, `memory_bytes`, `gather_full_state_dict` (this rank's stages).

Stage modules take tensors and return a tuple of tensors (the stage GraphModules of
`passes.split_pipeline`); the last stage's outputs are unflattened with `out_spec` before
`loss_fn` sees them, and stage 0's inputs are the flattened `(args, kwargs)` of `in_spec`.

It reads and writes no `node.meta` keys (it runs modules; the graphs were cut upstream).
Counts the pp transfers of the executor and of `forward` in `collectives.COUNTER`
("send"/"recv" and their "_meta" on the pp axis), and the reported-loss dp (and ep) all-reduce as
"metric_all_reduce".
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives as C
from .collective_errors import issue, where
from ._torch_compat import pytree
from .mesh import Mesh
from .pipeline import PipelineExecutor
from .pipeline_tied import TiedPair
from .program import evaluate
from .rng import RNGTracker
from .schedules import Schedule, make_schedule
from .zero import broadcast_module, make_engine
from .zero_optim import LossScaleGroup
from .grad_norm import local_norm_parts, reduce_norm_parts

__all__ = ["PipelineProgram", "PipelineEngines", "PipelineOptimizer"]


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


class PipelineProgram(nn.Module):
    """This rank's part of a pipeline: see the module docstring.

    Args:
        stages: {stage index: module} for the stages the schedule places on this pp rank.
        mesh: the Mesh; `pp_axis` must be one of its axes.
        n_stages: stages in the whole pipeline (pp size x stages per rank).
        schedule: a `runtime.schedules` name ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv").
        n_microbatches: the default for `step`.
        dp_axis, zero_stage, bucket_mb, engine_options: each stage's `make_engine(...)`.
        tied: groups ((stage_a, name_a), (stage_b, name_b), ...) of one weight held on several stages.
        in_spec, out_spec: pytree specs of the model's inputs (args, kwargs) and outputs.
        sync_init: broadcast every stage from dp index 0 first (and, with ep, the parameters
            that are not in `expert_params` from ep index 0).
        ep_axis, expert_params: the expert-parallel axis (None: none) and the names of this
            rank's expert parameters (see the module docstring).
    """

    def __init__(self, stages: Mapping[int, nn.Module], mesh: Mesh, *, n_stages: int, schedule: str = "1f1b",
                 n_microbatches: int = 1, pp_axis: str = "pp", dp_axis: str | None = "dp", zero_stage: int = 0,
                 bucket_mb: float = 25.0, tied: Sequence[TiedPair] = (), in_spec=None, out_spec=None,
                 sync_init: bool = True, engine_options: dict | None = None, ep_axis: str | None = None,
                 expert_params: Sequence[str] = ()):
        super().__init__()
        if pp_axis not in mesh.sizes:
            raise ValueError(f"{mesh} has no pipeline axis {pp_axis!r}; build the mesh with autopar.mesh(pp=N, ...)")
        self.mesh, self.pp_axis = mesh, pp_axis
        self.pp = mesh.size(pp_axis)
        self.schedule_name = schedule
        self.n_stages = n_stages
        if n_stages % self.pp:
            raise ValueError(f"{n_stages} stages do not spread evenly over {pp_axis}={self.pp} ranks; "
                             f"use a multiple of {self.pp} stages")
        self.n_virtual = n_stages // self.pp
        self.n_microbatches = n_microbatches
        self.dp_axis = dp_axis if dp_axis in mesh.sizes else None
        self.dp = mesh.size(self.dp_axis) if self.dp_axis else 1
        self.ep_axis = ep_axis if ep_axis in mesh.sizes and mesh.size(ep_axis) > 1 else None
        self.ep = mesh.size(self.ep_axis) if self.ep_axis else 1
        self.in_spec, self.out_spec = in_spec, out_spec
        self.tied = [tuple(map(tuple, p)) for p in tied]
        C.set_active_mesh(mesh)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.pp_rank = mesh.coords(rank)[pp_axis]
        placement = self._schedule(self.pp)  # where stages sit does not depend on the micro-batch count
        self.stage_to_rank = list(placement.stage_to_rank)
        mine = placement.stages_of(self.pp_rank)
        if sorted(stages) != mine:
            raise ValueError(f"pp rank {self.pp_rank} holds stages {mine} under schedule {schedule!r} with "
                             f"{n_stages} stages, but modules were given for {sorted(stages)}")
        self.stages = nn.ModuleDict({str(s): stages[s] for s in mine})
        opts = dict(engine_options or {})
        if sync_init and self.dp > 1 and dist.is_initialized():
            for m in self.stages.values():
                broadcast_module(m, self.dp_axis)
        if self.ep_axis:
            self._sync_ep(expert_params, sync_init)
            mp = {k: tuple(v) for k, v in (opts.get("model_parallel") or {}).items()}
            for name in expert_params:  # each ep rank holds other experts: a norm counts them all once
                mp[name] = tuple(sorted(set(mp.get(name, ())) | {self.ep_axis}))
            opts["model_parallel"] = mp
        engines = {s: make_engine(stages[s], mesh, self.dp_axis, zero_stage, bucket_mb, **opts) for s in mine}
        scalers = [e.scaler for e in engines.values() if e.scaler is not None]
        if scalers:  # fp16 loss scaling: one scale, applied by the last stage, one verdict over the job
            group = LossScaleGroup(scalers[0], [a for a, n in mesh.sizes.items() if n > 1], mesh.device)
            for s in mine:
                group.add(engines[s], scales_outputs=s == n_stages - 1)
        self.engine = PipelineEngines(engines, mesh, pp_axis, self.dp_axis, self.tied)
        self._executors: dict[int, PipelineExecutor] = {}
        self.rng = RNGTracker.for_mesh(mesh, self.dp_axis)  # dropout masks (pp stages apart): runtime/rng.py

    @property
    def module(self) -> nn.Module:
        """This rank's stage modules (a ModuleDict keyed by stage index), as `Program.module`."""
        return self.stages

    # --- helpers -------------------------------------------------------------------------
    def _sync_ep(self, expert_params: Sequence[str], sync_init: bool) -> None:
        """Start the parameters the ep ranks share equal (from ep index 0); the experts differ."""
        if not (sync_init and dist.is_initialized()):
            return
        skip = set(expert_params)
        with torch.no_grad():
            for m in self.stages.values():
                for name, t in list(m.named_parameters()) + list(m.named_buffers()):
                    if name not in skip:
                        C.broadcast_(t.data, self.ep_axis, 0)

    def _schedule(self, m: int) -> Schedule:
        v = self.n_virtual if self.n_virtual > 1 else None
        sch = make_schedule(self.schedule_name, self.pp, m, v)
        if sch.n_stages != self.n_stages:
            raise ValueError(f"schedule {self.schedule_name!r} on {self.pp} ranks runs {sch.n_stages} stages, but the "
                             f"pipeline was cut into {self.n_stages}; cut it into {sch.n_stages} stages")
        return sch

    def _executor(self, m: int) -> PipelineExecutor:
        ex = self._executors.get(m)
        if ex is None:
            mods = {s: self.stages[str(s)] for s in sorted(int(k) for k in self.stages)}
            ex = PipelineExecutor(mods, self._schedule(m), self.mesh, self._no_loss, axis=self.pp_axis,
                                  engines=self.engine.engines, tied=self.tied)
            self._executors[m] = ex
        return ex

    @staticmethod
    def _no_loss(out, target):
        raise RuntimeError("internal: the pipeline ran without a loss_fn")

    def _flat_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list:
        if self.in_spec is not None:
            flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
            if spec != self.in_spec:
                raise ValueError(f"inputs do not match the captured structure: got {spec}, captured {self.in_spec}")
        else:
            if kwargs:
                raise ValueError("this pipeline was built without an input spec; pass inputs positionally")
            flat = list(args)
        flat = self.mesh.to_device(flat)  # a CPU batch reaches a GPU program
        bad = [type(x).__name__ for x in flat if not (x is None or isinstance(x, torch.Tensor))]
        if bad:  # None (an optional input left out, e.g. an attention mask) reaches stage 0 as None
            raise ValueError(f"pipeline inputs must be tensors or None (they travel to stage 0 as micro-batches); "
                             f"got {bad}")
        return flat

    def _unflatten(self, out):
        if isinstance(out, torch.Tensor):
            return out
        out = list(out)
        if self.out_spec is not None:
            return pytree.tree_unflatten(out, self.out_spec)
        return out[0] if len(out) == 1 else tuple(out)

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a global batch: dim 0 of every tensor split over the dp axis,
        then over the ep axis (when there is one), on the mesh's device."""
        batch = self.mesh.to_device(batch)
        for axis, n in ((self.dp_axis, self.dp), (self.ep_axis, self.ep)):
            if n > 1:
                batch = pytree.tree_map(lambda t, axis=axis, n=n: self._piece(t, axis, n), batch)
        return batch

    def _piece(self, t: Any, axis: str, n: int) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % n:
            whole = "global batch" if axis == self.dp_axis or self.dp == 1 else "data-parallel piece of the batch"
            raise ValueError(f"the {whole} has {t.shape[0]} rows, which does not divide by {axis}={n}; use a "
                             f"global batch that is a multiple of {self.dp * self.ep} (dp x ep)")
        k = t.shape[0] // n
        idx = self.mesh.local_rank(axis)
        return t[idx * k:(idx + 1) * k]

    # --- training step -------------------------------------------------------------------
    def step(self, batch: Sequence[Any], loss_fn: Callable, n_microbatches: int | None = None) -> torch.Tensor:
        """Forward and backward of one global batch `(inputs, targets)` through the pipeline;
        returns its loss on every rank (see the module docstring)."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("model.step takes batch=(inputs, targets): inputs a tensor or tuple of "
                             f"the model's inputs, targets what loss_fn needs; got {type(batch).__name__}"
                             + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
        m = n_microbatches or self.n_microbatches
        if m < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {m}")
        C.set_active_mesh(self.mesh)
        inputs, targets = self.local_batch(tuple(batch))
        if isinstance(inputs, Mapping):  # model(**inputs)
            flat = self._flat_inputs((), inputs)
        else:
            flat = self._flat_inputs(inputs if isinstance(inputs, (tuple, list)) else (inputs,), {})
        ex = self._executor(m)
        unflatten = self._unflatten
        ex.loss_fn = lambda out, tgt: loss_fn(unflatten(out), tgt)
        holds_first, holds_last = 0 in ex.modules, self.n_stages - 1 in ex.modules
        mbs = _split(tuple(flat), m, "the local batch's inputs") if holds_first else None
        tgts = _split(targets, m, "the local batch's targets") if holds_last else None
        self.steps_run = getattr(self, "steps_run", 0) + 1
        try:
            with where(f"step {self.steps_run}"), self.rng.fork(self.training):
                loss = ex.step(mbs, tgts)
        finally:
            ex.loss_fn = self._no_loss
        for axis, n in ((self.dp_axis, self.dp), (self.ep_axis, self.ep)):
            if n > 1:
                loss = loss.clone()
                C.COUNTER.record("metric_all_reduce", axis, loss.numel() * loss.element_size())
                issue("loss all_reduce", dist.all_reduce, loss, op=dist.ReduceOp.AVG, group=self.mesh.group(axis),
                      axis=axis)
        return loss

    # --- inference -----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any):
        """Run the stages in order (no autograd across stages); every pp rank returns the output."""
        C.set_active_mesh(self.mesh)
        me = self.pp_rank
        place = self.stage_to_rank
        vals: list | None = None
        if place[0] == me:
            vals = self._flat_inputs(args, kwargs)
        for s in range(self.n_stages):
            r = place[s]
            if s > 0 and place[s - 1] != r:
                if me == place[s - 1]:
                    self._send(vals, r)
                    vals = None
                elif me == r:
                    vals = self._recv(place[s - 1])
            if r == me:
                with self.rng.fork(self.training):  # dropout / batch norm follow pm.train() / pm.eval()
                    out = self.stages[str(s)](*vals)
                vals = [out] if isinstance(out, torch.Tensor) else list(out)
        last = place[-1]
        if self.pp > 1:
            vals = self._broadcast(vals if me == last else None, last)
        return self._unflatten(vals)

    def evaluate(self, batch: Sequence[Any], loss_fn: Callable) -> torch.Tensor:
        """The loss of one global batch without gradients, in the program's mode (`pm.eval()`
        first), on every rank, averaged over dp (and ep) as `step` does (`runtime.program.evaluate`)."""
        return evaluate(self, batch, loss_fn, self.dp_axis, self.ep_axis)

    def _group(self):
        return self.mesh.group(self.pp_axis)

    def _peer(self, pp_index: int) -> int:
        return self.mesh.axis_ranks(self.pp_axis, dist.get_rank())[pp_index]

    def _meta(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        meta = [len(tensors)]
        for t in tensors:
            meta += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        return torch.tensor(meta, dtype=torch.int64, device=self.mesh.device)

    def _read_meta(self, v: list[int]) -> list[torch.Tensor]:
        n, k, out = v[0], 1, []
        for _ in range(n):
            code, nd = v[k], v[k + 1]
            out.append(torch.empty(v[k + 2:k + 2 + nd], dtype=_DTYPES[code], device=self.mesh.device))
            k += 2 + nd
        return out

    def _send(self, tensors: list[torch.Tensor], dst_pp: int) -> None:
        dst, g = self._peer(dst_pp), self._group()
        meta = self._meta(tensors)
        head = torch.tensor([meta.numel()], dtype=torch.int64, device=self.mesh.device)
        for t in (head, meta):
            dist.send(t, dst=dst, group=g)
            C.COUNTER.record("send_meta", self.pp_axis, t.numel() * 8)
        for t in tensors:
            dist.send(t.contiguous(), dst=dst, group=g)
            C.COUNTER.record("send", self.pp_axis, t.numel() * t.element_size())

    def _recv(self, src_pp: int) -> list[torch.Tensor]:
        src, g = self._peer(src_pp), self._group()
        head = torch.empty(1, dtype=torch.int64, device=self.mesh.device)
        dist.recv(head, src=src, group=g)
        meta = torch.empty(int(head.item()), dtype=torch.int64, device=self.mesh.device)
        dist.recv(meta, src=src, group=g)
        C.COUNTER.record("recv_meta", self.pp_axis, 8 + meta.numel() * 8)
        bufs = self._read_meta(meta.tolist())
        for t in bufs:
            dist.recv(t, src=src, group=g)
            C.COUNTER.record("recv", self.pp_axis, t.numel() * t.element_size())
        return bufs

    def _broadcast(self, tensors: list[torch.Tensor] | None, src_pp: int) -> list[torch.Tensor]:
        src, g = self._peer(src_pp), self._group()
        if tensors is not None:
            meta = self._meta(tensors)
            head = torch.tensor([meta.numel()], dtype=torch.int64, device=self.mesh.device)
        else:
            head = torch.empty(1, dtype=torch.int64, device=self.mesh.device)
        dist.broadcast(head, src=src, group=g)
        if tensors is None:
            meta = torch.empty(int(head.item()), dtype=torch.int64, device=self.mesh.device)
        dist.broadcast(meta, src=src, group=g)
        bufs = [t.contiguous() for t in tensors] if tensors is not None else self._read_meta(meta.tolist())
        for t in bufs:
            dist.broadcast(t, src=src, group=g)
            C.COUNTER.record("broadcast", self.pp_axis, t.numel() * t.element_size())
        return bufs


def _split(x: Any, m: int, what: str) -> list:
    """`x` (a tensor or a pytree of tensors) as m equal micro-batches along dim 0."""
    leaves, spec = pytree.tree_flatten(x)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] % m:
            raise ValueError(f"{what} have {t.shape[0]} rows, which do not divide into {m} micro-batches; "
                             f"use a batch of dp x {m} x k rows")
    chunks = [t.chunk(m) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * m for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(m)]


# ------------------------------------------------------------------------------ engines
class PipelineEngines:
    """The engines of this rank's stages, seen as one (what `autopar.optimizer` uses)."""

    def __init__(self, engines: Mapping[int, Any], mesh: Mesh, pp_axis: str, dp_axis: str | None,
                 tied: Sequence[TiedPair] = ()):
        self.engines = dict(engines)
        self.mesh, self.pp_axis, self.dp_axis = mesh, pp_axis, dp_axis
        # the second copy of a tied weight: skipped when a norm must count it once
        self._dup = {(m[0], m[1]) for group in tied for m in group[1:]}
        self.optimizer: PipelineOptimizer | None = None

    def make_optimizer(self, cls, param_groups: list[dict] | None = None, **kwargs) -> "PipelineOptimizer":
        """`cls(**kwargs)` over every local stage's masters. `param_groups`: dicts whose
        "params" are parameter names (the model's) or parameter objects, as for one engine."""
        opts = {}
        for s, eng in sorted(self.engines.items()):
            groups = None
            if param_groups is not None:
                names = {n for sl in eng.slots for n in [sl.name, *sl.aliases]}
                ids = {id(sl.param) for sl in eng.slots}
                groups = []
                for g in param_groups:
                    mine = [p for p in g["params"] if (p in names if isinstance(p, str) else id(p) in ids)]
                    if mine:
                        groups.append({**g, "params": mine})
                if not groups:
                    continue
            opts[s] = eng.make_optimizer(cls, groups, **kwargs)
        if not opts:
            raise ValueError("param_groups name no parameter of this rank's pipeline stages")
        self.optimizer = PipelineOptimizer(opts)
        return self.optimizer

    def no_sync(self):
        stack = contextlib.ExitStack()
        for e in self.engines.values():
            stack.enter_context(e.no_sync())
        return stack

    def finish_backward(self) -> None:
        for e in self.engines.values():
            e.finish_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for e in self.engines.values():
            e.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every stage's master gradients so that the norm over the whole model (every
        pp rank, dp shard and tensor-parallel shard; a tied weight once) is at most `max_norm`;
        returns the norm before clipping (accumulated in fp32, fp64 for fp64 gradients)."""
        self.finish_backward()
        norm_type = float(norm_type)
        inf = norm_type == math.inf

        def live(axes) -> tuple[str, ...]:
            return tuple(a for a in axes if self.mesh.size(a) > 1)

        grads, parts = [], {}
        mp = [e.model_parallel for e in self.engines.values()]
        keys = [()] + sorted({live(v) for m in mp for v in m.values()} - {()})  # the same on tp and dp peers
        for s, e in sorted(self.engines.items()):
            for sl in e.slots:
                g = sl.master.grad
                if g is None:
                    continue
                grads.append(g)
                if (s, sl.name) not in self._dup:
                    parts.setdefault(live(e.model_parallel.get(sl.name, ())), []).append(g)
        dev = self.mesh.device
        acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        sharded = any(e.stage >= 1 and e.k > 1 for e in self.engines.values())
        t = local_norm_parts(parts, keys, norm_type, acc, dev)
        t = reduce_norm_parts(t, keys, inf, self.dp_axis if sharded else None).reshape(1)  # this stage's
        if self.mesh.size(self.pp_axis) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self.mesh.group(self.pp_axis))
            C.COUNTER.record("all_reduce", self.pp_axis, t.numel() * t.element_size())
        total = t[0] if inf else t[0].pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def memory_bytes(self, device: str | None = None) -> dict[str, int]:
        out = {"params": 0, "grads": 0, "optimizer": 0}
        for e in self.engines.values():
            for k, v in e.memory_bytes(device).items():
                out[k] = out.get(k, 0) + v
        return out

    def gather_full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full tensors of this rank's stages (collective over dp), keyed by the model's names."""
        sd: dict[str, torch.Tensor] = {}
        for _s, e in sorted(self.engines.items()):
            sd.update(e.gather_full_state_dict(rank0_only=rank0_only))
        return sd

    @property
    def loss_scale(self) -> float:
        return next(iter(self.engines.values())).loss_scale

    @property
    def last_step_skipped(self) -> bool:
        return any(e.last_step_skipped for e in self.engines.values())

    def remove(self) -> None:
        for e in self.engines.values():
            e.remove()


class PipelineOptimizer(torch.optim.Optimizer):
    """One optimizer over the local stages' engines: `step`, `zero_grad`, `param_groups`
    (the inner groups themselves, so LR schedulers reach them), `state_dict` per stage."""

    _autopar_managed = True  # zero_plain_optim.MANAGED: its stages' optimizers drive the engines

    def __init__(self, optimizers: Mapping[int, Any]):
        self.optimizers = dict(optimizers)
        first = next(iter(self.optimizers.values()))
        params = [p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]]
        super().__init__(params, first.defaults)
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]
        self.state = {k: v for o in self.optimizers.values() for k, v in o.state.items()}  # type: ignore[assignment]

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the pipeline optimizer's step does not take a closure: run model.step(...) first")
        for o in self.optimizers.values():
            o.step()
        self.state = {k: v for o in self.optimizers.values() for k, v in o.state.items()}  # type: ignore[assignment]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"stages": {s: o.state_dict() for s, o in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        stages = state_dict.get("stages")
        if stages is None or sorted(map(int, stages)) != sorted(self.optimizers):
            raise ValueError(f"this state holds stages {sorted(stages or {})}, this rank's optimizer stages "
                             f"{sorted(self.optimizers)}; load each rank's own state on the same mesh")
        for s, o in self.optimizers.items():
            o.load_state_dict(stages[s] if s in stages else stages[str(s)])
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]

    def __repr__(self) -> str:
        return f"PipelineOptimizer(stages={sorted(self.optimizers)}, {next(iter(self.optimizers.values()))!r})"
