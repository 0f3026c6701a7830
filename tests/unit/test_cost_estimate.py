"""estimate(gm, plan, hardware): the step-time and memory report, data parallelism and ZeRO,
the tensor-parallel plug-in, graph collectives, fallbacks, and the cost of costing."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import capture, captured  # noqa: E402

from autopar.cost import analyze, estimate, liveness  # noqa: E402
from autopar.passes.plan import Plan  # noqa: E402
from autopar.runtime.placement import Layout, S  # noqa: E402


def test_single_device_step_is_forward_plus_backward_plus_optimizer_and_reports_per_layer():
    _, _, gm = captured("gpt-tiny")
    e = estimate(gm, None, "h100-sxm")
    assert e.comm_s == 0 and e.comm_exposed_s == 0 and e.world_size == 1
    assert e.step_s == pytest.approx(e.fwd_s + e.bwd_s + e.optimizer_s)
    assert [ly.name for ly in e.layers if ly.name.startswith("layers.")] == ["layers.0", "layers.1"]
    by = {ly.name: ly for ly in e.layers}
    assert by["layers.1"].fwd_flops > 0 and sum(ly.fwd_flops for ly in e.layers) == e.fwd_flops
    assert by["layers.0"].saved_bytes == by["layers.1"].saved_bytes > 0
    m = e.memory
    assert m["peak"] >= m["params"] + m["optimizer"] + m["activations"]
    assert m["optimizer"] == pytest.approx(2 * m["params"] + 4 * 21, abs=0)  # AdamW m, v + 21 step scalars
    assert e.summary()["step_s"] == e.step_s and e.summary()["fits"]
    d = json.loads(e.to_json())
    assert d["memory"]["peak"] == m["peak"] and [ly["name"] for ly in d["layers"]] == list(by)
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=160).print(e.table())
    assert "layers.0..1 (x2)" in buf.getvalue() and "lm_head" in buf.getvalue()


def test_data_parallel_gradient_all_reduce_matches_the_runtime_buckets_and_ring_bytes():
    from autopar.runtime.zero import GradReducer

    _, _, gm = captured("gpt-tiny")
    plan = Plan(mesh={"dp": 8}, bucket_mb=0.05)
    e = estimate(gm, plan, "h100-8x", algorithm="ring")
    (ar,) = [c for c in e.comm if c.op == "all_reduce"]
    reducer = GradReducer([p for p in gm.parameters()], "dp", plan.bucket_mb)
    reducer.remove()
    grads = sum(p.numel() * p.element_size() for p in gm.parameters())
    assert ar.calls == len(reducer.buckets) > 1
    assert ar.payload_bytes == grads
    assert ar.bytes_sent == pytest.approx(2 * 7 / 8 * grads)
    assert e.bytes_per_axis["dp"]["sent"] == pytest.approx(ar.bytes_sent)
    assert 0 <= e.comm_exposed_s <= e.comm_s and e.comm_overlapped_s > 0  # buckets overlap backward
    single = estimate(gm, None, "h100-8x")
    assert e.step_s == pytest.approx(single.step_s + e.comm_exposed_s)
    assert e.memory["transient"] == grads  # GradReducer keeps a flat copy of each bucket until the step


def test_zero_stages_shrink_memory_and_change_collectives():
    _, _, gm = captured("gpt-tiny")
    gc = analyze(gm, "h100-8x")
    est = {z: estimate(gc, Plan(mesh={"dp": 8}, zero_stage=z), "h100-8x", algorithm="ring") for z in range(4)}
    opt = [est[z].memory["optimizer"] for z in range(4)]
    assert opt[0] > opt[1] == opt[2] == opt[3]
    assert est[1].memory["grads"] > est[2].memory["grads"] == est[3].memory["grads"]
    assert est[2].memory["params"] > est[3].memory["params"]
    ops = {z: {(c.op, c.phase) for c in est[z].comm} for z in range(4)}
    # as runtime.zero runs them: stage 1 all-reduces full gradients, stage 2 reduce-scatters
    assert ops[0] == {("all_reduce", "backward")}
    assert ops[1] == {("all_reduce", "backward"), ("all_gather", "step")}
    assert ops[2] == {("reduce_scatter", "backward"), ("all_gather", "step")}
    assert ops[3] == {("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward")}
    # ZeRO-3 moves the bytes of plain data parallelism plus one more gather of every unit whose
    # weights backward reads: all but the embedding (its backward needs only the token ids)
    params = {p.name: p.nbytes for p in gc.params if not p.is_buffer}
    ring = 7 / 8  # ring all-gather / reduce-scatter: each rank sends 7/8 of the full bytes
    want = est[0].bytes_per_axis["dp"]["sent"] + ring * (sum(params.values()) - params["tok_emb.weight"])
    assert est[3].bytes_per_axis["dp"]["sent"] == pytest.approx(want)
    calls = est[3].collectives()
    units = ["tok_emb", "layers.0", "layers.1", "norm", "lm_head"]  # runtime.zero_stage3.default_units
    assert calls["all_gather@dp"]["calls"] == len(units) + len(units) - 1
    assert calls["reduce_scatter@dp"]["calls"] == len(units)
    assert est[1].collectives()["all_reduce@dp"] == est[0].collectives()["all_reduce@dp"]


def test_buckets_are_the_runtime_buckets_with_a_small_first_bucket():
    # DDP's rule, which runtime.zero_shard.make_buckets follows: the first bucket (the first
    # gradients backward produces) holds at most 1 MB, later ones bucket_mb
    import autopar.models as M
    from autopar.runtime.zero_shard import make_buckets

    cfg = dataclasses.replace(M.get("gpt-tiny").config, dim=256, ffn_dim=512, vocab_size=1024)  # 4.5 MB
    with torch.device("meta"):
        model = M.GPT(cfg)
    gm = capture(model, (torch.empty(2, 8, dtype=torch.long, device="meta"),))
    params = list(gm.parameters())
    for bucket_mb in (0.3, 2.0, 25.0):
        want = make_buckets(params, bucket_mb)
        e = estimate(gm, Plan(mesh={"dp": 4}, bucket_mb=bucket_mb), "h100-8x")
        got = e.collectives()["all_reduce@dp"]
        assert got == {"calls": len(want), "bytes": sum(p.numel() * 4 for p in params)}, bucket_mb
        if bucket_mb == 25.0:
            assert len(want) == 2  # 1 MB, then the rest
        z2 = estimate(gm, Plan(mesh={"dp": 4}, bucket_mb=bucket_mb, zero_stage=2), "h100-8x").collectives()
        assert z2["reduce_scatter@dp"]["calls"] == z2["all_gather@dp"]["calls"] == len(want)


def test_liveness_forward_end_holds_inputs_saved_and_outputs():
    _, _, gm = captured("hf-llama")
    gc = analyze(gm, "cpu-gloo")
    v = gc.values()
    live = liveness(gc, v)
    assert live.saved == gc.at(gc.saved_bytes)
    assert live.forward_end == pytest.approx(live.inputs + live.saved + live.outputs - _overlap(gc))
    assert live.peak >= live.forward_end
    assert live.param_grads == sum(p.nbytes for p in gc.params if p.requires_grad)


def _overlap(gc) -> float:
    # inputs that are also saved (token ids kept by the embedding) are counted in both
    keys = {k for n in gc.nodes for k, _, _ in n.saved}
    return sum(st.nbytes for k, st in gc.storages.items() if st.producer < 0 and not st.is_state and k in keys)


def test_tensor_parallel_node_layouts_divide_compute_and_activation_memory():
    _, _, gm = captured("gpt-tiny")
    gc = analyze(gm, "h100-8x")
    w1 = [n for n in gc.nodes if n.module == "layers.0.ffn.w1"][0]
    assert w1.key == "layers.0.ffn.w1:linear#0"
    plan = Plan(mesh={"tp": 2}, dp_axis=None, node_layouts={w1.key: Layout.of({"tp": S(2)})},
                param_layouts={"layers.0.ffn.w1.weight": Layout.of({"tp": S(0)})})
    e1, e2 = estimate(gc, None, "h100-8x"), estimate(gc, plan, "h100-8x")
    l1, l2 = ({ly.name: ly for ly in e.layers}["layers.0"] for e in (e1, e2))
    assert l1.fwd_flops - l2.fwd_flops == gc.at(w1.cost.flops) / 2
    w1_bytes = 128 * 64 * 4
    assert e1.memory["params"] - e2.memory["params"] == w1_bytes / 2


def test_collective_nodes_in_the_graph_are_costed_on_their_axis():
    import autopar.runtime.collectives  # noqa: F401  (registers torch.ops.autopar.*)

    class RowParallel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(256, 256, bias=False)

        def forward(self, x):
            return torch.ops.autopar.all_reduce(self.w(x), "tp", "sum")

    gm = capture(RowParallel(), (torch.randn(8, 256),))
    e = estimate(gm, Plan(mesh={"tp": 8}, dp_axis=None), "h100-8x")
    (c,) = e.comm
    assert (c.op, c.axis, c.phase, c.calls, c.payload_bytes) == ("all_reduce", "tp", "forward", 1, 8 * 256 * 4)
    assert c.exposed_s == c.time_s > 0


def test_an_op_without_rules_gets_the_stated_fallback_and_is_listed():
    lib = torch.library.Library("costtest", "FRAGMENT")
    lib.define("mystery(Tensor x) -> Tensor")
    lib.impl("mystery", lambda x: x * 2, "CompositeExplicitAutograd")
    lib.impl("mystery", lambda x: torch.empty_like(x), "Meta")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.ops.costtest.mystery(self.lin(x))

    gm = capture(M(), (torch.randn(4, 16),))
    gc = analyze(gm, "cpu-gloo")
    (n,) = [n for n in gc.nodes if n.op.startswith("costtest.")]
    assert gc.unknown_ops == {"costtest.mystery.default": 1} and n.fallback_cost
    assert n.cost.other_flops == 4 * 16 and n.cost.bytes_read == n.cost.bytes_written == 4 * 16 * 4
    e = estimate(gc, None, "cpu-gloo")
    assert any("costtest.mystery.default x1" in note for note in e.notes)


def test_identical_layers_are_costed_once_and_a_70b_wide_graph_costs_quickly():
    import autopar.models as M

    cfg = M.get("llama3-70b").config
    times, evals = {}, {}
    for n_layers in (2, 4):
        with torch.device("meta"):
            model = M.GPT(dataclasses.replace(cfg, n_layers=n_layers))
            x = torch.empty(1, 4096, dtype=torch.long)
        gm = capture(model, (x,))
        t0 = time.perf_counter()
        gc = analyze(gm, "h100-512")
        e = estimate(gc, Plan(mesh={"dp": 512}, zero_stage=1), "h100-512")
        times[n_layers] = time.perf_counter() - t0
        evals[n_layers] = gc.evaluations
    print(f"70B-wide llama: costing 2 layers {times[2]:.3f}s, 4 layers {times[4]:.3f}s; "
          f"rule evaluations {evals}")
    assert evals[4] == evals[2]  # two more identical blocks: no new rule evaluations
    assert e.memory["peak"] > 0 and e.step_s > 0
    assert times[4] < 10  # generous sanity bound; benchmarks/bench_cost.py times the full 80 layers


def test_a_mesh_larger_than_the_profile_is_costed_on_more_nodes_of_the_same_kind():
    _, _, gm = captured("mlp-tiny")
    e = estimate(gm, Plan(mesh={"dp": 64}), "h100-sxm")
    assert e.hardware == "h100-sxm@8x8" and any("8 nodes of 8" in n for n in e.notes)
    assert [c.op for c in e.comm] == ["all_reduce"]


def test_recomputed_forward_time_divides_under_tensor_parallelism_as_the_forward_does():
    """The recompute walk (cost.timeline) times the recomputed ops on one rank's share of their
    work: under tp=2 a fully recomputed 2-layer GPT (dim 2048, 8 x 1024 tokens, built on meta)
    spends half the time recomputing, as its forward halves. It spent the whole node's time
    (the torchtitan 70B row of bench_published: 21.4 s of recompute at tp=8, 8x too much)."""
    from autopar.capture import capture as capture_dynamic  # a dynamic batch: costed at the global batch
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.runtime.mesh import make_mesh
    from autopar.search.shard_search import search_sharding

    cfg = dataclasses.replace(GPTConfig.tiny(), dim=2048, n_heads=16, n_kv_heads=16, ffn_dim=8192, vocab_size=32000,
                              max_seq_len=1024)
    with torch.device("meta"):
        model = GPT(cfg)
    gm = capture_dynamic(model, (torch.randint(0, cfg.vocab_size, (8, 1024)),))
    got = {}
    for tp in (1, 2):
        mesh = make_mesh(tp=tp) if tp > 1 else make_mesh(dp=1)
        plan = Plan(mesh=dict(mesh.sizes), dp_axis=None)
        if tp > 1:
            search_sharding(plan, gm, mesh, "h100-sxm")
        rc = plan.pin(recompute={f"layers.{i}": "full" for i in range(cfg.n_layers)})
        e = estimate(gm, rc, "h100-sxm", batch_is_global=True)
        got[tp] = (e.summary()["fwd_s"], e.recompute_s)
    fwd_ratio, rc_ratio = got[2][0] / got[1][0], got[2][1] / got[1][1]
    assert fwd_ratio < 0.6, got  # the forward does halve under this tp plan
    assert rc_ratio == pytest.approx(fwd_ratio, rel=0.05), got
