"""autopar's cost model against published training figures of large public runs, row by row.

    python benchmarks/bench_published.py [--only ROW] [--no-planner] [--breakdown] [--attention unfused|flash]

For each row the published model is built on the meta device, captured (`autopar.capture`),
and its PUBLISHED parallel configuration is costed by the joint planner with every published
dimension pinned (`autopar.search.planner.plan_for(gm, world, hw, pins={"tp", "pp", "dp",
"zero_stage", "n_microbatches", "schedule", "recompute"}, global_batch=...)`: with all axes
pinned the planner costs that one configuration; what it still chooses is only what the
publication does not say: the sharding on tp (sequence parallelism included), the stage split,
fusions, and recompute where it is not pinned). The pinned Plan's `predicted` (step time, TFLOP/s per
GPU in the source's FLOP count, tokens/s) is printed against the published figure, with error =
predicted / published - 1 (for TFLOP/s and tokens/s a positive error means the cost model is
optimistic, for step time pessimistic).
Then `plan_for` runs unpinned on the same model, GPUs and global batch (as
benchmarks/bench_planner.py calls it) and its own plan and prediction are printed beside; a row
whose run computed the loss on vocabulary shards (`Row.loss_parallel`) keeps that loss pinned
there too (the loss is the program's, not a parallel choice: the user's loss function calls
`autopar.cross_entropy`). Until 2026-11-27 the planner planned those rows with the gathered
loss, so its plan could come out slower than the published one under the same model.

Rows and sources (the figures are copied from these; nothing is estimated here):

* megatron-22b/175b/530b/1t -- Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models" (arXiv 2205.05198), A100 80GB, seq 2048: Table 3 (h, heads, layers,
  TP, PP, GPUs, global batch, micro-batch: 4 for 22B, whose global batch is 4; 1 for the
  others), Table 5 (iteration times with sequence parallelism + selective recompute: 1.10 s,
  13.75 s, 37.83 s, 71.49 s), Table 4 (22B, one layer's forward / backward: 7.2 / 11.8 ms with
  sequence parallelism and no recompute, 7.2 / 13.1 ms with selective recompute too; the
  `layer` line of --breakdown). The paper itself was not retrievable with this session's tools;
  the figures are those of issue 22 and of two public transcriptions of the paper's tables found
  by the corpus search (Tables 4 and 5 in both, Table 3 in one), which agree with them.
  Model: a GPT-3 block written below (`GPT3`: learned positions, pre-LayerNorm, fused QKV with
  biases laid out per head as Megatron's ParallelAttention lays it out, causal attention with
  dropout 0.1, 4h GeLU MLP, tied 51,200-token head: Megatron's
  padded GPT-2 vocabulary, which the paper's table does not list), not the Llama-style
  `autopar.models.gpt` (RMSNorm/SwiGLU/RoPE), which is not the paper's model.
  Pins: dp = 1 (GPUs = tp x pp), ZeRO 0 (dp = 1), micro-batches = global batch / Table 3's
  micro-batch (22B: one micro-batch of 4), schedule 1f1b (Megatron's non-interleaved default;
  Table 3 names no interleaving), recompute "selective" on every block: the program the paper
  ran. Megatron-LM then computed attention unfused (baddbmm, fused scale-mask-softmax, dropout,
  bmm: `CoreAttention` in megatron/model/transformer.py at NVIDIA/Megatron-LM cfd2e21607,
  2022-04-28, the selective-recompute commit, which recomputes that core in backward);
  FlashAttention entered Megatron-LM at d693034ecf (2022-12-08). The default `--attention
  unfused` costs that core (kernels sdpa "math", no fp32 upcast: the score matrix is kept) and
  the planner's "selective" blocks (`search.plan_selective`) replay it in backward; they also
  replay the norms and pointwise ops and keep the GEMMs' outputs, the row-parallel ones' partial
  sums included, where Megatron checkpoints the core alone (its layer holds 34 sbh/t bytes, ours
  more). `--attention flash` costs the profile's flash kernel with recompute "none" (no score
  matrix to drop). 2026-11-27, 22B: unfused + selective 1.053 s, one layer 7.03 / 13.57 ms
  against Table 4's 7.2 / 13.1; flash 0.822 s (5.84 / 9.97 ms against 7.2 / 11.8); unfused
  without recompute 0.936 s but 75.9 GiB, OVER (2026-11-26: with the scores kept the pipeline
  rows split unevenly to fit, 175B +6.7 %, 530B +17.0 %, 1T OVER), a memory effect the
  recomputing run did not have. The tied embedding across pipeline
  stages with bf16 parameters is allowed (`ALLOW["zero_with_tied_pp"]`): Megatron runs it,
  autopar's runtime does not yet, and the planner otherwise offers no such candidate.
  Loss: vocabulary-parallel (`Row.loss_parallel`, the planner's "loss_parallel" pin): Megatron-LM
  computes the cross-entropy on the tp shards of the logits, `vocab_parallel_cross_entropy`
  (megatron/mpu/cross_entropy.py at cfd2e21607; megatron/core/tensor_parallel/cross_entropy.py
  today), behind a VocabParallelEmbedding whose weight is the tied output layer's: the planner
  pins that weight S(0) on tp and prices the loss on the shards (`search.shard_loss`).
* llama3-405b-8k-8192 / -16384 / -128k-16384 -- Dubey et al. 2024, "The Llama 3 Herd of Models"
  (arXiv 2407.21783), the table of 4D-parallel configurations: 8,192 GPUs TP8 CP1 PP16 DP64
  seq 8,192, 430 TFLOP/s per GPU (43 % BF16 MFU); 16,384 GPUs TP8 CP1 PP16 DP128 seq 8,192, 400
  (41 %); 16,384 GPUs TP8 CP16 PP16 DP8 seq 131,072, 380 (38 %); 16M tokens per step in all three
  (the same table as shown at SC'24, quoted at glennklockwood.com/garden/llama-3.1). 16M tokens =
  2,048 sequences of 8,192 (batch/DP 32 and 16, micro-batch 1) or 128 of 131,072.
  The published figure is TFLOP/s per GPU in the paper's own FLOP count, the MFU of Chowdhery et
  al. (PaLM; that the paper cites it is recalled, not re-checked with this session's tools):
  `source_flops_per_token` (6 N + 12 L H Q T); the predicted step is converted to the
  same count (tokens/s per GPU x that count), so the error is the step-time error inverted. Until
  2026-11-27 the rows compared MFUs of two FLOP counts (the cost model's FlopCounterMode count,
  +1.4 % at 8,192 tokens and +9.6 % at 131,072 over PaLM's): +17.1 %, +2.9 %, +20.8 %.
  Pins: ZeRO 2 (the paper's FSDP shards optimizer states and gradients but does not reshard
  parameters after forward), micro-batches = batch/DP (micro-batch 1), interleaved_1f1b (the
  paper's schedule is interleaved), recompute left to the planner (not published). The
  data-parallel sync goes one transformer block at a time, as FSDP units do
  (`Row.fsdp_block_buckets`: "bucket_mb" = one block's bf16 parameters on a tp rank, 760 MiB),
  not in DDP's 25 MB buckets: at 25 MB the ring's per-step latency (127 steps of 8 us per
  collective on 128 ranks, ~800 collectives) priced 1.57 s of sync on 16,384 GPUs against 0.54 s
  (assumption: the paper does not say how its FSDP wraps the model; wrapping per block is FSDP's
  and torchtitan's practice).
  The number of virtual stages per rank is not in the sources above: the planner searches it
  (`candidate.virtual_choices`: 2, 3, 4 or 8 for 128 units on 16 ranks) unless
  `--pp-virtual V` pins it (the "pp_virtual" pin; a Row's `vpp` pins it for a source that
  gives it).
  Loss: vocabulary-parallel, as Megatron-LM's (`vocab_parallel_cross_entropy`, see the Megatron
  rows), which the paper's training stack builds on; the rows set `Row.loss_parallel` (an
  assumption: the paper's table does not name the loss kernel). With the logits counted whole
  when gathered, the 8,192-GPU row's pinned plan needed 110.7 GiB (OVER); priced on the shards,
  71.3 GiB (2026-11-26).
  The CP16 row pins cp=16 (pp x cp plans since issue 21: tests/dist/test_pipeline_context.py);
  its graph is captured with a symbolic sequence (`dynamic_seq=True`, ~2 min on meta for 405B
  at 131,072 tokens) and the exchange priced by `search.plan_context` (each pp rank runs its
  stages' attention calls, stretched by the schedule). The captured Llama repeats its 8 kv heads
  to 128 before attention; the context pass exchanges the 8 kv heads themselves
  (`passes.context_attention.unrepeated_kv`) and the price counts them: priced at the repeated
  128 heads, the ring's exposed time was 75x larger (7.56 s of a 23.3 s step, 27.6 % MFU,
  2026-11-26) than at the 8 (0.10 s of 15.9 s, 40.5 %).
* torchtitan-70b -- torchtitan docs/performance.md Table 4 (github.com/pytorch/torchtitan):
  Llama 3.1 70B, 256 H100 (FSDP 32, TP 8), local batch 16, global batch 512, full activation
  checkpointing, torch.compile + Float8, "2D": 829 tokens/s/GPU. Seq 8,192 (torchtitan's
  Llama 3 70B config). Their H100s have 96 GB HBM2e at a 500 W limit (the doc's platform
  note); the profile is h100-sxm (80 GB, 700 W). Float8 linears are not priced by the cost
  model (bf16), so the prediction is expected to be slower than published.
  Pins: ZeRO 3 (FSDP), 1 micro-batch (no accumulation), recompute "full".
  Memory: the run's measured 71.9 GiB per GPU (same table, "Memory(GiB)"; the numbers now sit
  in torchtitan's benchmarks/llama3_h100_202412_torchtitan.md, torchtitan 9dec370) is the
  "published GiB" column. The row runs as torchtitan does, with its loss_parallel: the output
  layer's weight pinned S(0) on tp (ColwiseParallel, Shard(-1) output,
  torchtitan/parallelisms/parallelize_llama.py) and `Plan.loss_parallel`, so the logits stay
  vocabulary-sharded and the cross-entropy runs on the shards (autopar.cross_entropy,
  runtime/vocab_loss.py). The joint planner prices it (the "loss_parallel" pin: the head pinned,
  the loss on the shards in its memory tables and sharding ILP, as `cost.estimate` prices it).
  On 2026-11-26: 98.6 GiB before the vocab-parallel loss (its log-softmax and gradient over all
  128,256 tokens for 16 x 8,192 tokens a rank, 62.6 GiB, but the held logits and their gradient
  counted at a shard's size though the runtime gathers them); 153.4 GiB for the gathered loss
  once the gathered logits are counted whole (cost/loss_memory.py: 4 x 31.3 GiB in bf16, OVER);
  39.1 GiB with the parallel loss (the logits' shard held plus one shard-sized buffer, 2 x 3.9
  GiB), the planner's own figure since it prices the pin (helper-50), -45.6 % against the
  published 71.9. What is left is not priced: torchtitan's loss
  upcasts the logits to fp32 (`cross_entropy_loss`: `pred.flatten(0, 1).float()`), the caching allocator's reserve
  and fragmentation, Float8 and NCCL buffers, torch.compile's workspaces. The planner also
  keeps the attention weights whole on tp (sequence-sharded projections, all-to-alls to and
  from heads) where torchtitan shards them by heads, 9.0 GiB of model state instead of 4.1.
  The rest is as torchtitan runs it: 16 bytes of model state per parameter at ZeRO 3 (fp32
  shard, fp32 gradient, two Adam states; no bf16 shard is kept), one layer input per block
  under full recompute (20.5 GiB), and the same repeat_kv copies of k and v (torchtitan's
  llama model.py calls repeat_kv too).
* ours-1.1b -- measured here: the 1.1 B Llama-style GPT of scripts/gpu_check, bf16-mixed,
  batch 4 x 2048, one H100 (world 1, profile h100-sxm), 123 ms per step (benchmarks/RESULTS.md,
  the "autopar dp" row of the gpu_check table, 2026-11-26; 122 ms on 2026-11-25). It ran with
  the plan's Triton fusions, so it is priced with them (`plan.predicted["with_fusions"]`).

Columns: the plan as costed (the pinned Plan's mesh, ZeRO stage, micro-batches, schedule with
its interleaving depth, recompute units "rcN" the planner added where recompute was not
pinned), the published figure, the predicted one (for MFU and tokens/s rows with the predicted
step time), the error, the predicted peak per GPU ("OVER": the cost model says the published
plan, which ran, does not fit; its time is then priced with no memory limit and a note says
by how much), the unpinned planner's plan and prediction, seconds spent on the row. Then the
number of rows within +-10 % and +-15 %, and notes.

Run time on the shared 2-core machine (load average 4-6 from others' work): 10 min wall, 7 min
CPU (megatron-1t 220 s and megatron-530b 135 s, mostly the unpinned planner over 512 / 280
ranks); `--no-planner` (the published plans only) 6 min wall, 4.5 min CPU. Over the ~5 minute
aim; an OVER row is costed twice (with the limit, then without).

Overlap is priced with the profiles' `contention` (compute beside an in-flight collective runs
1.189 times slower on both GPU profiles, arXiv 2507.03114; `autopar.cost.overlap`) since
2026-11-26: ZeRO gathers, bucketed gradient reductions and pipeline transfers no longer hide
behind compute for free.

Profiles: A100 rows on `a100-80gb`, H100 rows on `h100-sxm`, widened to the row's node count
with `Hardware.with_nodes` as bench_planner does for 405B. Memory limit: the planner's default
(90 % of the device) except torchtitan-70b, whose GPUs have 96 GB (limit 90 % of 96 GB).

Reads and writes no node.meta itself (the planner reads the captured graph's).
Deterministic output except the "seconds" column (time spent on the row).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any

import torch

# plans as data for clusters this machine does not have: recompute inside pipeline stages, and
# a tied embedding / output layer across stages with 16-bit parameters (Megatron all-reduces
# the two copies' gradients between the first and last stage); the runtime runs both today
# (search.planner.RUNTIME_SUPPORT: both True), allowed here whatever those flags say
ALLOW = {"recompute_with_pp": True, "zero_with_tied_pp": True}
UNLIMITED = 2.0**60  # bytes: a memory limit no plan reaches (to price a plan the cost model says cannot fit)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from published_gpt3 import GPT3, GPT3Block  # noqa: E402,F401  (the Megatron rows' model; tests read it here)


# ----------------------------------------------------------------------------- rows
@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    model: tuple  # ("gpt3", h, heads, layers) | ("spec", registry name) | ("gpt", GPTConfig kwargs)
    gpus: int
    profile: str
    seq: int
    global_batch: int  # sequences per step
    pins: dict  # the published plan
    metric: str  # "step_s" | "tflops_per_gpu" (the source's FLOP count, `source_flops_per_token`) | "tokens_per_s_gpu"
    published: float
    source: str
    memory_gb: float | None = None  # device memory of the published run when it differs from the profile's
    published_peak_gib: float | None = None  # the published run's measured memory per GPU, where the source gives it
    not_costed: str | None = None  # why the published plan cannot be priced through the API
    cp: int = 1  # context-parallel degree of the published plan
    vpp: int | None = None  # published virtual stages per pipeline rank (interleaved_1f1b), if given
    layer_ms: tuple[float, float] | None = None  # published (forward, backward) ms of one transformer block per step
    layer_ms_rc: tuple[float, float] | None = None  # the same, the block recomputed as the row's run recomputed it
    loss_parallel: bool = False  # the run kept the logits vocab-sharded (torchtitan's loss_parallel, Megatron's
    # vocab_parallel_cross_entropy): the planner's "loss_parallel" pin
    our_fusions: bool = False  # the run was autopar's, with the plan's Triton fusions: priced with them
    # (`plan.predicted["with_fusions"]`, search/plan_write.price_fusions), as it ran
    fsdp_block_buckets: bool = False  # the run's data-parallel sync went one transformer block at a time (FSDP
    # units): the "bucket_mb" pin is one block's parameters on a rank (`block_bucket_mb`), not DDP's 25 MB


def _mega(key, h, a, L, tp, pp, batch, t, micro=1, layer_ms=None, layer_ms_rc=None):
    return Row(key, ("gpt3", h, a, L), tp * pp, "a100-80gb", 2048, batch,
               {"tp": tp, "pp": pp, "dp": 1, "zero_stage": 0, "n_microbatches": batch // micro,
                "recompute": "selective", **({"schedule": "1f1b"} if pp > 1 else {})}, "step_s", t,
               "Korthikanti et al. 2022, Table 5", layer_ms=layer_ms, layer_ms_rc=layer_ms_rc,
               loss_parallel=True)  # Megatron-LM's vocab_parallel_cross_entropy


def _llama(key, gpus, dp, per_dp, tflops, seq=8192, cp=1):
    return Row(key, ("spec", "llama3-405b"), gpus, "h100-sxm", seq, dp * per_dp,
               {"tp": 8, "pp": 16, "dp": dp, "zero_stage": 2, "n_microbatches": per_dp, "schedule": "interleaved_1f1b",
                **({"cp": cp} if cp > 1 else {})},
               "tflops_per_gpu", tflops, "Llama 3 paper, Table 4", cp=cp,
               loss_parallel=True, fsdp_block_buckets=True)  # vocab-parallel loss; FSDP per block (docstring)


OURS_1B = dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=2048,
               rope_theta=500000.0)

ROWS: dict[str, Row] = {r.key: r for r in [
    Row("ours-1.1b", ("gpt", OURS_1B), 1, "h100-sxm", 2048, 4, {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0,
        "n_microbatches": 1, "recompute": "none"}, "step_s", 0.123, "benchmarks/RESULTS.md gpu_check, measured",
        our_fusions=True),
    _mega("megatron-22b", 6144, 64, 48, 8, 1, 4, 1.10, micro=4,  # Table 3: micro-batch 4 = the global batch
          layer_ms=(7.2, 11.8), layer_ms_rc=(7.2, 13.1)),  # Table 4: SP; SP + selective recompute
    _mega("megatron-175b", 12288, 96, 96, 8, 8, 64, 13.75),
    _mega("megatron-530b", 20480, 128, 105, 8, 35, 280, 37.83),
    _mega("megatron-1t", 25600, 160, 128, 8, 64, 512, 71.49),
    Row("torchtitan-70b", ("spec", "llama3-70b"), 256, "h100-sxm", 8192, 512,
        {"tp": 8, "pp": 1, "dp": 32, "zero_stage": 3, "n_microbatches": 1, "recompute": "full",
         "param_layouts": {"lm_head.weight": {"tp": "S(0)"}}},  # ColwiseParallel output, Shard(-1)
        "tokens_per_s_gpu", 829.0, "torchtitan docs/performance.md, Table 4 (Float8)", memory_gb=96.0,
        published_peak_gib=71.9, loss_parallel=True),
    _llama("llama3-405b-8k-8192", 8192, 64, 32, 430.0),  # TFLOP/s per GPU (43 % BF16 MFU)
    _llama("llama3-405b-8k-16384", 16384, 128, 16, 400.0),  # (41 %)
    _llama("llama3-405b-128k-16384", 16384, 8, 16, 380.0, seq=131072, cp=16),  # (38 %)
]}


_CAPTURED: dict[tuple, Any] = {}


def build_and_capture(row: Row):
    """The row's model built on meta and captured with 2 rows (the batch dim stays symbolic);
    rows with the same model and sequence length share one capture."""
    key = (repr(row.model), row.seq)
    if key not in _CAPTURED:
        _CAPTURED.clear()  # one graph at a time: a 405B graph is not small
        _CAPTURED[key] = _build_and_capture(row)
    return _CAPTURED[key]


def _build_and_capture(row: Row):
    from autopar.capture import capture
    from autopar.models import GPT, GPTConfig, get

    kind = row.model[0]
    with torch.device("meta"):
        if kind == "gpt3":
            _, h, a, L = row.model
            model = GPT3(h, a, L, seq=row.seq).to(torch.bfloat16)
        elif kind == "gpt":
            model = GPT(GPTConfig(**row.model[1])).to(torch.bfloat16)
        else:
            model = get(row.model[1]).build().to(torch.bfloat16)
    idx = torch.empty(2, row.seq, dtype=torch.long, device="meta")
    return capture(model, (idx,), dynamic_seq=row.cp > 1)  # cp plans need the sequence symbolic


# the attention kernels a row's model can be costed with (`--attention`): the profile's own ("flash"), or
# the unfused core 2022 Megatron-LM ran (score matrix materialised in 16-bit: FusedScaleMaskSoftmax, dropout,
# bmm), the profile's kernels with sdpa "math" and no fp32 upcast; only the Megatron rows ("gpt3") take it
ATTENTION = {"flash": {}, "unfused": {"sdpa": "math", "sdpa_math_upcast": False}}


def hardware(row: Row, attention: str = "unfused"):
    from autopar.cost import load_profile

    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: choose one of {sorted(ATTENTION)}")
    hw = load_profile(row.profile)
    if row.gpus > hw.world_size:
        hw = hw.with_nodes(-(-row.gpus // hw.gpus_per_node))
    if ATTENTION[attention] and row.model[0] == "gpt3":
        hw = dataclasses.replace(hw, kernels={**hw.kernels, **ATTENTION[attention]})
    return hw


def as_ran(row: Row, plan) -> dict:
    """The plan's predicted figures as the row's run ran: with autopar's fusions where it had them."""
    return {**plan.predicted, **plan.predicted.get("with_fusions", {})} if row.our_fusions else plan.predicted


