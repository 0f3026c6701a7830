"""Overlap under contention (issue 22, item 3): compute beside a collective in flight runs
(1 + k) times slower, k the profile's `contention` for the collective's link; what is exposed is
what cannot hide behind the slowed compute. Profiles state k, `cost.overlap` models it, and
`cost.estimate` and the planner's cost model (`search.plan_cost`, `search.plan_comm`) apply it
where collectives overlap compute, and nowhere else; the context-parallel ring's hops
(`search.context.price_context`, the one price both read) are priced with the same model."""
from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import captured  # noqa: E402

import autopar  # noqa: E402
from autopar.cost import estimate, load_profile  # noqa: E402
from autopar.cost.comm import axis_links  # noqa: E402
from autopar.cost.hardware import from_dict  # noqa: E402
from autopar.cost.overlap import CommStream, overlap_extra, slowdown  # noqa: E402
from autopar.passes.plan import Plan  # noqa: E402

K = 0.189  # the shipped GPU figure (arXiv 2507.03114: 18.9 % mean compute slowdown under overlap)


def test_profiles_state_contention_per_link_and_reject_bad_values(tmp_path):
    for name in ("h100-sxm", "h200", "h100-64", "a100-40gb", "a100-80gb"):
        hw = load_profile(name)
        assert hw.contention_for(False) == K and hw.contention_for(True) == K, name
    cpu = load_profile("cpu-gloo")
    assert cpu.contention_for(False) == 0.0 and cpu.contention_for(True) == 0.0
    from autopar.cost.hardware import PROFILE_DIR

    cited = json.loads((PROFILE_DIR / "h100-sxm.json").read_text())["contention"]["source"]
    assert "https://arxiv.org/abs/2507.03114" in cited and "18.9 %" in cited  # the figure and where it is from
    # a profile extending another overrides one link's figure and inherits the other
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"name": "mine", "extends": "h100-sxm", "topology": {"nodes": 2},
                             "contention": {"inter_node": 0.3}}))
    hw = load_profile(p)
    assert (hw.contention_for(False), hw.contention_for(True)) == (K, 0.3)
    links = axis_links(hw, {"dp": 2, "tp": 8})  # tp inside a node, dp across the two
    assert (links["tp"].contention, links["dp"].contention) == (K, 0.3)
    assert from_dict(hw.to_dict()).contention == hw.contention  # a saved profile keeps it
    assert hw.with_contention(0.05).contention == {"intra_node": 0.05, "inter_node": 0.05}
    for bad, said in (({"intra_node": -0.1}, "-0.1"), ({"intra_node": "x"}, "'x'"), ({"intra": 0.1}, "intra")):
        p.write_text(json.dumps({"name": "bad", "extends": "h100-sxm", "contention": bad}))
        with pytest.raises(ValueError, match="contention") as e:
            load_profile(p)
        assert said in str(e.value)


def test_exposure_is_what_cannot_hide_behind_the_slowed_compute_by_hand():
    k = 0.25
    # 1 s of compute beside a 3 s collective: the compute stretches to 1.25 s, 1.75 s stays exposed
    s = CommStream(k)
    s.issue(0.0, 3.0)
    end = s.run(0.0, 1.0)
    assert end == pytest.approx(1.25) and s.free - end == pytest.approx(max(0.0, 3.0 - 1.0 * (1 + k)))
    assert overlap_extra(1.0, 3.0, k) == pytest.approx(1.75 + 0.25)  # exposed + slowdown = 3 - 1
    # 4 s of compute beside a 2 s collective: 1.6 s of work done under it, nothing exposed
    s = CommStream(k)
    s.issue(0.0, 2.0)
    assert s.run(0.0, 4.0) == pytest.approx(4.4) and overlap_extra(4.0, 2.0, k) == pytest.approx(0.4)
    assert slowdown(4.0, 2.0, k) == pytest.approx(0.25 * 1.6) and slowdown(1.0, 3.0, k) == pytest.approx(0.25)
    # no contention: plain overlap
    assert overlap_extra(1.0, 3.0, 0.0) == 2.0 and overlap_extra(4.0, 2.0, 0.0) == 0.0 and slowdown(4.0, 2.0, 0.0) == 0
    # gaps run at full speed; back-to-back collectives are one busy interval
    s = CommStream(1.0)
    s.issue(1.0, 1.0)
    s.issue(5.0, 1.0)
    assert [s.run(0.0, w) for w in (4.0, 5.0, 6.0)] == pytest.approx([4.5, 6.0, 7.0])  # 4.5 s of work by t = 5
    s = CommStream(1.0)
    s.issue(0.0, 1.0)
    s.issue(0.0, 1.0)
    assert s.free == 2.0 and s.run(0.0, 1.0) == pytest.approx(2.0)


