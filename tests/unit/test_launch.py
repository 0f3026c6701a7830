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
