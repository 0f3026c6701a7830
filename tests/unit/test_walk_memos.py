"""The planner's walk shortcuts give what the walks they replace give, exactly (bit for bit):

  * `cost.timeline`'s `later_peak` (one walk gives the peak of later micro-batches, the
    parameter gradients preallocated) equals the peak of a second walk with
    `grads_preallocated=True`, per stage of a split graph, with and without checkpoint regions,
    tp storage divisors and sharded parameter gradients (what `cost.pipeline_memory.stage_walk`
    now reads instead of walking twice);
  * `runtime.schedules.simulate` times each schedule's memoised action order as its event loop
    did: every schedule, fused backward or not, against a plain re-implementation of the loop
    on random durations (and `fuse_backward` gives one object per schedule and stage set);
  * `search.plan_pipeline_memory`'s stage walks shared between candidates of equal parameter
    gradients (ZeRO stage, replicas, ep) equal the walk of each.

Reads no node.meta beyond what `cost.analyze` reads.
"""
import random

import pytest
import torch

import autopar
from autopar.cost import analyze
from autopar.cost.pipeline_memory import stage_graph, stage_of_nodes, stage_regions
from autopar.cost.timeline import regions_for, timeline
from autopar.models.gpt import GPT, GPTConfig
from autopar.runtime.schedules import Kind, fuse_backward, make_schedule, simulate


@pytest.fixture(scope="module")
def gm():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    return autopar.capture(GPT(cfg), torch.randint(0, 128, (8, 32)))


@pytest.fixture(scope="module")
def gc(gm):
    return analyze(gm, "cpu-gloo")


@pytest.mark.parametrize("blocks", [(), ("layers.1",), ("layers.0", "layers.1", "layers.2", "layers.3")])
def test_later_peak_is_the_walk_with_gradients_preallocated(gc, blocks):
    stage_of = stage_of_nodes(gc, ["layers.1", "layers.3"])
    regions = regions_for(gc, {b: "full" for b in blocks})
    values = gc.values({"b": 2})
    checked = 0
    for s in range(3):
        g = stage_graph(gc, stage_of, s)
        keys = [p.key for p in g.params if p.requires_grad and p.key is not None]
        div = {k: 2 for i, k in enumerate(g.storages) if i % 3 == 0}  # some storages tp-sharded
        for pg in (None, {k: 1000.0 * (i + 1) for i, k in enumerate(keys)}):  # full, or sharded gradients
            kw = dict(param_grad_bytes=pg, storage_divisor=div, keep_points=False)
            one = timeline(g, stage_regions(regions, g), values, **kw)
            again = timeline(g, stage_regions(regions, g), values, grads_preallocated=True, **kw)
            assert one.later_peak == again.peak, (s, blocks, pg is None)
            assert again.later_peak == again.peak
            checked += 1
    assert checked == 6


def _loop(schedule, f, b, i, w, hop):
    """simulate's event loop as it was before the order was memoised (the reference)."""
    S, P = schedule.n_stages, schedule.n_ranks
    dur = {Kind.F: f, Kind.B: b, Kind.I: i, Kind.W: w}
    s2r = schedule.stage_to_rank
    bkind = {(a.stage, a.mb): a.kind for acts in schedule.actions for a in acts if a.kind in (Kind.B, Kind.I)}
    done, pos, clock, out = {}, [0] * P, [0.0] * P, [[] for _ in range(P)]
    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pos[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pos[r]]
                s, m = a.stage, a.mb
                if a.kind is Kind.F:
                    ds = [] if s == 0 else [((s - 1, Kind.F, m), hop[s - 1] if s2r[s - 1] != s2r[s] else 0.0)]
                elif a.kind is Kind.W:
                    ds = [((s, Kind.I, m), 0.0)]
                else:
                    ds = [((s, Kind.F, m), 0.0)] + ([((s + 1, bkind[(s + 1, m)], m), hop[s] if s2r[s + 1] != s2r[s]
                                                      else 0.0)] if s < S - 1 else [])
                if any(d not in done for d, _ in ds):
                    break
                start = max([clock[r]] + [done[d] + lat for d, lat in ds])
                done[(s, a.kind, m)] = clock[r] = start + dur[a.kind][s]
                out[r].append((a, start, clock[r]))
                pos[r] += 1
                progress = True
    return out


@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 8), ("gpipe", 3, 5), ("interleaved_1f1b", 2, 4), ("zb_h1", 3, 6),
                                      ("zbv", 2, 5)])
def test_simulate_times_the_memoised_order_as_the_event_loop_did(name, p, m):
    rng = random.Random(0)
    sched = make_schedule(name, p, m)
    S = sched.n_stages
    for fuse in ((), (0,), tuple(range(S))):
        fused = fuse_backward(sched, fuse)
        assert fuse_backward(sched, list(fuse)) is fused  # one object per schedule and stage set
        assert all(a.kind is not Kind.I or a.stage not in fuse for acts in fused.actions for a in acts)
        for _ in range(5):
            f, b = [rng.random() for _ in range(S)], [rng.random() * 3 for _ in range(S)]
            i, w, hop = [x / 3 for x in b], [2 * x / 3 for x in b], [rng.random() * 0.1 for _ in range(S - 1)]
            sim = simulate(fused, f=f, b=b, i=i, w=w, p2p=hop)
            want = _loop(fused, f, b, i, w, hop)
            assert sim.ok and [[(t.action, t.start, t.end) for t in tl] for tl in sim.timelines] == want
            assert sim.makespan == max(tl[-1][2] for tl in want if tl)


def test_candidates_of_equal_gradients_share_a_stage_walk_equal_to_each_ones_own(gm):
    """ZeRO 0 and 1 shard no gradient: their pipeline candidates' stage walks are one walk, and
    that walk is what each candidate's own (uncached) walk gives."""
    import autopar.search.plan_pipeline_memory as ppm
    from autopar.search.candidate import Candidate
    from autopar.search.plan_cost import PlanCostModel

    m = PlanCostModel(gm, "cpu-gloo", 4)
    firsts = ppm.unit_first_nodes(m)
    lo, hi = firsts[0], firsts[3]
    walks = []
    for zero in (0, 1):
        c = Candidate(dp=2, pp=2, zero=zero, micro=2, schedule="1f1b")
        st = m.states(c.tp, c.zero, c.replicas, c.ep)
        shared = ppm._stage_walk(m, c, 4, lo, hi, st.param_grad)
        m._split_cache.clear()  # the candidate's own walk, nothing cached
        own = ppm._stage_walk(m, c, 4, lo, hi, st.param_grad)
        assert repr(own) == repr(shared), zero
        walks.append(shared)
    m._split_cache.clear()
    c0, c1 = (Candidate(dp=2, pp=2, zero=z, micro=2, schedule="1f1b") for z in (0, 1))
    a = ppm._stage_walk(m, c0, 4, lo, hi, m.states(1, 0, 2, 1).param_grad)
    assert ppm._stage_walk(m, c1, 4, lo, hi, m.states(1, 1, 2, 1).param_grad) is a  # one walk for both
    assert repr(walks[0]) == repr(walks[1])
