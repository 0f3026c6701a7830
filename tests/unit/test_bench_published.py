"""benchmarks/bench_published.py: the row function costs the PUBLISHED plan, not another one.

The 22B Megatron row (8 GPUs, TP8, one micro-batch of 4: the smallest row with tp > 1)
is costed without the free planner; the checks are structural: a positive finite prediction,
the error is predicted / published - 1, and the costed Plan's mesh, ZeRO stage and
micro-batches are the published ones; its per-layer times (`layer_times`, the cost model's side
of Table 4) add up to the planner's compute. No timings, no predicted values pinned.
The GPT-3 block's QKV is laid out per head as Megatron's, so tensor parallelism shards it by
heads without an all-to-all; `--attention unfused` (the default) reaches only the Megatron rows'
kernels, whose blocks are then recomputed "selective" as the paper's runs were.
"""
from __future__ import annotations

import dataclasses
import math

from bench_module import load_bench


def _bench():
    return load_bench("bench_published")


def test_row_costs_the_published_plan_and_reports_its_relative_error():
    bench = _bench()
    row = bench.ROWS["megatron-22b"]  # tp8 on 8 A100s, one micro-batch of 4: the smallest row with tp > 1
    r = bench.cost_row(row, planner=False)
    assert r.get("not_costed") is None, r.get("not_costed")
    pred = r["predicted"]
    assert math.isfinite(pred) and pred > 0
    assert r["error"] == pred / row.published - 1
    plan = r["plan"]
    mesh = {a: plan.mesh.get(a, 1) for a in ("tp", "pp", "dp")}
    assert mesh == {a: row.pins[a] for a in ("tp", "pp", "dp")}
    assert plan.zero_stage == row.pins["zero_stage"]
    assert plan.n_microbatches == row.pins["n_microbatches"]
    assert plan.predicted["fits"]
    assert "planner_plan" not in r  # --no-planner costs only the published plan
    # the paper's runs recompute selectively (Table 5): every block "selective", keeping its GEMMs' outputs
    assert set(plan.recompute) == {f"layers.{i}" for i in range(48)} and set(plan.recompute.values()) == {"selective"}
    assert all(k.split(":")[1].startswith("linear") for v in plan.extra["recompute_save"].values() for k in v)
    # one block's forward + backward, timed node by node with its tp conversions, times the 48 blocks is
    # the planner's compute but what lies outside the blocks (embeddings, head, loss: a few %)
    f, b = bench.layer_times(r)
    assert f > 0 and b > f
    assert 0.9 * plan.predicted["compute_s"] < 48 * (f + b) <= plan.predicted["compute_s"]
    # with flash attention no score matrix is kept: the row is costed without recompute, each block's
    # backward shorter by its replay
    rf = bench.cost_row(row, planner=False, attention="flash")
    assert not rf["plan"].recompute and bench.layer_times(rf)[1] < b


def test_gpt3_qkv_is_laid_out_per_head_so_tensor_parallelism_needs_no_all_to_all():
    import torch

    from autopar.capture import capture
    from autopar.cost import load_profile
    from autopar.cost.tp_conversions import edge_conversions, resolve_strategies
    from autopar.passes.rules.sharding import requires_grad_nodes
    from autopar.search.planner import plan_for

    bench = _bench()
    with torch.device("meta"):
        model = bench.GPT3(2048, 16, 2, vocab=1024, seq=1024).to(torch.bfloat16)  # big enough that tp shards it
    gm = capture(model, (torch.empty(2, 1024, dtype=torch.long, device="meta"),))
    pins = {"tp": 4, "pp": 1, "dp": 1, "zero_stage": 0, "n_microbatches": 1, "recompute": "none"}
    plan, _ = plan_for(gm, 4, load_profile("a100-80gb"), pins=pins, global_batch=2, top_k=1)
    convs = edge_conversions(resolve_strategies(gm, plan, "tp"), requires_grad_nodes(gm))
    assert convs  # the plan does shard (gathers and reduce-scatters around the blocks)
    split = (torch.ops.aten.view.default, torch.ops.aten.permute.default)  # qkv -> heads
    assert any(v.target in split for v in resolve_strategies(gm, plan, "tp"))  # the head split is planned on tp ...
    assert not [c for c in convs if c[0].target in split]  # ... and converts nothing (a [3, a, H/a] split all-to-alls)


def test_unfused_attention_changes_only_the_megatron_rows_kernels():
    bench = _bench()
    flash = bench.hardware(bench.ROWS["megatron-22b"], "flash")
    unfused = bench.hardware(bench.ROWS["megatron-22b"])  # the Megatron rows' default: the 2022 code's core
    assert unfused.kernels == {**flash.kernels, "sdpa": "math", "sdpa_math_upcast": False}
    llama = bench.ROWS["llama3-405b-8k-8192"]
    assert bench.hardware(llama, "unfused").kernels == bench.hardware(llama, "flash").kernels
    try:
        bench.hardware(llama, "fused")
    except ValueError as e:
        assert "fused" in str(e) and "unfused" in str(e)
    else:
        raise AssertionError("an unknown attention choice was accepted")


