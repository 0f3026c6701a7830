"""Pipeline-parallel executor: runs a `runtime.schedules.Schedule` over the pp axis of a mesh.

Each rank holds the stage modules the schedule places on it (one, or several for
interleaved / V schedules) and runs its action list in order: `F` runs a stage forward and
sends the outputs to the next stage, `B` runs the full backward and sends the input gradients
to the previous stage, `I`/`W` split the backward into the input part (sent at once) and the
weight part (run later to fill bubbles). Stages that sit on the same rank hand tensors over
directly. The last stage applies `loss_fn(output, target)`; the backward is seeded with
1/n_microbatches, so the gradients summed over micro-batches equal those of one step on the
whole batch (for a mean loss and equal micro-batches); `step` returns the mean loss on every
pp rank (broadcast from the rank that holds the last stage).

Why our own executor and not `torch.distributed.pipelining`: its `PipelineStage` and the
public schedule classes run torch's own orders only; running an arbitrary action list
(`_PipelineScheduleRuntime`, `_Action`) is private API, which this package confines to
`runtime/_torch_compat.py`; its gradient sync knows DDP/FSDP modules, not our ZeRO engines;
and it has no tied-parameter option. The executor therefore uses public c10d point-to-point
calls (`isend`/`irecv` on the pp group) and public autograd graph APIs (`get_gradient_edge`,
`Node.register_prehook`, `autograd.backward` on `GradientEdge`s). `benchmarks/bench_pipeline.py`
measures it against `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B`.

Communication. Tensors between stages may be a tensor or a tuple of tensors (any dtype; a
floating tensor that requires grad gets a gradient back). Shapes are exchanged, not
inferred: the first message of every (stage, direction) channel in a step is preceded by a
small int64 metadata message (count, then dtype / requires_grad / shape of each tensor); the
later micro-batches of the step must have the same shapes (a `ValueError` says so otherwise).
Receives are posted in the order the peer sends (both sides derive it from the schedule),
so matching needs no tags (NCCL has none; only gloo is tested here); the receive for the
next action is posted before the current one computes, so transfers overlap compute. Sends are
asynchronous and awaited at the end of the step; the schedule is checked by the simulator at
construction, so a run cannot deadlock on the schedule's own waits.

Zero-bubble split (`I` then `W`): `I` computes only the input gradients, `W` the weight
gradients later, from the gradients `I` captured (runtime/pipeline_split.py says how). A
stage holding activation-checkpoint regions (`pipeline_split.allows_one_backward`) runs its
whole backward at its `I`'s place and no `W` (`fuse_backward`; `fused_stages` lists them): a
selective checkpoint's cache serves one backward (a second raises), and through a plain one
every `W` autograd call (one per parameter group) recomputes its region again (measured on
one process, benchmarks/bench_split_backward_recompute.py: 16 block forwards a step instead
of 8, the split backward 1.38-1.50x the fused one in three runs on a shared CPU), more than
the bubble a `W` fills. Its gradients are then made, and reduced, exactly once, as under
1F1B; the other stages keep the split. `schedule` is the schedule this rank runs
(`cost.schedule.fuse_backward` gives the cost model the same one).

Data parallel (pp x dp): give `engines={stage: make_engine(module, mesh, "dp", stage=k)}`
(any ZeRO stage 0-3; the engines' collectives use the active mesh, `set_active_mesh`);
every backward of a stage except its last one in the step runs in `engine.no_sync()`, the
last one (`B`, or the last `W`) lets the engine's hooks launch their reductions, and
`finish_backward()` runs once per stage after the schedule. fp16 loss scaling: engines joined
in a `zero_optim.LossScaleGroup` (as `runtime.program.Program` makes them) scale only at the last
stage (its fp32 loss's backward seeded with the scale, or a 16-bit loss's outputs: zero_optim
`loss_scale_factor`) and settle one agreed overflow verdict in that `finish_backward()`.
Tied parameters on different stages (embedding on the first, LM head on the last) are made
equal at construction and get their gradients summed after every stage's
`finish_backward()` (runtime/pipeline_tied.py): on the engines' masters where there are
engines (any ZeRO stage, fp32 masters of 16-bit parameters: both copies hold the same rows
of the same dp rank), on `.grad` without; all-reduce over a group of the ranks holding a
copy, or a local sum when one rank holds them all.

Reads and writes no `node.meta` keys. Counts every point-to-point transfer in
`collectives.COUNTER` as ("send" | "recv", axis) with payload bytes, and the shape metadata
as ("send_meta" | "recv_meta", axis).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .collective_errors import failed, p2p, where
from .collectives import COUNTER
from .pipeline_split import WeightGradState, allows_one_backward, backward_input, backward_weight
from .pipeline_tied import TiedCopies, TiedPair
from .zero_optim import loss_scale_factor
from .schedules import Action, Kind, Schedule, fuse_backward, simulate

__all__ = ["PipelineExecutor", "split_microbatches", "backward_input", "backward_weight", "WeightGradState"]


# dtype codes for the shape metadata (append only: both ends must agree)
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def split_microbatches(batch: torch.Tensor | Sequence[torch.Tensor], n: int) -> list:
    """Split a tensor (or a tuple of tensors) into `n` equal micro-batches along dim 0."""
    items = (batch,) if torch.is_tensor(batch) else tuple(batch)
    for t in items:
        if t.shape[0] % n:
            raise ValueError(f"batch dim {t.shape[0]} is not divisible by n_microbatches={n}; "
                             "micro-batches must be equal for the pipeline step to equal a full-batch step")
    chunks = [t.chunk(n, dim=0) for t in items]
    out = [tuple(c[k] for c in chunks) for k in range(n)]
    return [o[0] for o in out] if torch.is_tensor(batch) else out


# ---------------------------------------------------------------------------- executor
def _as_tuple(x, what: str, allow_none: bool = False) -> tuple[torch.Tensor, ...]:
    t = (x,) if torch.is_tensor(x) else tuple(x) if isinstance(x, (tuple, list)) else None
    if t is None or not all(torch.is_tensor(v) or (allow_none and v is None) for v in t):
        raise ValueError(f"{what} must be a tensor or a tuple of tensors, got {type(x).__name__}; "
                         "return only tensors from a pipeline stage")
    return t


class PipelineExecutor:
    """Runs one pipeline step per `step()` call on this rank.

    Args:
        stages: this rank's stage modules: one module, a list in increasing stage order, or
            {stage index: module}; they must be the stages `schedule.stage_to_rank` puts here.
        schedule: the action lists (`runtime.schedules`).
        mesh: the `runtime.mesh.Mesh`; the pp axis must have `schedule.n_ranks` ranks.
        loss_fn: `loss_fn(last_stage_output, target) -> scalar`, a mean over the micro-batch.
        axis: the pipeline axis name.
        engines: {stage: engine} data-parallel engines (`runtime.zero.make_engine`) for the
            stages on this rank, or None.
        tied: groups ((stage_a, param_name_a), (stage_b, param_name_b), ...) of parameters that
            are one weight in the model (e.g. ((0, "tok_emb.weight"), (3, "lm_head.weight")); T5's
            shared embedding is read on three stages); every copy gets the sum of their gradients;
            construct the executor on every rank at the same point: it creates process groups.
    """

    def __init__(self, stages: nn.Module | Sequence[nn.Module] | Mapping[int, nn.Module], schedule: Schedule,
                 mesh, loss_fn: Callable[[Any, Any], torch.Tensor] | None, *, axis: str = "pp",
                 engines: Mapping[int, Any] | None = None, tied: Sequence[TiedPair] = ()):
        if not dist.is_initialized():
            raise RuntimeError("PipelineExecutor needs torch.distributed initialised (torchrun or autopar's launcher)")
        self.schedule, self.mesh, self.axis, self.loss_fn = schedule, mesh, axis, loss_fn
        if mesh.size(axis) != schedule.n_ranks:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.n_ranks} ranks but mesh axis {axis!r} has "
                             f"{mesh.size(axis)}; build the schedule for n_ranks={mesh.size(axis)}")
        self.global_rank = dist.get_rank()
        self.pp_rank = mesh.coords(self.global_rank)[axis]
        self.pp_ranks = mesh.axis_ranks(axis, self.global_rank)  # global rank of each pp index
        self.group = mesh.group(axis)
        self.device = mesh.device
        mine = schedule.stages_of(self.pp_rank)
        if isinstance(stages, nn.Module):
            stages = [stages]
        if isinstance(stages, Mapping):
            self.modules = dict(stages)
        else:
            stages = list(stages)
            if len(stages) != len(mine):
                raise ValueError(f"pp rank {self.pp_rank} holds stages {mine} in schedule {schedule.name!r} "
                                 f"but {len(stages)} modules were given; pass one module per stage")
            self.modules = dict(zip(mine, stages))
        if sorted(self.modules) != mine:
            raise ValueError(f"pp rank {self.pp_rank} holds stages {mine} in schedule {schedule.name!r}, "
                             f"but modules were given for stages {sorted(self.modules)}")
        self.last_stage = schedule.n_stages - 1
        if self.last_stage in self.modules and loss_fn is None:
            raise ValueError("the rank holding the last stage needs a loss_fn(output, target)")
        self.engines = dict(engines or {})
        extra = sorted(set(self.engines) - set(self.modules))
        if extra:
            raise ValueError(f"engines given for stages {extra} that pp rank {self.pp_rank} does not hold ({mine})")
        # stages whose backward cannot be split (checkpoint regions): their I runs B, no W
        self.fused_stages = sorted(s for s, mod in self.modules.items() if allows_one_backward(mod))
        self.schedule = schedule = fuse_backward(schedule, self.fused_stages)
        sim = simulate(schedule, f=1, b=1, i=1, w=1)
        sim.raise_if_deadlocked()
        self._params = {s: [p for p in m.parameters() if p.requires_grad] for s, m in self.modules.items()}
        # the last backward that accumulates into each stage's weights (grad sync runs there)
        self._last_grad_action: dict[int, int] = {}
        for k, a in enumerate(schedule.actions[self.pp_rank]):
            if a.kind in (Kind.B, Kind.W):
                self._last_grad_action[a.stage] = k
        self._recv_plan = self._build_recv_plan()
        self._received_proof = self._build_received_proof()
        # construct on every rank at the same point: it creates the tied groups' process groups
        self._tied = TiedCopies(list(tied), self.modules, self.engines, schedule, mesh, axis)

    # --- set-up ---------------------------------------------------------------------------
    def _rank_of(self, stage: int) -> int:
        return self.schedule.stage_to_rank[stage]

    def _build_recv_plan(self) -> dict[int, list[tuple[str, int, int]]]:
        """For each peer, the messages it sends to this rank, in its sending order."""
        plan: dict[int, list[tuple[str, int, int]]] = {}
        for q, acts in enumerate(self.schedule.actions):
            if q == self.pp_rank:
                continue
            seq = []
            for a in acts:
                if a.kind is Kind.F and a.stage < self.last_stage and self._rank_of(a.stage + 1) == self.pp_rank:
                    seq.append(("F", a.stage, a.mb))
                elif a.kind in (Kind.B, Kind.I) and a.stage > 0 and self._rank_of(a.stage - 1) == self.pp_rank:
                    seq.append(("B", a.stage, a.mb))
            if seq:
                plan[q] = seq
        return plan

    def _build_received_proof(self) -> dict[tuple, frozenset]:
        """For each message a peer sends this rank: the messages of this rank that the peer has
        consumed before sending it (both derive it from the schedule). Once it arrives, those
        sends are complete, so their tensors can be released before the end of the step (gloo's
        `is_completed` stays False until `wait`)."""
        me, out = self.pp_rank, {}
        for q, acts in enumerate(self.schedule.actions):
            if q == me:
                continue
            consumed: set = set()
            for a in acts:
                if a.kind is Kind.F and a.stage > 0 and self._rank_of(a.stage - 1) == me:
                    consumed.add(("F", a.stage - 1, a.mb))
                elif a.kind in (Kind.B, Kind.I) and a.stage < self.last_stage and self._rank_of(a.stage + 1) == me:
                    consumed.add(("B", a.stage + 1, a.mb))
                if a.kind is Kind.F and a.stage < self.last_stage and self._rank_of(a.stage + 1) == me:
                    out[("F", a.stage, a.mb)] = frozenset(consumed)
                elif a.kind in (Kind.B, Kind.I) and a.stage > 0 and self._rank_of(a.stage - 1) == me:
                    out[("B", a.stage, a.mb)] = frozenset(consumed)
        return out

    # --- one step ---------------------------------------------------------------------------
    def step(self, microbatches: Sequence[Any] | None = None, targets: Sequence[Any] | None = None) -> torch.Tensor:
        """Run the schedule once: forward and backward of every micro-batch.

        Args:
            microbatches: n_microbatches inputs of stage 0 (each a tensor or a tuple of tensors);
                needed on the rank that holds stage 0, ignored elsewhere.
            targets: n_microbatches targets for `loss_fn`; needed on the rank holding the last stage.

        Returns:
            The mean loss over the micro-batches, on every pp rank. Gradients are accumulated
            into `.grad` (zero them between steps as usual).
        """
        M = self.schedule.n_microbatches
        if 0 in self.modules and (microbatches is None or len(microbatches) != M):
            raise ValueError(f"pp rank {self.pp_rank} holds stage 0 and needs {M} micro-batches, got "
                             f"{None if microbatches is None else len(microbatches)}; see split_microbatches")
        if self.last_stage in self.modules and (targets is None or len(targets) != M):
            raise ValueError(f"pp rank {self.pp_rank} holds the last stage and needs {M} targets, got "
                             f"{None if targets is None else len(targets)}")
        self._mbs, self._targets = microbatches, targets
        self._in: dict = {}  # (stage, mb) -> input tensors
        self._out: dict = {}  # (stage, mb) -> outputs to differentiate
        self._gout: dict = {}  # (stage, mb) -> gradients of those outputs (None: scalar loss)
        self._wstate: dict = {}  # (stage, mb) -> WeightGradState
        self._handoff: dict = {}  # local (dir, stage, mb) -> tensors
        self._posted: dict = {}  # (dir, stage, mb) -> (tensors, works)
        self._recv_next = {q: 0 for q in self._recv_plan}
        self._meta_in: dict = {}  # (dir, sender stage) -> [(dtype, shape, requires_grad)]
        self._meta_out: dict = {}
        self._sends: list = []
        self._losses: list = [None] * M
        acts = self.schedule.actions[self.pp_rank]
        for k, a in enumerate(acts):
            self._post(self._needs(a), block=True)
            if k + 1 < len(acts):
                self._post(self._needs(acts[k + 1]), block=False)
            eng = self.engines.get(a.stage)
            sync_here = a.kind in (Kind.B, Kind.W) and self._last_grad_action.get(a.stage) == k
            ctx = eng.no_sync() if eng is not None and not sync_here else contextlib.nullcontext()
            with ctx, where(f"pipeline action {a}"):
                if a.kind is Kind.F:
                    self._forward(a)
                elif a.kind is Kind.B:
                    self._backward(a, full=True)
                elif a.kind is Kind.I:
                    self._backward(a, full=False)
                else:
                    backward_weight(self._wstate.pop((a.stage, a.mb)))
                    self._drop(a.stage, a.mb)
            self._sends = [(w, t, key) for w, t, key in self._sends if not w.is_completed()]  # NCCL: done ones
        with where("pipeline sends, gradient reduction, loss broadcast"):
            for w, _t, _key in self._sends:
                w.wait()
            self._sends = []
            self._mbs = self._targets = None  # not kept alive until the next step
            for s in sorted(self.engines):
                self.engines[s].finish_backward()
            self._tied.reduce()
            return self._mean_loss()

    # --- actions -----------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, m = a.stage, a.mb
        if s == 0:
            inputs = _as_tuple(self._mbs[m], f"micro-batch {m}", allow_none=True)  # an optional input left out
        else:
            inputs = self._take(("F", s - 1, m))
        out = self.modules[s](*inputs)
        if s == self.last_stage:
            loss = self.loss_fn(out, self._targets[m])
            if not (torch.is_tensor(loss) and loss.numel() == 1):
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                                 f"{tuple(getattr(loss, 'shape', ()))}")
            self._losses[m] = loss.detach().reshape(())
            self._out[(s, m)] = [loss.reshape(())]
            # fp16: the scale seeds an fp32 loss's backward (zero_optim.loss_scale_factor)
            factor = loss_scale_factor(self.engines.get(s), loss)
            self._gout[(s, m)] = [torch.full((), factor / self.schedule.n_microbatches, dtype=loss.dtype,
                                             device=loss.device)]
        else:
            outs = _as_tuple(out, f"the output of stage {s}")
            self._out[(s, m)] = list(outs)
            self._give(("F", s, m), [o.detach() for o in outs], [o.requires_grad for o in outs],
                       self._rank_of(s + 1))
        self._in[(s, m)] = inputs

    def _backward(self, a: Action, full: bool) -> None:
        s, m = a.stage, a.mb
        outs_all = self._out[(s, m)]
        if s == self.last_stage:
            outs, grads = outs_all, self._gout[(s, m)]
        else:
            gs = self._take(("B", s + 1, m))
            outs = [o for o in outs_all if o.requires_grad]
            if len(gs) != len(outs):
                raise RuntimeError(f"stage {s} micro-batch {m}: got {len(gs)} output gradients for "
                                   f"{len(outs)} outputs that require grad")
            grads = list(gs)
        inputs = self._in[(s, m)] if s > 0 else ()
        keep = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        outs, grads = [o for o, _ in keep], [g for _, g in keep]
        if full:
            if outs:
                torch.autograd.backward(outs, grads)
            in_grads = [x.grad if x.requires_grad else None for x in inputs]
            self._drop(s, m)
        else:
            in_grads, self._wstate[(s, m)] = backward_input(outs, grads, inputs, self._params[s])
        if s > 0:
            req = [x for x in inputs if x.requires_grad]
            gsend = [g if g is not None else torch.zeros_like(x)
                     for x, g in zip(inputs, in_grads) if x.requires_grad]
            assert len(gsend) == len(req)
            self._give(("B", s, m), [g.detach() for g in gsend], [False] * len(gsend), self._rank_of(s - 1))

    def _drop(self, s: int, m: int) -> None:
        self._in.pop((s, m), None)
        self._out.pop((s, m), None)
        self._gout.pop((s, m), None)

    # --- transport ----------------------------------------------------------------------------
    def _give(self, key, tensors: list[torch.Tensor], req: list[bool], dst_pp: int) -> None:
        """Hand `tensors` (message `key`) to the stage on pp rank `dst_pp`."""
        if dst_pp == self.pp_rank:
            self._handoff[key] = [t.requires_grad_(r) if t.is_floating_point() or t.is_complex() else t
                                  for t, r in zip(tensors, req)]
            return
        chan = key[:2]
        sig = [(t.dtype, tuple(t.shape), bool(r)) for t, r in zip(tensors, req)]
        dst = self.pp_ranks[dst_pp]
        if chan not in self._meta_out:
            self._meta_out[chan] = sig
            meta = [len(sig)]
            for dt, shape, r in sig:
                if dt not in _DTYPE_CODE:
                    raise ValueError(f"stage {key[1]} sends a {dt} tensor; the pipeline sends {_DTYPES}")
                meta += [_DTYPE_CODE[dt], int(r), len(shape), *shape]
            body = torch.tensor(meta, dtype=torch.int64, device=self.device)
            head = torch.tensor([body.numel()], dtype=torch.int64, device=self.device)
            for t in (head, body):
                self._sends.append((p2p("send", dist.isend, t, dst, self.group, self.axis), t, key))
                COUNTER.record("send_meta", self.axis, t.numel() * t.element_size())
        elif self._meta_out[chan] != sig:
            what = "outputs" if key[0] == "F" else "input gradients"
            raise ValueError(f"micro-batch {key[2]}: stage {key[1]}'s {what} are {sig} but micro-batch 0's were "
                             f"{self._meta_out[chan]}; all micro-batches of a step must have equal shapes "
                             "(split the batch evenly, see split_microbatches)")
        for t in tensors:
            t = t.contiguous()
            self._sends.append((p2p("send", dist.isend, t, dst, self.group, self.axis), t, key))
            COUNTER.record("send", self.axis, t.numel() * t.element_size())

    def _needs(self, a: Action):
        """The message `a` consumes, if any: (dir, sender stage, mb)."""
        if a.kind is Kind.F and a.stage > 0:
            return ("F", a.stage - 1, a.mb)
        if a.kind in (Kind.B, Kind.I) and a.stage < self.last_stage:
            return ("B", a.stage + 1, a.mb)
        return None

    def _post(self, key, block: bool) -> None:
        """Post the receive of message `key` and of every message its sender sends to this
        rank before it (receives must be posted in the sender's order). Without `block`, stop
        at a channel whose shape metadata has not arrived yet instead of waiting for it."""
        if key is None or key in self._posted or key in self._handoff:
            return
        q = self._rank_of(key[1])
        if q == self.pp_rank:
            return
        plan = self._recv_plan[q]
        while key not in self._posted:
            nxt = plan[self._recv_next[q]]
            chan = nxt[:2]
            if chan not in self._meta_in:
                if not block:
                    return
                self._meta_in[chan] = self._recv_meta(q)
            bufs = [torch.empty(shape, dtype=dt, device=self.device) for dt, shape, _ in self._meta_in[chan]]
            works = []
            for t in bufs:
                works.append(p2p("recv", dist.irecv, t, self.pp_ranks[q], self.group, self.axis))
                COUNTER.record("recv", self.axis, t.numel() * t.element_size())
            self._posted[nxt] = (bufs, works)
            self._recv_next[q] += 1

    def _recv_meta(self, q: int) -> list:
        src = self.pp_ranks[q]
        head = torch.empty(1, dtype=torch.int64, device=self.device)
        with failed("recv", axis=self.axis, group=self.group, peer=src):
            dist.recv(head, src=src, group=self.group)
            body = torch.empty(int(head.item()), dtype=torch.int64, device=self.device)
            dist.recv(body, src=src, group=self.group)
        COUNTER.record("recv_meta", self.axis, 8 + body.numel() * 8)
        v = body.tolist()
        n, k, out = v[0], 1, []
        for _ in range(n):
            code, req, nd = v[k], v[k + 1], v[k + 2]
            out.append((_DTYPES[code], tuple(v[k + 3:k + 3 + nd]), bool(req)))
            k += 3 + nd
        return out

    def _take(self, key) -> list[torch.Tensor]:
        if key in self._handoff:
            return self._handoff.pop(key)
        self._post(key, block=True)
        bufs, works = self._posted.pop(key)
        for w in works:
            w.wait()
        done = self._received_proof.get(key)
        if done:  # the peer consumed these before sending `key`: their sends are complete
            keep = []
            for w, t, k in self._sends:
                if k in done:
                    w.wait()  # returns at once
                else:
                    keep.append((w, t, k))
            self._sends = keep
        chan = key[:2]
        return [t.requires_grad_(r) if (t.is_floating_point() or t.is_complex()) else t
                for t, (_, _, r) in zip(bufs, self._meta_in[chan])]

    # --- after the actions -------------------------------------------------------------------
    def _mean_loss(self) -> torch.Tensor:
        """The mean loss over the micro-batches on every pp rank, in the loss's dtype promoted to
        at least fp32 (an fp64 model reports an fp64 loss); it travels as fp64 with its dtype code."""
        if self.last_stage in self.modules:
            dt = torch.promote_types(self._losses[0].dtype, torch.float32)
            loss = torch.stack(self._losses).to(torch.float64).mean()
            msg = torch.stack([loss, torch.tensor(float(_DTYPE_CODE[dt]), dtype=torch.float64, device=loss.device)])
        else:
            msg = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.schedule.n_ranks > 1:
            with failed("loss broadcast", axis=self.axis, group=self.group):
                dist.broadcast(msg, src=self.pp_ranks[self._rank_of(self.last_stage)], group=self.group)
            COUNTER.record("broadcast", self.axis, msg.numel() * msg.element_size())
        return msg[0].to(_DTYPES[int(msg[1].item())])
