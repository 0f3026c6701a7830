"""What a micro-batch of a pipeline stage holds while its backward is split in two (`I`, `W`).

Under the zero-bubble schedules (ZB-H1, ZBV) `runtime.pipeline_split` runs a stage's backward
as `I` (`autograd.grad` of the outputs w.r.t. the stage inputs, `retain_graph=True`) and,
later, `W` (autograd restarted from the gradients `I` captured at the frontier nodes, towards
the parameters, `retain_graph=True` again); the micro-batch is dropped after its `W`. So,
unlike a full backward (`memory.liveness`), nothing saved for backward is freed before `W`
ends, and the gradient arriving at every node that reads a trainable parameter stays alive
from the moment `I` computes it until `W`.

`split_backward(g, values, ...)` walks a stage graph's backward the way `I` runs it:

  i_rise    the most bytes the running micro-batch's `I` adds above its forward end (`held`):
            the loss's saved tensor and its backward temporaries on the last stage, the
            gradients of the input chain alive at once, the captured ones so far, the insides of
            a composite op's backward (`COMPOSITE_BACKWARD_TEMPS`: rms_norm on a CPU); no
            parameter gradient is made (autograd prunes the branches that reach only parameters)
  pending   what stays from `I` until `W` above the forward end: the gradients captured at
            the frontier nodes (a node on the input path that reads a trainable parameter,
            itself or through parameter-only nodes), the output gradients (`WeightGradState.
            grads`, the received buffers), the input gradients sent to the previous stage (its
            send holds them until it is waited, `runtime.pipeline`); the last stage's loss keeps
            its saved tensor in the place of the outputs the executor drops (counted in `held`)
  w_rise    the most `W` adds above held + pending: one weight-gradient temporary (an
            elementwise weight's gradient is `(grad * x).sum()`, a temporary of the node's
            output; a matmul's is the parameter's own size); the gradients themselves, made by
            the stage's first `W`, are the walk's (`cost.schedule.walk_peaks`)

A stage whose inputs need no gradient (stage 0) runs its whole backward in `W` (as torch's
`stage_backward_input` does): its terms are a full backward's, not these (the callers give it
`None`). `forward_peak` is the most a micro-batch holds during its F (the walk's forward part).
`received_grad_bytes` is the gradient a stage before the last receives for its outputs
(the receive buffer the runtime posts one action ahead, `cost.schedule.walk_peaks`).

Reads no node.meta (a GraphCost only). Deterministic; the stage graph is not changed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .graph import GraphCost
from .memory import GRAD_PASSTHROUGH, GradBuffers, LossModel, liveness, loss_output_bytes
from .ops import packet_name
from .symbolic import evaluate

__all__ = ["SplitBackward", "forward_peak", "received_grad_bytes", "split_backward"]

# weight gradients that are a product of two activations' views (no temporary beyond the
# gradient itself); every other op's weight gradient reduces a temporary of its output's size
MATMUL_LIKE = {"aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.baddbmm", "aten.embedding",
               "aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten._grouped_mm"}


# the insides of a composite op's backward that matter once nothing is freed: autograd runs
# rms_norm as pow, mean, rsqrt and two muls on a CPU, and its PowBackward holds two temporaries of
# the input's size next to the input gradient (measured: the peak of gpt-tiny's I, ZB-H1 and ZBV,
# is in that PowBackward, tests/dist/test_pipeline_memory_truth.py); multiples of the output bytes
COMPOSITE_BACKWARD_TEMPS = {"aten.rms_norm": 2.0}


@dataclass(frozen=True)
class SplitBackward:
    """A stage's split-backward terms (bytes, see the module docstring)."""

    i_rise: float
    pending: float
    w_rise: float

    def scaled(self, k: float) -> "SplitBackward":
        return SplitBackward(self.i_rise * k, self.pending * k, self.w_rise * k)


class _InputGradBuffers(GradBuffers):
    """`GradBuffers` for `I`: no parameter gradient, no gradient towards parameter-only nodes,
    and the output gradients of the frontier nodes kept (captured for `W`)."""

    def __init__(self, g: GraphCost, ev, to_in: set, frontier: set):
        super().__init__(g, ev, None, grads_preallocated=False)
        self.to_in, self.frontier = to_in, frontier
        self._key_of: dict[int, Any] = {}
        self.kept: list[int] = []  # buffers captured for W: the frontier's and the seeds

    def seed(self, outputs) -> None:
        n = len(self._buf)
        super().seed(outputs)
        self.kept.extend(range(n + 1, len(self._buf) + 1))  # the received output gradients: WeightGradState.grads

    def bytes_of(self, buffers: set[int]) -> float:
        return float(sum(self._buf[b] for b in buffers))

    def buffers_of(self, keys: set) -> set[int]:
        """The gradient buffers of the tensors stored in `keys` (the stage inputs' gradients)."""
        return {b for t_id, b in self._grads.items() if self._key_of.get(t_id) in keys}

    def backward(self, n, observe) -> None:
        out_b = [self._grads.pop(id(t)) for t in n.outputs if id(t) in self._grads]
        if not out_b:
            return
        through = n.kind == "view" or packet_name(n.op) in GRAD_PASSTHROUGH
        out_numel = n.outputs[0].numel if n.outputs else None
        transient = 0.0
        for i, t in enumerate(n.grad_inputs):
            if t.is_state or t.key in self._state_bytes or t.key not in self.to_in:
                continue  # a parameter's branch: W's
            transient += self.route(n, i, t, out_b, through, out_numel)
            self._key_of[id(t)] = t.key
        k = COMPOSITE_BACKWARD_TEMPS.get(packet_name(n.op), 0.0)
        if k:
            transient += k * sum(self.ev(t.nbytes, t.key) for t in n.outputs)
        observe(transient)
        if n.index in self.frontier:  # captured by the prehook: alive until W
            self.kept.extend(out_b)
        else:
            for b in out_b:
                self._unref(b)


