"""Schedules as data: closed-form bubbles, peak activations, deadlock reports, grid round trip,
and the Gantt picture of a simulation."""
import xml.etree.ElementTree as ET

import pytest

from autopar.build.gantt import gantt_svg, write_gantt_svg
from autopar.runtime.schedules import (Action, Kind, Schedule, gpipe, interleaved_1f1b, make_schedule,
                                       one_f_one_b, simulate, zbv, zero_bubble_h1)


def closed_form(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------------------------------------ actions
def test_actions_print_like_torch_pipelining_and_parse_back():
    a = Action(2, Kind.F, 0)
    assert str(a) == "2F0" and Action.from_str("2F0") == a
    assert [str(Action.from_str(s)) for s in ("0B13", "11I2", "3W0")] == ["0B13", "11I2", "3W0"]
    with pytest.raises(ValueError, match="e.g. 2F0"):
        Action.from_str("F2")


# ------------------------------------------------------------------------------ bubbles
@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.3, 1.1)])
def test_gpipe_and_1f1b_bubble_equals_closed_form_with_equal_stage_times(p, m, f, b):
    for sched in (gpipe(p, m), one_f_one_b(p, m)):
        r = simulate(sched, f=f, b=b)
        assert r.ok
        assert r.bubble_fraction == pytest.approx(closed_form(p, m), abs=1e-12), sched.name
        assert r.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_equals_closed_form_and_is_below_1f1b(p, m, v):
    # the same model cut into p*v stages: each virtual stage takes 1/v of a rank's time
    r = simulate(interleaved_1f1b(p, m, v), f=1.0 / v, b=2.0 / v)
    assert r.ok and sorted(r.schedule.stages_of(1)) == [s for s in range(p * v) if s % p == 1]
    assert r.bubble_fraction == pytest.approx(closed_form(p, m, v), abs=1e-12)
    assert r.bubble_fraction < simulate(one_f_one_b(p, m), f=1.0, b=2.0).bubble_fraction


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_schedules_have_smaller_bubbles(p, m):
    # F, I and W take equal time (the zero-bubble paper's setting), B = I + W
    one = simulate(one_f_one_b(p, m), f=1, b=2).bubble_fraction
    h1 = simulate(zero_bubble_h1(p, m), f=1, b=2, i=1, w=1)
    inter = simulate(interleaved_1f1b(p, m, 2), f=0.5, b=1).bubble_fraction
    v = simulate(zbv(p, m), f=0.5, b=1, i=0.5, w=0.5)
    assert h1.ok and v.ok
    # ZB-H1: the paper's (p-1)(T_F + T_I - T_W) bubble, i.e. (p-1)/(3m+p-1) here
    assert h1.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert h1.bubble_fraction < one
    assert v.bubble_fraction < inter < one
    assert v.bubble_fraction <= h1.bubble_fraction + 1e-12
    if m >= 2 * p:
        assert v.bubble_fraction < h1.bubble_fraction
    assert v.schedule.stage_to_rank == tuple(list(range(p)) + list(reversed(range(p))))


def test_unequal_stages_and_transfer_time_follow_the_gpipe_critical_path():
    f = [1.0, 2.0, 1.0, 0.5]
    b = [2 * x for x in f]
    hops = [0.1, 0.3, 0.2]  # transfer time per stage boundary
    for m in (1, 4, 8):
        r = simulate(gpipe(4, m), f=f, b=b, p2p=hops)
        # every micro-batch crosses every stage once each way; the slowest stage paces the rest
        assert r.makespan == pytest.approx(sum(f) + sum(b) + (m - 1) * (max(f) + max(b)) + 2 * sum(hops))
        assert r.busy == pytest.approx([m * (x + y) for x, y in zip(f, b)])
    with pytest.raises(ValueError, match="3 stage boundaries"):
        simulate(gpipe(4, 2), p2p=[0.1, 0.2])


def test_stages_on_the_same_rank_hand_over_without_transfer_time():
    r = simulate(zbv(2, 4), f=1, b=2, p2p=0.5)  # stages 1 and 2 both live on rank 1
    t = {str(x.action): x for x in r.timelines[1]}
    assert t["1F0"].start == pytest.approx(1.5) and t["2F0"].start == pytest.approx(t["1F0"].end)


# ------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_1f1b_holds_at_most_p_activations_where_gpipe_holds_m(p, m):
    assert simulate(gpipe(p, m)).peak_in_flight == [m] * p
    peak = simulate(one_f_one_b(p, m)).peak_in_flight
    assert peak == [min(p - r, m) for r in range(p)] and max(peak) <= p
    assert max(simulate(zero_bubble_h1(p, m), i=1, w=1).peak_in_flight) <= p  # ZB-H1 keeps 1F1B's memory


# ------------------------------------------------------------------------------ deadlocks
def crossed() -> Schedule:
    """Rank 0 waits for rank 1's backward of micro-batch 0 while rank 1 waits for rank 0's
    forward of micro-batch 1."""
    A = Action.from_str
    return Schedule("crossed", 2, (0, 1), [[A("0F0"), A("0B0"), A("0F1"), A("0B1")],
                                          [A("1F1"), A("1B1"), A("1F0"), A("1B0")]])