def _not_costed_row(bench):
    """A row whose published plan the API cannot price (the cp row was one until pp x cp planned:
    the reason a Row carries is what is printed; nothing is captured for it)."""
    return dataclasses.replace(bench.ROWS["llama3-405b-128k-16384"], not_costed="cp=16: a reason given by the row")


def test_a_row_marked_not_costed_is_reported_with_its_reason_and_costs_nothing():
    bench = _bench()
    r = bench.cost_row(_not_costed_row(bench), planner=True)
    assert "predicted" not in r and "plan" not in r and "cp=16" in r["not_costed"]
    line = bench.table_row(r)
    assert line[4].startswith("not costed") and line[5] == "-"


def test_summary_counts_only_costed_rows_and_prints_the_reason(capsys):
    bench = _bench()
    costed = {"row": bench.ROWS["megatron-22b"], "published": 1.10, "not_costed": None, "predicted": 1.21,
              "error": 1.21 / 1.10 - 1, "seconds": 0.0}
    skipped = bench.cost_row(_not_costed_row(bench), planner=False)
    bench.print_table([costed, skipped])
    out = capsys.readouterr().out
    assert "summary: 1 rows costed of 2; within +-10 %: 1; within +-15 %: 1" in out
    assert "+10.0%" in out
    assert "note llama3-405b-128k-16384: not costed: cp=16" in out


def test_memory_column_compares_the_predicted_peak_with_the_published_runs_measured_memory(capsys):
    bench = _bench()
    row = bench.ROWS["torchtitan-70b"]
    assert row.published_peak_gib == 71.9  # torchtitan's Table 4, "Memory(GiB)"
    r = {"row": row, "published": row.published, "not_costed": None, "predicted": 900.0,
         "error": 900.0 / row.published - 1, "peak_gib": 75.0, "predicted_step_s": 18.0, "seconds": 0.0}
    assert abs(bench.memory_error(r) - (75.0 / 71.9 - 1)) < 1e-12
    line = bench.table_row(r)
    assert line[bench.HEAD.index("peak GiB")] == "75.0"
    assert line[bench.HEAD.index("published GiB")] == "71.9 (+4.3%)"
    no_pub = {**r, "row": bench.ROWS["megatron-22b"]}  # the paper gives no memory figure
    assert bench.memory_error(no_pub) is None and bench.table_row(no_pub)[bench.HEAD.index("published GiB")] == "-"
    over = {**r, "peak_gib": 98.6}  # +37 %: outside the band
    bench.print_table([r, no_pub, over])
    assert "memory: 2 rows with a published peak; within +-10 %: 1" in capsys.readouterr().out


def test_llama_rows_compare_tflops_in_the_papers_own_flop_count_and_sync_one_block_at_a_time():
    """The Llama 3 rows publish TFLOP/s per GPU in PaLM's count (6 N + 12 L H Q T, N without the
    input embedding): the prediction is converted to that count, never compared in another one;
    their data-parallel buckets are one block's parameters on a tp rank (FSDP units)."""
    bench = _bench()
    row = bench.ROWS["llama3-405b-8k-8192"]
    assert (row.metric, row.published) == ("tflops_per_gpu", 430.0)
    n = 405_853_388_800 - 128_256 * 16_384  # Llama 3.1 405B's parameters but its input embedding
    per_token = bench.source_flops_per_token(row)
    assert per_token == 6.0 * n + 12.0 * 126 * 16_384 * 8_192
    long = bench.ROWS["llama3-405b-128k-16384"]
    assert bench.source_flops_per_token(long) - per_token == 12.0 * 126 * 16_384 * (131_072 - 8_192)
    # tokens/s over the cluster -> TFLOP/s per GPU in that count
    assert abs(bench.figure(row, {"tokens_per_s": 1.0e6, "step_s": 1.0}) - 1.0e6 / 8_192 * per_token / 1e12) < 1e-9
    assert bench.fmt(row, 429.6) == "430 TFLOP/s/GPU"
    # one block: 4 d^2 attention (q, o whole; k, v at 8 of 128 heads) + 3 d ffn + 2 norms, bf16, / tp 8
    block = 2 * 16_384**2 + 2 * 16_384 * 1_024 + 3 * 16_384 * 53_248 + 2 * 16_384
    assert bench.row_pins(row)["bucket_mb"] == block * 2 / 8 / 2**20
    assert "bucket_mb" not in bench.row_pins(bench.ROWS["megatron-175b"])  # DDP's buckets where the source is Megatron
