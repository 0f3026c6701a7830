"""autopar's collective ops: values and gradients against hand-computed references on gloo
worlds (even and torch.chunk-uneven dims, a sub-axis of a 2x2 mesh and a 4-rank axis),
fx tracing and fake-tensor shapes without a process group, byte counting, and mismatch
detection that names the rank and op within a bounded time."""
import time

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

from harness import WorldError, world
from autopar.runtime import collectives as C
from autopar.runtime.mesh import make_mesh

ops = torch.ops.autopar


def _warm_custom_ops():
    # the first custom-op call in a process imports torch's compiler stack (~3 s): pay it once
    # here, before the worlds fork, instead of once per rank on a 2-core machine
    C.set_active_mesh(make_mesh(dp=1), rank=0)
    ops.split(torch.ones(2), "dp", 0)
    C.set_active_mesh(None)


_warm_custom_ops()


def _glob(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _per_rank(shape, seed, k):
    """One tensor per rank of the axis (rank-dependent data), the same on every process."""
    return [_glob(shape, seed + 100 * r) for r in range(k)]


def _grad(fn, x, gy):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (g,) = torch.autograd.grad(y, x, gy)
    return y.detach(), g


def _check_ops_on_axis(axis: str, k: int, me: int) -> None:
    # all_reduce: P -> R; backward identity
    xs = _per_rank((3, 5), 1, k)
    gy = _glob((3, 5), 2)
    y, g = _grad(lambda x: ops.all_reduce(x, axis, "sum"), xs[me], gy)
    assert_close(y, sum(xs))
    assert_close(g, gy)

    # grad_all_reduce: identity; backward sums every rank's gradient
    gys = _per_rank((3, 5), 3, k)
    y, g = _grad(lambda x: ops.grad_all_reduce(x, axis), xs[0], gys[me])
    assert_close(y, xs[0])
    assert_close(g, sum(gys))

    for n in (4 * k, 4 * k + 3, k - 1 if k > 2 else 3):  # even, uneven, fewer rows than ranks
        G = _glob((2, n, 3), 4 + n)
        mine = torch.chunk(G, k, dim=1)
        mine = mine[me] if me < len(mine) else G[:, :0]
        full = -1 if n % k == 0 else n
        gys = _per_rank((2, n, 3), 5 + n, k)
        # all_gather: S(1) -> R, backward reduce-scatters the (partial) output gradients
        y, g = _grad(lambda x: ops.all_gather(x, axis, 1, full), mine, gys[me])
        assert_close(y, G)
        want = torch.chunk(sum(gys), k, dim=1)
        assert_close(g, want[me] if me < len(want) else G[:, :0])
        # all_gather_chunk_grad: backward takes this rank's chunk of the (replicated) gradient
        y, g = _grad(lambda x: ops.all_gather_chunk_grad(x, axis, 1, full), mine, gys[0])
        assert_close(y, G)
        want = torch.chunk(gys[0], k, dim=1)
        assert_close(g, want[me] if me < len(want) else G[:, :0])
        # reduce_scatter: P -> S(1), backward all-gathers the chunk gradients
        parts = _per_rank((2, n, 3), 6 + n, k)
        gfull = _glob((2, n, 3), 7 + n)
        gchunks = torch.chunk(gfull, k, dim=1)
        gmine = gchunks[me] if me < len(gchunks) else gfull[:, :0]
        y, g = _grad(lambda x: ops.reduce_scatter(x, axis, 1, "sum"), parts[me], gmine)
        want = torch.chunk(sum(parts), k, dim=1)
        assert_close(y, want[me] if me < len(want) else G[:, :0])
        assert_close(g, gfull)
        # split: R -> S(1) locally, backward all-gathers
        y, g = _grad(lambda x: ops.split(x, axis, 1), G, gmine)
        assert_close(y, mine)
        assert_close(g, gfull)

    # all_to_all S(0) -> S(2), uneven on both dims, and back through autograd
    for (n0, n2) in ((2 * k, 3 * k), (2 * k + 1, 3 * k + 2)):
        G = _glob((n0, 4, n2), 8 + n0)
        src = torch.chunk(G, k, dim=0)
        x = src[me] if me < len(src) else G[:0]
        GY = _glob((n0, 4, n2), 9 + n0)
        dst_g = torch.chunk(GY, k, dim=2)
        y, g = _grad(lambda t: ops.all_to_all(t, axis, 0, 2, n0), x, dst_g[me] if me < len(dst_g) else GY[..., :0])
        dst = torch.chunk(G, k, dim=2)
        assert_close(y, dst[me] if me < len(dst) else G[..., :0])
        src_g = torch.chunk(GY, k, dim=0)
        assert_close(g, src_g[me] if me < len(src_g) else GY[:0])

    # all_to_all_v: rank r sends (r + d + 1) rows to rank d, tagged with (r, d)
    in_splits = [me + d + 1 for d in range(k)]
    out_splits = [r + me + 1 for r in range(k)]
    x = torch.cat([torch.full((me + d + 1, 2), float(10 * me + d)) for d in range(k)])
    gy = torch.cat([torch.full((r + me + 1, 2), float(100 + 10 * r + me)) for r in range(k)])
    y, g = _grad(lambda t: ops.all_to_all_v(t, axis, out_splits, in_splits), x, gy)
    assert_close(y, torch.cat([torch.full((r + me + 1, 2), float(10 * r + me)) for r in range(k)]))
    assert_close(g, torch.cat([torch.full((me + d + 1, 2), float(100 + 10 * me + d)) for d in range(k)]))

    # send / recv around a ring along the axis (even indices send first to avoid deadlock)
    nxt, prv = (me + 1) % k, (me - 1) % k
    t = torch.full((3,), float(me))
    like = torch.empty(3)
    if me % 2 == 0:
        ops.send(t, axis, nxt)
        got = ops.recv(like, axis, prv)
    else:
        got = ops.recv(like, axis, prv)
        ops.send(t, axis, nxt)
    assert_close(got, torch.full((3,), float(prv)))


def _ops_world(rank, ws):
    m22 = make_mesh(dp=2, tp=2)
    C.set_active_mesh(m22)
    _check_ops_on_axis("tp", 2, m22.local_rank("tp"))
    _check_ops_on_axis("dp", 2, m22.local_rank("dp"))
    m4 = make_mesh(tp=4)
    C.set_active_mesh(m4)
    C.COUNTER.reset()
    x = torch.ones(3, 8)
    ops.all_gather(x, "tp", 0)  # payload: the local shard
    ops.reduce_scatter(torch.ones(10, 2), "tp", 0)  # payload: the input padded to 4 * ceil(10/4) rows
    ops.all_reduce(x, "tp")
    ops.split(x, "tp", 1)  # no communication, not counted
    counted = C.COUNTER.snapshot()
    _check_ops_on_axis("tp", 4, m4.local_rank("tp"))
    return counted


def test_collective_ops_match_hand_computed_values_and_gradients_on_two_and_four_rank_axes():
    t0 = time.monotonic()
    out = world(4, _ops_world)
    for counted in out:
        assert counted == {"all_gather@tp": {"calls": 1, "bytes": 3 * 8 * 4},
                           "reduce_scatter@tp": {"calls": 1, "bytes": 12 * 2 * 4},
                           "all_reduce@tp": {"calls": 1, "bytes": 3 * 8 * 4}}
    assert time.monotonic() - t0 < 60


def test_collective_ops_trace_into_fx_graphs_with_fake_shapes_and_their_backward_collectives():
    # no process group: the mesh shape (and a stand-in rank for uneven dims) is enough
    C.set_active_mesh(make_mesh(dp=2, tp=4), rank=7)  # tp index 3: the short piece
    try:
        def f(x, w):
            h = ops.all_gather(x, "tp", 1, 10)  # (2, 10, 8): 10 rows over 4 ranks -> 3,3,3,1
            h = h @ w
            h = ops.all_to_all(h, "tp", 0, 2, 8)  # (8, 10, 16) over tp ... S(0) -> S(2)
            y = ops.reduce_scatter(h, "tp", 1)  # index 3 keeps 1 of 10 rows
            y = ops.grad_all_reduce(ops.split(y, "dp", 0), "tp")
            loss = ops.all_reduce(y.sum(), "dp")
            return torch.autograd.grad(loss, (x, w))

        x = torch.empty(2, 1, 8, requires_grad=True)  # this rank's uneven piece of 10
        w = torch.empty(8, 16, requires_grad=True)
        gm = make_fx(f, tracing_mode="fake")(x, w)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        names = [str(t) for t in targets if "autopar" in str(t)]
        fwd = ["autopar.all_gather.default", "autopar.all_to_all.default", "autopar.reduce_scatter.default",
               "autopar.split.default", "autopar.grad_all_reduce.default", "autopar.all_reduce.default"]
        assert names[:6] == fwd
        # backward collectives: all_reduce (from grad_all_reduce), all_gather_chunk_grad (split,
        # reduce_scatter), all_to_all back, reduce_scatter (from all_gather)
        assert sorted(names[6:]) == sorted(["autopar.all_reduce.default", "autopar.all_gather_chunk_grad.default",
                                            "autopar.all_gather_chunk_grad.default", "autopar.all_to_all.default",
                                            "autopar.reduce_scatter.default"])
        shapes = {}  # forward occurrence of each op
        for n in gm.graph.nodes:
            if n.op == "call_function" and "autopar" in str(n.target):
                shapes.setdefault(str(n.target), tuple(n.meta["val"].shape))
        assert shapes["autopar.all_gather.default"] == (2, 10, 8)
        assert shapes["autopar.all_to_all.default"] == (8, 10, 4)  # S(0) of 8 rows -> S(2) of 16 cols
        assert shapes["autopar.reduce_scatter.default"] == (8, 1, 4)  # tp index 3 keeps 1 of 10 rows
        assert shapes["autopar.split.default"] == (4, 1, 4)  # dp index 1 keeps rows 4..7
    finally:
        C.set_active_mesh(None)


def _mismatch(rank, ws):
    mesh = make_mesh(dp=2)
    C.set_active_mesh(mesh)
    C.check_collectives(timeout_s=5)
    C.COUNTER.seq.clear()
    t = torch.ones(8)
    C.all_reduce_(t, "dp")  # call #0 matches
    if rank == 1:
        C.reduce_scatter_into_(torch.empty(4), t, "dp")
    else:
        C.all_gather_into_(torch.empty(16), t, "dp")
    return "no error"


def _skipper(rank, ws):
    mesh = make_mesh(dp=2)
    C.set_active_mesh(mesh)
    C.check_collectives(timeout_s=1)
    C.COUNTER.seq.clear()
    if rank == 0:
        C.all_reduce_(torch.ones(4), "dp")
    else:
        time.sleep(3)  # rank 1 never issues the collective
    return "no error"


def _detail(rank, ws):
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # groups made from now on are fingerprinted
    g = dist.new_group([0, 1], backend="gloo")
    t = torch.ones(8)
    if rank == 1:
        dist.reduce_scatter_tensor(torch.empty(4), t, group=g)
    else:
        dist.all_reduce(t, group=g)
    return "no error"


def test_a_rank_issuing_a_different_collective_fails_naming_the_rank_and_both_ops():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as ei:
        world(2, _mismatch, timeout_s=30)
    msg = str(ei.value)
    assert "CollectiveMismatchError" in msg
    assert "rank 1 called reduce_scatter@dp call #1" in msg and "rank 0 called all_gather@dp call #1" in msg
    assert time.monotonic() - t0 < 20


def test_a_rank_that_skips_a_collective_is_named_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as ei:
        world(2, _skipper, timeout_s=30)
    msg = str(ei.value)
    assert "all_reduce@dp call #0" in msg and "Ranks 1 failed to pass monitoredBarrier" in msg
    assert time.monotonic() - t0 < 20


def test_torch_distributed_debug_detail_also_catches_mismatched_collectives_on_gloo():
    # measured alternative: PyTorch's fingerprinting names rank 1's op (it reports rank 0's as GATHER)
    with pytest.raises(WorldError, match=r"Detected mismatch between collectives on ranks. Rank 1 is running "
                                         r"collective: CollectiveFingerPrint\(SequenceNumber=0, OpType=_REDUCE_SCATTER_BASE"):
        world(2, _detail, timeout_s=30)
