"""Weights tied across pipeline stages: one value held on two or more stages (an embedding on
the first stage and the LM head on the last; T5's shared embedding read on three stages).

`TiedCopies(tied, modules, engines, schedule, mesh, axis)` is built by every rank at the same
point (it creates one process group per tied entry and pp group, on every rank, in the same
order) and:

  * makes the copies equal at construction: the first listed stage's value wins; every copy's
    parameter and, where its stage has an engine with a separate master (fp32 masters of
    16-bit parameters, offload), that master too;
  * `reduce()`, after every local stage's `engine.finish_backward()`, gives every copy the sum
    of all copies' gradients: all-reduce over the group of the pp ranks holding a copy (a
    local sum when one rank holds them all).

Where the sum acts: on the tensor the optimizer steps. With an engine that is the engine's
master for the parameter (ZeRO 0: the parameter itself, or its fp32 master; ZeRO 1-2: this dp
rank's rows, or their fp32 master; ZeRO 3: this dp rank's shard). Every copy of a tied weight
has the same full shape, and the stages' engines share the dp axis, so on one dp rank every
copy's master holds the same rows: the sum of the copies' dp-averaged row gradients is the
dp average of the summed gradient (averaging is linear), which is what one process computes.
The masters then take identical optimizer steps, so the copies stay equal. Without an engine
the sum acts on `.grad`.

Not handled here: fp16 dynamic loss scaling. The engines of every stage share one scale and one
overflow verdict (`zero_optim.LossScaleGroup`, made by `runtime.program.Program`), so both
copies step or skip together.

Reads and writes no `node.meta` keys. Counts the all-reduce in `collectives.COUNTER` as
("all_reduce", pp axis) and the initial broadcast as ("broadcast", pp axis).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .collective_errors import failed
from .collectives import COUNTER

__all__ = ["TiedCopies", "TiedPair", "grad_holder"]

TiedPair = tuple[tuple[int, str], ...]  # ((stage, param name), ...): one weight on 2+ stages


def grad_holder(engine: Any, name: str, param: nn.Parameter) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the tensor whose `.grad` the optimizer reads for parameter `name`, the full shape of the
    parameter): the engine's master for it (the engine's slot named `name` or aliased to it), or
    `param` itself without an engine."""
    if engine is None:
        return param, tuple(param.shape)
    for sl in engine.slots:
        if name == sl.name or name in sl.aliases:
            return sl.master, tuple(sl.info.shape)
    raise ValueError(f"the engine of this stage has no parameter {name!r}; it has "
                     f"{sorted(sl.name for sl in engine.slots)[:12]}")


class TiedCopies:
    """See the module docstring.

    Args:
        tied: entries ((stage, param name), (stage, param name), ...), one per tied weight.
        modules: {stage: module} of this pp rank.
        engines: {stage: engine} of this pp rank (may be empty).
        schedule: the `runtime.schedules.Schedule` (where each stage sits).
        mesh, axis: the Mesh and its pipeline axis.
    """

    def __init__(self, tied: Sequence[TiedPair], modules: Mapping[int, nn.Module], engines: Mapping[int, Any],
                 schedule, mesh, axis: str):
        self.mesh, self.axis = mesh, axis
        S = schedule.n_stages
        rank = dist.get_rank()
        pp_ranks = mesh.axis_ranks(axis, rank)
        pp_groups = sorted({tuple(mesh.axis_ranks(axis, r)) for r in range(dist.get_world_size())})
        self.entries: list[tuple[list[torch.Tensor], Any]] = []  # (this rank's grad holders, group)
        for entry in tied:
            try:
                members = [(int(s), str(n)) for s, n in entry]
            except (TypeError, ValueError):
                raise ValueError(f"tied entry {entry!r} must be ((stage, param_name), (stage, param_name), ...)") \
                    from None
            stages = [s for s, _ in members]
            if len(members) < 2 or len(set(stages)) != len(stages) or not all(0 <= s < S for s in stages):
                raise ValueError(f"tied entry {entry!r} must name two or more different stages in 0..{S - 1}")
            ranks = sorted({schedule.stage_to_rank[s] for s in stages})
            group = None
            if len(ranks) > 1:
                for g in pp_groups:  # every rank creates every group, in the same order
                    members_g = sorted({g[r] for r in ranks})
                    pg = dist.new_group(members_g)
                    if rank in members_g:
                        group = pg
            held = []  # (stage, name, parameter, grad holder, full shape)
            for s, n in members:
                if s not in modules:
                    continue
                params = dict(modules[s].named_parameters())
                if n not in params:
                    raise ValueError(f"stage {s} has no parameter {n!r}; it has {sorted(params)[:12]}")
                p = params[n]
                if p.requires_grad is False:
                    raise ValueError(f"tied parameter {n!r} of stage {s} does not require grad")
                holder, shape = grad_holder(engines.get(s), n, p)
                held.append((s, n, p, holder, shape))
            for s, n, _p, _h, shape in held:
                if shape != held[0][4]:
                    raise ValueError(f"tied parameters {held[0][1]!r} (stage {held[0][0]}) and {n!r} (stage {s}) "
                                     f"have shapes {held[0][4]} and {shape}")
            src = pp_ranks[schedule.stage_to_rank[stages[0]]]
            # start equal: the first stage's parameter (and master, where separate) wins
            self._equalize([h[2] for h in held], group, src)
            if group is not None or any(h[3] is not h[2] for h in held):
                self._equalize([h[3] for h in held], group, src)
            self.entries.append(([h[3] for h in held], group))

    def _equalize(self, tensors: list[torch.Tensor], group, src: int) -> None:
        with torch.no_grad():
            if group is not None and tensors:
                buf = tensors[0].detach().to(self.mesh.device)  # an offloaded master travels on the device
                dist.broadcast(buf, src=src, group=group)
                COUNTER.record("broadcast", self.axis, buf.numel() * buf.element_size())
                if buf.data_ptr() != tensors[0].data_ptr():
                    tensors[0].copy_(buf)
            for t in tensors[1:]:
                t.copy_(tensors[0])

    def reduce(self) -> None:
        """Every copy of a tied weight gets the sum of all copies' gradients (after the engines'
        `finish_backward()`)."""
        for holders, group in self.entries:
            if not holders:
                continue
            tot = sum((h.grad if h.grad is not None else torch.zeros_like(h)) for h in holders)
            if group is not None:
                dev = tot.to(self.mesh.device)  # offloaded masters' gradients are reduced on the device
                with failed("tied-weight all_reduce", group=group):
                    dist.all_reduce(dev, group=group)
                COUNTER.record("all_reduce", self.axis, dev.numel() * dev.element_size())
                tot = dev.to(tot.device) if dev is not tot else dev
            for h in holders:
                h.grad = tot.to(h.device, h.dtype, copy=True)

    def __len__(self) -> int:
        return len(self.entries)
