"""The engines of a pipeline rank's stages, seen as one: what `autopar.optimizer` drives.

A rank of a pipeline holds one ZeRO engine per stage the schedule places on it
(`runtime.zero.make_engine`; `runtime.program.Program` makes them). `PipelineEngines` gives
them the interface of one engine: `make_optimizer(cls, **kw)` builds one `PipelineOptimizer`
over every local stage's masters, plus `zero_grad`, `no_sync`, `finish_backward`,
`clip_grad_norm_` (the norm over every stage, pp rank, dp shard and tensor-parallel shard; a
tied weight counted once), `memory_bytes`, `gather_full_state_dict` (this rank's stages),
`loss_scale` and `last_step_skipped`. A one-stage program uses its engine directly.

Reads and writes no node.meta. Counts the norm's pp all-reduce in `collectives.COUNTER`.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from . import collectives as C
from .grad_norm import local_norm_parts, reduce_norm_parts
from .mesh import Mesh
from .pipeline_tied import TiedPair

__all__ = ["PipelineEngines", "PipelineOptimizer"]


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
