"""Context parallelism through `autopar.parallelize`: a `cp` mesh axis splits every sequence
over its ranks (zigzag chunks), attention exchanges K/V around a ring or by Ulysses
all-to-alls, and training matches one process.

One 4-rank world runs every cell (spawning is the expensive part): gpt-tiny (RoPE from a
sliced buffer, GQA) under cp=4 ring, cp=4 Ulysses, cp=2 x dp=2 with ZeRO-3, cp=2 x tp=2 and
cp=2 x dp=2 with recompute (memory_budget=0);
a transformers Llama (positions from arange, a causal mask built from positions and
recognised as causal) under cp=2 x dp=2 Ulysses; a transformers Qwen3 (per-head q/k norms)
under cp=4 ring; and packed documents (several per row, position ids restarting at each, so
transformers masks attention causal within each document): a transformers Llama under
dp=2 x cp=2 ring, cp=4 Ulysses, and dp=4 without cp. Each cell: the loss of every one of three AdamW steps and every parameter
after them, against one process with the same seed and batches, in float64: losses and
parameters within 1e-9 (the exchange only reorders sums).

Refusals, before any step, with the reason: attention written as matmul + softmax; a model
that shifts the labels inside (as a transformers `labels=` loss does). (cp with pp trains:
tests/dist/test_pipeline_context.py.)
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from harness import capture_before_fork, world

BATCH, SEQ, STEPS, TOL = 4, 32, 3, 1e-9


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


def _build(name):
    torch.manual_seed(0)
    if name == "gpt":
        from autopar.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig.tiny()).double()
    if name == "qwen3":
        return _qwen3().double()
    from autopar.models import zoo

    return zoo.build(name, "tiny").double()


def _loss(out, y):
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _batches(vocab, packed=False):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]  # next-token targets, shifted outside the model
        if packed:  # documents of random lengths packed into each row: positions restart per document
            pos = torch.empty(BATCH, SEQ, dtype=torch.long)
            for r in range(BATCH):
                cuts = sorted(torch.randperm(SEQ - 1, generator=g)[:3].add(1).tolist())
                starts = [0] + cuts
                for a, b in zip(starts, cuts + [SEQ]):
                    pos[r, a:b] = torch.arange(b - a)
            x = {"input_ids": x, "position_ids": pos}
        out.append((x, y))
    return out


def _call(model, x):
    return model(**x, use_cache=False) if isinstance(x, dict) else model(x)


def _vocab(model):
    return model.config.vocab_size


@functools.cache  # one per (model, batches), shared by the cells that train it (the tests only read it)
def _reference(name, packed=False):
    model = _build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(_vocab(model), packed):
        loss = _loss(_call(model, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


CELLS = [  # (cell name, model, mesh, parallelize keywords)
    ("gpt cp4 ring", "gpt", dict(cp=4), dict(context_method="ring")),
    ("gpt cp4 ulysses", "gpt", dict(cp=4), dict(context_method="ulysses")),
    ("gpt dp2 cp2 zero3 ring", "gpt", dict(dp=2, cp=2), dict(context_method="ring", zero_stage=3)),
    ("gpt cp2 tp2 ring", "gpt", dict(cp=2, tp=2), dict(context_method="ring", hardware="h100-sxm")),
    ("gpt dp2 cp2 ring recompute", "gpt", dict(dp=2, cp=2), dict(context_method="ring", memory_budget=0.0)),
    ("hf-llama dp2 cp2 ulysses", "hf-llama", dict(dp=2, cp=2), dict(context_method="ulysses")),
    ("qwen3 cp4 ring", "qwen3", dict(cp=4), dict(context_method="ring")),
    ("hf-llama packed dp2 cp2 ring", "hf-llama", dict(dp=2, cp=2), dict(context_method="ring")),
    ("hf-llama packed cp4 ulysses", "hf-llama", dict(cp=4), dict(context_method="ulysses")),
    ("hf-llama packed dp4 (no cp)", "hf-llama", dict(dp=4), {}),
]


def _cells(rank, ws):
    out = {}
    for cell, name, mesh_kw, kw in CELLS:
        model = _build(name)
        batches = _batches(_vocab(model), "packed" in cell)
        pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=batches[0][0], **kw)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
        losses = []
        for x, y in batches:
            losses.append(pm.step((x, y), _loss).item())
            opt.step()
            opt.zero_grad()
        layouts = {k: {a: str(p) for a, p in lay.axes} for k, lay in pm.plan.param_layouts.items()}
        out[cell] = (losses, pm.engine.gather_full_state_dict(), layouts, pm.mesh.coords(rank),
                     pm.plan.extra.get("context", {}).get("method", "no cp"),
                     "".join(m.code for m in pm.graph_module.modules() if hasattr(m, "code")),  # regions too
                     dict(pm.plan.recompute))
    return out


def _refusals(rank, ws):
    class Eager(nn.Module):  # attention written out: scores = q k^T, softmax, @ v
        def __init__(self):
            super().__init__()
            self.emb, self.qkv, self.out = nn.Embedding(16, 8), nn.Linear(8, 24), nn.Linear(8, 16)

        def forward(self, x):
            q, k, v = self.qkv(self.emb(x)).chunk(3, -1)
            return self.out(torch.softmax(q @ k.transpose(1, 2), -1) @ v)

    class ShiftsLabels(nn.Module):  # the loss inside, on labels shifted by one (as transformers' labels=)
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, x, labels):
            logits = self.head(self.emb(x))
            return F.cross_entropy(logits[:, :-1].reshape(-1, 16), labels[:, 1:].reshape(-1))

    errors = {}
    x = torch.randint(0, 16, (2, 8))
    for what, build, mesh_kw, inputs in [
        ("eager attention", Eager, dict(cp=2, dp=2), x),
        ("labels loss", ShiftsLabels, dict(cp=2, dp=2), (x, x)),
    ]:
        try:
            autopar.parallelize(build(), autopar.mesh(**mesh_kw), example_inputs=inputs)
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    return errors


def _world(rank, ws):
    return _cells(rank, ws), _refusals(rank, ws)


@pytest.fixture(scope="module")
def results():
    # each structure (model x packed batch x cp or not) captured once here: the forked ranks reuse it
    for name, packed, cp in sorted({(c[1], "packed" in c[0], "cp" in c[2]) for c in CELLS}):
        model = _build(name)
        capture_before_fork(model, _batches(_vocab(model), packed)[0][0], cp=cp)
    return world(4, _world, timeout_s=600)


@pytest.mark.parametrize("cell", [c[0] for c in CELLS])
def test_context_parallel_cell_matches_one_process_after_three_adamw_steps(results, cell):
    name = next(c[1] for c in CELLS if c[0] == cell)
    ref_losses, ref_params = _reference(name, "packed" in cell)
    per_rank = [r[0][cell] for r in results]
    for losses, *_ in per_rank:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
    code = per_rank[0][5]
    if "no cp" in cell:
        assert "scaled_dot_product_attention" in code and "ring_attention" not in code, cell
    else:
        op = "ring_attention" if "ring" in cell else "ulysses_attention"
        assert per_rank[0][4] in cell and op in code and "scaled_dot_product_attention" not in code, cell
        if "packed" in cell:  # attention kept inside each document: the exchange carries document ids
            assert "cp_document_ids" in code, cell
    layouts = per_rank[0][2]
    if "recompute" in cell:
        assert any(v != "none" for v in per_rank[0][6].values()), f"{cell}: nothing recomputed: {per_rank[0][6]}"
    if "tp" in cell:
        assert any(v.get("tp", "R") != "R" for v in layouts.values()), f"{cell}: the plan shards nothing on tp"
    for pname, ref in ref_params.items():
        pieces = sorted((c.get("tp", 0), sd[pname]) for _l, sd, _lay, c, _m, _code, _rec in per_rank
                        if pname in sd and c.get("dp", 0) == 0 and c.get("cp", 0) == 0)
        assert pieces, f"no rank holds {pname}"
        place = layouts.get(pname, {}).get("tp", "R")
        got = torch.cat([p for _, p in pieces], int(place[2:-1])) if place.startswith("S(") else pieces[0][1]
        torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL, msg=lambda m: f"{cell} {pname}: {m}")


@pytest.mark.parametrize("what, words", [
    ("eager attention", ["sequence x sequence", "scaled_dot_product_attention"]),
    ("labels loss", ["shifts or slices the sequence", "loss_fn"]),
])
def test_context_parallel_refuses_what_it_cannot_run_before_any_step(results, what, words):
    msg = results[0][1][what]
    assert msg is not None, f"{what}: parallelize accepted it"
    for w in words:
        assert w in msg, f"{what}: {w!r} not in {msg!r}"
