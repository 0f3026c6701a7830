"""Collective byte counts against step-by-step simulations of the algorithms, times against
the alpha-beta model, and the link each mesh axis gets from the topology."""
from __future__ import annotations

import math

import pytest

from autopar.cost import bytes_sent, collective_time, load_profile, total_bytes_sent
from autopar.cost.comm import axis_links, axis_spans_nodes, steps
from autopar.cost.hardware import Link


def _ring_reduce_scatter(n: int, chunk: int) -> list[int]:
    """Simulate ring reduce-scatter of n chunks: in step t rank r sends chunk (r - t) mod n to
    r + 1. Returns bytes sent per rank; checks every rank ends owning one fully reduced chunk."""
    sent = [0] * n
    have = [[{r} for _ in range(n)] for r in range(n)]  # have[r][c]: ranks whose summand of chunk c r holds
    for t in range(n - 1):
        msgs = [(r, (r - t) % n) for r in range(n)]
        snapshot = [[set(s) for s in row] for row in have]
        for r, c in msgs:
            have[(r + 1) % n][c] |= snapshot[r][c]
            sent[r] += chunk
    for r in range(n):
        assert have[r][(r + 1) % n] == set(range(n))  # owner of chunk r+1 after n-1 steps
    return sent


def _ring_all_gather(n: int, chunk: int) -> list[int]:
    sent = [0] * n
    have = [{r} for r in range(n)]
    for t in range(n - 1):
        snapshot = [set(h) for h in have]
        for r in range(n):
            c = (r - t) % n
            assert c in snapshot[r]
            have[(r + 1) % n].add(c)
            sent[r] += chunk
    assert all(h == set(range(n)) for h in have)
    return sent


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_bytes_equal_a_simulated_ring(n):
    chunk = 1024
    payload = n * chunk
    rs = _ring_reduce_scatter(n, chunk)
    ag = _ring_all_gather(n, chunk)
    for r in range(n):
        assert bytes_sent("reduce_scatter", payload, n, rank=r) == rs[r]
        assert bytes_sent("all_gather", chunk, n, rank=r) == ag[r]  # all-gather payload: the local shard
        assert bytes_sent("all_reduce", payload, n, rank=r) == rs[r] + ag[r]  # = reduce-scatter + all-gather
        assert bytes_sent("all_to_all", payload, n, rank=r) == (n - 1) * chunk  # keeps its own 1/n
    assert bytes_sent("all_reduce", payload, n) == 2 * (n - 1) / n * payload
    assert total_bytes_sent("all_reduce", payload, n) == 2 * (n - 1) * payload


@pytest.mark.parametrize("n", [2, 5, 8])
def test_broadcast_bytes_equal_a_simulated_chain_and_tree(n):
    chain = [payload if r < n - 1 else 0 for r, payload in enumerate([4096] * n)]
    assert [bytes_sent("broadcast", 4096, n, rank=r) for r in range(n)] == chain
    # binary tree rooted at 0: rank r forwards to 2r+1 and 2r+2; every rank but the root receives once
    tree = [sum(4096 for c in (2 * r + 1, 2 * r + 2) if c < n) for r in range(n)]
    assert [bytes_sent("broadcast", 4096, n, "tree", rank=r) for r in range(n)] == tree
    assert sum(tree) == 4096 * (n - 1)


def test_times_follow_alpha_beta():
    link = Link("test", bandwidth=100e9, latency=5e-6)
    b = 1 << 30
    assert collective_time("all_reduce", b, 8, link) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * b / 100e9)
    assert collective_time("all_gather", b / 8, 8, link) == pytest.approx(7 * 5e-6 + 7 * (b / 8) / 100e9)
    assert collective_time("all_reduce", b, 8, link, "tree") == pytest.approx(2 * 3 * 5e-6 + 2 * b / 100e9)
    assert collective_time("send_recv", b, 2, link) == pytest.approx(5e-6 + b / 100e9)
    assert collective_time("all_reduce", b, 1, link) == 0.0
    # small messages: tree wins on latency; large ones on 8 ranks: ring, on bandwidth (2(n-1)/n B < 2B)
    small, large = 1024, 1 << 30
    assert collective_time("all_reduce", small, 64, link, "tree") < collective_time("all_reduce", small, 64, link)
    assert collective_time("all_reduce", large, 8, link, "auto") == collective_time("all_reduce", large, 8, link)
    assert collective_time("all_reduce", large, 8, link) < collective_time("all_reduce", large, 8, link, "tree")
    assert steps("all_reduce", 8) == 14 and steps("broadcast", 8, "tree") == 3


