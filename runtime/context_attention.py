"""Context-parallel attention: the runtime ops of a `cp` mesh axis.

Under context parallelism the sequence dim of every activation is split across the ranks of
the `cp` axis; everything but attention is token-local, so attention is the only op that
exchanges data. The split is the load-balanced zigzag layout: the sequence is cut into 2*cp
equal chunks and cp rank i holds chunk i followed by chunk 2*cp-1-i (`zigzag_positions`,
`zigzag_shard`, `zigzag_unshard`). Under a causal mask every rank then has the same amount of
work (an early chunk paired with a late one).

Two algorithms, both returning exactly this rank's rows of `F.scaled_dot_product_attention`
over the full sequence (causal by global position), with GQA as `enable_gqa=True`:

    ring_attention     K/V blocks travel around the cp ring (async P2P, the next block's
                       exchange posted before the current block's compute); the partial results
                       merge through their log-sum-exp in fp32 (fp64 for fp64 inputs). Backward
                       is a ring too: dK/dV accumulators travel with their K/V block and take
                       one extra hop home; dQ stays local. Custom ops
                       `autopar::ring_attention_lse` (returns (out, lse)) and
                       `autopar::ring_attention_backward`, both with fake kernels.
    ulysses_attention  all-to-all from (all heads, local tokens) to (local heads, all tokens),
                       full-sequence attention, all-to-all back; built from the differentiable
                       `autopar::all_to_all`, so autograd gives the backward. Needs Hq % cp == 0.

The graph ops `autopar::ring_attention` and `autopar::ulysses_attention` (q, k, v, axis,
is_causal, scale, doc=None) -> out replace an SDPA node one for one; they are composite (they
decompose into the ops above under tracing, fake tensors and autograd).

Packed sequences (`doc`, int64 (B, Tl): each local token's document index, from
`doc_ids_from_positions` over the full sequence then zigzag-sharded): token i sees token j only
when doc_i == doc_j (and pos_j <= pos_i when causal), i.e. SDPA with the block-diagonal (causal)
mask. The ring sends each K/V block's ids with it, masks every block from both sides' ids and
skips the chunk pairs that share no document (`doc_step`); Ulysses all-gathers the ids.

Block compute (runtime/context_blocks.py): a fused SDPA kernel that returns the log-sum-exp
where torch has one for the device and dtype, plain torch math otherwise, after
`set_block_kernel("math")`, and for every block under a document mask.
`RING_WORK` counts the score entries each rank's ring computed (the balance check).

It reads and writes no `node.meta` keys. Guarantees: outputs and gradients equal the
single-process SDPA rows (tests/dist/test_context_attention.py: fp64 to 1e-10, fp32 to 1e-5);
every user error (shapes, odd local length under causal, heads not divisible for Ulysses, an
axis the active mesh lacks, a doc tensor of the wrong shape or dtype) is a ValueError naming the
values and the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .active_mesh import active_mesh, axis_index, group_of
from .collective_check import COUNTER
from .collective_errors import NamedWork, failed
from .collectives import all_gather, all_to_all
from .context_blocks import block_backward, block_forward, fused_block, set_block_kernel


# --- the zigzag layout ------------------------------------------------------------------------
def _check_layout(seq_len: int, cp: int, index: int) -> int:
    if cp < 1 or not 0 <= index < cp:
        raise ValueError(f"zigzag layout: cp={cp}, index={index}; need cp >= 1 and 0 <= index < cp")
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"zigzag layout: sequence length {seq_len} does not divide into 2*cp = {2 * cp} equal "
                         f"chunks (cp={cp}); pad the sequence to a multiple of {2 * cp} or choose a cp with "
                         f"{seq_len} % (2*cp) == 0")
    return seq_len // (2 * cp)


def zigzag_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """Global token positions (int64, shape (seq_len // cp,)) held by cp rank `index`: chunk
    `index` then chunk `2*cp-1-index` of the 2*cp equal chunks of the sequence."""
    c = _check_layout(seq_len, cp, index)
    hi = 2 * cp - 1 - index
    return torch.cat([torch.arange(index * c, (index + 1) * c), torch.arange(hi * c, (hi + 1) * c)])


def zigzag_shard(x: torch.Tensor, dim: int, cp: int, index: int) -> torch.Tensor:
    """This rank's part of the full tensor `x` along `dim` (a new contiguous tensor)."""
    c = _check_layout(x.size(dim), cp, index)
    hi = 2 * cp - 1 - index
    return torch.cat([x.narrow(dim, index * c, c), x.narrow(dim, hi * c, c)], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full tensor from every cp rank's part (`parts[i]` from rank i), inverse of zigzag_shard."""
    cp = len(parts)
    if cp == 0:
        raise ValueError("zigzag_unshard needs one part per cp rank, got none")
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1 or parts[0].size(dim) % 2:
        raise ValueError(f"zigzag_unshard: parts have shapes {[tuple(p.shape) for p in parts]}; every rank's part "
                         f"must have the same shape with an even size of dim {dim}")
    c = parts[0].size(dim) // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for i, p in enumerate(parts):
        chunks[i], chunks[2 * cp - 1 - i] = p.narrow(dim, 0, c), p.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


# --- checks shared by both algorithms (and the fake kernels) ----------------------------------
def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, is_causal: bool, what: str) -> int:
    """Validate the inputs; return the cp size of `axis`."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what}: q, k, v must be (B, H, T_local, D); got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match; k and v "
                         "must have equal shapes, and q the same batch, local length and head dim as k")
    if q.size(1) % k.size(1):
        raise ValueError(f"{what}: {q.size(1)} query heads are not a multiple of {k.size(1)} kv heads; GQA needs "
                         "Hq % Hkv == 0")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} differ; cast them to one dtype")
    mesh = active_mesh()
    if axis not in mesh.sizes:
        raise ValueError(f"{what}: axis {axis!r} is not an axis of the active mesh {mesh} (axes "
                         f"{list(mesh.axis_names)}); pass one of them, or build the mesh with {axis}=<size>")
    if is_causal and q.size(2) % 2:
        raise ValueError(f"{what}: causal attention over the zigzag layout needs an even local length (two "
                         f"chunks per rank), got {q.size(2)} local tokens; pad the sequence to a multiple of "
                         f"2*cp = {2 * mesh.sizes[axis]}")
    return mesh.sizes[axis]


def _check_doc(doc: torch.Tensor | None, q: torch.Tensor, what: str) -> None:
    if doc is None:
        return
    if doc.dim() != 2 or doc.shape != (q.size(0), q.size(2)) or doc.dtype != torch.int64:
        raise ValueError(f"{what}: doc must be int64 of shape (B, T_local) = {(q.size(0), q.size(2))} (the "
                         f"document index of each of this rank's tokens), got {doc.dtype} of shape "
                         f"{tuple(doc.shape)}; build it with doc_ids_from_positions and zigzag_shard(doc, 1, cp, i)")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # partial results merge in at least fp32 (bf16/fp16 inputs), fp64 inputs stay fp64
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- ring: schedule, work count, transport ------------------------------------------------------
@dataclass
class RingWork:
    """Score entries (q rows x kv cols) and block calls the ring computed on this rank, per
    phase ("forward", "backward"); masked counts blocks that needed a mask (causal or document),
    skipped the ring steps whose whole block was skipped (no visible pair: `doc_step`)."""

    scores: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)
    masked: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)

    def record(self, phase: str, rows: int, cols: int, masked: bool) -> None:
        self.scores[phase] = self.scores.get(phase, 0) + rows * cols
        self.blocks[phase] = self.blocks.get(phase, 0) + 1
        self.masked[phase] = self.masked.get(phase, 0) + int(masked)

    def skip(self, phase: str) -> None:
        self.skipped[phase] = self.skipped.get(phase, 0) + 1

    def reset(self) -> None:
        for d in (self.scores, self.blocks, self.masked, self.skipped):
            d.clear()


RING_WORK = RingWork()


def ring_step(cp: int, index: int, step: int, tl: int, is_causal: bool) -> tuple[slice, slice, bool]:
    """(q rows, kv cols, needs causal mask) that rank `index` computes at ring step `step`,
    against the K/V block of rank (index - step) % cp. Zigzag chunks: rank i holds chunks
    (i, 2cp-1-i). Causal, block of rank j != i:
      j < i: chunk j precedes both of ours, chunk 2cp-1-j follows both -> all q rows x first half
      j > i: chunk i precedes both of j's, chunk 2cp-1-i follows both -> second half rows x all kv
    Each is Tl*Tl/2 entries, no mask; step 0 (own block) is the only masked one."""
    everything = slice(0, tl)
    if not is_causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    src = (index - step) % cp
    half = tl // 2
    if src < index:
        return everything, slice(0, half), False
    return slice(half, tl), everything, False


def doc_step(cp: int, index: int, step: int, doc_q: torch.Tensor, doc_k: torch.Tensor,
             is_causal: bool) -> list[tuple[slice, slice, torch.Tensor]]:
    """The blocks of ring step `step` on rank `index` for packed documents: a list of (q rows,
    kv cols, mask (B, rows, cols), True = visible), empty when no pair of the step is visible.
    `doc_q`, `doc_k` (B, Tl): document ids of this rank's tokens and of the visiting block's
    (rank (index - step) % cp). Pair (i, j) is visible iff doc_q[b, i] == doc_k[b, j] and, when
    causal, global position j <= i.

    Skipping works on zigzag chunks (two per rank; one when Tl is odd, non-causal only): a
    (q chunk, kv chunk) pair is dropped when it is acausal (kv chunk after the q chunk) or when
    the [min, max] document ranges of the two chunks are disjoint in every batch row (then no
    id is shared, whatever their order; with ids non-decreasing along the sequence this drops
    every chunk pair lying in different documents). One block per q chunk with a kept pair: its
    rows x the span of its kept kv chunks, masked by the full rule. A step with no kept pair is
    skipped whole (its K/V still travel on)."""
    B, tl = doc_q.shape
    n = 2 if tl % 2 == 0 else 1
    c = tl // n
    lo_q, hi_q = doc_q.reshape(B, n, c).amin(-1), doc_q.reshape(B, n, c).amax(-1)  # (B, n)
    lo_k, hi_k = doc_k.reshape(B, n, c).amin(-1), doc_k.reshape(B, n, c).amax(-1)
    vis = (torch.maximum(lo_q[:, :, None], lo_k[:, None, :])
           <= torch.minimum(hi_q[:, :, None], hi_k[:, None, :])).any(0).tolist()  # (n q chunks, n kv chunks)
    src = (index - step) % cp
    if is_causal:  # global chunk order: rank r holds chunks r and 2cp-1-r
        qc, kc = (index, 2 * cp - 1 - index), (src, 2 * cp - 1 - src)
        vis = [[vis[a][b] and kc[b] <= qc[a] for b in range(n)] for a in range(n)]
        qpos = zigzag_positions(tl * cp, cp, index).to(doc_q.device)
        kpos = zigzag_positions(tl * cp, cp, src).to(doc_q.device)
    blocks = []
    for a in range(n):
        ks = [b for b in range(n) if vis[a][b]]
        if not ks:
            continue
        rows, cols = slice(a * c, (a + 1) * c), slice(ks[0] * c, (ks[-1] + 1) * c)
        mask = doc_q[:, rows, None] == doc_k[:, None, cols]
        if is_causal:
            mask = mask & (kpos[cols][None, None, :] <= qpos[rows][None, :, None])
        blocks.append((rows, cols, mask))
    return blocks


class _Exchange:
    """One ring hop: send the tensors `ts` to the next cp rank, receive like tensors from the
    previous, asynchronously (posted before the compute it overlaps, waited after)."""

    def __init__(self, ts: tuple[torch.Tensor, ...], axis: str, cp: int, me: int):
        g = group_of(axis)
        nxt, prv = dist.get_global_rank(g, (me + 1) % cp), dist.get_global_rank(g, (me - 1) % cp)
        self.sent = [t.contiguous() for t in ts]
        self.got = [torch.empty_like(t) for t in self.sent]
        ops = [op for t, r in zip(self.sent, self.got)
               for op in (dist.P2POp(dist.isend, t, nxt, g), dist.P2POp(dist.irecv, r, prv, g))]
        with failed("ring_attention send/recv", axis=axis, group=g, peer=nxt):
            works = dist.batch_isend_irecv(ops)
        self.works = [NamedWork(w, "ring_attention send/recv", axis=axis, group=g, peer=prv) for w in works]
        for t in self.sent:
            COUNTER.record("send", axis, t.numel() * t.element_size())
            COUNTER.record("recv", axis, t.numel() * t.element_size())

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.got


def _scale_of(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.size(-1)) if scale is None else scale


# --- ring forward -------------------------------------------------------------------------------
def _blocks_of(cp, me, s, tl, is_causal, doc, kdoc):
    """[(rows, cols, masked, mask)] of ring step `s`; empty when documents skip it whole."""
    if doc is None:
        return [(*ring_step(cp, me, s, tl, is_causal), None)]
    return [(r, c, True, m[:, None, None]) for r, c, m in doc_step(cp, me, s, doc, kdoc, is_causal)]  # (Hkv, G)


def _ring_fwd(q, k, v, axis, is_causal, scale, doc):
    cp = _check(q, k, v, axis, is_causal, "ring_attention")
    _check_doc(doc, q, "ring_attention")
    me = axis_index(axis) if cp > 1 else 0
    sc = _scale_of(q, scale)
    acc = _acc_dtype(q.dtype)
    B, Hq, tl, D = q.shape
    hkv = k.size(1)
    qg = q.reshape(B, hkv, Hq // hkv, tl, D)
    out = torch.zeros(qg.shape, dtype=acc, device=q.device)
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    msg = [torch.stack([k, v])] + ([] if doc is None else [doc])  # K/V travel with their doc ids
    for s in range(cp):
        hop = _Exchange(msg, axis, cp, me) if s < cp - 1 else None  # overlap: post before compute
        blocks = _blocks_of(cp, me, s, tl, is_causal, doc, msg[-1])
        if not blocks:
            RING_WORK.skip("forward")
        kv = msg[0]
        for rows, cols, masked, mask in blocks:
            bout, blse = block_forward(qg[..., rows, :], kv[0, :, :, cols], kv[1, :, :, cols], sc, masked, acc, mask)
            RING_WORK.record("forward", bout.size(-2), kv[0, :, :, cols].size(2), masked)
            old = lse[..., rows]
            new = torch.logaddexp(old, blse)
            # a row with nothing seen so far (new = -inf) keeps out 0: its factors exp(-inf - 0) are 0
            safe = new.masked_fill(new == float("-inf"), 0.0)
            out[..., rows, :] = (out[..., rows, :] * torch.exp(old - safe).unsqueeze(-1)
                                 + bout * torch.exp(blse - safe).unsqueeze(-1))
            lse[..., rows] = new
        if hop is not None:
            msg = hop.wait()
    return out.reshape(B, Hq, tl, D).to(q.dtype), lse.reshape(B, Hq, tl)


@torch.library.custom_op("autopar::ring_attention_lse", mutates_args=())
def ring_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, is_causal: bool,
                       scale: float | None = None, doc: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, Tl, D), lse (B, Hq, Tl) in fp32/fp64): ring attention over `axis`; `doc`
    (B, Tl) int64 document ids of packed sequences (see ring_attention)."""
    return _ring_fwd(q, k, v, axis, is_causal, scale, doc)


@ring_attention_lse.register_fake
def _(q, k, v, axis, is_causal, scale=None, doc=None):
    _check(q, k, v, axis, is_causal, "ring_attention")
    _check_doc(doc, q, "ring_attention")
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_acc_dtype(q.dtype))


# --- ring backward ------------------------------------------------------------------------------
def _ring_bwd(dout, dlse, q, k, v, out, lse, axis, is_causal, scale, doc):
    cp = _check(q, k, v, axis, is_causal, "ring_attention backward")
    me = axis_index(axis) if cp > 1 else 0
    sc = _scale_of(q, scale)
    acc = _acc_dtype(q.dtype)
    B, Hq, tl, D = q.shape
    hkv, G = k.size(1), Hq // k.size(1)
    qg, og, dog = (t.reshape(B, hkv, G, tl, D) for t in (q, out, dout))
    lg = lse.to(acc).reshape(B, hkv, G, tl)
    # the fused kernel forms delta itself, knows no lse gradient and no document mask: math then
    fused = dlse is None and doc is None and fused_block(q)
    delta = None
    if not fused:  # delta = rowsum(dO * O), less the lse's own gradient (d lse / dS = P)
        delta = (dog.to(acc) * og.to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(acc).reshape(B, hkv, G, tl)
    dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
    msg = [torch.stack([k, v])] + ([] if doc is None else [doc])
    home = None  # the dK/dV partial of the block arriving next, from the previous rank
    for s in range(cp):
        hop = _Exchange(msg, axis, cp, me) if s < cp - 1 else None
        blocks = _blocks_of(cp, me, s, tl, is_causal, doc, msg[-1])
        dkv = torch.zeros((2, B, hkv, tl, D), dtype=acc, device=q.device)
        if not blocks:
            RING_WORK.skip("backward")
        kv = msg[0]
        for rows, cols, masked, mask in blocks:
            dqb, dkb, dvb = block_backward(qg[..., rows, :], kv[0, :, :, cols], kv[1, :, :, cols], og[..., rows, :],
                                           dog[..., rows, :], lg[..., rows], None if fused else delta[..., rows],
                                           sc, masked, acc, fused, mask)
            RING_WORK.record("backward", dqb.size(-2), dkb.size(-2), masked)
            dq[..., rows, :] += dqb
            dkv[0, :, :, cols] += dkb
            dkv[1, :, :, cols] += dvb
        if home is not None:  # the previous ranks' sum for this block, sent while we computed
            dkv += home.wait()[0]
        # pass the block's dK/dV on with it; after the last step the next rank is its owner
        home = _Exchange([dkv], axis, cp, me) if cp > 1 else None
        if hop is not None:
            msg = hop.wait()
    dkv = home.wait()[0] if home is not None else dkv
    # copies: dk and dv must not alias each other (custom-op outputs)
    return dq.reshape(B, Hq, tl, D).to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


@torch.library.custom_op("autopar::ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, axis: str, is_causal: bool,
                               scale: float | None = None, doc: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ring attention from the saved output and log-sum-exp."""
    return _ring_bwd(dout, dlse, q, k, v, out, lse, axis, is_causal, scale, doc)


@ring_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, axis, is_causal, scale=None, doc=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ring_setup(ctx, inputs, output):
    q, k, v, axis, is_causal, scale, doc = inputs
    ctx.save_for_backward(q, k, v, *output, doc)
    ctx.set_materialize_grads(False)  # an unused lse gets None, not zeros: the fused backward applies
    ctx.axis, ctx.is_causal, ctx.scale = axis, is_causal, scale


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse, doc = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.autopar.ring_attention_backward(dout.contiguous(), dlse, q, k, v, out, lse, ctx.axis,
                                                           ctx.is_causal, ctx.scale, doc)
    return dq, dk, dv, None, None, None, None


ring_attention_lse.register_autograd(_ring_backward, setup_context=_ring_setup)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, is_causal: bool,
                   scale: float | None = None, doc: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows of attention over the full sequence, K/V passed around the `axis` ring.

    Args:
        q: (B, Hq, Tl, D), k and v: (B, Hkv, Tl, D), Hq % Hkv == 0; Tl = T / cp tokens of this
            rank in the zigzag layout (`zigzag_shard`).
        axis: the cp axis of the active mesh.
        is_causal: causal by global position.
        scale: softmax scale (default 1/sqrt(D)).
        doc: packed sequences: int64 (B, Tl), the document index of each of this rank's tokens
            (zigzag layout as q; ids non-decreasing along the global sequence for the skipping to
            pay, e.g. `doc_ids_from_positions`). Token i then sees token j only within its own
            document: doc[b, i] == doc[b, j] (and j <= i when causal). None: one document.
    Returns:
        (B, Hq, Tl, D), equal to this rank's rows of F.scaled_dot_product_attention over the full
        sequence (with doc: attn_mask = the block-diagonal, causal when is_causal, mask).

    Work under causal: with the zigzag layout every rank computes the same cp blocks per pass:
    its own block once with a causal mask (Tl x Tl entries computed, about half of them masked)
    and cp-1 unmasked half blocks (Tl x Tl/2 each: all rows against the early chunk of
    a preceding rank, or the late half of the rows against all of a following rank), so
    Tl^2 * (cp+1)/2 score entries on every rank, against cp*Tl^2 without the mask. The graph
    shows `autopar::ring_attention`, which decomposes (under tracing and autograd) into
    `autopar::ring_attention_lse` and, in backward, `autopar::ring_attention_backward`.

    With doc, each K/V block travels with its doc ids (a second tensor in the same hop); every
    block is computed on the plain-math path with the mask built from both sides' ids and global
    positions, and `doc_step` trims or skips (RING_WORK.skipped) the chunk pairs that share no
    document. A row that sees nothing in a block contributes nothing to it (lse -inf).
    """
    return torch.ops.autopar.ring_attention(q, k, v, axis, is_causal, scale, doc)


# --- Ulysses --------------------------------------------------------------------------------------
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, is_causal: bool,
                      scale: float | None = None, doc: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows of attention over the full sequence by head-parallel all-to-all (Ulysses).

    Shapes as `ring_attention`. The all-to-all turns (all Hq heads, Tl local tokens) into
    (Hq/cp heads, all T tokens in zigzag order); the tokens are put back in natural order for
    the causal mask, attended with F.scaled_dot_product_attention, and returned the same way.
    Needs Hq % cp == 0. When Hkv % cp != 0 the kv heads are repeated (each kv head r times,
    consecutively) up to lcm(Hkv, cp) heads, which divides Hq, so every rank gets whole kv
    heads for its query heads; the repeat's backward sums the copies' gradients.
    Backward: autograd through `autopar::all_to_all` (its backward is the all-to-all back).
    The graph shows `autopar::ulysses_attention`, which decomposes into those ops.

    doc (as `ring_attention`): all-gathered over `axis` (`autopar::all_gather`, rank-major, each
    rank's part in zigzag order); the mask doc_i == doc_j (and pos_j <= pos_i when causal, with
    the global positions of that gathered order) is built in the gathered order itself, so no
    token reordering is needed, and SDPA runs with it as attn_mask.
    """
    return torch.ops.autopar.ulysses_attention(q, k, v, axis, is_causal, scale, doc)


def _ulysses(q, k, v, axis, is_causal, scale=None, doc=None):
    cp = _check(q, k, v, axis, is_causal, "ulysses_attention")
    _check_doc(doc, q, "ulysses_attention")
    hq, hkv, tl = q.size(1), k.size(1), q.size(2)
    if hq % cp:
        raise ValueError(f"ulysses_attention: {hq} query heads do not divide over cp={cp} ranks; use "
                         "ring_attention for this layer, or a cp that divides the head count")
    if hkv % cp:
        rep = math.lcm(hkv, cp) // hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # S(2) -> S(1): tokens of every rank (rank-major, each in its zigzag order), this rank's heads
    qh, kh, vh = (all_to_all(t.contiguous(), axis, 2, 1) for t in (q, k, v))
    gqa = qh.size(1) != kh.size(1)
    if doc is not None:
        dg = all_gather(doc.contiguous(), axis, 1)  # (B, T) in the gathered order of qh, kh, vh
        mask = dg[:, :, None] == dg[:, None, :]
        if is_causal:
            pos = torch.cat([zigzag_positions(tl * cp, cp, i) for i in range(cp)]).to(q.device)
            mask = mask & (pos[None, None, :] <= pos[None, :, None])
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa)
        return all_to_all(y.contiguous(), axis, 1, 2)
    reorder = is_causal and cp > 1  # without a mask the token order does not matter
    if reorder:
        pos = torch.cat([zigzag_positions(tl * cp, cp, i) for i in range(cp)]).to(q.device)
        natural = torch.argsort(pos)  # gathered index holding each global position
        qh, kh, vh = (t.index_select(2, natural) for t in (qh, kh, vh))
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    if reorder:
        y = y.index_select(2, pos)  # back to the gathered zigzag order
    return all_to_all(y.contiguous(), axis, 1, 2)  # S(1) -> S(2)


# --- the graph ops ------------------------------------------------------------------------------
# One tensor out, as the SDPA node they replace: composite ops, so a graph prints
# `torch.ops.autopar.ring_attention.default(q, k, v, 'cp', True, None)` while tracing, fake
# tensors and autograd see what they decompose into (ring_attention_lse keeps the lse that the
# ring backward needs; Ulysses is differentiable all-to-alls around SDPA).
_LIB = torch.library.Library("autopar", "FRAGMENT")
for _name, _fn in (("ring_attention", lambda q, k, v, axis, is_causal, scale=None, doc=None:
                    torch.ops.autopar.ring_attention_lse(q, k, v, axis, is_causal, scale, doc)[0]),
                   ("ulysses_attention", _ulysses)):
    _LIB.define(f"{_name}(Tensor q, Tensor k, Tensor v, str axis, bool is_causal, float? scale=None, "
                "Tensor? doc=None) -> Tensor")
    _LIB.impl(_name, _fn, "CompositeImplicitAutograd")


# --- packed sequences -----------------------------------------------------------------------------
def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index (int64 (B, T): 0, 1, 2, ... per row) of each token of packed sequences,
    from their position ids over the full sequence in natural order: a document starts at t = 0
    and wherever the position does not continue the previous one (pos[t] != pos[t-1] + 1), as
    transformers detects packing from position_ids. Shard the result like the tokens
    (`zigzag_shard(doc, 1, cp, i)`) for the `doc` argument."""
    if position_ids.dim() != 2 or position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(f"doc_ids_from_positions: position_ids must be an integer (B, T) tensor over the full "
                         f"sequence, got {position_ids.dtype} of shape {tuple(position_ids.shape)}; add the batch "
                         "dim with position_ids[None] for one row")
    p = position_ids.long()
    start = torch.ones_like(p, dtype=torch.bool)
    start[:, 1:] = p[:, 1:] != p[:, :-1] + 1
    return start.long().cumsum(1) - 1


__all__ = ["zigzag_positions", "zigzag_shard", "zigzag_unshard", "ring_attention", "ulysses_attention",
           "ring_attention_lse", "ring_attention_backward", "ring_step", "doc_step", "RingWork", "RING_WORK",
           "set_block_kernel", "doc_ids_from_positions"]
