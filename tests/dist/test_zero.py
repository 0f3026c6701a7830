"""ZeRO stages 0-3 on gloo: parity with one process and with PyTorch's FSDP2 and
ZeroRedundancyOptimizer, an exported GraphModule, exact per-rank memory and collective bytes,
mixed precision with loss scaling, offload, and building on meta with shard-wise loading.

Parity with one process (every stage, the exported GraphModule, the meta build) runs in fp64,
where sharding leaves nothing but the order of additions: losses, gradients after the first
backward and parameters after three AdamW steps (lr 1e-3) within FP64_TOL (rtol 1e-9, atol
1e-12 / 1e-10). Measured in one fp64 process, the global batch split in 2 or 4 halves with
gradients accumulated (the dp reordering) moves the parameters by at most 1.6e-14 and the
first gradients by 3.5e-17 (the engine's runs: parameters 1.6e-14 at dp=2, 2.0e-14 at dp=4);
gradients rounded to fp32 once before the reduction fail it (1.9e-5 relative). In fp32 the same
one-process reordering is as far off as the parallel run: the split in 2 moves
layers.0.ffn.w3.weight by 1.28e-5 after 3 steps (the dp=2 miss seen with fp32 tolerances
exactly), and the fp32 reference itself is 1.16e-5 from fp64 there, over atol 1e-5: Adam's
m/sqrt(v) turns last-bit differences of near-zero gradient entries into lr-sized steps.

The comparisons with PyTorch's FSDP2 / ZeroRedundancyOptimizer and the SGD run stay fp32:
losses rtol 1e-5 / atol 1e-5, parameters rtol 1e-4 / atol 1e-5 (measured there: passing).
"""
import copy
import contextlib

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from harness import world
from autopar.models import GPT, GPTConfig, MLP, MLPConfig, get
from autopar.models.mlp import loss_fn as mlp_loss
from autopar.runtime import collectives as C
from autopar.runtime.mesh import make_mesh
from autopar.runtime.zero import make_engine

LOSS_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)  # fp32
# fp64 parity: measured floor (one process, batch split in 2 / 4) params 1.6e-14, first grads
# 3.5e-17 (max |grad| 7.5e-2); the tolerances sit >= 1e3 above that and >= 1e2 below fp32 rounding
FP64_TOL = {"loss": dict(rtol=1e-9, atol=1e-12), "grad": dict(rtol=1e-9, atol=1e-12),
            "param": dict(rtol=1e-9, atol=1e-10)}
LR = 1e-3
STEPS = 3
GLOBAL_BATCH, SEQ = 8, 16


def _warm_custom_ops():
    # the first custom-op / autograd.Function call imports torch's compiler stack (~3 s): pay
    # it once before the worlds fork, not once per rank
    C.set_active_mesh(make_mesh(dp=1), rank=0)
    torch.ops.autopar.split(torch.ones(2), "dp", 0)
    C.set_active_mesh(None)


_warm_custom_ops()


GPT_TINY = get("gpt-tiny")
gpt_loss = GPT_TINY.loss_fn