def test_unknown_collective_or_algorithm_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="known"):
        bytes_sent("allreduce", 1, 2)
    with pytest.raises(ValueError, match="ring"):
        bytes_sent("all_gather", 1, 2, "tree")


def test_an_axis_that_spans_nodes_uses_the_inter_node_link():
    hw = load_profile("h100-64")  # 8 nodes x 8
    links = axis_links(hw, {"dp": 8, "tp": 8})
    assert not links["tp"].inter_node and links["tp"].link == hw.intra_node
    assert links["dp"].inter_node and links["dp"].link == hw.inter_node
    assert axis_links(hw, {"dp": 64})["dp"].inter_node
    assert not axis_links(hw, {"dp": 8})["dp"].inter_node
    # tp outside, dp inside: dp groups are 8 consecutive ranks (one node), tp strides across nodes
    assert axis_spans_nodes({"tp": 8, "dp": 8}, "tp", 8) and not axis_spans_nodes({"tp": 8, "dp": 8}, "dp", 8)
    # a 4-wide axis on nodes of 8 stays inside as long as groups are aligned
    assert not axis_spans_nodes({"pp": 16, "tp": 4}, "tp", 8)
    nvlink = links["tp"].time("all_reduce", 1 << 28)
    ib = axis_links(hw, {"tp": 8, "dp": 8})["tp"].time("all_reduce", 1 << 28)
    assert ib > 5 * nvlink  # 50 GB/s per GPU across nodes against 450 GB/s NVLink


def test_a_mesh_larger_than_the_hardware_is_refused_with_a_fix():
    with pytest.raises(ValueError, match=r"with_nodes\(64\)"):
        axis_links(load_profile("h100-8x"), {"dp": 512})
    assert axis_links(load_profile("h100-8x").with_nodes(64), {"dp": 512})["dp"].size == 512
    assert math.isclose(load_profile("h100-512").world_size, 512)


def test_auto_picks_the_faster_algorithm_per_call_and_reports_its_bytes():
    (dp,) = axis_links(load_profile("h100-512"), {"dp": 512}).values()
    assert dp.algorithm("all_reduce", 1 << 20) == "tree"  # 1 MiB over 512 ranks: latency-bound
    assert dp.algorithm("all_reduce", 1 << 20, "ring") == "ring"
    assert dp.time("all_reduce", 1 << 20, "auto") < dp.time("all_reduce", 1 << 20, "ring")
    assert dp.bytes_sent("all_reduce", 1 << 20, "auto") == bytes_sent("all_reduce", 1 << 20, 512, "tree")
    assert dp.algorithm("reduce_scatter", 1 << 20) == "ring"  # the only one it has


def test_payloads_pad_uneven_pieces_to_the_largest_one_as_the_runtime_does():
    # 5 rows over 2 ranks: pieces of 3 and 2 rows, both sent as 3 (tests/dist/test_cost_counter.py
    # checks these against runtime.collectives.COUNTER)
    from autopar.cost.comm import padded_payload, payload_bytes

    row = 4 * 4  # 4 fp32 columns
    assert payload_bytes("all_gather", (2, 4), 4, 2, dim=0, full_size=5) == 3 * row
    assert payload_bytes("all_gather", (3, 4), 4, 2, dim=0, full_size=5) == 3 * row
    assert payload_bytes("all_gather", (3, 4), 4, 2, dim=0) == 3 * row  # even: the piece itself
    assert payload_bytes("reduce_scatter", (5, 4), 4, 2, dim=0) == 6 * row
    assert payload_bytes("reduce_scatter", (4, 5), 4, 2, dim=-1) == 6 * row
    assert payload_bytes("all_reduce", (5, 4), 4, 2) == payload_bytes("all_to_all", (5, 4), 4, 2) == 5 * row
    assert padded_payload("reduce_scatter", 5, row, 4) == 8 * row and padded_payload("all_gather", 5, row, 4) == 2 * row
    with pytest.raises(ValueError, match="all_gather and reduce_scatter"):
        padded_payload("all_reduce", 5, row, 2)
    with pytest.raises(ValueError, match="known"):
        payload_bytes("gather", (5,), 4, 2)