def split_backward(g: GraphCost, values: Mapping, *, param_grad_bytes: Mapping[Any, float] | None = None,
                   storage_divisor: Mapping[Any, int] | None = None, loss: LossModel) -> SplitBackward:
    """The `I` / `W` terms of stage graph `g` (see the module docstring). `loss`: the stage's
    `memory.LossModel` (the last stage's loss, `HELD_OUTPUTS` before it); `param_grad_bytes`:
    a parameter's gradient bytes on this rank (default: its full bytes)."""
    div = storage_divisor or {}

    def ev(x, key=None):
        v = evaluate(x, values)
        return v / div.get(key, 1) if key in div else v

    st = g.storages
    trainable = {p.key for p in g.params if p.requires_grad and not p.is_buffer and p.key is not None}
    # storages that depend on a stage input that gets a gradient (the received activations)
    to_in: set = {k for k, s in st.items() if s.producer < 0 and not s.is_state}
    rg_in = set()
    for n in g.nodes:
        for t in n.grad_inputs:
            if t.key in to_in:
                rg_in.add(t.key)
    to_in = set(rg_in)
    par_only: set = set()  # storages computed from trainable parameters alone (a transposed weight)
    frontier: set = set()
    for n in g.nodes:
        reads_in = any(t.key in to_in for t in n.grad_inputs)
        reads_par = any(t.key in trainable or t.key in par_only for t in n.grad_inputs)
        keys = [t.key for t in n.outputs]
        if reads_in:
            to_in.update(keys)
            to_in.update(n.new_storages)
            if reads_par:
                frontier.add(n.index)
        elif reads_par and n.has_grad_fn:
            par_only.update(keys)
    loss_out = loss_output_bytes(g, ev)
    with_loss = loss.saved or loss.grad_temp
    gb = _InputGradBuffers(g, ev, to_in, frontier)
    gb.seed(g.outputs)
    peak = gb.live + (loss.saved + loss.grad_temp) * loss_out if with_loss else gb.live

    def observe(transient: float) -> None:
        nonlocal peak
        peak = max(peak, loss.saved * loss_out + gb.live + transient)

    for n in reversed(g.nodes):
        if n.has_grad_fn:
            gb.backward(n, observe)
    # the executor keeps only the loss of the last stage, not its outputs: the loss's saved tensor
    # (log-softmax's output) stands in the outputs' place in `held`
    outputs = sum(ev(t.nbytes, t.key) for t in g.outputs if not t.is_state)
    # the input gradients I sends stay referenced by the send until the previous stage has
    # received them (`runtime.pipeline` waits its sends): counted until the micro-batch's W
    pending = max(0.0, loss.saved * loss_out - outputs) + gb.bytes_of(set(gb.kept) | gb.buffers_of(rg_in))
    w_rise = 0.0
    pg = param_grad_bytes or {}
    for n in g.nodes:
        if n.index not in frontier:
            continue
        grads = sum(pg.get(t.key, ev(st[t.key].nbytes)) for t in n.grad_inputs
                    if t.key in trainable and t.key in st)
        temp = 0.0 if packet_name(n.op) in MATMUL_LIKE else sum(ev(t.nbytes, t.key) for t in n.outputs)
        w_rise = max(w_rise, grads + temp)
    return SplitBackward(i_rise=float(max(peak, pending)), pending=float(pending), w_rise=float(w_rise))


def received_grad_bytes(g: GraphCost, values: Mapping, storage_divisor: Mapping[Any, int] | None = None) -> float:
    """Bytes of the gradients a stage before the last receives for its outputs (those that
    require grad), tp-local: the receive buffer its B or I consumes."""
    div = storage_divisor or {}
    return float(sum(evaluate(t.nbytes, values) / div.get(t.key, 1) for t in g.outputs if t.rg and not t.is_state))


def forward_peak(g: GraphCost, values: Mapping, *, storage_divisor: Mapping[Any, int] | None = None,
                 loss: LossModel, trace: list | None = None) -> float:
    """The most bytes a micro-batch of stage graph `g` holds during its forward (its F: the
    inputs, what each node makes and keeps, the loss's saved tensor on the last stage), without
    parameter gradients: the points of `memory.liveness`'s walk up to the loss. `trace`: the
    trace of a `liveness` walk of `g` with these values and loss already made (no second walk)."""
    if trace is None:
        trace = []
        liveness(g, values, storage_divisor=storage_divisor, loss=loss, trace=trace)
    return float(max(x[0] for x in trace[:len(g.nodes) + 2]))
