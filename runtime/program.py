"""The per-rank program: this rank's stages of the rewritten graph, and a training step.

There is one kind of program. `Program` holds the stage modules this rank runs (one module for
a plan without pipeline parallelism; the stages a pipeline schedule places on this pp rank
otherwise), the mesh, and one engine per stage that reduces and shards gradients and optimizer
state (`runtime.zero`). What else a plan uses composes inside it:

  * data parallelism (`dp_axis`) and context parallelism (`cp_axis`) split the batch (dim 0 over
    dp; dim 1, the sequence, over cp in zigzag chunks), and the ranks of both hold the same
    parameters: gradients, ZeRO's shards and the reported loss are over them joined ("dp+cp");
  * expert parallelism (`ep_axis`): the stage graphs hold the expert all-to-alls (the expert
    pass put them there, and `moe.grad_avg` / `moe.grad_scale` on the parameter reads, so
    gradients leave the graph averaged over ep); the program cuts each dp piece of the batch
    again in ep pieces (ep index j takes rows [j * b, (j + 1) * b)), starts the parameters the
    ep ranks share equal (broadcast from ep index 0; the `expert_params` differ) and tells the
    engines the experts are ep-sharded, so a global gradient norm counts every expert once;
  * pipeline parallelism (`pp_axis` of size > 1): `step` runs a schedule over the stages
    (`runtime.pipeline.PipelineExecutor`, built on the first step for each number of
    micro-batches); tied weights on several stages hold the sum of their gradients on the
    engines' masters (runtime/pipeline_tied.py); `forward` runs the stages in order for
    inference (runtime/stage_transport.py), every pp rank returning the output; `engine` is a
    `runtime.stage_engines.PipelineEngines` over the stages' engines.
  * a vocab-parallel loss (`Plan.loss_parallel`, runtime/vocab_loss.py): when the last stage's
    logits leave it sharded over the vocabulary (`vocab_shard`), `step` / `evaluate` given
    `autopar.cross_entropy` compute the loss on the shards, a mean over the tokens of the whole
    global batch that are not ignored (`loss_on_outputs`); any other loss_fn, and `forward`,
    get them gathered (`gather_vocab`).
  * fp16 loss scaling (`zero_optim.LossScaleGroup`): one scale per rank, applied by the last
    stage only, and the inf/NaN verdict agreed over every axis of size > 1 before any stage
    steps or skips, so a tp rank whose shard overflowed never skips alone.

`step(batch, loss_fn, n_microbatches)` takes the *global* batch `(inputs, targets)`, keeps
this rank's part, splits it into micro-batches, runs forward and backward (one stage: the
micro-batches in turn, communicating only on the last; several: the schedule), and returns the
loss of the whole global batch on every rank (the mean over micro-batches, then over the axes
that split the batch, which equals the one-process loss when `loss_fn` is a mean over the
batch). Gradients are left reduced (and sharded, under ZeRO) for the optimizer's `step()`.

Mode and random numbers: each stage runs inside `self.rng.fork(self.training)`
(runtime/rng.py), so `train()` / `eval()` switch dropout and batch norm as in PyTorch, and
dropout draws from this rank's model-parallel stream (dp ranks differ, tp peers agree, pp
stages are independent). `evaluate(batch, loss_fn)` is the no-grad loss of a global batch,
averaged like `step`'s.

The runtime knows nothing of plans or graphs beyond "modules to call": the search decides, the
passes rewrite, the build floor makes the stages, this runs. The step labels its parts
(`collective_errors.where`: "step 3 > micro-batch 1/2 backward", "gradient reduction"), so a
collective that fails names where. Counts the reported loss's all-reduces as
"metric_all_reduce" in `collectives.COUNTER`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives as C
from . import stage_transport
from . import vocab_loss
from ._torch_compat import pytree
from .collective_errors import issue, where
from .context_layout import shard_sequence
from .mesh import Mesh
from .pipeline import PipelineExecutor
from .pipeline_tied import TiedPair
from .rng import RNGTracker
from .schedules import Schedule, make_schedule
from .stage_engines import PipelineEngines
from .zero import broadcast_module, make_engine
from .zero_optim import LossScaleGroup, loss_scale_factor

__all__ = ["Program", "evaluate", "data_axis", "check_loss"]


class Program(nn.Module):
    """This rank's program (see the module docstring).

    Args:
        stages: this rank's stage modules: one module (no pipeline), or {stage index: module}
            for the stages the schedule places on this pp rank.
        mesh: the Mesh.
        dp_axis, cp_axis, ep_axis: the axes that split the batch (None or absent: none).
        expert_params: names of this rank's expert parameters (they differ between ep ranks).
        zero_stage, bucket_mb, engine_options: each stage's `make_engine(...)`.
        in_spec, out_spec: pytree specs of the model's inputs (args, kwargs) and outputs.
        sync_init: start the ranks equal: every stage broadcast from dp index 0 (and, with ep,
            the parameters other than `expert_params` from ep index 0).
        pp_axis, n_stages, schedule, n_microbatches, tied: the pipeline: its axis, the stages in
            the whole pipeline (pp size x stages per rank), a `runtime.schedules` name
            ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"), the default micro-batch count
            of `step`, and groups ((stage_a, name_a), (stage_b, name_b), ...) of one weight held
            on several stages.
        shard_one_rank: False runs ZeRO 1-3 as the plain engine where the data-parallel axis has
            one rank (nothing to shard: a stage-3 gather would only pack and unpack), unless
            offloading (ZeRO-3 offload holds no parameter on the device at rest); the build
            passes False, as cost.estimate prices dp = 1. `self.zero_stage` is the stage run.
    """

    def __init__(self, stages: nn.Module | Mapping[int, nn.Module], mesh: Mesh, *, dp_axis: str | None = "dp",
                 cp_axis: str | None = None, ep_axis: str | None = None, expert_params: Sequence[str] = (),
                 zero_stage: int = 0, bucket_mb: float = 25.0, engine_options: dict | None = None,
                 in_spec=None, out_spec=None, sync_init: bool = True, pp_axis: str = "pp", n_stages: int = 1,
                 schedule: str = "1f1b", n_microbatches: int = 1, tied: Sequence[TiedPair] = (),
                 shard_one_rank: bool = True):
        super().__init__()
        stages = {0: stages} if isinstance(stages, nn.Module) else dict(stages)
        self.mesh, self.pp_axis = mesh, pp_axis
        self.pp = mesh.size(pp_axis) if pp_axis in mesh.sizes else 1
        self.n_stages, self.schedule_name, self.n_microbatches = n_stages, schedule, n_microbatches
        self.n_virtual = max(1, n_stages // self.pp)  # stages per pp rank
        self.batch_axis = dp_axis if dp_axis in mesh.sizes else None  # splits dim 0 of the batch
        self.cp_axis = cp_axis if cp_axis and mesh.size(cp_axis) > 1 else None  # splits dim 1: the sequence
        # the ranks that hold the same parameters and different data: gradients, the loss and
        # ZeRO's shards are over all of them (dp and cp joined: runtime.mesh.Mesh.parts)
        self.dp_axis = data_axis(mesh, self.batch_axis, self.cp_axis)
        self.dp = mesh.size(self.dp_axis) if self.dp_axis else 1
        self.ep_axis = ep_axis if ep_axis in mesh.sizes and mesh.size(ep_axis) > 1 else None
        self.ep = mesh.size(self.ep_axis) if self.ep_axis else 1
        self.in_spec, self.out_spec = in_spec, out_spec
        self.tied = [tuple(map(tuple, p)) for p in tied]
        C.set_active_mesh(mesh)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.pp_rank = mesh.coords(rank)[pp_axis] if self.pp > 1 else 0
        self.stage_to_rank = self._placement(stages)
        self.stages = nn.ModuleDict({str(s): stages[s] for s in sorted(stages)})
        last = str(n_stages - 1)
        # the logits a plan left vocab-sharded (Plan.loss_parallel): gathered unless the loss is
        # autopar.cross_entropy, which then runs on the shard (runtime/vocab_loss.py)
        self.vocab_shard = vocab_loss.sharded_output(self.stages[last]) if last in self.stages else None
        if self.pp > 1 and dist.is_initialized():  # every pp rank receives the outputs in forward / evaluate
            box, g = [self.vocab_shard], mesh.group(pp_axis)
            dist.broadcast_object_list(box, src=dist.get_global_rank(g, self.stage_to_rank[-1]), group=g,
                                       device=mesh.device)
            self.vocab_shard = box[0]
        self._raw_outputs = False  # step / evaluate: the stage's outputs as they leave it (not gathered)
        if sync_init and self.dp > 1 and dist.is_initialized():
            for m in self.stages.values():
                broadcast_module(m, self.dp_axis)
        opts = dict(engine_options or {})
        if self.ep_axis:
            self._sync_ep(expert_params, sync_init)
            mp = {k: tuple(v) for k, v in (opts.get("model_parallel") or {}).items()}
            for name in expert_params:  # each ep rank holds other experts: a norm counts them all once
                mp[name] = tuple(sorted(set(mp.get(name, ())) | {self.ep_axis}))
            opts["model_parallel"] = mp
        plain = not shard_one_rank and self.dp == 1 and not opts.get("offload")  # see `shard_one_rank`
        self.zero_stage = 0 if plain else zero_stage
        engines = {s: make_engine(stages[s], mesh, self.dp_axis, self.zero_stage, bucket_mb, **opts)
                   for s in sorted(stages)}
        data = set(mesh.parts(self.dp_axis)) if self.dp_axis else set()
        live = [a for a, n in mesh.sizes.items() if n > 1]
        scalers = [e.scaler for e in engines.values() if e.scaler is not None]
        if scalers and [a for a in live if a not in data]:
            # fp16 loss scaling beside tp / ep / pp: one scale, applied by the last stage, the
            # inf/NaN verdict agreed over every axis (a rank whose shard overflowed never skips alone)
            group = LossScaleGroup(scalers[0], live, mesh.device)
            for s in sorted(engines):
                group.add(engines[s], scales_outputs=s == n_stages - 1)
        self.engine = engines[0] if self.pp == 1 else PipelineEngines(engines, mesh, pp_axis, self.dp_axis, self.tied)
        self._executors: dict[int, PipelineExecutor] = {}
        self.steps_run = 0  # training steps so far: failure messages name the step
        self.rng = RNGTracker.for_mesh(mesh, self.dp_axis)  # dropout masks: runtime/rng.py

    @property
    def module(self) -> nn.Module:
        """The stage module of a one-stage program (the rewritten graph); with several stages,
        the ModuleDict of this rank's stages keyed by stage index."""
        return self.stages["0"] if self.pp == 1 else self.stages

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes whose ranks see different rows of the batch: the loss is averaged over them."""
        return tuple(a for a in (self.dp_axis, self.ep_axis) if a)

    # --- set-up ---------------------------------------------------------------------------
    def _placement(self, stages: Mapping[int, nn.Module]) -> list[int]:
        if self.pp == 1:
            if sorted(stages) != [0] or self.n_stages != 1:
                raise ValueError(f"a program without a pipeline axis (no {self.pp_axis!r} of size > 1 in {self.mesh}) "
                                 f"runs one stage; got stages {sorted(stages)} of {self.n_stages}")
            return [0]
        if self.n_stages % self.pp:
            raise ValueError(f"{self.n_stages} stages do not spread evenly over {self.pp_axis}={self.pp} ranks; "
                             f"use a multiple of {self.pp} stages")
        placement = self._schedule(self.pp)  # where stages sit does not depend on the micro-batch count
        mine = placement.stages_of(self.pp_rank)
        if sorted(stages) != mine:
            raise ValueError(f"pp rank {self.pp_rank} holds stages {mine} under schedule {self.schedule_name!r} with "
                             f"{self.n_stages} stages, but modules were given for {sorted(stages)}")
        return list(placement.stage_to_rank)

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
        sch = make_schedule(self.schedule_name, self.pp, m, self.n_virtual if self.n_virtual > 1 else None)
        if sch.n_stages != self.n_stages:
            raise ValueError(f"schedule {self.schedule_name!r} on {self.pp} ranks runs {sch.n_stages} stages, but the "
                             f"pipeline was cut into {self.n_stages}; cut it into {sch.n_stages} stages")
        return sch

    def _executor(self, m: int) -> PipelineExecutor:
        ex = self._executors.get(m)
        if ex is None:
            mods = {int(s): mod for s, mod in self.stages.items()}
            ex = PipelineExecutor(mods, self._schedule(m), self.mesh, _no_loss, axis=self.pp_axis,
                                  engines=self.engine.engines, tied=self.tied)
            self._executors[m] = ex
        return ex

    # --- inputs and outputs --------------------------------------------------------------
    def _flat_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list:
        if self.in_spec is not None:
            flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
            if spec != self.in_spec:
                raise ValueError(f"inputs do not match the captured structure: got {spec}, captured {self.in_spec}")
        else:
            if kwargs:
                raise ValueError("this program was built without an input spec; pass inputs positionally")
            flat = list(args)
        flat = self.mesh.to_device(flat)  # a CPU batch reaches a GPU program
        if self.pp > 1:
            bad = [type(x).__name__ for x in flat if not (x is None or isinstance(x, torch.Tensor))]
            if bad:  # None (an optional input left out, e.g. an attention mask) reaches stage 0 as None
                raise ValueError(f"pipeline inputs must be tensors or None (they travel to stage 0 as "
                                 f"micro-batches); got {bad}")
        return flat

    def _unflatten(self, out):
        if self.out_spec is not None:
            return pytree.tree_unflatten([out] if isinstance(out, torch.Tensor) else list(out), self.out_spec)
        if self.pp == 1 or isinstance(out, torch.Tensor):
            return out
        out = list(out)
        return out[0] if len(out) == 1 else tuple(out)

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a global batch, on the mesh's device: under context parallelism
        dim 1 (the sequence) split over cp in zigzag chunks, then dim 0 of every tensor split
        over dp, then over ep."""
        batch = self.mesh.to_device(batch)
        if self.cp_axis:
            seq = [t.shape[1] for t in pytree.tree_leaves(batch[0] if isinstance(batch, tuple) else batch)
                   if isinstance(t, torch.Tensor) and t.dim() > 1][:1]
            if seq:
                batch = shard_sequence(batch, self.cp_axis, seq[0])
        dp = self.mesh.size(self.batch_axis) if self.batch_axis else 1
        for axis, n in ((self.batch_axis, dp), (self.ep_axis, self.ep)):
            if n > 1:
                batch = pytree.tree_map(lambda t, axis=axis, n=n: self._piece(t, axis, n, dp), batch)
        return batch

    def _piece(self, t: Any, axis: str, n: int, dp: int) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % n:
            whole = "global batch" if axis == self.batch_axis or dp == 1 else "data-parallel piece of the batch"
            raise ValueError(f"the {whole} has {t.shape[0]} rows, which does not divide by {axis}={n}; use a "
                             f"global batch that is a multiple of {dp * self.ep}"
                             + (" (dp x ep)" if self.ep > 1 else ""))
        k = t.shape[0] // n
        idx = self.mesh.local_rank(axis)
        return t[idx * k:(idx + 1) * k]

    # --- training step ---------------------------------------------------------------------
    def step(self, batch: Sequence[Any], loss_fn: Callable, n_microbatches: int | None = None) -> torch.Tensor:
        """Forward and backward of one global batch `(inputs, targets)`; returns its loss.

        `inputs` is a tensor, a tuple of the model's positional inputs or a dict of its keyword
        inputs (as captured); `targets` (None when the model computes its own loss) goes to
        `loss_fn(output, targets)`. Gradients are left reduced (and sharded, under ZeRO) for
        the optimizer's `step()`.
        """
        _check_pair(batch, "model.step")
        m = n_microbatches or self.n_microbatches
        if m < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {m}")
        C.set_active_mesh(self.mesh)
        inputs, targets = self.local_batch(tuple(batch))
        loss_fn = self.loss_on_outputs(loss_fn, batch[1], m)  # on the stage's outputs
        keyword = isinstance(inputs, Mapping)  # model(**inputs)
        if not keyword and not isinstance(inputs, (tuple, list)):
            inputs = (inputs,)
        self.steps_run += 1
        with where(f"step {self.steps_run}"), self.rng.fork(self.training):
            if self.pp > 1:
                flat = self._flat_inputs((), inputs) if keyword else self._flat_inputs(inputs, {})
                loss, averaged = self._run_schedule(flat, targets, loss_fn, m), ()
            else:
                loss, averaged = self._run_micro_batches(inputs, keyword, targets, loss_fn, m)
        for axis in self.batch_axes:
            if axis not in averaged and self.mesh.size(axis) > 1:
                loss = loss.clone()
                C.COUNTER.record("metric_all_reduce", axis, loss.numel() * loss.element_size())
                issue("loss all_reduce", dist.all_reduce, loss, op=dist.ReduceOp.AVG, group=self.mesh.group(axis),
                      axis=axis)
        return loss

    def _run_micro_batches(self, inputs, keyword: bool, targets, loss_fn: Callable, m: int):
        """One stage: forward and backward of each micro-batch in turn, the engine's reductions
        on the last; the reported loss is averaged over dp while that backward runs (issued
        before any gradient bucket, so every rank sees the same collective order). Returns
        (loss, the axes it was averaged over)."""
        micro = _split((dict(inputs) if keyword else tuple(inputs), targets), m, "the local batch")
        total = loss_work = None
        for i, (mb_in, mb_tgt) in enumerate(micro):
            last = i == len(micro) - 1
            with where(f"micro-batch {i + 1}/{len(micro)} forward"):
                self._raw_outputs = True  # loss_fn (loss_on_outputs) takes the stage's outputs
                try:
                    out = self(**mb_in) if keyword else self(*mb_in)
                finally:
                    self._raw_outputs = False
                loss = check_loss(loss_fn(out, mb_tgt))
            scaled = loss / len(micro)
            total = scaled.detach() if total is None else total + scaled.detach()
            factor = loss_scale_factor(self.engine, loss)  # fp16: the scale on the fp32 loss (zero_optim)
            if factor != 1.0:
                scaled = scaled * factor
            if last and self.dp > 1:
                total = total.clone()
                C.COUNTER.record("metric_all_reduce", self.dp_axis, total.numel() * total.element_size())
                loss_work = issue("loss all_reduce", dist.all_reduce, total, op=dist.ReduceOp.AVG,
                                  group=self.mesh.group(self.dp_axis), async_op=True, axis=self.dp_axis)
            with where(f"micro-batch {i + 1}/{len(micro)} backward"):
                if last:
                    scaled.backward()
                else:
                    with self.engine.no_sync():
                        scaled.backward()
        with where("gradient reduction"):
            self.engine.finish_backward()
            if loss_work is not None:
                loss_work.wait()
        return total, (self.dp_axis,) if loss_work is not None else ()

    def _run_schedule(self, flat: list, targets, loss_fn: Callable, m: int) -> torch.Tensor:
        """Several stages: the pipeline schedule over `m` micro-batches; the mean loss on every pp rank."""
        ex = self._executor(m)
        ex.loss_fn = loss_fn  # loss_on_outputs: on the last stage's flat outputs
        try:
            mbs = _split(tuple(flat), m, "the local batch's input") if 0 in ex.modules else None
            tgts = _split(targets, m, "the local batch's target") if self.n_stages - 1 in ex.modules else None
            return ex.step(mbs, tgts)
        finally:
            ex.loss_fn = _no_loss

    # --- inference -----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any):
        """The model's output for these inputs. With several stages they run in order (no
        autograd across stages) and every pp rank returns the output."""
        C.set_active_mesh(self.mesh)
        if self.pp == 1:
            flat = self._flat_inputs(args, kwargs)
            with self.rng.fork(self.training):  # dropout / batch norm follow pm.train() / pm.eval()
                out = self.stages["0"](*flat)
            return out if self._raw_outputs else self._unflatten(self.gather_vocab(out))
        with torch.no_grad():
            out = self._forward_stages(args, kwargs)
            return out if self._raw_outputs else self._unflatten(self.gather_vocab(out))

    def gather_vocab(self, out):
        """The stage's flat outputs with vocab-sharded logits (`vocab_shard`) gathered over their
        axis; under autograd the logits' shard gets this rank's chunk of the gradient."""
        info = self.vocab_shard
        if info is None:
            return out
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        i = info["output"]
        outs[i] = torch.ops.autopar.all_gather_chunk_grad(outs[i], info["axis"], info["dim"], info["size"])
        return outs[0] if isinstance(out, torch.Tensor) else type(out)(outs) if isinstance(out, tuple) else outs

    def loss_on_outputs(self, loss_fn: Callable, global_targets: Any, m: int) -> Callable:
        """`f(stage outputs, targets)`: the loss of one micro-batch from the last stage's flat
        outputs. `autopar.cross_entropy` (or a partial of it) on vocab-sharded logits: the
        vocab-parallel loss on this rank's shard, scaled to one process's mean over the global
        batch (`vocab_loss.global_scale`: `global_targets`, `m` micro-batches); any other loss:
        `loss_fn` on the gathered, unflattened outputs (as without `Plan.loss_parallel`)."""
        spec, info = vocab_loss.parallel_spec(loss_fn), self.vocab_shard
        if info is None or spec is None:
            return lambda out, tgt: loss_fn(self._unflatten(self.gather_vocab(out)), tgt)
        if not isinstance(global_targets, torch.Tensor):
            raise ValueError(f"autopar.cross_entropy takes targets as one tensor of class indices, got "
                             f"{type(global_targets).__name__}")
        vocab_loss.check_targets(global_targets, info["size"], spec.ignore_index)
        scale = vocab_loss.global_scale(global_targets, spec.ignore_index, m * self.dp * self.ep)

        def f(out, tgt):
            flat = [out] if isinstance(out, torch.Tensor) else list(out)
            z = vocab_loss.select_logits(self._unflatten(out), spec.output)
            if z is not flat[info["output"]]:
                raise ValueError(f"output={spec.output!r} does not name the model's logits (flat output "
                                 f"{info['output']}, vocabulary-sharded over {info['axis']}); name the logits")
            return vocab_loss.vocab_parallel_cross_entropy(z, tgt, info["axis"], info["size"], scale=scale,
                                                           ignore_index=spec.ignore_index,
                                                           label_smoothing=spec.label_smoothing)
        return f

    def _forward_stages(self, args, kwargs) -> list:
        me, place = self.pp_rank, self.stage_to_rank
        vals: list | None = self._flat_inputs(args, kwargs) if place[0] == me else None
        for s in range(self.n_stages):
            r = place[s]
            if s > 0 and place[s - 1] != r:
                if me == place[s - 1]:
                    stage_transport.send(self.mesh, self.pp_axis, vals, r)
                    vals = None
                elif me == r:
                    vals = stage_transport.recv(self.mesh, self.pp_axis, place[s - 1])
            if r == me:
                with self.rng.fork(self.training):
                    out = self.stages[str(s)](*vals)
                vals = [out] if isinstance(out, torch.Tensor) else list(out)
        last = place[-1]
        return stage_transport.broadcast(self.mesh, self.pp_axis, vals if me == last else None, last)

    @torch.no_grad()
    def evaluate(self, batch: Sequence[Any], loss_fn: Callable) -> torch.Tensor:
        """The loss of one global batch `(inputs, targets)` without gradients, in the
        program's mode (`pm.eval()` first for evaluation), on every rank, averaged over the
        axes that split the batch as `step` does."""
        return evaluate(self, batch, loss_fn, *self.batch_axes)