def tiny_gpt(name: str = "gpt-tiny", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return get(name).build().to(dtype)


def gpt_batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        (x,), y = GPT_TINY.example_batch(GLOBAL_BATCH, seq_len=SEQ, generator=g)
        out.append((x, y))
    return out


def local(batch, rank, ws):
    x, y = batch
    n = x.shape[0] // ws
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train_reference(model, batches, loss_fn, clip=None, steps=STEPS):
    """One process, the whole global batch per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, grads0 = [], [], None
    for s in range(steps):
        x, y = batches[s]
        loss = loss_fn(model(x), y)
        loss.backward()
        if s == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads0


def train_engine(model, engine, batches, loss_fn, rank, ws, micro=1, clip=None, steps=STEPS):
    """Local batch per rank, `micro` micro-batches with communication on the last only."""
    opt = engine.make_optimizer(torch.optim.AdamW, lr=LR)
    losses, norms, grads0 = [], [], None
    for s in range(steps):
        x, y = local(batches[s], rank, ws)
        total = torch.zeros((), dtype=torch.float64)  # an fp64 run's losses are not rounded to fp32
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            ctx = engine.no_sync() if i < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model(xm), ym) / micro
                loss.backward()
            total += loss.detach()
        engine.finish_backward()
        if s == 0:
            grads0 = {n: (info, m.grad.clone()) for n, info, m in engine.named_shards()}
        if clip:
            norms.append(engine.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
        C.all_reduce_(total, engine.axis, "avg")
        losses.append(total.item())
    return losses, norms, grads0


def rows(t, info):
    return t.reshape(info.rows, *info.shape[1:])[info.start:info.end] if info.shape else t.reshape(1)


def check_against_reference(engine, ref_model, ref_out, out):
    """fp64 parity (FP64_TOL): losses, clipped norms, first gradients, parameters after STEPS."""
    (rl, rn, rg), (l, n, g) = ref_out, out
    assert all(p.dtype == torch.float64 for p in ref_model.parameters())
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)
    assert_close(f64(l), f64(rl), **FP64_TOL["loss"])
    assert_close(torch.stack(n) if n else torch.zeros(0), torch.stack(rn) if rn else torch.zeros(0), **FP64_TOL["loss"])
    for name, (info, grad) in g.items():
        assert_close(grad, rows(rg[name], info), **FP64_TOL["grad"], msg=lambda m: f"grad of {name}: {m}")
    full = engine.gather_full_state_dict()
    for name, p in ref_model.named_parameters():
        assert_close(full[name], p.detach(), **FP64_TOL["param"], msg=lambda m: f"{name} after {STEPS} steps: {m}")


# --- parity with one process --------------------------------------------------------------
def _parity_world(rank, ws):
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    base, batches = tiny_gpt(dtype=torch.float64), gpt_batches()
    refs = {}
    for clip in (None, 0.3):
        ref = copy.deepcopy(base)
        refs[clip] = (ref, train_reference(ref, batches, gpt_loss, clip))
    assert all(nm > 0.3 for nm in refs[0.3][1][1]), "clipping must be active for the test to mean anything"
    done = []
    for stage in (0, 1, 2, 3):
        for micro, clip in ((1, None), (2, 0.3)):
            model = copy.deepcopy(base)
            eng = make_engine(model, mesh, "dp", stage=stage, bucket_mb=0.05)  # several buckets
            out = train_engine(model, eng, batches, gpt_loss, rank, ws, micro=micro, clip=clip)
            ref, ref_out = refs[clip]
            check_against_reference(eng, ref, ref_out, out)
            done.append((stage, micro, clip))
    # tied embeddings: one parameter read by two modules (two units at stage 3)
    tied = tiny_gpt("gpt-tiny-tied", torch.float64)
    ref = copy.deepcopy(tied)
    ref_out = train_reference(ref, batches, gpt_loss)
    for stage in (1, 2, 3):
        model = copy.deepcopy(tied)
        eng = make_engine(model, mesh, "dp", stage=stage)
        assert model.lm_head._parameters["weight"] is model.tok_emb._parameters["weight"]
        check_against_reference(eng, ref, ref_out, train_engine(model, eng, batches, gpt_loss, rank, ws))
        done.append(("tied", stage))
    return done


@pytest.mark.parametrize("ws", [2, 4])
def test_every_stage_with_and_without_accumulation_and_clipping_matches_one_process_after_three_adamw_steps(ws):
    out = world(ws, _parity_world)
    assert out[0] == [(s, m, c) for s in (0, 1, 2, 3) for m, c in ((1, None), (2, 0.3))] + [("tied", s) for s in (1, 2, 3)]


# --- an exported GraphModule ----------------------------------------------------------------
def _graph_world(rank, ws):
    from autopar.passes.zero import zero

    # exported on each rank: a GraphModule does not pickle, and fork-server worlds pickle arguments
    x = local(gpt_batches()[0], 0, 2)[0]
    gm_sunk, gm_raw = (torch.export.export(tiny_gpt(dtype=torch.float64), (x,), strict=False).module()
                       for _ in range(2))
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    base, batches = tiny_gpt(dtype=torch.float64), gpt_batches()
    ref = copy.deepcopy(base)
    ref_out = train_reference(ref, batches, gpt_loss)
    zero(gm_sunk)
    eng = make_engine(gm_sunk, mesh, "dp", stage=3)
    out = train_engine(gm_sunk, eng, batches, gpt_loss, rank, ws)
    check_against_reference(eng, ref, ref_out, out)
    # without the pass every get_attr sits at the top of the graph: all units live at once
    eng_raw = make_engine(gm_raw, mesh, "dp", stage=3)
    gm_raw(local(batches[0], rank, ws)[0])
    return [u.prefix for u in eng.units], eng.stats["max_live_units"], eng_raw.stats["max_live_units"]


def test_stage3_on_an_exported_graph_module_matches_eager_one_process_and_holds_two_units_at_most():
    out = world(2, _graph_world)
    units, live, live_raw = out[0]
    assert units == ["tok_emb", "layers.0", "layers.1", "norm", "lm_head"]
    assert live <= 2 and live_raw == len(units)


# --- PyTorch's references ------------------------------------------------------------------
def _reference_impls_world(rank, ws):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    base, batches = tiny_gpt(), gpt_batches()

    fsdp = copy.deepcopy(base)
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh.device_mesh)
    fully_shard(fsdp, mesh=mesh.device_mesh)
    ddp = DDP(copy.deepcopy(base))
    zro = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    fopt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    ref_losses = {"fsdp2": [], "zero_redundancy": []}
    for s in range(STEPS):
        x, y = local(batches[s], rank, ws)
        for name, m, o in (("fsdp2", fsdp, fopt), ("zero_redundancy", ddp, zro)):
            loss = gpt_loss(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            t = loss.detach()
            C.all_reduce_(t, "dp", "avg")
            ref_losses[name].append(t.item())
    fsdp_full = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    zro_full = dict(ddp.module.named_parameters())
    for stage, ref_name, ref_full in ((3, "fsdp2", fsdp_full), (1, "zero_redundancy", zro_full),
                                      (2, "zero_redundancy", zro_full)):
        model = copy.deepcopy(base)
        eng = make_engine(model, mesh, "dp", stage=stage)
        losses, _, _ = train_engine(model, eng, batches, gpt_loss, rank, ws)
        assert_close(torch.tensor(losses), torch.tensor(ref_losses[ref_name]), **LOSS_TOL)
        full = eng.gather_full_state_dict()
        for n, p in ref_full.items():
            assert_close(full[n], p.detach(), **PARAM_TOL, msg=lambda m: f"stage {stage} vs {ref_name}, {n}: {m}")
    return True


def test_stage3_matches_fsdp2_and_stages_1_2_match_zero_redundancy_optimizer_on_the_same_model():
    assert world(2, _reference_impls_world) == [True, True]


# --- memory and bytes ----------------------------------------------------------------------
ODD = MLPConfig(dim=10, hidden=6, n_layers=2, n_classes=7)  # dim-0 sizes 6, 6, 7 over 4 ranks


def _mlp_batch(cfg, n):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, cfg.dim, generator=g), torch.randint(0, cfg.n_classes, (n,), generator=g)


def _memory_world(rank, ws):
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    res = {}
    for label, make, batch, lf in (("gpt", tiny_gpt, local(gpt_batches()[0], rank, ws), gpt_loss),
                                   ("mlp", lambda: (torch.manual_seed(0), MLP(ODD))[1], _mlp_batch(ODD, 2 * ws), mlp_loss)):
        for stage in (0, 1, 2, 3):
            model = make()
            eng = make_engine(model, mesh, "dp", stage=stage, bucket_mb=1e-3)
            opt = eng.make_optimizer(torch.optim.AdamW, lr=LR)
            x, y = batch if label == "gpt" else (batch[0][2 * rank:2 * rank + 2], batch[1][2 * rank:2 * rank + 2])
            C.COUNTER.reset()
            lf(model(x), y).backward()
            eng.finish_backward()
            after_backward = eng.memory_bytes()
            opt.step()
            opt.zero_grad()
            after_step = eng.memory_bytes()
            res[(label, stage)] = (after_backward, after_step, C.COUNTER.snapshot())
    return res


def _expected(shapes, ws, rank, stage):
    """Bytes the stage promises on `rank`: full = every element; rows = this rank's
    torch.chunk rows of dim 0 (no padding); AdamW keeps two fp32 tensors per element plus a
    4-byte `step` per parameter tensor (on every rank, for its possibly empty rows)."""
    full = sum(torch.Size(s).numel() * 4 for s in shapes)
    mine = 0
    for s in shapes:
        r0 = s[0]
        start, end = C.chunk_range(r0, ws, rank)
        mine += (end - start) * torch.Size(s[1:]).numel() * 4
    own = full if stage == 0 else mine
    return ({"params": full if stage < 3 else mine, "grads": full if stage < 2 else mine, "optimizer": 0},
            {"params": full if stage < 3 else mine, "grads": 0, "optimizer": 2 * own + 4 * len(shapes)})


def _expected_bytes(shapes, ws, stage, bwd_skip=()):
    """COUNTER payload per step: P = full bytes, Pp = dim 0 padded to ws * ceil(rows / ws)."""
    P = sum(torch.Size(s).numel() * 4 for s in shapes)
    pad = lambda s: -(-s[0] // ws) * ws * torch.Size(s[1:]).numel() * 4
    Pp = sum(pad(s) for s in shapes)
    if stage == 0:
        return {"all_reduce@dp": P}
    if stage == 1:
        return {"all_reduce@dp": P, "all_gather@dp": Pp // ws}
    if stage == 2:
        return {"reduce_scatter@dp": Pp, "all_gather@dp": Pp // ws}
    bwd = sum(pad(s) for i, s in enumerate(shapes) if i not in bwd_skip) // ws
    return {"reduce_scatter@dp": Pp, "all_gather@dp": Pp // ws + bwd}


def test_per_rank_memory_and_collective_bytes_are_exactly_what_each_stage_promises():
    ws = 4
    out = world(ws, _memory_world)
    gpt_shapes = [tuple(p.shape) for p in tiny_gpt().parameters()]
    torch.manual_seed(0)
    mlp_shapes = [tuple(p.shape) for p in MLP(ODD).parameters()]  # layers.0.fc w/b, layers.1.fc w/b, head w/b
    for label, shapes in (("gpt", gpt_shapes), ("mlp", mlp_shapes)):
        for stage in (0, 1, 2, 3):
            for rank in range(ws):
                after_backward, after_step, counted = out[rank][(label, stage)]
                assert (after_backward, after_step) == _expected(shapes, ws, rank, stage), (label, stage, rank)
            # sharded categories add up over the ranks to the full model (AdamW: two tensors per
            # element plus a 4-byte step per parameter on every rank), not to more
            full = sum(torch.Size(s).numel() * 4 for s in shapes)
            total = lambda cat, i: sum(out[r][(label, stage)][i][cat] for r in range(ws))
            if stage >= 1:
                assert total("optimizer", 1) == 2 * full + ws * 4 * len(shapes)
            if stage >= 2:
                assert total("grads", 0) == full
            if stage >= 3:
                assert total("params", 1) == full
            # backward re-gathers every unit whose weight it reads: the embedding's gradient does
            # not need the embedding, and the MLP's first layer computes no input gradient
            skip = (0,) if label == "gpt" else (0, 1)
            want = _expected_bytes(shapes, ws, stage, bwd_skip=skip)
            got = {k: v["bytes"] for k, v in out[0][(label, stage)][2].items()}
            assert got == want, (label, stage)
    # the cost model's model_states agrees where every size divides by 4 (it shards the flattened
    # tensor, the engine shards dim 0: the two differ only for uneven tensors such as the MLP's)
    from autopar.cost.memory import model_states, params_of
    for stage in (0, 1, 2, 3):
        for rank in range(ws):
            sb = model_states(params_of(tiny_gpt()), "adamw", zero_stage=stage, dp=ws, rank=rank)
            after_backward, after_step, _ = out[rank][("gpt", stage)]
            assert (after_backward["params"], after_backward["grads"], after_step["optimizer"]) == \
                (sb.params, sb.grads, sb.optimizer + sb.master)
    # gpt-tiny divides evenly over 4: stage 3 holds exactly a quarter of everything
    full = sum(torch.Size(s).numel() * 4 for s in gpt_shapes)
    assert out[1][("gpt", 3)][1]["params"] * 4 == full


# --- mixed precision, loss scaling, offload ----------------------------------------------------
def _precision_world(rank, ws):
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    base, batches = tiny_gpt(), gpt_batches()
    ref = copy.deepcopy(base)
    ref_losses = train_reference(ref, batches, gpt_loss)[0]
    res = {}
    for stage in (2, 3):
        model = copy.deepcopy(base)
        eng = make_engine(model, mesh, "dp", stage=stage, param_dtype=torch.bfloat16)
        losses, _, _ = train_engine(model, eng, batches, gpt_loss, rank, ws)
        # bf16 compute: 8 mantissa bits (relative precision 2**-8 = 0.4 %) through a few layers
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)
        compute = model.layers[0].attn.wq.weight  # stage 3: this read gathers the unit
        masters = [m for _, _, m in eng.named_shards()]
        state = [v for st in eng.optimizer.state.values() for v in st.values() if v.dim() > 0]
        res[f"bf16 stage {stage}"] = (compute.dtype, {m.dtype for m in masters}, {v.dtype for v in state})
    # fp16 with dynamic loss scaling: a huge initial scale overflows, steps are skipped and
    # the scale halves until the gradients fit, then training proceeds
    for stage in (1, 3):
        model = copy.deepcopy(base)
        eng = make_engine(model, mesh, "dp", stage=stage, param_dtype=torch.float16, init_scale=2.0**24)
        opt = eng.make_optimizer(torch.optim.AdamW, lr=LR)
        before = {n: v.clone() for n, v in eng.gather_full_state_dict().items()}
        scales, skipped, losses = [], 0, []
        while len(losses) < STEPS:
            x, y = local(batches[len(losses)], rank, ws)
            loss = gpt_loss(model(x).float(), y)
            loss.backward()
            eng.finish_backward()
            scales.append(eng.loss_scale)
            opt.step()
            opt.zero_grad()
            if eng.last_step_skipped:
                skipped += 1
                if skipped == 1:  # a skipped step leaves the parameters as they were
                    after = eng.gather_full_state_dict()
                    assert all(torch.equal(after[n], before[n]) for n in before)
                continue
            t = loss.detach()
            C.all_reduce_(t, "dp", "avg")
            losses.append(t.item())
        assert skipped >= 1 and scales[0] == 2.0**23 and all(b == a / 2 for a, b in zip(scales[:skipped - 1], scales[1:skipped]))
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)  # fp16: 2**-11
        res[f"fp16 stage {stage}"] = skipped
    # offload: fp32 masters and optimizer state on the CPU, separate from the model's tensors
    for stage in (2, 3):
        runs = {}
        for offload in (False, True):
            model = copy.deepcopy(base)
            eng = make_engine(model, mesh, "dp", stage=stage, offload=offload)
            runs[offload] = (train_engine(model, eng, batches, gpt_loss, rank, ws)[0], eng.gather_full_state_dict(), eng, model)
        (l0, sd0, _, _), (l1, sd1, eng, model) = runs[False], runs[True]
        assert l0 == l1 and all(torch.equal(sd0[n], sd1[n]) for n in sd0)  # the same arithmetic, elsewhere
        model_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        masters = [m for _, _, m in eng.named_shards()]
        assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters)
        state = [v for st in eng.optimizer.state.values() for v in st.values()]
        assert all(v.device.type == "cpu" for v in state)
        if stage == 2:  # stage 2's model keeps its own full parameters; the masters are copies
            assert not any(m.untyped_storage().data_ptr() in model_ptrs for m in masters)
        res[f"offload stage {stage}"] = eng.memory_report()
    return res


def test_mixed_precision_loss_scaling_and_offload_keep_fp32_masters_and_match_fp32_training():
    res = world(2, _precision_world)[0]
    assert res["bf16 stage 2"] == (torch.bfloat16, {torch.float32}, {torch.float32})
    assert res["bf16 stage 3"] == (torch.bfloat16, {torch.float32}, {torch.float32})
    assert res["fp16 stage 1"] >= 1 and res["fp16 stage 3"] >= 1
    assert set(res["offload stage 3"]["optimizer"]) == {"cpu"}


# --- building on meta ----------------------------------------------------------------------
def _meta_world(rank, ws):
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    base, batches = tiny_gpt(dtype=torch.float64), gpt_batches()
    full_sd = dict(base.state_dict())
    full_sd["rope_cos"], full_sd["rope_sin"] = base.rope_cos, base.rope_sin  # non-persistent buffers
    reads = []

    def source(name, start, end):
        reads.append((name, start, end))
        return full_sd[name][start:end]

    with torch.device("meta"):
        model = GPT(GPTConfig.tiny()).to(torch.float64)
    eng = make_engine(model, mesh, "dp", stage=3)
    assert all(p.shape == info.local_shape and not p.is_meta for p, (_, info, _) in zip(model.parameters(), eng.named_shards()))
    eng.load_state_dict_shards(source)
    with torch.no_grad():
        model.rope_cos.copy_(base.rope_cos)
        model.rope_sin.copy_(base.rope_sin)
    infos = {n: info for n, info, _ in eng.named_shards()}
    assert sorted(reads) == sorted((n, i.start, i.end) for n, i in infos.items())
    assert all(end - start < infos[n].rows for n, start, end in reads)  # never a whole parameter
    ref = copy.deepcopy(base)
    ref_out = train_reference(ref, batches, gpt_loss)
    out = train_engine(model, eng, batches, gpt_loss, rank, ws)
    check_against_reference(eng, ref, ref_out, out)
    # init_fn gives the same rows without any source
    with torch.device("meta"):
        model2 = GPT(GPTConfig.tiny()).to(torch.float64)
    eng2 = make_engine(model2, mesh, "dp", stage=3, init_fn=lambda n, shape, s, e: full_sd[n][s:e])
    return all(torch.equal(a, full_sd[n]) for n, a in eng2.gather_full_state_dict().items() if n in dict(base.named_parameters()))


def test_a_model_built_on_meta_reads_only_this_ranks_rows_and_then_trains_like_one_process():
    assert world(2, _meta_world) == [True, True]


# --- any torch.optim optimizer, param groups, LR schedulers -----------------------------------
def _optimizer_world(rank, ws):
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    base, batches = tiny_gpt(), gpt_batches()
    names = [n for n, _ in base.named_parameters()]
    norms = [n for n in names if "norm" in n]
    groups = lambda get: [{"params": [get(n) for n in norms], "weight_decay": 0.0},
                          {"params": [get(n) for n in names if n not in norms], "weight_decay": 0.1}]
    sgd = dict(lr=0.5, momentum=0.9, nesterov=True)
    ref = copy.deepcopy(base)
    rp = dict(ref.named_parameters())
    ropt = torch.optim.SGD(groups(rp.__getitem__), **sgd)
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, lambda s: 0.5 ** s)
    for s in range(STEPS):
        gpt_loss(ref(batches[s][0]), batches[s][1]).backward()
        ropt.step(), ropt.zero_grad(), rsched.step()
    for stage in (1, 3):
        model = copy.deepcopy(base)
        eng = make_engine(model, mesh, "dp", stage=stage)
        opt = eng.make_optimizer(torch.optim.SGD, param_groups=groups(str), **sgd)  # groups by name
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        for s in range(STEPS):
            x, y = local(batches[s], rank, ws)
            gpt_loss(model(x), y).backward()
            opt.step(), opt.zero_grad(), sched.step()  # step() finishes the backward itself
        assert opt.param_groups[1]["lr"] == 0.5 * 0.5 ** STEPS
        full = eng.gather_full_state_dict()
        for n, p in ref.named_parameters():
            assert_close(full[n], p.detach(), **PARAM_TOL, msg=lambda m: f"stage {stage} SGD, {n}: {m}")
    return True


def test_any_torch_optimizer_with_param_groups_by_name_and_an_lr_scheduler_matches_one_process():
    assert world(2, _optimizer_world) == [True, True]


# --- overlap and interface errors ------------------------------------------------------------
def _overlap_world(rank, ws):
    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    x, y = local(gpt_batches()[0], rank, ws)
    seen = {}
    for stage, op in ((0, "all_reduce@dp"), (2, "reduce_scatter@dp"), (3, "reduce_scatter@dp")):
        model = tiny_gpt()
        eng = make_engine(model, mesh, "dp", stage=stage, bucket_mb=0.05)
        C.COUNTER.reset()
        loss = gpt_loss(model(x), y)
        fwd_gathers = C.COUNTER.calls.get(("all_gather", "dp"), 0)
        loss.backward()  # reductions are launched from backward hooks, asynchronously ...
        launched = C.COUNTER.calls.get(tuple(op.split("@")), 0)
        eng.finish_backward()  # ... and only waited for here
        seen[stage] = (fwd_gathers, launched, C.COUNTER.calls.get(tuple(op.split("@")), 0))
    return seen


def test_reductions_are_launched_during_backward_and_only_waited_for_in_finish_backward():
    seen = world(2, _overlap_world)[0]
    for stage in (0, 2, 3):
        fwd, launched, total = seen[stage]
        assert launched == total and total > 1, (stage, seen[stage])
    assert seen[3][0] == 5  # stage 3 gathers each of gpt-tiny's 5 units in forward


def test_bad_options_and_units_are_value_errors_that_name_them():
    mesh = make_mesh(dp=1)
    with pytest.raises(ValueError, match=r"unknown make_engine options \['bucket'\]"):
        make_engine(tiny_gpt(), mesh, "dp", stage=2, bucket=1)
    with pytest.raises(ValueError, match=r"\['prefetch', 'units'\] need stage=3"):
        make_engine(tiny_gpt(), mesh, "dp", stage=2, units=["layers.0"])
    with pytest.raises(ValueError, match=r"units \['layers.9'\] match no parameter"):
        make_engine(tiny_gpt(), mesh, "dp", stage=3, units=["layers.0", "layers.9"])
    with pytest.raises(ValueError, match=r"has no axis 'tp'"):
        make_engine(tiny_gpt(), mesh, "tp", stage=1)