def source_flops_per_token(row: Row) -> float:
    """FLOPs per token of forward + backward as the row's source counts them, for a
    "tflops_per_gpu" row: PaLM's model-FLOPs count (Chowdhery et al. 2022, arXiv 2204.02311,
    Appendix B), which the Llama 3 paper names for its MFU: 6 N + 12 L H Q T, N the parameters
    but the input embedding (a lookup, no matmul; torchtitan's `get_num_flop_per_token` convention),
    L layers, H heads, Q head dim, T the sequence; attention counted whole, causal or not.
    (The cost model's own count, FlopCounterMode's, times the causal attention at half its score
    matrix but counts flash's backward as five matmuls, 14 L H Q T; the paper's figures are in
    its own count, so the prediction is converted to it, never the published figure to ours.)"""
    from autopar.models import get

    if row.model[0] != "spec":
        raise ValueError(f"{row.key}: a source FLOP count needs a registry model, got {row.model!r}")
    cfg = get(row.model[1]).config
    return 6.0 * _counts(row.model[1])[0] + 12.0 * cfg.n_layers * cfg.dim * row.seq  # H Q = dim


def block_bucket_mb(row: Row) -> float:
    """MiB of one transformer block's parameters on a rank (its tp shard, in bf16): the
    data-parallel payload of one FSDP unit, for a row with `fsdp_block_buckets`."""
    return _counts(row.model[1])[1] * 2 / row.pins.get("tp", 1) / 2**20


