"""Context-parallel attention (runtime/context_attention.py): the zigzag layout, the ring's
causal schedule, errors and fake-tensor tracing without a process group; then, on gloo worlds
of 2 and 4 ranks, ring and Ulysses outputs and gradients against one-process
F.scaled_dot_product_attention over the full sequence (causal and not, MHA and GQA, fp32 and
fp64; the ring on both block kernels: CPU flash and plain math), the ring's log-sum-exp output
and its gradient, the ring's per-rank work under causal, and its point-to-point message count.
Packed sequences (`doc`): document ids from position ids, the ring's document block schedule
(`doc_step`: exact masks, nothing visible left out, chunk pairs without a shared document
skipped), and in the same worlds ring and Ulysses against one-process SDPA with the
block-diagonal (causal) mask, fp64.

Tolerances: fp64 rtol = atol = 1e-10; fp32 rtol = atol = 1e-5 (inputs and upstream gradients
standard normal, D = 8; the math path accumulates in the input's precision or fp32)."""
import time

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

from harness import world
from autopar.runtime import collectives as C
from autopar.runtime._torch_compat import FakeTensorMode
from autopar.runtime.context_attention import (RING_WORK, doc_ids_from_positions, doc_step, ring_attention,
                                               ring_step, set_block_kernel, ulysses_attention, zigzag_positions,
                                               zigzag_shard, zigzag_unshard)
from autopar.runtime.mesh import make_mesh

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
HEADS = ((4, 4), (4, 2), (4, 1))  # (Hq, Hkv): MHA, GQA groups of 2, MQA


def _warm_custom_ops():
    # the first custom-op call imports torch's compiler stack (~3 s): pay it once before forking
    C.set_active_mesh(make_mesh(cp=1), rank=0)
    x = torch.randn(1, 1, 2, 2, requires_grad=True)
    ring_attention(x, x, x, "cp", True).sum().backward()
    C.set_active_mesh(None)


_warm_custom_ops()


# --- no process group -------------------------------------------------------------------------
def test_zigzag_positions_give_rank_i_chunks_i_and_2cp_minus_1_minus_i():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert zigzag_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert zigzag_positions(4, 1, 0).tolist() == [0, 1, 2, 3]
    assert zigzag_positions(8, 2, 0).dtype == torch.int64
    for cp in (1, 2, 3, 4):
        allpos = torch.cat([zigzag_positions(12 * cp, cp, i) for i in range(cp)])
        assert sorted(allpos.tolist()) == list(range(12 * cp))  # a partition of the sequence
    x = torch.randn(2, 3, 24, 5)
    for cp in (1, 2, 3):
        parts = [zigzag_shard(x, 2, cp, i) for i in range(cp)]
        for i, p in enumerate(parts):
            assert torch.equal(p, x.index_select(2, zigzag_positions(24, cp, i)))
        assert torch.equal(zigzag_unshard(parts, 2), x)
    y = torch.arange(16.0).reshape(2, 8)  # a negative dim
    assert zigzag_shard(y, -1, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(zigzag_unshard([zigzag_shard(y, -1, 2, i) for i in range(2)], -1), y)
    with pytest.raises(ValueError, match=r"sequence length 10 does not divide into 2\*cp = 4 .*multiple of 4"):
        zigzag_positions(10, 2, 0)
    with pytest.raises(ValueError, match=r"cp=2, index=2"):
        zigzag_positions(8, 2, 2)
    with pytest.raises(ValueError, match="same shape"):
        zigzag_unshard([torch.zeros(4), torch.zeros(6)], 0)


def test_ring_causal_schedule_covers_each_earlier_position_once_with_equal_work_per_rank():
    for cp in (1, 2, 3, 4, 5):
        tl, T = 4, 4 * cp
        seen = torch.zeros(T, T, dtype=torch.int64)
        work = []
        for me in range(cp):
            mine, n = zigzag_positions(T, cp, me), 0
            for s in range(cp):
                rows, cols, masked = ring_step(cp, me, s, tl, True)
                qpos = mine[rows]
                kpos = zigzag_positions(T, cp, (me - s) % cp)[cols]
                keep = torch.ones(len(qpos), len(kpos), dtype=torch.bool)
                if masked:
                    keep = keep.tril()
                # entries the block computes and keeps must all be causal
                assert (qpos[:, None] >= kpos[None, :])[keep].all()
                seen[qpos[:, None].expand_as(keep)[keep], kpos[None, :].expand_as(keep)[keep]] += 1
                n += len(qpos) * len(kpos)
            work.append(n)
        assert torch.equal(seen, torch.ones(T, T, dtype=torch.int64).tril()), f"cp={cp}"
        assert work == [tl * tl * (cp + 1) // 2] * cp, f"cp={cp}: {work}"


# packed rows per cp: (B = 2 rows) x 3 documents of uneven lengths over T = 8 * cp tokens (zigzag
# chunks of 4): one boundary on a chunk edge and one inside a chunk in each row
PACKS = {2: ((4, 7, 5), (6, 2, 8)), 4: ((8, 13, 11), (3, 17, 12))}


def _packed_doc(cp: int) -> torch.Tensor:
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKS[cp]])  # (2, T)
    return doc_ids_from_positions(pos)


