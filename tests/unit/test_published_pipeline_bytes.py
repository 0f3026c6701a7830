"""What a pipeline boundary carries per tensor-parallel rank under sequence parallelism.

With sequence parallelism the hidden state between two layers is S(seq) on tp: each tp rank
holds, sends to the next stage and keeps for its backward 2sbh / t bytes, not 2sbh (Megatron:
Narayanan et al. 2021, section 4.1, each rank sends its 1/t over its own link). The cost model
counted the whole tensor on every rank: 8x the transfer and the held stage input at tp = 8,
which made Llama 3 405B's interleaved pipelines look transfer-bound (benchmarks/
bench_published.py). `search.stage_costs.cross_bytes` with `boundary_divisors` counts the shard.

Built on the meta device (bench_published's GPT-3 block, small sizes); the sharding ILP runs
with the norms and dropouts pinned to a sequence shard, as Megatron's sequence parallelism
places them.
"""
from __future__ import annotations

import torch

from autopar.capture import capture
from autopar.cost import analyze
from autopar.cost.node_time import layout_divisors
from autopar.cost.placements import Layout, Replicate, Shard
from autopar.passes.plan import Plan
from autopar.passes.split_pipeline import pipeline_units
from autopar.search.shard_ilp import solve_sharding
from autopar.search.stage_costs import boundary_divisors, cross_bytes

from bench_module import load_bench


def _bench():
    return load_bench("bench_published")


def test_sequence_parallel_boundary_counts_one_tp_shard_per_rank():
    t, b, s, h = 4, 2, 256, 512
    with torch.device("meta"):
        model = _bench().GPT3(h, 8, 3, vocab=1024, seq=s).to(torch.bfloat16)
    gm = capture(model, (torch.empty(b, s, dtype=torch.long, device="meta"),))
    gc = analyze(gm, "a100-80gb")
    pins = {n.key: Shard(1) for n in gc.nodes if n.op in ("aten.layer_norm.default", "aten.dropout.default")}
    sol = solve_sharding(gm, "tp", t, mesh={"tp": t}, hardware="a100-80gb", gc=gc, node_pins=pins)
    layouts = {sol.keys[n]: Layout.of({"tp": c.out}) for n, c in sol.chosen.items()
               if n.op == "call_function" and c.out is not None and not isinstance(c.out, Replicate)}
    _, mem_div = layout_divisors(gc, Plan(mesh={"tp": t}, dp_axis=None, node_layouts=layouts))
    units = pipeline_units(gm)
    names = [u.name for u in units]
    assert names[:4] == ["tok_emb", "layers.0", "layers.1", "layers.2"]
    whole = cross_bytes(gm, gc, units, {}, 1.0)
    shard = cross_bytes(gm, gc, units, {}, 1.0, boundary_divisors(gc, mem_div))
    # between two blocks only the residual stream crosses: (b, s, h) in bf16
    for i in (1, 2):  # layers.0 | layers.1 and layers.1 | layers.2
        assert whole[i] == 2 * b * s * h
        assert shard[i] == whole[i] / t
    # a boundary tensor left whole by the plan stays whole: nothing sharded, nothing divided
    assert cross_bytes(gm, gc, units, {}, 1.0, boundary_divisors(gc, {})) == whole