_COUNTS: dict[str, tuple[int, int]] = {}  # registry name -> (parameters but the input embedding, one block's)


def _counts(name: str) -> tuple[int, int]:
    """The registry model's parameter counts, from one build on meta (a 405B build takes a second)."""
    from autopar.models import get

    if name not in _COUNTS:
        with torch.device("meta"):
            model = get(name).build()
        _COUNTS[name] = (sum(p.numel() for p in model.parameters()) - model.tok_emb.weight.numel(),
                         sum(p.numel() for p in model.layers[0].parameters()))
    return _COUNTS[name]


def figure(row: Row, predicted: dict) -> float:
    """The predicted figure in the published metric."""
    if row.metric == "step_s":
        return float(predicted["step_s"])
    per_gpu = float(predicted["tokens_per_s"]) / row.gpus  # (not in with_fusions: no fused row measures tokens/s)
    if row.metric == "tflops_per_gpu":
        return per_gpu * source_flops_per_token(row) / 1e12
    return per_gpu


def fmt(row: Row, v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    if row.metric == "step_s":
        return f"{v:.3f} s"
    if row.metric == "tflops_per_gpu":
        return f"{v:.0f} TFLOP/s/GPU"
    return f"{v:,.0f} tok/s/GPU"


def plan_label(plan) -> str:
    m = plan.mesh
    parts = [f"tp{m.get('tp', 1)}", f"pp{m.get('pp', 1)}", f"dp{m.get('dp', 1)}"]
    if m.get("cp", 1) > 1:
        parts.append(f"cp{m['cp']} {(plan.extra.get('context') or {}).get('method', '')}".rstrip())
    parts += [f"Z{plan.zero_stage}", f"mb{plan.n_microbatches}"]
    if m.get("pp", 1) > 1 and plan.schedule:
        v = plan.extra.get("pp_virtual", 1)
        parts.append(str(plan.schedule) + (f"(v{v})" if v > 1 else ""))
    rc = plan.recompute
    n_rc = len(rc) if isinstance(rc, dict) else (0 if rc in (None, "none") else rc)
    if n_rc:
        parts.append(f"rc{n_rc}" if isinstance(n_rc, int) else f"rc:{n_rc}")
    return " ".join(parts)


def published_label(row: Row) -> str:
    p = row.pins
    return (f"tp{p['tp']} pp{p['pp']} dp{p['dp']}" + (f" cp{row.cp}" if row.cp > 1 else "")
            + f" Z{p['zero_stage']} mb{p['n_microbatches']}" + (f" {p['schedule']}" if "schedule" in p else ""))


def row_pins(row: Row, pp_virtual: int | None = None) -> dict[str, Any]:
    """The row's published plan as planner pins; `pp_virtual` (else the row's own `vpp`) pins
    the virtual stages per rank of an interleaved schedule (otherwise the planner searches it)."""
    pins = dict(row.pins, **({"loss_parallel": True} if row.loss_parallel else {}))
    if row.fsdp_block_buckets:
        pins["bucket_mb"] = block_bucket_mb(row)
    v = pp_virtual or row.vpp
    if v and pins.get("schedule") == "interleaved_1f1b":
        pins["pp_virtual"] = v
    return pins


def cost_row(row: Row, planner: bool = True, pp_virtual: int | None = None, attention: str = "unfused") -> dict[str, Any]:
    """Cost the row's published plan (and, with `planner`, plan it freely). Returns a dict:
    predicted, published, error (predicted / published - 1), plan (the pinned Plan), and
    planner_plan / planner_figure when planned; `not_costed` with the reason instead.
    `pp_virtual`: the interleaved rows' virtual stages per rank (`row_pins`); `attention`: a key of
    `ATTENTION` (the Megatron rows' attention kernels)."""
    from autopar.search.planner import plan_for

    t0 = time.perf_counter()
    out: dict[str, Any] = {"row": row, "published": row.published, "not_costed": row.not_costed, "attention": attention}
    if row.not_costed:
        out["seconds"] = time.perf_counter() - t0
        return out
    gm = build_and_capture(row)
    hw = hardware(row, attention)
    limit = 0.9 * row.memory_gb * 2**30 if row.memory_gb else None
    pins = row_pins(row, pp_virtual)
    if row.model[0] == "gpt3" and attention == "flash":  # no score matrix kept: the paper's selective recompute has
        pins["recompute"] = "none"  # nothing to drop (flash's backward replays the core itself)
    pinned = dict(pins=pins, global_batch=row.global_batch, allow=ALLOW, top_k=1, precision={"offload": False})
    try:
        plan, _ = plan_for(gm, row.gpus, hw, memory_limit=limit, **pinned)
    except ValueError as e:
        if "fits the memory limit" not in str(e):
            raise
        # the cost model says the published plan does not fit, though it ran: price its time
        # anyway with no memory limit, and flag the row with the predicted peak
        out["over_memory"] = str(e)
        plan, _ = plan_for(gm, row.gpus, hw, memory_limit=UNLIMITED, **pinned)
    out["plan"] = plan
    pred = as_ran(row, plan)
    out["predicted"] = figure(row, pred)
    out["error"] = out["predicted"] / row.published - 1
    out["peak_gib"] = float(pred["peak_bytes"]) / 2**30
    out["predicted_step_s"] = float(pred["step_s"])
    if row.loss_parallel and not plan.loss_parallel:
        raise RuntimeError(f"{row.key}: the planner did not write loss_parallel into the pinned plan")
    if planner:
        try:
            pplan, _ = plan_for(gm, row.gpus, hw, global_batch=row.global_batch, allow=ALLOW, memory_limit=limit,
                                top_k=1, pins={"loss_parallel": True} if row.loss_parallel else None)
            out["planner_plan"] = pplan
            out["planner_figure"] = figure(row, as_ran(row, pplan))
        except ValueError as e:
            out["planner_error"] = str(e)
    out["seconds"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- table
HEAD = ["row", "GPUs", "published plan (as costed)", "published", "predicted", "error", "peak GiB",
        "published GiB", "planner's plan", "planner predicts", "s"]


def memory_error(r: dict) -> float | None:
    """Predicted peak / the published run's measured memory - 1 (None without both)."""
    pub = r["row"].published_peak_gib
    return r["peak_gib"] / pub - 1 if pub and "peak_gib" in r else None


def table_row(r: dict) -> list[str]:
    row = r["row"]
    pred = r.get("predicted")
    err = r.get("error")
    pp = r.get("planner_plan")
    return [row.key, f"{row.gpus:,}", plan_label(r["plan"]) if "plan" in r else published_label(row),
            fmt(row, row.published),
            (fmt(row, pred) + (f" ({r['predicted_step_s']:.2f} s)" if row.metric != "step_s" else ""))
            if pred is not None else "not costed (note)",
            f"{err:+.1%}" if err is not None else "-",
            (f"{r['peak_gib']:.1f}" + (" OVER" if r.get("over_memory") else "")) if "peak_gib" in r else "-",
            (f"{row.published_peak_gib:.1f}" + (f" ({memory_error(r):+.1%})" if memory_error(r) is not None else ""))
            if row.published_peak_gib else "-",
            plan_label(pp) if pp is not None else (r.get("planner_error", "-") if "planner_error" in r else "-"),
            fmt(row, r.get("planner_figure")), f"{r['seconds']:.1f}"]


def print_table(results: list[dict]) -> None:
    rows = [HEAD] + [table_row(r) for r in results]
    widths = [max(len(x[i]) for x in rows) for i in range(len(HEAD))]
    for x in rows:
        print(" | ".join(c.ljust(w) if i < len(HEAD) - 1 else c for i, (c, w) in enumerate(zip(x, widths))).rstrip())
    errs = [abs(r["error"]) for r in results if r.get("error") is not None]
    n10 = sum(e <= 0.10 for e in errs)
    n15 = sum(e <= 0.15 for e in errs)
    print(f"summary: {len(errs)} rows costed of {len(results)}; within +-10 %: {n10}; within +-15 %: {n15}")
    mem = [abs(e) for e in (memory_error(r) for r in results) if e is not None]
    if mem:
        print(f"memory: {len(mem)} rows with a published peak; within +-10 %: {sum(e <= 0.10 for e in mem)}")
    for r in results:
        key = r["row"].key
        if r.get("not_costed"):
            print(f"note {key}: not costed: {r['not_costed']}")
        if r.get("over_memory"):
            print(f"note {key}: OVER: the cost model rejects the published plan, which ran: {r['over_memory']}; "
                  "its time is priced with no memory limit")
        if r.get("planner_error"):
            print(f"note {key}: the planner found no plan: {r['planner_error']}")
        if r["row"].loss_parallel and "plan" in r:
            print(f"note {key}: loss_parallel: the pinned plan priced with the vocab-parallel loss (the planner's "
                  f"'loss_parallel' pin), peak {r['peak_gib']:.1f} GiB")


def breakdown(r: dict) -> str:
    """One line of where the pinned plan's predicted step goes: the busiest rank's compute
    (recompute included), the pipeline bubble, each axis's exposed communication, the optimizer,
    and the stage split (units per stage, fewest-most) with its recomputed blocks."""
    p = r["plan"].predicted
    comm = ", ".join(f"{a} {v.get('exposed_s', 0.0):.3g} s" for a, v in sorted((p.get("comm_per_axis") or {}).items()))
    plan = r["plan"]
    sizes = []
    if plan.split_points:
        from autopar.passes.split_pipeline import pipeline_units
        names = [u.name for u in pipeline_units(build_and_capture(r["row"]))]  # the row's graph (cached)
        starts = [0] + [names.index(x) for x in plan.split_points] + [len(names)]
        sizes = [b - a for a, b in zip(starts, starts[1:])]
    rc = plan.recompute
    n_rc = len(rc) if isinstance(rc, dict) else 0
    split = (f"; units per stage {min(sizes)}-{max(sizes)}" if sizes else "") + (f"; {n_rc} blocks recomputed" if n_rc else "")
    return (f"breakdown {r['row'].key}: step {p['step_s']:.4g} s = compute {p['compute_s']:.4g} s (recompute "
            f"{p.get('recompute_s', 0.0):.3g} s) with bubble {p.get('bubble', 0.0):.1%}; exposed comm: {comm or '-'}; "
            f"optimizer {p.get('optimizer_s', 0.0):.3g} s{split}")


def layer_times(r: dict, layer: str = "layers.1") -> tuple[float, float]:
    """(forward, backward) seconds of one transformer block in the pinned plan's step, all its
    micro-batches: each node's time on its rank (`cost.node_time.NodeTimer` with the plan's layout
    divisors) plus the tensor-parallel conversions it consumes (`cost.tp_conversions.node_tp_seconds`,
    half forward, half backward, as the planner charges them): the cost model's side of a source
    that times one layer (`Row.layer_ms`)."""
    from autopar.cost import analyze
    from autopar.cost.comm import axis_links
    from autopar.cost.node_time import NodeTimer, layout_divisors
    from autopar.cost.timeline import region_recompute, regions_for
    from autopar.cost.tp_conversions import node_tp_seconds

    row, plan = r["row"], r["plan"]
    gm = build_and_capture(row)
    hw = hardware(row, r.get("attention", "unfused"))
    gc = analyze(gm, hw)
    values = gc.values({"b": row.global_batch // (plan.mesh.get("dp", 1) * plan.n_microbatches)})
    timer = NodeTimer(hw, values, compute_dtype=plan.param_dtype)
    div, _ = layout_divisors(gc, plan)
    tp = node_tp_seconds(gm, gc, plan, values, axis_links(hw, plan.mesh), hw.kernel_overhead_s) or {}
    f = b = 0.0
    for n in gc.nodes:
        if n.layer == layer:
            nf, nb = timer.node(n, div.get(n.index, 1))
            f, b = f + nf + tp.get(n.index, 0.0) / 2, b + nb + tp.get(n.index, 0.0) / 2
    if f == 0.0:
        raise ValueError(f"{row.key}: no node of block {layer!r} in the captured graph; name a block it has")
    mode = (plan.recompute or {}).get(layer, "none")
    if mode != "none":  # its checkpoint region's replay, in its backward (the walk estimate makes)
        save = (plan.extra.get("recompute_save") or {}).get(layer)
        (region,) = regions_for(gc, {layer: mode}, {layer: save} if save is not None else None)
        b += region_recompute(gc, region, values, hardware=hw, compute_divisor=div)[1]
    return f * plan.n_microbatches, b * plan.n_microbatches


def layer_line(r: dict) -> str:
    """One line of a row's predicted block time against its source's per-layer figure."""
    f, b = layer_times(r)
    recomputed = (r["plan"].recompute or {}).get("layers.1", "none") != "none"
    pf, pb = r["row"].layer_ms_rc if recomputed and r["row"].layer_ms_rc else r["row"].layer_ms
    return (f"layer {r['row'].key}: one block forward {f * 1e3:.2f} ms (published {pf} ms, {f * 1e3 / pf - 1:+.1%}), "
            f"backward {b * 1e3:.2f} ms (published {pb} ms, {b * 1e3 / pb - 1:+.1%})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(ROWS), action="append", help="run only this row (repeatable)")
    ap.add_argument("--no-planner", action="store_true", help="cost the published plans only")
    ap.add_argument("--breakdown", action="store_true",
                    help="after the table, where each pinned plan's predicted step goes (compute, bubble, comm)")
    ap.add_argument("--pp-virtual", type=int, default=None, metavar="V",
                    help="pin the virtual stages per rank of the interleaved rows (default: searched)")
    ap.add_argument("--attention", choices=sorted(ATTENTION), default="unfused",
                    help="the Megatron rows' attention: the unfused core 2022 Megatron-LM ran (default; blocks "
                         "recomputed selective, as the paper's runs) or the profile's flash kernel (no recompute)")
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}; error = predicted / published - 1; Megatron rows' attention: {a.attention}")
    results = []
    for key, row in ROWS.items():
        if a.only and key not in a.only:
            continue
        results.append(cost_row(row, planner=not a.no_planner, pp_virtual=a.pp_virtual, attention=a.attention))
        print(f"  {key}: done in {results[-1]['seconds']:.1f} s", flush=True)
        if a.breakdown and "plan" in results[-1]:
            results[-1]["breakdown"] = breakdown(results[-1])  # while the row's graph is the captured one
            if row.layer_ms:
                results[-1]["breakdown"] += "\n" + layer_line(results[-1])
    print_table(results)
    for r in results:
        if r.get("breakdown"):
            print(r["breakdown"])


if __name__ == "__main__":
    main()
