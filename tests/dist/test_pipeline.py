"""The pipeline executor trains exactly like one process: every schedule, 2 and 4 stages per
world, pp x dp, tied embeddings; and the zero-bubble I/W split equals a full backward.

A small Llama-style GPT is split by hand into stage modules (token embedding on stage 0, norm
and head on the last; between stages flow the hidden states (float, needs grad) and the
positions (int64, no grad): a tuple). Every rank builds the same model from the same seed,
runs the single-process reference itself, and compares its own stages: loss per step, the
gradients of the first step, and the parameters after 3 AdamW steps, with fp32 tolerances
(rtol 1.3e-6, atol 1e-5: torch.testing.assert_close's fp32 defaults, stated explicitly).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import world
from autopar import models
from autopar.models.gpt import GPT, loss_fn
from autopar.runtime import schedules as sch
from autopar.runtime.collectives import COUNTER, set_active_mesh
from autopar.runtime.mesh import make_mesh
from autopar.runtime.pipeline import PipelineExecutor, backward_input, backward_weight, split_microbatches
from autopar.runtime.zero import make_engine

TOL = dict(rtol=1.3e-6, atol=1e-5)
MB, T, STEPS = 2, 8, 3
# AdamW divides each element by its own gradient size: with the default eps=1e-8 an element whose
# gradient is at rounding level (~1e-9, summed in another order over micro-batches) turns that
# noise into lr-sized parameter differences. eps=1e-6 keeps such elements' updates proportional.
ADAMW = dict(lr=1e-3, eps=1e-6)


class GPTStage(nn.Module):
    """A contiguous run of a GPT: optional embedding, some blocks, optional norm + head."""

    def __init__(self, model: GPT, first: bool, layers: list[int], last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.names: dict[str, str] = {}  # local parameter name -> name in the full model
        if first:
            self.tok_emb = copy.deepcopy(model.tok_emb)
            self.names["tok_emb.weight"] = "tok_emb.weight"
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in layers)
        for j, i in enumerate(layers):
            for n, _ in model.layers[i].named_parameters():
                self.names[f"layers.{j}.{n}"] = f"layers.{i}.{n}"
        if last:
            self.norm = copy.deepcopy(model.norm)
            self.lm_head = copy.deepcopy(model.lm_head)
            self.names["norm.weight"] = "norm.weight"
            self.names["lm_head.weight"] = "lm_head.weight"
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None):
        if self.first:
            B, Tn = x.shape
            pos = torch.arange(Tn).repeat(B, 1)  # (B, T) int64, travels with the activations
            x = self.tok_emb(x)  # (B, T, C)
        cos, sin = self.rope_cos[pos[0]], self.rope_sin[pos[0]]  # (T, hd)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.last:
            return self.lm_head(self.norm(x))  # (B, T, V)
        return x, pos


def split_gpt(model: GPT, n_stages: int) -> list[GPTStage]:
    """Pieces [embedding, block 0 .. block L-1, head] dealt out evenly, in order."""
    pieces = ["emb"] + list(range(model.config.n_layers)) + ["head"]
    if n_stages > len(pieces):
        raise ValueError(f"{n_stages} stages need at least {n_stages - 2} layers")
    q, r = divmod(len(pieces), n_stages)
    out, k = [], 0
    for s in range(n_stages):
        n = q + (1 if s < r else 0)
        chunk = pieces[k:k + n]
        k += n
        out.append(GPTStage(model, "emb" in chunk, [c for c in chunk if isinstance(c, int)], "head" in chunk))
    return out


def make_model(n_layers: int, tie: bool = False) -> GPT:
    """The registry's gpt-tiny (gpt-tiny-tied), with more layers where 8 stages need them."""
    spec = models.get("gpt-tiny-tied" if tie else "gpt-tiny")
    torch.manual_seed(0)
    if n_layers == spec.config.n_layers:
        return spec.build()
    return GPT(dataclasses.replace(spec.config, n_layers=n_layers))


def make_data(n: int, vocab: int, seed: int = 1):
    (idx,), tgt = models.get("gpt-tiny").example_batch(n, seq_len=T, generator=torch.Generator().manual_seed(seed))
    assert idx.max() < vocab
    return idx, tgt


