"""One cost model for pipelines (issue 22 items 1 and 4): for every pipeline candidate (pp > 1)
the joint planner ranks, its per-rank peak memory and its step time equal `cost.estimate`'s for
the Plan the planner writes, on cpu-gloo and h100-sxm.

The candidates are the planner's own enumeration (`search.candidate.candidates`, every pp > 1
one: 1F1B, interleaved 1F1B with its virtual stages, ZB-H1, ZBV, GPipe when pinned; dp with
ZeRO 0-3, tp, micro-batches), each evaluated as the search evaluates it (`_Search._evaluate`)
and written as it writes its chosen plan (`search.plan_write.write_plan`).

Memory: both sides build the same per-stage terms (the stage graph's liveness walk, the
stage's model states) and combine them along each rank's own actions in the schedule with one
function (`cost.pipeline_memory.rank_peaks`): equal to 1e-6 per rank, every schedule.

Time: both sides stretch the stages by the pipeline transfers, simulate the schedule and add per
rank the data-parallel sync and the optimizer step with one implementation
(`cost.pipeline_time`): equal to 1e-6 for tp = 1 and ZeRO 0-2 on gpt-tiny. Their inputs differ
where a stage boundary or a tied weight is counted differently (measured at world 4):
  - vit-tiny: the boundary before the last stage (`norm`): the planner's unit boundary bytes
    (`search.stage_costs.cross_bytes`) 8 % under the stage graph's outputs that estimate sends,
    and the gradients' ready times per pipeline unit (planner) or per node (estimate): the
    planner's step up to 2.4 % shorter on cpu-gloo, 0.03 % on h100-sxm;
  - gpt-tiny-tied, dp > 1: estimate syncs the gradient of every stage's copy of the tied weight
    over dp, the planner's per-unit payloads count it once: planner up to 1.8 % shorter.
Not yet one (the planner only, so the planner's step is the larger):
  - tensor-parallel conversions inside the stage times (estimate has no tp collectives on the
    captured graph; at pp = 1 they add on top, inside a schedule they do not): planner up to
    +69 % on cpu-gloo (gloo's slow collectives), +18 % on h100-sxm;
  - ZeRO 3's exposed gathers per pipeline unit (`search.plan_comm.zero3_exposed`; estimate's
    pipeline prices none yet): up to +65 % cpu-gloo, +17 % h100-sxm (vit-tiny);
"""
import pytest
import torch

from autopar.cost import estimate, load_profile
from autopar.cost.schedule import held_peaks, in_flight_per_stage, make_schedule, walk_peaks
from autopar.search.candidate import candidates
from autopar.search.plan_write import write_plan
from autopar.search.planner import DEFAULT_HEADROOM, RUNTIME_SUPPORT, _Search
from test_one_cost_model import _capture, _graph  # the captures (hf-* rows from the transformers zoo)

WORLD = 4  # pp 2 and 4, with dp 2 or tp 2 beside pp 2
RTOL = 1e-6
STEP_RTOL = {"gpt-tiny": RTOL, "vit-tiny": 0.03, "gpt-tiny-tied": 0.025}  # tp = 1, ZeRO 0-2 (docstring)
REMAINING = {"cpu-gloo": 0.8, "h100-sxm": 0.25}  # tp conversions / ZeRO-3 exposure (measured <= 69 % / 18 %)


@pytest.fixture(scope="module")
def graphs():
    return {}  # name -> captured graph, filled by `_graph`

def _close(got: float, want: float, what: str, rtol: float = RTOL) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0.0, msg=lambda m: f"{what}: planner {got!r}, estimate {want!r}\n{m}")


def _pipelines(gm, hw: str, pins=None) -> list:
    """Every feasible pp > 1 candidate of the planner's enumeration, with the estimate of the Plan
    the planner writes for it: [(candidate, evaluation, estimate)]."""
    prof = load_profile(hw)
    s = _Search(gm, prof, WORLD, dict(pins or {}), DEFAULT_HEADROOM * prof.device.memory_bytes, None, 1, "adamw",
                dict(RUNTIME_SUPPORT), None)
    out = []
    for c in candidates(s.model, WORLD, s.pins, s.support):
        if c.pp == 1:
            continue
        ev = s._evaluate(c)
        assert ev is not None and ev.feasible, c.label()
        plan = write_plan(s, ev, s._report(ev, [ev], 0.0))
        out.append((c, ev, estimate(gm, plan, hw, batch_is_global=True)))
    return out


