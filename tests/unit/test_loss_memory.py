"""The cost model of the loss on the logits (autopar/cost/loss_memory.py), one process.

A GPT whose logits dominate its activations (vocabulary 2048, width 32, one block) is captured
and costed on tp=2 with a column-parallel head (`lm_head.weight` S(0), its output S(2)):

* gathered (no `loss_parallel`): each tp rank holds all the logits L = B*T*V*4 bytes, and the
  step's peak is at the loss's backward with 4 L (the outputs, the log-softmax, its gradient and
  the outputs' gradient: `memory.CROSS_ENTROPY`);
* `plan.loss_parallel`: the logits stay sharded, L/2 a rank, and the vocab-parallel loss holds
  the outputs and one buffer (the shard's softmax, then its gradient): 2 x L/2; the peak then
  moves to the head's backward, where that gradient meets the head's input gradient
  (B*T*C*4) and its weight's gradient shard (V/2*C*4).

So the estimate's peak drops by 4 L - (L/2 + L/2 + B*T*C*4 + V/2*C*4), computed here from the
shapes (everything else alive at both points is the same), and the parallel plan prices the
loss's two all-reduces on tp (B*T maxima, then 2 x B*T sums, fp32).
"""
import torch
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.plan import Plan
from autopar.runtime.placement import Layout, R, Shard

from autopar.capture import capture
from autopar.cost import analyze, estimate

B, T, V, C = 4, 32, 2048, 32


def _graph():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, dim=C, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=T))
    return capture(model, (torch.randint(0, V, (B, T)),))


def _plan(loss_parallel: bool) -> Plan:
    plan = Plan(mesh={"tp": 2}, dp_axis=None, param_layouts={"lm_head.weight": Layout.of({"tp": Shard(0)})},
                node_layouts={"lm_head:linear#0": Layout.of({"tp": Shard(2)})})
    plan.loss_parallel = loss_parallel
    return plan


def test_estimate_peak_drops_by_the_gathered_logits_under_loss_parallel():
    gc = analyze(_graph(), "h100-sxm")
    gathered = estimate(gc, _plan(False), "h100-sxm")
    parallel = estimate(gc, _plan(True), "h100-sxm")
    logits = B * T * V * 4  # fp32
    assert gathered.memory["params"] == parallel.memory["params"]
    drop = gathered.memory["peak"] - parallel.memory["peak"]
    head_grads = B * T * C * 4 + V // 2 * C * 4  # the head's input gradient and its weight's gradient shard
    assert drop == 4 * logits - (logits // 2 + logits // 2 + head_grads), (drop, logits)
    # the loss's all-reduces on tp: one max per token (fp32), then sum of exp + target logit per token
    ar = [r for r in parallel.comm if r.op == "all_reduce" and r.axis == "tp"]
    assert [r.calls for r in ar] == [2] and ar[0].payload_bytes == B * T * 4 + 2 * B * T * 4, ar
    assert not [r for r in gathered.comm if r.op == "all_reduce" and r.axis == "tp"]


def test_a_replicated_head_prices_the_same_with_or_without_loss_parallel():
    """No output is vocab-sharded (the head replicated): loss_parallel changes nothing."""
    gc = analyze(_graph(), "h100-sxm")
    plans = []
    for on in (False, True):
        p = Plan(mesh={"tp": 2}, dp_axis=None, node_layouts={"lm_head:linear#0": Layout.of({"tp": R})})
        p.loss_parallel = on
        plans.append(estimate(gc, p, "h100-sxm"))
    assert plans[0].memory["peak"] == plans[1].memory["peak"]
    assert plans[0].comm == plans[1].comm


def test_plan_loss_parallel_round_trips_through_json():
    p = _plan(True)
    assert Plan.from_json(p.to_json()).loss_parallel is True
    assert Plan.from_json(_plan(False).to_json()).loss_parallel is False