def evaluate(program: nn.Module, batch: Sequence[Any], loss_fn: Callable, *axes: str | None) -> torch.Tensor:
    """`loss_fn(program(this rank's inputs), its targets)` under no_grad, averaged over `axes`
    (the axes that split the batch)."""
    _check_pair(batch, "evaluate")
    inputs, targets = program.local_batch(tuple(batch))
    raw = isinstance(program, Program)  # its outputs as they leave the stage: loss_on_outputs takes them
    if raw:
        loss_fn = program.loss_on_outputs(loss_fn, batch[1], 1)
    with torch.no_grad():
        if raw:
            program._raw_outputs = True
        try:
            if isinstance(inputs, Mapping):
                out = program(**inputs)
            else:
                out = program(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
        finally:
            if raw:
                program._raw_outputs = False
        loss = loss_fn(out, targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                         + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
    loss = loss.detach().clone()
    for axis in axes:
        if axis and program.mesh.size(axis) > 1:
            C.COUNTER.record("metric_all_reduce", axis, loss.numel() * loss.element_size())
            issue("loss all_reduce", dist.all_reduce, loss, op=dist.ReduceOp.AVG,
                  group=program.mesh.group(axis), axis=axis)
    return loss


def data_axis(mesh: Mesh, batch_axis: str | None, cp_axis: str | None) -> str | None:
    """The axis over which ranks hold the same parameters and different data: the batch's
    axis, joined with the context-parallel one when there is one ("dp+cp")."""
    axes = [a for a in mesh.axis_names if a in (batch_axis, cp_axis)]
    return "+".join(axes) if len(axes) > 1 else batch_axis or cp_axis


def check_loss(loss: Any) -> torch.Tensor:
    """`loss` if it is what backward needs (a floating-point scalar tensor that requires
    grad), else a ValueError saying what loss_fn returned and what to return instead."""
    if not isinstance(loss, torch.Tensor):
        hint = " (a transformers output: return out.loss or out[\"loss\"])" if hasattr(loss, "keys") else ""
        raise ValueError(f"loss_fn returned a {type(loss).__name__}, not a tensor; return the loss as a scalar "
                         f"tensor computed from the model's output{hint}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar, got a tensor of shape {tuple(loss.shape)}; reduce it "
                         "(e.g. loss.mean(), or reduction=\"mean\" in the loss function)")
    if not (loss.is_floating_point() or loss.is_complex()):
        raise ValueError(f"loss_fn returned a {str(loss.dtype).replace('torch.', '')} tensor; a loss must be "
                         "floating point to have gradients")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad (detached, made from .item() or "
                         "under torch.no_grad()), so backward cannot reach the model; compute it from the model's "
                         "output without detaching")
    return loss


def _check_pair(batch: Any, what: str) -> None:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"{what} takes batch=(inputs, targets): inputs a tensor or tuple of the model's inputs, "
                         f"targets what loss_fn needs; got {type(batch).__name__}"
                         + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))


def _no_loss(out, target):
    raise RuntimeError("internal: the pipeline ran without a loss_fn")


def _split(x: Any, m: int, what: str) -> list:
    """`x` (a tensor or a pytree of tensors) as m equal micro-batches along dim 0."""
    leaves, spec = pytree.tree_flatten(x)
    if m == 1:
        return [x]
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] % m:
            raise ValueError(f"{what} has {t.shape[0]} rows, which does not divide into {m} micro-batches; "
                             f"use a global batch of dp x {m} x k rows")
    chunks = [t.chunk(m) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * m for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(m)]
