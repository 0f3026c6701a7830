"""`autopar verify`: run a plan on small shapes on a local CPU world and compare it with one
process.

Both sides start from the same seed and weights and train on the same batches with AdamW
(lr 1e-2): the plan on `plan.world_size` gloo processes (forked, `runtime.launch.run_world`)
through `autopar.parallelize(..., plan=plan)`, the reference as the plain module on one
process. Compared: the loss of every step (absolute tolerance LOSS_ATOL plus LOSS_RTOL of the
reference) and every parameter after the last step (PARAM_TOL, absolute), as
`autopar.export_state_dict` returns them: whole (tensor- and expert-parallel shards joined,
pipeline stages gathered) under every name of the original model (tied names too).

Tolerances: sharded sums change the order of additions, and AdamW (m / sqrt(v)) turns last-bit
differences of near-zero gradient entries into lr-sized steps, so fp32 parameters differ by a
measured floor that one process shows alone (PARAM_TOL's comment). Deliberate bugs in the
default tp=2 run moved them by far more: the backward all-reduce skipped 6.0e-2, its gradient
rounded to bf16 first 2.6e-2 (with every loss still within tolerance).

Reads and writes no node.meta keys. Guarantees: `ok` is True only when every loss and every
parameter of every rank is within tolerance; a parameter no rank holds is a failure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.passes.plan import Plan

LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-4
# fp32 parameter floor, measured (2026-11-26, torch 2.13 CPU, AVX-512) on one process for the
# default run (a 2-layer transformers Llama, hidden 64, batch 4, seq 16, 3 AdamW steps at LR):
# every Linear's contraction summed in 2 halves (tp=2's order) 1.33e-4 from the plain run, the
# batch split in 2 (dp=2's) 2.9e-6, fp64 vs fp32 8.3e-5; a tp=2 plan 1.12e-4 (the same Llama
# under dp2 x tp2 in fp64: logits 3.9e-16 from one process). About 4x the floor: 1e-4 failed a
# correct tp=2 plan on this CPU.
PARAM_TOL = 5e-4
LR = 1e-2
MAX_PARAMS = 2e8  # beyond this a CPU world of several copies is not a quick check


@dataclass
class VerifyResult:
    model: str
    mesh: dict[str, int]
    batch: int
    seq: int | None
    steps: int
    losses: list[float]
    ref_losses: list[float]
    worst_param: tuple[str, float]  # (name, max |parallel - reference|)
    missing: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def loss_ok(self) -> bool:
        return all(abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b) for a, b in zip(self.losses, self.ref_losses))

    @property
    def ok(self) -> bool:
        return self.loss_ok and not self.missing and self.worst_param[1] <= PARAM_TOL

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "mesh": self.mesh, "batch": self.batch, "seq": self.seq, "steps": self.steps,
                "losses": self.losses, "reference_losses": self.ref_losses,
                "worst_parameter": {"name": self.worst_param[0], "max_abs_diff": self.worst_param[1]},
                "missing_parameters": self.missing, "loss_ok": self.loss_ok, "ok": self.ok,
                "tolerances": {"loss_atol": LOSS_ATOL, "loss_rtol": LOSS_RTOL, "param": PARAM_TOL}}


def small_batch(plan: Plan, wanted: int | None) -> int:
    """A small global batch the plan can split: a multiple of dp x micro-batches, at least 4."""
    k = plan.dp * plan.n_microbatches
    if wanted is not None:
        if wanted % k:
            raise ValueError(f"--batch {wanted} does not divide by dp x micro-batches = {plan.dp} x "
                             f"{plan.n_microbatches}; use a multiple of {k}")
        return wanted
    return k * max(1, math.ceil(4 / k))


def _rank(rank: int, ws: int, model_text: str, plan_json: str, batch: int, seq: int | None, steps: int,
          weights: str | None = None):
    import autopar
    from autopar.tools.model_source import resolve

    src = resolve(model_text)
    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    with torch.device("meta" if weights else "cpu"):  # from weights: each rank reads only its slices
        model = src.build()
    x0, _ = src.example_batch(batch, seq_len=seq, generator=torch.Generator().manual_seed(1))
    # a CPU world by design, also where a GPU is visible (the ranks are forked: no CUDA in them)
    pm = autopar.parallelize(model, autopar.mesh(**plan.mesh, device_type="cpu"), example_inputs=x0, plan=plan,
                             weights=weights)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = src.example_batch(batch, seq_len=seq, generator=g)
        losses.append(pm.step((x, y), src.loss_fn).item())
        opt.step()
        opt.zero_grad()
    # every name of the original model, whole (tp / ep shards joined, pp stages gathered, tied names
    # repeated) on rank 0
    return losses, autopar.export_state_dict(pm, like=model)


def _reference(model_text: str, batch: int, seq: int | None, steps: int, weights: str | None = None):
    from autopar.tools.model_source import resolve

    src = resolve(model_text)
    torch.manual_seed(0)
    model = src.build()
    if weights:
        from autopar.build.materialize import load_into  # noqa: PLC0415

        load_into(model, weights)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = src.example_batch(batch, seq_len=seq, generator=g)
        loss = src.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def verify(model_text: str, plan: Plan, *, batch: int | None = None, seq: int | None = None, steps: int = 3,
           max_procs: int = 8, weights: str | None = None) -> VerifyResult:
    """Run `plan` against one process (see the module docstring)."""
    import time

    from autopar.tools.model_source import resolve
    from autopar.runtime.launch import run_world

    src = resolve(model_text)
    ws = plan.world_size
    if ws > max_procs:
        raise ValueError(f"the plan's mesh {plan.mesh} has {ws} ranks; verify runs one CPU process per rank and "
                         f"stops at --max-procs {max_procs}. Verify the same plan shape on a smaller mesh "
                         "(autopar plan --mesh ... with fewer ranks), or raise --max-procs")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in src.build().parameters())
    if n_params > MAX_PARAMS:
        raise ValueError(f"{src.name} has {n_params / 1e9:.1f} B parameters: too large for a parity run on CPU "
                         f"processes. Verify a plan made the same way for a small config of the architecture "
                         "(e.g. gpt-tiny, or a transformers config with fewer layers and a smaller width)")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    batch = small_batch(plan, batch)
    seq = seq if seq is not None else (min(src.default_seq, 16) if src.default_seq else None)
    from autopar import parallelize  # noqa: F401 - autopar's public names load on first use: here, not in each rank
    t0 = time.perf_counter()
    results = run_world(ws, _rank, model_text, plan.to_json(), batch, seq, steps, weights)
    ref_losses, ref_params = _reference(model_text, batch, seq, steps, weights)
    full = results[0][1]
    worst, missing = ("", 0.0), []
    for name, ref in ref_params.items():
        got = full.get(name)
        if got is None:
            missing.append(name)
            continue
        if got.shape != ref.shape:
            missing.append(f"{name} (shape {tuple(got.shape)} vs {tuple(ref.shape)})")
            continue
        d = float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0
        if d > worst[1] or not worst[0]:
            worst = (name, d)
    return VerifyResult(src.name, dict(plan.mesh), batch, seq, steps, results[0][0], ref_losses, worst, missing,
                        time.perf_counter() - t0)