def test_deadlock_check_names_the_blocked_actions_and_what_they_wait_for():
    r = simulate(crossed())
    assert not r.ok and r.makespan is None
    assert [str(x) for x in r.deadlock] == ["rank 0 blocked at 0B0 waiting for 1B0",
                                            "rank 1 blocked at 1F1 waiting for 0F1"]
    assert [str(t.action) for t in r.timelines[0]] == ["0F0"] and r.timelines[1] == []
    with pytest.raises(ValueError, match=r"crossed.*deadlocks: rank 0 blocked at 0B0 waiting for 1B0; "
                                         r"rank 1 blocked at 1F1 waiting for 0F1"):
        r.raise_if_deadlocked()


def test_a_backward_placed_before_its_own_forward_deadlocks_on_one_rank():
    A = Action.from_str
    s = Schedule("early", 1, (0, 1), [[A("0B0"), A("0F0")], [A("1F0"), A("1B0")]])
    r = simulate(s)
    assert [str(x) for x in r.deadlock] == ["rank 0 blocked at 0B0 waiting for 0F0, 1B0",
                                            "rank 1 blocked at 1F0 waiting for 0F0"]


def test_generated_schedules_never_deadlock():
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 5, 8, 12):
            for name, v in (("gpipe", None), ("1f1b", None), ("zb_h1", None), ("zbv", None),
                            ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)):
                try:
                    s = make_schedule(name, p, m, v)
                except ValueError:  # interleaved needs m divisible by its rounds
                    assert name == "interleaved_1f1b" and m % max(1, m // p)
                    continue
                assert simulate(s, f=1, b=2, p2p=0.1).ok, (name, p, m, v)


def test_malformed_schedules_are_refused_with_the_problem_named():
    A = Action.from_str
    with pytest.raises(ValueError, match=r"stage 1 micro-batch 0: B=0, I=0, W=0"):
        Schedule("x", 1, (0, 1), [[A("0F0"), A("0B0")], [A("1F0")]])
    with pytest.raises(ValueError, match=r"rank 0: 1F0 belongs to rank 1"):
        Schedule("x", 1, (0, 1), [[A("0F0"), A("0B0"), A("1F0")], [A("1B0")]])
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 2, 4)


# ------------------------------------------------------------------------------ grid
GRID_1F1B_3x4 = """\
schedule 1F1B: 3 ranks, 3 stages, 4 micro-batches
        0   1   2   3   4   5   6   7   8   9   10  11
rank 0: 0F0 0F1 0F2         0B0 0F3 0B1     0B2     0B3
rank 1:     1F0 1F1     1B0 1F2 1B1 1F3 1B2     1B3
rank 2:         2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
"""


def test_grid_prints_one_row_per_rank_and_one_column_per_time_step():
    assert one_f_one_b(3, 4).to_grid() == GRID_1F1B_3x4


def test_every_generated_grid_parses_back_exactly():
    cases = [gpipe(3, 5), one_f_one_b(4, 6), interleaved_1f1b(2, 4, 3), interleaved_1f1b(4, 8, 2),
             zero_bubble_h1(4, 8), zbv(3, 6), zbv(2, 2), crossed()]
    for s in cases:
        back = Schedule.from_grid(s.to_grid())
        assert back == s, s.name
        assert back.to_grid() == s.to_grid()
    assert "(deadlocks)" in crossed().to_grid()


def test_a_hand_written_grid_parses_and_its_placement_is_read_from_the_rows():
    s = Schedule.from_grid("rank 0: 0F0 2F0 2B0 0B0\nrank 1: 1F0 3F0 3B0 1B0\n")
    assert s.stage_to_rank == (0, 1, 0, 1) and s.n_microbatches == 1 and s.name == "custom"
    assert simulate(s).ok
    with pytest.raises(ValueError, match="appear on several ranks"):
        Schedule.from_grid("rank 0: 0F0 1F0 0B0\nrank 1: 1B0\n")


# ------------------------------------------------------------------------------ gantt
def test_gantt_svg_is_well_formed_deterministic_and_draws_every_action(tmp_path):
    sim = simulate(interleaved_1f1b(2, 4, 2), f=0.5, b=1.0, p2p=0.05)
    text = gantt_svg(sim)
    assert text == gantt_svg(simulate(interleaved_1f1b(2, 4, 2), f=0.5, b=1.0, p2p=0.05))
    root = ET.fromstring(text)
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in root.iter(ns + "title")]
    assert len(titles) == sum(len(a) for a in sim.schedule.actions) == 2 * 2 * 4 * 2
    first = sim.timelines[1][0]  # rank 1 starts after stage 0's forward and one transfer
    assert f"{first.action} [{first.start:.4g}, {first.end:.4g})" in titles
    assert first.start == pytest.approx(0.5 + 0.05)
    labels = [t.text for t in root.iter(ns + "text")]
    assert "rank 0" in labels and "rank 1" in labels
    p = write_gantt_svg(sim, tmp_path / "sub" / "gantt.svg")
    assert open(p, encoding="utf-8").read() == text
    with pytest.raises(ValueError, match="deadlocks"):
        gantt_svg(simulate(crossed()))