def _check(done, hw: str, step_rtol: float = RTOL) -> None:
    for c, ev, e in done:
        label = f"{hw} {c.label()}"
        per_rank = e.memory.get("peak_per_pp_rank")
        assert per_rank is not None and len(per_rank) == c.pp, (label, e.notes)
        assert not ev.recompute, label  # estimate costs a pipeline without recompute: not compared here
        for r, (got, want) in enumerate(zip(ev.rank_peaks, per_rank)):
            _close(got, want, f"{label} pp rank {r} peak memory")
        _close(ev.peak_bytes, e.memory["peak"], f"{label} peak memory")
        if c.tp == 1 and (c.zero < 3 or c.dp == 1):
            _close(ev.step_s, e.step_s, f"{label} step", step_rtol)
        else:  # the terms only the planner prices (module docstring): its step is the larger
            assert e.step_s <= ev.step_s * (1 + step_rtol), (label, ev.step_s, e.step_s)  # but for the inputs' gap
            assert ev.step_s <= e.step_s * (1 + REMAINING[hw]), (label, ev.step_s, e.step_s)


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
@pytest.mark.parametrize("name", ["gpt-tiny", "vit-tiny", "gpt-tiny-tied"])
def test_every_pipeline_candidate_equals_cost_estimate(graphs, name, hw):
    done = _pipelines(_graph(graphs, name), hw)
    _check(done, hw, STEP_RTOL[name])
    seen = {(c.schedule, c.virtual) for c, _ev, _e in done}
    assert {("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)} <= seen, seen
    assert {c.zero for c, _ev, _e in done if c.dp > 1} == {0, 1, 2, 3}
    assert any(c.pp == 4 for c, _ev, _e in done) and any(c.micro > c.pp for c, _ev, _e in done)


def test_gpipe_candidates_equal_cost_estimate(graphs):
    done = _pipelines(_graph(graphs, "gpt-tiny"), "cpu-gloo", pins={"schedule": "gpipe"})
    assert done and all(c.schedule == "gpipe" for c, _ev, _e in done)
    _check(done, "cpu-gloo")


def test_interleaved_and_zbv_ranks_hold_two_stages_each():
    """The per-rank walk sums a rank's stages: ZBV's rank 0 holds the first and the last stage,
    and its peak is more than either stage's alone."""
    gm = _capture("gpt-tiny")
    from autopar.passes.plan import Plan

    for sched in ("interleaved_1f1b", "zbv"):
        plan = Plan(mesh={"pp": 2}, dp_axis=None, split_points=["layers.0", "layers.1", "norm"], schedule=sched, n_microbatches=4)
        peaks = estimate(gm, plan, "cpu-gloo", batch_is_global=True).memory["peak_per_pp_rank"]
        one = Plan(mesh={"pp": 4}, dp_axis=None, split_points=["layers.0", "layers.1", "norm"], schedule="1f1b", n_microbatches=4)
        alone = estimate(gm, one, "cpu-gloo", batch_is_global=True).memory["peak_per_pp_rank"]
        pairs = [(0, 2), (1, 3)] if sched == "interleaved_1f1b" else [(0, 3), (1, 2)]
        for r, (a, b) in enumerate(pairs):
            assert peaks[r] > max(alone[a], alone[b]), (sched, r, peaks, alone)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 3, 5, None), ("gpipe", 2, 4, None), ("zb_h1", 3, 6, None),
                                        ("interleaved_1f1b", 2, 4, 2), ("zbv", 2, 4, None)])
def test_schedule_walk_follows_each_ranks_actions(name, p, m, v):
    """`walk_peaks` with no walk of its own is `held_peaks`; with one stage per rank, a first walk
    and gradients made, it is (k - 1) held + the first walk or (k - 1) held + the later walk."""
    sched = make_schedule(name, p, m, v)
    S = sched.n_stages
    held = [10.0 + s for s in range(S)]
    assert walk_peaks(sched, held) == held_peaks(sched, held)
    first = [h + 100.0 for h in held]
    later = [h + 150.0 for h in held]
    grads = [7.0] * S
    got = walk_peaks(sched, held, first, later, grads)
    if name in ("1f1b", "gpipe"):
        k = in_flight_per_stage(sched)
        for s in range(S):  # k in flight at the first backward; j at the second (1F1B: k again once m > k)
            j = (k[s] if m > k[s] else k[s] - 1) if name == "1f1b" else m - 1
            want = max((k[s] - 1) * held[s] + first[s], (j - 1) * held[s] + later[s] + 0.0)
            assert got[s] == pytest.approx(want, rel=1e-12), (name, s, got, want)
    elif sched.stage_to_rank == tuple(range(p)):  # ZB-H1: at least 1F1B's walk (W releases later)
        ref = walk_peaks(make_schedule("1f1b", p, m), held, first, later, grads)
        assert all(a >= b for a, b in zip(got, ref)), (got, ref)
    else:  # two stages a rank: each walk with the other stage's gradients once they exist
        for r in range(p):
            mine = sched.stages_of(r)
            assert got[r] > max(later[s] for s in mine), (name, r, got)
            assert got[r] <= sum(m * held[s] for s in mine) + max(later) + sum(grads[s] for s in mine)