def _doc_mask(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, T, T) boolean: query i sees key j (full sequence, natural order)."""
    m = doc[:, :, None] == doc[:, None, :]
    return m & torch.ones(doc.size(1), doc.size(1), dtype=torch.bool).tril() if causal else m


def test_doc_ids_from_positions_start_a_document_where_positions_do_not_continue():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 0, 1, 2, 3, 4, 0, 0]])
    assert doc_ids_from_positions(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 2, 3]]
    assert doc_ids_from_positions(pos).dtype == torch.int64
    assert doc_ids_from_positions(torch.arange(6, dtype=torch.int32)[None]).tolist() == [[0] * 6]
    assert _packed_doc(2).tolist() == [[0] * 4 + [1] * 7 + [2] * 5, [0] * 6 + [1] * 2 + [2] * 8]
    with pytest.raises(ValueError, match=r"integer \(B, T\) tensor.*shape \(6,\); add the batch dim"):
        doc_ids_from_positions(torch.arange(6))


def test_doc_step_masks_exactly_the_visible_pairs_and_skips_chunk_pairs_without_a_shared_document():
    c = 4  # chunk length; Tl = 2c
    for cp in (1, 2, 3, 4):
        tl = 2 * c
        T = tl * cp
        per_chunk = torch.arange(2 * cp).repeat_interleave(c)[None]  # one document per zigzag chunk
        one = torch.zeros(1, T, dtype=torch.int64)
        for doc in [per_chunk, one] + ([_packed_doc(cp)] if cp in PACKS else []):
            for causal in (True, False):
                full = _doc_mask(doc, causal)
                entries = plain = skipped = 0
                for me in range(cp):
                    mine = zigzag_positions(T, cp, me)
                    for s in range(cp):
                        src = (me - s) % cp
                        truth = full[:, mine[:, None], zigzag_positions(T, cp, src)[None, :]]  # (B, Tl, Tl)
                        rows, cols, _ = ring_step(cp, me, s, tl, causal)
                        plain += len(range(tl)[rows]) * len(range(tl)[cols])
                        blocks = doc_step(cp, me, s, zigzag_shard(doc, 1, cp, me), zigzag_shard(doc, 1, cp, src),
                                          causal)
                        skipped += not blocks
                        covered = torch.zeros(tl, tl, dtype=torch.int64)
                        for rows, cols, mask in blocks:
                            assert torch.equal(mask, truth[:, rows, cols])
                            covered[rows, cols] += 1
                            entries += mask[0].numel()
                        assert covered.max() <= 1, "blocks of one step overlap"
                        assert not (truth & (covered == 0)).any(), f"cp={cp} me={me} step={s}: visible pair left out"
                what = f"cp={cp} causal={causal} doc={doc.tolist()}"
                if doc is per_chunk:  # only each rank's own block: each of its two chunks with itself
                    assert (entries, skipped) == (cp * 2 * c * c, cp * (cp - 1)), what
                elif doc is one:  # the plain ring's blocks, less the own block's acausal chunk pair
                    assert (entries, skipped) == ((plain - cp * c * c) if causal else plain, 0), what
                else:  # packed rows: some chunk pairs lie in different documents
                    assert entries < (plain - cp * c * c if causal else plain), what


def test_inputs_that_cannot_work_raise_value_errors_naming_values_and_fix():
    C.set_active_mesh(make_mesh(cp=2), rank=0)
    try:
        q = torch.randn(1, 4, 4, 8)
        with pytest.raises(ValueError, match=r"q \(1, 4, 4, 8\), k \(1, 2, 6, 8\).*do not match"):
            ring_attention(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), "cp", True)
        with pytest.raises(ValueError, match=r"3 local tokens; pad the sequence to a multiple of 2\*cp = 4"):
            ring_attention(*(torch.randn(1, 2, 3, 8) for _ in range(3)), "cp", True)
        with pytest.raises(ValueError, match=r"4 query heads are not a multiple of 3 kv heads"):
            ulysses_attention(q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), "cp", False)
        with pytest.raises(ValueError, match=r"axis 'sp' is not an axis of the active mesh Mesh\(cp=2\)"):
            ring_attention(q, q, q, "sp", False)
        with pytest.raises(ValueError, match=r"3 query heads do not divide over cp=2 ranks; use ring_attention"):
            ulysses_attention(*(torch.randn(1, 3, 4, 8) for _ in range(3)), "cp", True)
        with pytest.raises(ValueError, match=r"block kernel 'flash': use 'auto' or 'math'"):
            set_block_kernel("flash")
        with pytest.raises(ValueError, match=r"dtypes torch.float32, torch.float64"):
            ring_attention(q, q.double(), q.double(), "cp", False)
        for attn in (ring_attention, ulysses_attention):
            with pytest.raises(ValueError, match=r"doc must be int64 of shape \(B, T_local\) = \(1, 4\).*got "
                                                 r"torch.int64 of shape \(1, 8\)"):
                attn(q, q, q, "cp", True, doc=torch.zeros(1, 8, dtype=torch.int64))
            with pytest.raises(ValueError, match=r"got torch.int32 of shape \(1, 4\)"):
                attn(q, q, q, "cp", True, doc=torch.zeros(1, 4, dtype=torch.int32))
    finally:
        C.set_active_mesh(None)


def test_ring_and_ulysses_trace_into_fx_graphs_with_fake_shapes_and_backward_ops():
    C.set_active_mesh(make_mesh(cp=4), rank=1)  # no process group: the mesh shape is enough
    try:
        def grads(attn):
            def f(q, k, v, gy):
                return (attn(q, k, v, "cp", True),) + torch.autograd.grad(attn(q, k, v, "cp", True), (q, k, v), gy)
            return f

        q = torch.empty(2, 4, 6, 8, requires_grad=True)  # Tl = 6: T = 24 over cp = 4
        k = torch.empty(2, 2, 6, 8, requires_grad=True)
        v = torch.empty(2, 2, 6, 8, requires_grad=True)
        gy = torch.empty(2, 4, 6, 8)
        for attn in (ring_attention, ulysses_attention):
            gm = make_fx(grads(attn), tracing_mode="fake")(q, k, v, gy)
            ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "autopar" in str(n.target)]
            if attn is ring_attention:
                assert ops.count("autopar.ring_attention_lse.default") == 2
                assert ops.count("autopar.ring_attention_backward.default") == 1
            else:  # q, k, v in, the output back, twice; backward: the four all-to-alls back
                assert ops == ["autopar.all_to_all.default"] * 12
            outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
            assert [tuple(o.meta["val"].shape) for o in outs] == [(2, 4, 6, 8), (2, 4, 6, 8), (2, 2, 6, 8),
                                                                  (2, 2, 6, 8)]
        ring = [n for n in make_fx(grads(ring_attention), tracing_mode="fake")(q, k, v, gy).graph.nodes
                if str(n.target) == "autopar.ring_attention_lse.default"][0]
        assert ring.args[3:5] == ("cp", True)
        assert [tuple(t.shape) for t in ring.meta["val"]] == [(2, 4, 6, 8), (2, 4, 6)]  # out, lse
        # as the context_attention pass inserts them: one node, one tensor, in place of SDPA
        for op in (torch.ops.autopar.ring_attention.default, torch.ops.autopar.ulysses_attention.default):
            g = torch.fx.Graph()
            args = [g.placeholder(n) for n in "qkv"]
            g.output(g.call_function(op, (*args, "cp", True, None)))
            gm = torch.fx.GraphModule(torch.nn.Module(), g)
            assert f"torch.ops.autopar.{op._schema.name.split('::')[1]}.default(q, k, v, 'cp', True, None)" in gm.code
            with FakeTensorMode():
                y = gm(*(torch.empty(t.shape) for t in (q, k, v)))
            assert tuple(y.shape) == (2, 4, 6, 8)
        # packed documents: doc is one more input of the ops (the ring's backward op reads it too)
        doc = torch.zeros(2, 6, dtype=torch.int64)
        for attn in (ring_attention, ulysses_attention):
            def f(q, k, v, gy, doc):
                y = attn(q, k, v, "cp", True, doc=doc)
                return (y,) + torch.autograd.grad(y, (q, k, v), gy)
            gm = make_fx(f, tracing_mode="fake")(q, k, v, gy, doc)
            ops = [n for n in gm.graph.nodes if n.op == "call_function" and "autopar" in str(n.target)]
            if attn is ring_attention:
                assert [str(n.target) for n in ops] == ["autopar.ring_attention_lse.default",
                                                        "autopar.ring_attention_backward.default"]
                assert ops[0].args[6].name == ops[1].args[10].name == "doc_1"
            else:
                assert [str(n.target) for n in ops].count("autopar.all_gather.default") == 1
            assert [tuple(o.meta["val"].shape) for o in [n for n in gm.graph.nodes if n.op == "output"][0].args[0]] \
                == [(2, 4, 6, 8), (2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8)]
    finally:
        C.set_active_mesh(None)


# --- gloo worlds ------------------------------------------------------------------------------
def _full(B, hq, hkv, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape in
            ((B, hq, T, D), (B, hkv, T, D), (B, hkv, T, D), (B, hq, T, D))]


def _check_parity(axis: str, cp: int, me: int, seed: int, algorithms=(ring_attention, ulysses_attention)) -> int:
    """Every (algorithm, causal, heads, dtype) case on `axis`; returns how many were checked."""
    n = 0
    for dtype in (torch.float64, torch.float32):
        for hq, hkv in HEADS:
            q, k, v, gy = _full(2, hq, hkv, 4 * cp, 8, dtype, seed + hq * 10 + hkv)
            for causal in (True, False):
                full = [t.clone().requires_grad_(True) for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
                ref_grads = torch.autograd.grad(ref, full, gy)
                mine = lambda t: zigzag_shard(t, 2, cp, me)  # noqa: E731
                for attn in algorithms:
                    local = [mine(t).requires_grad_(True) for t in (q, k, v)]
                    y = attn(*local, axis, causal)
                    got = torch.autograd.grad(y, local, mine(gy))
                    what = f"{attn.__name__} cp={cp} causal={causal} Hq={hq} Hkv={hkv} {dtype}"
                    assert y.dtype == dtype and y.shape == local[0].shape, what
                    assert_close(y, mine(ref), **TOL[dtype], msg=lambda m: f"{what} out: {m}")
                    for name, gl, gr in zip("qkv", got, ref_grads):
                        assert_close(gl, mine(gr), **TOL[dtype], msg=lambda m: f"{what} d{name}: {m}")
                    n += 1
    return n


def _check_lse_gradient(axis: str, cp: int, me: int) -> None:
    """The ring op's second output, the log-sum-exp of each row, and its gradient (math backward),
    against plain one-process math: loss = <out, gy> + <lse, gl>, causal GQA, fp64."""
    q, k, v, gy = _full(2, 4, 2, 4 * cp, 8, torch.float64, 11)
    gl = torch.randn(2, 4, 4 * cp, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kf, vf = (t.repeat_interleave(2, dim=1) for t in full[1:])
    s = (full[0] @ kf.transpose(-1, -2) / 8 ** 0.5).masked_fill(~torch.ones(4 * cp, 4 * cp, dtype=torch.bool).tril(),
                                                               float("-inf"))
    lse = s.logsumexp(-1)
    out = torch.exp(s - lse[..., None]) @ vf
    ref = torch.autograd.grad((out * gy).sum() + (lse * gl).sum(), full)
    local = [zigzag_shard(t, 2, cp, me).requires_grad_(True) for t in (q, k, v)]
    o, l = torch.ops.autopar.ring_attention_lse(*local, axis, True, None)
    assert_close(l, zigzag_shard(lse, 2, cp, me), **TOL[torch.float64])
    got = torch.autograd.grad((o * zigzag_shard(gy, 2, cp, me)).sum() + (l * zigzag_shard(gl, 2, cp, me)).sum(), local)
    for gl_, gr in zip(got, ref):
        assert_close(gl_, zigzag_shard(gr, 2, cp, me), **TOL[torch.float64])


def _ring_work(axis: str, cp: int, me: int, causal: bool) -> dict:
    """Score entries and ring messages of one fwd + bwd (Tl = 8, Hq = 4, Hkv = 2)."""
    q, k, v, gy = _full(1, 4, 2, 8 * cp, 4, torch.float32, 7)
    local = [zigzag_shard(t, 2, cp, me).requires_grad_(True) for t in (q, k, v)]
    RING_WORK.reset()
    C.COUNTER.reset()
    y = ring_attention(*local, axis, causal)
    fwd_sends = C.COUNTER.calls[("send", axis)]
    torch.autograd.grad(y, local, zigzag_shard(gy, 2, cp, me))
    return {"scores": dict(RING_WORK.scores), "masked": dict(RING_WORK.masked),
            "fwd_sends": fwd_sends, "sends": C.COUNTER.calls[("send", axis)]}


def _check_packed(axis: str, cp: int, me: int) -> dict:
    """Ring and Ulysses with `doc` (two rows of three packed documents) against one-process SDPA
    with the block-diagonal (causal) mask, fp64, MHA/GQA/MQA, causal and not; then the ring's
    work with one document per zigzag chunk (every step but the own block skipped)."""
    n, doc = 0, _packed_doc(cp)
    mine = lambda t, d=2: zigzag_shard(t, d, cp, me)  # noqa: E731
    for hq, hkv in HEADS:
        q, k, v, gy = _full(2, hq, hkv, 8 * cp, 8, torch.float64, 50 + hq * 10 + hkv)
        for causal in (True, False):
            full = [t.clone().requires_grad_(True) for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, attn_mask=_doc_mask(doc, causal)[:, None], enable_gqa=True)
            ref_grads = torch.autograd.grad(ref, full, gy)
            for attn in (ring_attention, ulysses_attention):
                local = [mine(t).requires_grad_(True) for t in (q, k, v)]
                y = attn(*local, axis, causal, doc=mine(doc, 1))
                got = torch.autograd.grad(y, local, mine(gy))
                what = f"packed {attn.__name__} cp={cp} causal={causal} Hq={hq} Hkv={hkv}"
                assert_close(y, mine(ref), **TOL[torch.float64], msg=lambda m: f"{what} out: {m}")
                for name, gl, gr in zip("qkv", got, ref_grads):
                    assert_close(gl, mine(gr), **TOL[torch.float64], msg=lambda m: f"{what} d{name}: {m}")
                n += 1
    q, k, v, gy = _full(1, 4, 2, 8 * cp, 8, torch.float64, 60)
    per_chunk = torch.arange(2 * cp).repeat_interleave(4)[None]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, attn_mask=_doc_mask(per_chunk, True)[:, None], enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, full, gy)
    local = [mine(t).requires_grad_(True) for t in (q, k, v)]
    RING_WORK.reset()
    y = ring_attention(*local, axis, True, doc=mine(per_chunk, 1))
    got = torch.autograd.grad(y, local, mine(gy))
    for a, b in zip((y, *got), (ref, *ref_grads)):
        assert_close(a, mine(b), **TOL[torch.float64])
    return {"cases": n, "skipped": dict(RING_WORK.skipped), "scores": dict(RING_WORK.scores)}


def _cp_world(rank, ws):
    mesh = make_mesh(cp=ws)
    C.set_active_mesh(mesh)
    me = mesh.local_rank("cp")
    out = {"cases": _check_parity("cp", ws, me, seed=1)}  # fused block kernel (CPU flash)
    set_block_kernel("math")
    out["cases_math"] = _check_parity("cp", ws, me, seed=2, algorithms=(ring_attention,))
    set_block_kernel("auto")
    _check_lse_gradient("cp", ws, me)
    out["causal"] = _ring_work("cp", ws, me, True)
    out["full"] = _ring_work("cp", ws, me, False)
    out["packed"] = _check_packed("cp", ws, me)
    if ws == 4:  # cp as the inner axis of dp x cp: cp groups {0, 1} and {2, 3}, data per dp rank
        m22 = make_mesh(dp=2, cp=2)
        C.set_active_mesh(m22)
        out["cases_dp_cp"] = _check_parity("cp", 2, m22.local_rank("cp"), seed=100 * m22.local_rank("dp"))
    C.set_active_mesh(None)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_ulysses_match_single_process_sdpa_rows_and_grads_with_balanced_causal_ring(cp):
    t0 = time.monotonic()
    res = world(cp, _cp_world)
    tl = 8
    for r in res:
        assert r["cases"] == 2 * len(HEADS) * 2 * 2  # dtypes x heads x causal x algorithms
        assert r["cases_math"] == 2 * len(HEADS) * 2  # the ring again, on the plain-math block path
        # causal: every rank computes Tl^2 (cp+1)/2 entries per pass, one masked block
        assert r["causal"]["scores"] == {"forward": tl * tl * (cp + 1) // 2, "backward": tl * tl * (cp + 1) // 2}
        assert r["causal"]["masked"] == {"forward": 1, "backward": 1}
        assert r["full"]["scores"] == {"forward": cp * tl * tl, "backward": cp * tl * tl}
        assert r["full"]["masked"] == {"forward": 0, "backward": 0}
        # K/V hop cp-1 times each way; dK/dV hop cp times (the last one home)
        assert r["causal"]["fwd_sends"] == cp - 1
        assert r["causal"]["sends"] == (cp - 1) + (cp - 1) + cp
        if cp == 4:
            assert r["cases_dp_cp"] == r["cases"]
        # packed documents: heads x causal x algorithms; one document per chunk: the own block's
        # two chunk-with-itself blocks only (2 * 4 * 4 entries, chunks of 4) and cp-1 skipped steps
        assert r["packed"]["cases"] == len(HEADS) * 2 * 2
        assert r["packed"]["skipped"] == {"forward": cp - 1, "backward": cp - 1}
        assert r["packed"]["scores"] == {"forward": 2 * 4 * 4, "backward": 2 * 4 * 4}
    assert res[0]["causal"] == res[-1]["causal"]
    assert time.monotonic() - t0 < 40