def test_planner_terms_by_hand():
    """`plan_comm.zero3_exposed` and `cost.pipeline_time.dp_sync` (which `plan_comm.dp_sync` calls
    on estimate's per-node pieces) on arrays whose times are their payloads."""
    from autopar.cost.pipeline_time import dp_sync
    from autopar.search.plan_comm import zero3_exposed

    def link(k):
        return SimpleNamespace(time=lambda op, x: float(x), bytes_sent=lambda op, x: float(x), contention=k)

    st = SimpleNamespace(gather=np.array([0.5, 1.0, 3.0]), grad_payload=np.zeros(3))
    fwd = np.array([1.0, 1.0, 1.0])
    for k, want in ((0.0, [0.5, 0.0, 2.0]), (0.25, [0.5, 0.25 * 0.8, 1.75 + 0.25])):
        f, _ = zero3_exposed(fwd, np.zeros(3), st, link(k))
        assert f.tolist() == pytest.approx(want), k
    # gradient sync: two units of 2 bytes (2 s each), buckets of 2; backward: unit 1 (1 s) then unit 0 (4 s).
    # k = 0: [1, 3] and [5, 7]: 2 s exposed. k = 0.25: unit 0's compute does 1.6 s of work under
    # the first bucket and ends at 5.4; the second bucket [5.4, 7.4] is exposed: 2 + 0.4
    B_u = np.array([4.0, 1.0])
    for k, want in ((0.0, 2.0), (0.25, 2.0 + 0.25 * 1.6)):
        exposed, after, t, _b = dp_sync([0], [0], [2], [5.0], B_u, 5.0, [2.0, 2.0], [0.0, 0.0], link(k), 0, 2, 1,
                                        (2.0, 2.0))
        assert (exposed, after, t) == pytest.approx((want, 0.0, 4.0)), k


def test_virtual_stages_reduce_their_gradients_as_their_last_backward_makes_them():
    """Interleaved ranks hold several stages, each with its own engine whose last backward
    launches its buckets (`runtime.pipeline`): stage 1's bucket (3 s) goes out when its last
    backward [0, 1] ends and is done by 4, before stage 0's backward [5, 6] ends; only stage 0's
    bucket (1 s) is exposed. Without the windows both wait for the rank's last backward: 3 s."""
    from autopar.cost.pipeline_time import dp_sync, simulate_ranks
    from autopar.cost.schedule import Kind, make_schedule

    link = SimpleNamespace(time=lambda op, x: float(x), bytes_sent=lambda op, x: float(x), contention=0.0)
    pay, gat = [1.0, 3.0], [0.0, 0.0]
    args = ([0, 1], [0, 1], [1, 2], [1.0, 1.0], [1.0, 1.0], 6.0, pay, gat, link, 0, 2, 4, (10.0, 10.0))
    assert dp_sync(*args, {0: (5.0, 6.0), 1: (0.0, 1.0)})[0] == pytest.approx(1.0)
    assert dp_sync(*args)[0] == pytest.approx(3.0)  # old rule: both ready at 5
    # the windows simulate_ranks gives are each stage's last B (or W) on its rank
    sched = make_schedule("interleaved_1f1b", 2, 4, 2)
    ends, _busy, _bubble, windows = simulate_ranks(sched, [1.0] * 4, [2.0] * 4, [0.1] * 3)
    assert sorted(windows) == [0, 1, 2, 3]
    for r in range(2):
        mine = sched.stages_of(r)
        assert max(windows[s][1] for s in mine) == pytest.approx(ends[r])
        assert windows[min(mine)][1] == pytest.approx(ends[r])  # the lowest stage finishes the rank
        assert windows[max(mine)][1] < ends[r] - 2.0  # its other stage's gradients are made earlier
    zb = make_schedule("zb_h1", 2, 4)
    _e, _b, _f, w = simulate_ranks(zb, [1.0] * 2, [2.0] * 2, [0.1])
    assert all(w[s][1] - w[s][0] == pytest.approx(1.0) for s in (0, 1))  # its last W: half a B
    assert all(a.kind != Kind.B for acts in zb.actions for a in acts)


