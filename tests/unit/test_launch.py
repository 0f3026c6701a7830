"""The world launcher reports results, failures with tracebacks, and hangs within bounds."""
import time

import pytest
import torch
import torch.distributed as dist

from harness import WorldError, world
from autopar.runtime.mesh import make_mesh


def _sum_over_tp(rank, ws):
    m = make_mesh(dp=2, tp=2)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=m.group("tp"))
    return t.tolist(), m.coords(rank)


def _rank1_raises(rank, ws):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _rank0_hangs(rank, ws):
    if rank == 0:
        time.sleep(60)
    return rank


def test_world_of_four_returns_each_ranks_result_and_groups_follow_mesh_coords():
    out = world(4, _sum_over_tp)
    assert [o[0] for o in out] == [[1.0] * 3, [1.0] * 3, [5.0] * 3, [5.0] * 3]
    assert [o[1] for o in out] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0},
                                   {"dp": 1, "tp": 1}]


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(WorldError, match=r"rank 1 failed(.|\n)*boom on rank 1"):
        world(2, _rank1_raises)


def test_hung_rank_fails_within_the_deadline_and_is_named():
    t0 = time.monotonic()
    with pytest.raises(WorldError, match=r"ranks \[0\] did not finish"):
        world(2, _rank0_hangs, timeout_s=3)
    assert time.monotonic() - t0 < 20


def _transport_crash_once(rank, ws, marker):
    """First world: rank 0 reports gloo's connect failure and rank 1 dies of SIGABRT, as when
    gloo's listener aborts mid-handshake; a second world finds the marker and succeeds."""
    import os
    from autopar.runtime.launch import TRANSPORT_SETUP_CRASH
    dist.barrier()
    first = not os.path.exists(marker)
    dist.barrier()
    if first:
        if rank == 0:
            open(marker, "w").close()
            raise RuntimeError(f"{TRANSPORT_SETUP_CRASH} with [pair.cc:553] Connection closed by peer (simulated)")
        if rank == 1:
            time.sleep(0.3)
            os.abort()
        time.sleep(30)  # the others wait in a collective, as they would
    return rank


def _count_and_fail(rank, ws, counter):
    with open(counter, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError("a plain failure")


def test_a_world_whose_gloo_transport_crashed_while_connecting_is_started_again_once(tmp_path, capfd):
    from autopar.runtime.launch import run_world
    marker = str(tmp_path / "crashed")
    assert run_world(4, _transport_crash_once, marker, timeout_s=60, transport_retries=1) == [0, 1, 2, 3]
    err = capfd.readouterr().err
    assert "starting the world again (1 of 1)" in err and "rank 1: killed by SIGABRT" in err
    # without a retry the crash is raised, naming how rank 1 ended
    import os
    os.remove(marker)
    with pytest.raises(WorldError, match=r"(?s)connectFullMesh failed.*rank 1: killed by SIGABRT") as e:
        run_world(4, _transport_crash_once, marker, timeout_s=60)
    assert e.value.transport_setup_crash


def test_any_other_failure_is_not_run_again(tmp_path):
    from autopar.runtime.launch import run_world
    counter = tmp_path / "runs"
    with pytest.raises(WorldError, match="a plain failure") as e:
        run_world(2, _count_and_fail, str(counter), timeout_s=60, transport_retries=3)
    assert not e.value.transport_setup_crash
    assert sorted(counter.read_text().split()) == ["0", "1"]  # one world ran, not four