def reference(model: GPT, idx, tgt, steps: int = STEPS):
    """Single process: losses per step, grads of step 1, params after `steps` AdamW steps."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, grads0 = [], None
    for k in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(idx), tgt)
        loss.backward()
        losses.append(loss.item())
        if k == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, grads0, params


def run_pipeline(schedule, stages, mesh, idx, tgt, engines=None, tied=(), steps: int = STEPS):
    pp = mesh.coords(dist.get_rank())["pp"]
    mine = {s: stages[s] for s in schedule.stages_of(pp)}
    ex = PipelineExecutor(mine, schedule, mesh, loss_fn, engines=engines, tied=tied)
    params = [p for m in mine.values() for p in m.parameters()]
    if engines:
        opts = [engines[s].make_optimizer(torch.optim.AdamW, **ADAMW) for s in sorted(mine)]
    else:
        opts = [torch.optim.AdamW(params, **ADAMW)]
    M = schedule.n_microbatches
    mbs, tgts = split_microbatches(idx, M), split_microbatches(tgt, M)
    losses, grads0 = [], None
    for k in range(steps):
        for o in opts:
            o.zero_grad()
        losses.append(ex.step(mbs if 0 in mine else None, tgts if schedule.n_stages - 1 in mine else None).item())
        if k == 0:
            grads0 = {(s, n): p.grad.clone() for s, m in mine.items() for n, p in m.named_parameters()}
        for o in opts:
            o.step()
    return mine, losses, grads0


def check_against_reference(mine, losses, grads0, ref, what: str):
    ref_losses, ref_grads, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL,
                               msg=lambda m: f"{what}: losses differ: {m}")
    for s, mod in mine.items():
        for n, p in mod.named_parameters():
            g = mod.names[n]
            torch.testing.assert_close(grads0[(s, n)], ref_grads[g], **TOL,
                                       msg=lambda m: f"{what}: grad of stage {s} {n} ({g}): {m}")
            torch.testing.assert_close(p.detach(), ref_params[g], **TOL,
                                       msg=lambda m: f"{what}: param of stage {s} {n} ({g}) after {STEPS} steps: {m}")


def _every_schedule_matches(rank, ws, specs, n_layers):
    mesh = make_mesh(pp=ws)
    model = make_model(n_layers)
    checked = []
    for name, m, v in specs:
        schedule = sch.make_schedule(name, ws, m, v)
        idx, tgt = make_data(m * MB, model.config.vocab_size)
        ref = reference(model, idx, tgt)
        stages = split_gpt(model, schedule.n_stages)
        COUNTER.reset()
        mine, losses, grads0 = run_pipeline(schedule, stages, mesh, idx, tgt)
        check_against_reference(mine, losses, grads0, ref, f"{schedule.name} m={m} pp rank {rank}")
        # what crossed ranks: hidden (MB, T, C) fp32 + positions (MB, T) int64 forward, the hidden's
        # gradient backward; hand-overs between stages on the same rank send nothing
        act, grad = MB * T * model.config.dim * 4, MB * T * model.config.dim * 4
        s2r = schedule.stage_to_rank
        sends = [(act, MB * T * 8) if a.kind is sch.Kind.F else (grad,) for a in schedule.actions[rank]
                 if (a.kind is sch.Kind.F and a.stage + 1 < len(s2r) and s2r[a.stage + 1] != rank)
                 or (a.kind in (sch.Kind.B, sch.Kind.I) and a.stage > 0 and s2r[a.stage - 1] != rank)]
        assert COUNTER.calls[("send", "pp")] == STEPS * sum(len(x) for x in sends)
        assert COUNTER.bytes[("send", "pp")] == STEPS * sum(sum(x) for x in sends)
        checked.append((schedule.name, schedule.n_stages, m, sorted(mine), round(losses[-1], 5),
                        COUNTER.bytes[("send", "pp")], COUNTER.bytes[("recv", "pp")]))
    return checked


SPECS_2 = [("gpipe", 4, None), ("1f1b", 6, None), ("interleaved_1f1b", 4, 2), ("zb_h1", 8, None), ("zbv", 4, None)]
SPECS_4 = [("gpipe", 4, None), ("1f1b", 8, None), ("interleaved_1f1b", 8, 2), ("zb_h1", 6, None), ("zbv", 8, None)]


def test_two_ranks_match_single_process_for_gpipe_1f1b_interleaved_zbh1_and_zbv():
    out = world(2, _every_schedule_matches, SPECS_2, 2)
    assert [o[0] for o in out[0]] == ["GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBV"]
    assert [o[1] for o in out[0]] == [2, 2, 4, 2, 4]
    assert out[0][2][3] == [0, 2] and out[1][4][3] == [1, 2]  # interleaved: s % p; ZBV: the V
    assert [o[4] for o in out[0]] == [o[4] for o in out[1]]  # every rank got the same loss
    for k in range(len(SPECS_2)):  # every byte sent was received
        assert sum(o[k][5] for o in out) == sum(o[k][6] for o in out) > 0


def test_four_ranks_match_single_process_for_every_schedule_with_up_to_eight_stages():
    out = world(4, _every_schedule_matches, SPECS_4, 6)
    assert [o[1] for o in out[0]] == [4, 4, 8, 4, 8]
    for k in range(len(SPECS_4)):
        assert sum(o[k][5] for o in out) == sum(o[k][6] for o in out) > 0


def _pp2_dp2(rank, ws, cases):
    mesh = make_mesh(pp=2, dp=2)
    set_active_mesh(mesh)  # the dp engines' collectives name the "dp" axis of the active mesh
    c = mesh.coords(rank)
    model = make_model(2)
    done = []
    for zero, name in cases:
        m = 4
        schedule = sch.make_schedule(name, 2, m)
        idx, tgt = make_data(2 * m * MB, model.config.vocab_size)
        ref_losses, ref_grads, ref_params = reference(model, idx, tgt)
        half = slice(c["dp"] * m * MB, (c["dp"] + 1) * m * MB)
        s = c["pp"]
        stage = split_gpt(model, 2)[s]
        engine = make_engine(stage, mesh, "dp", stage=zero)
        ex = PipelineExecutor(stage, schedule, mesh, loss_fn, engines={s: engine})
        opt = engine.make_optimizer(torch.optim.AdamW, **ADAMW)
        mbs, tgts = split_microbatches(idx[half], m), split_microbatches(tgt[half], m)
        losses = []
        for k in range(STEPS):
            opt.zero_grad()
            losses.append(ex.step(mbs if s == 0 else None, tgts if s == 1 else None).item())
            if k == 0 and zero == 0:  # full, dp-averaged gradients live on the parameters
                for n, p in stage.named_parameters():
                    torch.testing.assert_close(p.grad, ref_grads[stage.names[n]], **TOL,
                                               msg=lambda msg: f"zero {zero} {name}: grad of {n}: {msg}")
            opt.step()
        # the loss is the dp rank's own mean; the full-batch mean is their average
        lt = torch.tensor(losses)
        dist.all_reduce(lt, group=mesh.group("dp"))
        torch.testing.assert_close(lt / 2, torch.tensor(ref_losses), **TOL)
        full = engine.gather_full_state_dict()  # stages 1-3 shard what the optimizer holds
        for n, _ in stage.named_parameters():
            torch.testing.assert_close(full[n].float(), ref_params[stage.names[n]], **TOL,
                                       msg=lambda msg: f"zero {zero} {name}: {n} after {STEPS} steps: {msg}")
        engine.remove()
        done.append((zero, name))
    return done


PP_DP_CASES = [(0, "1f1b"), (0, "zb_h1"), (1, "1f1b"), (2, "zb_h1"), (3, "1f1b"), (3, "zb_h1")]


def test_pp2_by_dp2_with_zero_stages_0_to_3_matches_single_process():
    assert world(4, _pp2_dp2, PP_DP_CASES) == [PP_DP_CASES] * 4


def _tied(rank, ws):
    model = make_model(2, tie=True)
    assert model.lm_head.weight is model.tok_emb.weight
    mesh = make_mesh(pp=2)
    done = []
    for name in ("1f1b", "zbv"):  # tied across two ranks; tied within rank 0 (stages 0 and 3)
        schedule = sch.make_schedule(name, 2, 4)
        S = schedule.n_stages
        idx, tgt = make_data(4 * MB, model.config.vocab_size)
        ref = reference(model, idx, tgt)
        stages = split_gpt(model, S)
        with torch.no_grad():  # the head starts different: the executor must make it equal
            stages[S - 1].lm_head.weight.add_(1.0)
        tied = [((0, "tok_emb.weight"), (S - 1, "lm_head.weight"))]
        mine, losses, grads0 = run_pipeline(schedule, stages, mesh, idx, tgt, tied=tied)
        check_against_reference(mine, losses, grads0, ref, f"tied {name} rank {rank}")
        done.append((name, sorted(mine)))
    return done


def test_tied_embedding_and_head_on_different_stages_match_a_tied_single_process_model():
    out = world(2, _tied)
    assert out[0] == [("1f1b", [0]), ("zbv", [0, 3])]


# ---------------------------------------------------------------- one process: the I/W split
def _split_vs_full(f, params, x0, gy, watch: str | None = None):
    """Check I + W == full backward for y = f(x); return how often the node named `watch`
    ran during I and during W."""
    x = x0.clone().requires_grad_()
    f(x).backward(gy)
    ref_x, ref = x.grad.clone(), [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x = x0.clone().requires_grad_()
    y = f(x)
    calls = []
    if watch:
        nodes = [n for n in _walk(y.grad_fn) if type(n).__name__.startswith(watch)]
        assert len(nodes) == 1, nodes
        nodes[0].register_prehook(lambda gr: calls.append(1))
    (gx,), state = backward_input([y], [gy], [x], params)
    assert all(p.grad is None for p in params), "I must not touch parameter gradients"
    n_i = len(calls)
    torch.testing.assert_close(gx, ref_x, **TOL)
    backward_weight(state)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r, **TOL)
    return n_i, len(calls) - n_i


def test_input_then_weight_backward_equals_full_backward_and_w_skips_the_input_chain():
    stage = split_gpt(make_model(2), 3)[1]  # one block: no embedding, no head
    g = torch.Generator().manual_seed(3)
    x0, gy = torch.randn(2, T, 64, generator=g), torch.randn(2, T, 64, generator=g)
    pos = torch.arange(T).repeat(2, 1)
    # SiLU's backward lies on the input chain and touches no weight: I runs it, W must not
    n_i, n_w = _split_vs_full(lambda x: stage(x, pos)[0], list(stage.parameters()), x0, gy, "SiluBackward")
    assert (n_i, n_w) == (1, 0)


def test_a_weight_used_twice_in_one_stage_gets_its_gradient_counted_once():
    stage = split_gpt(make_model(2), 3)[1]
    shared = nn.Linear(64, 64)  # used at both ends: its two uses are done in one pinned W call
    g = torch.Generator().manual_seed(4)
    x0, gy = torch.randn(2, T, 64, generator=g), torch.randn(2, T, 64, generator=g)
    pos = torch.arange(T).repeat(2, 1)
    _split_vs_full(lambda x: shared(stage(shared(x), pos)[0]) * 2,
                   list(stage.parameters()) + list(shared.parameters()), x0, gy)


def _walk(root):
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(c for c, _ in n.next_functions)
    return seen


def test_wrong_stage_count_and_deadlocking_schedule_are_refused_before_running():
    out = world(2, _refusals)
    assert out[0][0].startswith("pp rank 0 holds stages [0, 2]")
    assert "deadlocks" in out[0][1] and "0B0" in out[0][1]


def _refusals(rank, ws):
    mesh = make_mesh(pp=2)
    stages = split_gpt(make_model(2), 4)
    msgs = []
    with pytest.raises(ValueError) as e:
        PipelineExecutor([stages[rank]], sch.interleaved_1f1b(2, 2), mesh, loss_fn)
    msgs.append(str(e.value))
    A = sch.Action.from_str
    bad = sch.Schedule("crossed", 2, (0, 1), [[A("0F0"), A("0B0"), A("0F1"), A("0B1")],
                                             [A("1F1"), A("1B1"), A("1F0"), A("1B0")]])
    with pytest.raises(ValueError) as e:
        PipelineExecutor(stages[rank], bad, mesh, loss_fn)
    msgs.append(str(e.value))
    return msgs