def test_estimate_slows_only_compute_that_a_collective_overlaps():
    _, _, gm = captured("gpt-tiny")
    hw = load_profile("h100-8x")
    hw0 = hw.with_contention(0.0)
    one = estimate(gm, None, hw)  # no collective: nothing changes
    assert one.step_s == estimate(gm, None, hw0).step_s and one.contention_s == 0.0
    # one bucket, ready when backward ends: nothing overlaps it
    whole = Plan(mesh={"dp": 8}, bucket_mb=25.0)
    a, b = estimate(gm, whole, hw0), estimate(gm, whole, hw)
    assert b.step_s == a.step_s and b.contention_s == 0.0 and b.comm_exposed_s == a.comm_exposed_s > 0
    # buckets reduced while backward runs, ZeRO-3 gathers under forward and backward: slower
    for plan in (Plan(mesh={"dp": 8}, bucket_mb=0.05), Plan(mesh={"dp": 8}, bucket_mb=0.05, zero_stage=2),
                 Plan(mesh={"dp": 8}, zero_stage=3)):
        a, b = estimate(gm, plan, hw0), estimate(gm, plan, hw)
        assert b.contention_s > 0 and a.contention_s == 0, plan.zero_stage
        # the fluid model: at most k / (1 + k) of the communication's time is compute slowed
        assert b.contention_s <= K / (1 + K) * b.comm_s * (1 + 1e-9)
        assert b.step_s > a.step_s and b.step_s - a.step_s <= b.contention_s * (1 + 1e-9) + 1e-15, plan.zero_stage
        assert b.comm_exposed_s >= b.contention_s and b.summary()["contention_s"] == b.contention_s
    z3a, z3b = estimate(gm, Plan(mesh={"dp": 8}, zero_stage=3), hw0), estimate(gm, Plan(mesh={"dp": 8}, zero_stage=3), hw)
    assert z3b.fwd_s > z3a.fwd_s  # the forward's compute runs beside the prefetched gathers
    # the CPU profile's contention is 0: its figures are what plain overlap gives
    cpu = load_profile("cpu-gloo")
    plan = Plan(mesh={"dp": 4}, bucket_mb=0.05, zero_stage=2)
    assert estimate(gm, plan, cpu).step_s == estimate(gm, plan, cpu.with_contention(0.0)).step_s


def test_planner_prices_contention_where_estimate_does_and_on_pipeline_transfers():
    from autopar.models import get
    from autopar.search.plan_cost import Candidate, PlanCostModel

    spec = get("gpt-tiny")
    torch.manual_seed(0)
    x, _ = spec.example_batch(8, generator=torch.Generator().manual_seed(0))
    gm = autopar.capture(spec.build(), x)
    hw = load_profile("h100-8x")
    m0 = PlanCostModel(gm, hw.with_contention(0.0), 8, bucket_mb=0.02)
    m1 = PlanCostModel(gm, hw, 8, bucket_mb=0.02, gc=m0.gc)
    mi = PlanCostModel(gm, hw.with_contention(0.0, 0.5), 8, bucket_mb=0.02, gc=m0.gc)  # inter-node only
    for c in (Candidate(tp=2), Candidate(pp=1)):  # blocking collectives or none: unchanged
        assert m1.evaluate(c, math.inf, recompute="none").step_s == m0.evaluate(c, math.inf, recompute="none").step_s
    for c in (Candidate(dp=4), Candidate(dp=4, zero=2), Candidate(dp=4, zero=3),
              Candidate(pp=2, micro=4, schedule="1f1b")):
        a = m0.evaluate(c, math.inf, recompute="none").step_s
        b = m1.evaluate(c, math.inf, recompute="none").step_s
        assert a < b < a * (1 + K), c.label()
        # every axis of this world stays inside the node: an inter-node figure changes nothing
        assert mi.evaluate(c, math.inf, recompute="none").step_s == a, c.label()
        if c.pp == 1:  # the same plan through cost.estimate rises too
            plan = Plan(mesh=c.mesh(), dp_axis="dp", zero_stage=c.zero, bucket_mb=0.02)
            ea = estimate(gm, plan, hw.with_contention(0.0), batch_is_global=True)
            eb = estimate(gm, plan, hw, batch_is_global=True)
            assert eb.step_s > ea.step_s, c.label()


def test_ring_attention_hops_slow_the_block_attention_they_hide_behind():
    """`search.context.price_context`: each ring hop runs beside one block's attention, slowed by
    (1 + k) while the hop is in flight; at k = 0 the price is the plain-overlap one."""
    from autopar.search.context import ContextFacts, price_context

    # one attention call: b = h = hkv = d = 1, t = 4 fp32 tokens; cp = 2: tl = 2, a block pair is
    # 4 tl^2 d / 2 = 8 FLOPs, at 8 FLOP/s 1 s of compute; a hop moves K, V = 2 tl d 4 = 16 bytes
    facts = ContextFacts(((1, 1, 1, 4, 1, torch.float32),), 4, 1)
    hw = SimpleNamespace(peak=lambda dtype: 8.0, attention_eff=lambda dtype, seq, head_dim: 1.0)

    def ring(hop, k):
        sent = []
        link = SimpleNamespace(time=lambda op, x: sent.append((op, x)) or (hop if op == "send_recv" else 0.0),
                               contention=k)
        s = price_context(facts, 2, 1, None, link, hw)["exposed_s"]["ring"]
        assert ("send_recv", 16) in sent
        return s

    def fluid(work, busy, k):  # the same pair on a CommStream: time beyond the compute's own
        st = CommStream(k)
        st.issue(0.0, busy)
        return max(st.run(0.0, work), st.free) - work

    for hop in (0.5, 1.2, 3.0):  # compute-bound, nearly balanced, communication-bound hops
        old = max(0.0, hop - 1.0) + max(0.0, 2 * hop - 2.0)  # forward K, V; backward K, V, dK, dV over 2x work
        assert ring(hop, 0.0) == old, hop
        want = fluid(1.0, hop, 0.25) + fluid(2.0, 2 * hop, 0.25)
        assert ring(hop, 0.25) == pytest.approx(want, rel=1e-12), hop
    # by hand at k = 0.25: a 0.5 s hop holds 0.4 s of the 1 s block to 0.5 s of wall: 0.1 s more
    # forward, 0.2 s backward, where plain overlap hid it all; a 1.2 s hop: 0.24 + 0.48, not 0.2 + 0.4
    assert ring(0.5, 0.25) == pytest.approx(0.3) and ring(1.2, 0.25) == pytest.approx(0.72)
    # communication-bound: the compute's slowdown hides under the hop, the price is the hop's
    assert ring(3.0, 0.25) == pytest.approx(2.0 + 4.0)


def test_context_exchange_price_carries_the_cp_links_contention_into_plan_and_estimate():
    """A real profile: the cp link's k raises the ring's exposed seconds in the plan entry that
    both `cost.estimate` and the planner read; ulysses (nothing overlapped) does not move."""
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.search.context import context_facts, price_context

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=4096)
    gm = autopar.capture(GPT(cfg), (torch.zeros(2, 4096, dtype=torch.long),), dynamic_seq=True)
    facts = context_facts(gm)
    hw = load_profile("h100-sxm")
    p0 = price_context(facts, 2, 1, 2, axis_links(hw.with_contention(0.0), {"cp": 2})["cp"], hw)["exposed_s"]
    p1 = price_context(facts, 2, 1, 2, axis_links(hw, {"cp": 2})["cp"], hw)["exposed_s"]
    assert p1["ulysses"] == p0["ulysses"] > 0
    assert p1["ring"] > p0["ring"]
    # the fluid model's bound: at most k / (1 + k) of the hops' time is added (3 hop-times a step)
    link = axis_links(hw, {"cp": 2})["cp"]
    assert p1["ring"] - p0["ring"] <= 3 * K / (1 + K) * sum(
        link.time("send_recv", 2 * b * kv * (t // 2) * d * dt.itemsize) for b, _h, kv, t, d, dt in facts.calls) * 1.000001
    plan = Plan(mesh={"cp": 2}, dp_axis=None, extra={"context": {"axis": "cp", "method": "ring", "exposed_s": p1,
                                                   "bytes": {"ring": 1.0, "ulysses": 1.0}}})
    e = estimate(gm, plan, hw)
    assert sum(r.exposed_s for r in e.comm if r.axis == "cp" and r.phase == "attention") == pytest.approx(p1["ring"])
