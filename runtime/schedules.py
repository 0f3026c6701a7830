"""Pipeline schedules as data, a grid that prints and parses back, and a simulator.

A schedule is one ordered action list per pipeline rank. An action is (stage, kind,
micro-batch) and prints like `torch.distributed.pipelining`'s `_Action`: `2F0` is stage 2's
forward of micro-batch 0. Kinds: `F` forward, `B` full backward, `I` backward for the stage
inputs only, `W` backward for the weights only (zero-bubble schedules split `B` into `I` + `W`).

Generators: `gpipe`, `one_f_one_b`, `interleaved_1f1b` (v stages per rank, stage s on rank
s % p), `zero_bubble_h1` (ZB-H1: 1F1B with `W` deferred into the cool-down bubble) and `zbv`
(ZB-V: two stages per rank in a V, stage s on rank s for s < p and on 2p-1-s after). Their
orders follow torch's generators (`Schedule1F1B`, `ScheduleInterleaved1F1B`,
`ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`) without torch's `None` padding:
waiting is the executor's job, the order is the schedule.

`Schedule.to_grid()` prints one row per rank and one column per time step (the time steps of
a dry run where every action takes one unit); `Schedule.from_grid(text)` reads it back
exactly. `simulate(schedule, f=, b=, i=, w=, p2p=)` dry-runs the lists with per-stage
durations, respecting the dependencies

    F(s, m) after F(s-1, m)              (+ p2p when the stages sit on different ranks)
    B/I(s, m) after F(s, m) and B/I(s+1, m)   (+ p2p likewise)
    W(s, m) after I(s, m)

and each rank running its list in order, one action at a time. It reports a deadlock with the
blocked actions named, per-rank timelines, the makespan (predicted step time), the bubble
fraction, and the peak number of micro-batch activations held per rank (forward done, its
`B` or `W` not yet done). It touches no process, tensor or `node.meta` key.

Guarantees: a `Schedule` that exists is well formed (every stage/micro-batch has exactly one
`F` and either one `B` or one `I` and one `W`, each on the rank that holds the stage);
`from_grid(s.to_grid()) == s`; the simulator is deterministic: the order actions run in depends
on no duration, so it is found once per schedule object and only timed after (`fuse_backward` too
is memoised): the planner simulates the same few schedules thousands of times.
"""
from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

__all__ = [
    "Kind", "Action", "Schedule", "TimedAction", "Blocked", "SimResult", "simulate",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zbv", "make_schedule",
    "SCHEDULES", "fuse_backward",
]


class Kind(str, Enum):
    F = "F"  # forward
    B = "B"  # full backward (inputs and weights)
    I = "I"  # noqa: E741  backward for the stage inputs only
    W = "W"  # backward for the weights only

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    __repr__ = __str__

    @staticmethod
    def from_str(text: str) -> Action:
        """Reverse of `str`: `"2F0"` -> Action(2, F, 0)."""
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"cannot read action {text!r}: write [stage][F|B|I|W][micro-batch], e.g. 2F0")
        return Action(int(m.group(1)), Kind(m.group(2)), int(m.group(3)))


def _A(stage: int, kind: Kind, mb: int) -> Action:
    return Action(stage, kind, mb)


# ------------------------------------------------------------------------------ schedule
@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists. `stage_to_rank[s]` is the pipeline rank that holds stage s."""

    name: str
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]  # actions[rank] in execution order

    def __post_init__(self):
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        self._check()

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    @property
    def n_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` holds, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def splits_backward(self) -> bool:
        """True when backward is split into I and W (zero-bubble schedules)."""
        return any(a.kind is Kind.I for acts in self.actions for a in acts)

    def _check(self) -> None:
        S, M, P = self.n_stages, self.n_microbatches, self.n_ranks
        if S < 1 or M < 1 or P < 1:
            raise ValueError(f"schedule {self.name!r} needs >= 1 stage, micro-batch and rank; "
                             f"got stages={S}, micro-batches={M}, ranks={P}")
        bad_ranks = sorted({r for r in self.stage_to_rank if not 0 <= r < P})
        if bad_ranks:
            raise ValueError(f"schedule {self.name!r}: stage_to_rank {list(self.stage_to_rank)} names ranks "
                             f"{bad_ranks} outside 0..{P - 1}")
        if _well_formed(self.actions, self.stage_to_rank, S, M):
            return
        problems: list[str] = []  # the slow walk, only to name what is wrong
        count: Counter = Counter()
        for rank, acts in enumerate(self.actions):
            for a in acts:
                if not (0 <= a.stage < S and 0 <= a.mb < M):
                    problems.append(f"rank {rank}: {a} is outside stages 0..{S - 1} / micro-batches 0..{M - 1}")
                    continue
                if self.stage_to_rank[a.stage] != rank:
                    problems.append(f"rank {rank}: {a} belongs to rank {self.stage_to_rank[a.stage]} "
                                    f"(stage {a.stage} lives there)")
                count[(a.stage, a.kind, a.mb)] += 1
        for s in range(S):
            for m in range(M):
                f, b, i, w = (count[(s, k, m)] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
                tag = f"stage {s} micro-batch {m}"
                if f != 1:
                    problems.append(f"{tag}: {f} forwards (want 1)")
                if not ((b == 1 and i == 0 and w == 0) or (b == 0 and i == 1 and w == 1)):
                    problems.append(f"{tag}: B={b}, I={i}, W={w} (want one B, or one I and one W)")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ValueError(f"schedule {self.name!r} is malformed: " + "; ".join(problems[:8]) + more)

    # --- grid ----------------------------------------------------------------------------
    def to_grid(self) -> str:
        """One row per rank, one column per time step of a unit-time dry run.

        Idle steps are blank. A schedule that deadlocks is printed with the actions the dry run
        could place at their steps and the blocked rest packed after them.
        """
        sim = simulate(self, f=1, b=1, i=1, w=1, p2p=0)
        cols: list[dict[int, Action]] = []
        for rank in range(self.n_ranks):
            row: dict[int, Action] = {}
            t_end = 0
            for ta in sim.timelines[rank]:
                row[int(round(ta.start))] = ta.action
                t_end = int(round(ta.end))
            for a in self.actions[rank][len(sim.timelines[rank]):]:
                row[t_end] = a
                t_end += 1
            cols.append(row)
        n_steps = max((max(r) + 1 for r in cols if r), default=0)
        width = max([len(str(a)) for acts in self.actions for a in acts] + [len(str(max(n_steps - 1, 0)))])
        label = [f"rank {r}:" for r in range(self.n_ranks)]
        lw = max(len(x) for x in label)
        head = (f"schedule {self.name}: {self.n_ranks} ranks, {self.n_stages} stages, "
                f"{self.n_microbatches} micro-batches" + ("" if sim.ok else " (deadlocks)"))
        lines = [head, " " * lw + " " + " ".join(f"{t:<{width}}" for t in range(n_steps)).rstrip()]
        for r in range(self.n_ranks):
            cells = [str(cols[r].get(t, "")) for t in range(n_steps)]
            lines.append(f"{label[r]:<{lw}} " + " ".join(f"{c:<{width}}" for c in cells).rstrip())
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_grid(text: str) -> Schedule:
        """Read a grid written by `to_grid` (or by hand: `rank 0: 0F0 0F1 0B0 0B1` lines).

        The stage placement is read from the rows (a stage's actions sit on its rank's row);
        the name from a `schedule NAME:` header if present.
        """
        name = "custom"
        rows: dict[int, list[Action]] = {}
        for ln, line in enumerate(text.splitlines(), 1):
            s = line.strip()
            if not s:
                continue
            m = re.match(r"^schedule\s+(\S+?):", s)
            if m:
                name = m.group(1)
                continue
            m = re.match(r"^rank\s+(\d+)\s*:(.*)$", s)
            if not m:
                if re.fullmatch(r"[\d\s]*", s):
                    continue  # the step-number header
                raise ValueError(f"grid line {ln} ({line!r}) is neither `rank N: actions...` nor a header")
            r = int(m.group(1))
            if r in rows:
                raise ValueError(f"grid has two rows for rank {r} (line {ln})")
            rows[r] = [Action.from_str(tok) for tok in m.group(2).split()]
        if not rows:
            raise ValueError("grid has no `rank N:` rows")
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"grid rows name ranks {sorted(rows)}; want 0..{len(rows) - 1}")
        where: dict[int, set[int]] = {}
        n_mb = 0
        for r, acts in rows.items():
            for a in acts:
                where.setdefault(a.stage, set()).add(r)
                n_mb = max(n_mb, a.mb + 1)
        n_stages = max(where) + 1 if where else 0
        missing = [s for s in range(n_stages) if s not in where]
        split = {s: sorted(rs) for s, rs in where.items() if len(rs) > 1}
        if missing or split:
            raise ValueError(f"grid places stages inconsistently: stages {missing} have no actions, "
                             f"stages {split} appear on several ranks; every stage lives on one rank")
        s2r = tuple(next(iter(where[s])) for s in range(n_stages))
        return Schedule(name, n_mb, s2r, tuple(tuple(rows[r]) for r in range(len(rows))))

    def __str__(self) -> str:
        return self.to_grid()


_BIT = {Kind.F: 1, Kind.B: 2, Kind.I: 4, Kind.W: 8}
_WHOLE = (_BIT[Kind.F] | _BIT[Kind.B], _BIT[Kind.F] | _BIT[Kind.I] | _BIT[Kind.W])  # F + B, or F + I + W


def _well_formed(actions, stage_to_rank, S: int, M: int) -> bool:
    """Whether every action is in range and on its stage's rank, and every (stage, micro-batch)
    has exactly one F and one B, or one F, one I and one W: one pass over the actions setting a
    bit per kind in a byte per slot (a kind seen twice fails at once), then two C-level counts
    over the bytes. Linear, without the per-slot Python loop that names the problems (the
    planner builds schedules of 10^4-10^5 actions, thousands of times on a 256-GPU model)."""
    code = bytearray(S * M)
    bit = _BIT
    for rank, acts in enumerate(actions):
        for a in acts:
            s, m = a.stage, a.mb
            if not (0 <= s < S and 0 <= m < M) or stage_to_rank[s] != rank:
                return False
            k = s * M + m
            b = bit.get(a.kind, 0)
            if not b or code[k] & b:
                return False
            code[k] |= b
    return code.count(_WHOLE[0]) + code.count(_WHOLE[1]) == S * M


# ------------------------------------------------------------------------------ generators
def _check_sizes(name: str, n_ranks: int, n_microbatches: int) -> None:
    if n_ranks < 1 or n_microbatches < 1:
        raise ValueError(f"{name} needs n_ranks >= 1 and n_microbatches >= 1, got {n_ranks}, {n_microbatches}")


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """All forwards, then all backwards (micro-batch order), one stage per rank."""
    _check_sizes("gpipe", n_ranks, n_microbatches)
    acts = [[_A(r, Kind.F, m) for m in range(n_microbatches)] + [_A(r, Kind.B, m) for m in range(n_microbatches)]
            for r in range(n_ranks)]
    return Schedule("GPipe", n_microbatches, tuple(range(n_ranks)), acts)


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): p-1-r warm-up forwards on rank r, then one forward one backward."""
    _check_sizes("1f1b", n_ranks, n_microbatches)
    acts = []
    for r in range(n_ranks):
        warm = min(n_ranks - 1 - r, n_microbatches)
        seq = [_A(r, Kind.F, m) for m in range(warm)]
        for k in range(n_microbatches - warm):
            seq += [_A(r, Kind.F, warm + k), _A(r, Kind.B, k)]
        seq += [_A(r, Kind.B, m) for m in range(n_microbatches - warm, n_microbatches)]
        acts.append(seq)
    return Schedule("1F1B", n_microbatches, tuple(range(n_ranks)), acts)


def _looped_1f1b(n_ranks: int, n_microbatches: int, n_virtual: int, zero_bubble: bool) -> list[list[Action]]:
    """Torch's `_get_1f1b_rank_ops` orders (interleaved 1F1B; with `zero_bubble`, ZB-H1 and
    its interleaved form), without the `None` padding."""
    p, v, M = n_ranks, n_virtual, n_microbatches
    rounds = max(1, M // p)
    per_round = M // rounds
    if v > 1 and M % rounds:
        raise ValueError(f"interleaved schedules need n_microbatches divisible by the number of rounds "
                         f"max(1, n_microbatches // n_ranks) = {rounds}; got n_microbatches={M}. "
                         f"Use a multiple of n_ranks={p}")
    out = []
    for r in range(p):
        factor = 1 if zero_bubble else 2
        warm = min((v - 1) * per_round + factor * (p - 1 - r), M * v)
        total = M * v
        fwd_bwd = total - warm

        def f_stage(op):
            return ((op // per_round) % v) * p + r

        def b_stage(op):
            return (v - 1 - ((op - warm) // per_round) % v) * p + r

        fmb: Counter = Counter()
        bmb: Counter = Counter()
        wmb: Counter = Counter()
        seq: list[Action] = []
        bwd_ops: list[int] = []
        n_w = 0
        bk = Kind.I if zero_bubble else Kind.B

        def emit_w():
            nonlocal n_w
            s = b_stage(bwd_ops[n_w])
            seq.append(_A(s, Kind.W, wmb[s]))
            wmb[s] += 1
            n_w += 1

        for op in range(warm + fwd_bwd + warm):  # warm-up, steady (F then B), cool-down
            if op < warm + fwd_bwd:
                s = f_stage(op)
                seq.append(_A(s, Kind.F, fmb[s]))
                fmb[s] += 1
            if op >= warm:
                s = b_stage(op)
                seq.append(_A(s, bk, bmb[s]))
                bmb[s] += 1
                bwd_ops.append(op)
                if zero_bubble and op - warm >= r:  # rank r defers its first r weight passes
                    emit_w()
        while zero_bubble and n_w < len(bwd_ops):
            emit_w()
        out.append(seq)
    return out


def interleaved_1f1b(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): `n_virtual` stages per rank, stage s on rank
    s % n_ranks, depth-first over micro-batch rounds of n_ranks."""
    _check_sizes("interleaved_1f1b", n_ranks, n_microbatches)
    if n_virtual < 1:
        raise ValueError(f"n_virtual must be >= 1, got {n_virtual}")
    acts = _looped_1f1b(n_ranks, n_microbatches, n_virtual, zero_bubble=False)
    s2r = tuple(s % n_ranks for s in range(n_ranks * n_virtual))
    return Schedule("Interleaved1F1B", n_microbatches, s2r, acts)


def zero_bubble_h1(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with B split into I and W; rank r defers its first r
    weight passes into the cool-down, so peak activations stay those of 1F1B."""
    _check_sizes("zero_bubble_h1", n_ranks, n_microbatches)
    acts = _looped_1f1b(n_ranks, n_microbatches, 1, zero_bubble=True)
    return Schedule("ZBH1", n_microbatches, tuple(range(n_ranks)), acts)


def zbv(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6): two stages per rank placed in a V (rank r holds
    stages r and 2p-1-r), I/W split; zero bubble when F, I and W take equal time."""
    _check_sizes("zbv", n_ranks, n_microbatches)
    p, M = n_ranks, n_microbatches
    n_micro = max(2 * p - 1, M)  # generated as if there were enough micro-batches, then trimmed
    S = 2 * p
    acts = []
    for r in range(p):
        chunk = (r, S - 1 - r)  # the rank's stage on the way down the V, and on the way up
        seq: list[Action] = []
        nxt = {(c, k): 0 for c in (0, 1) for k in (Kind.F, Kind.I, Kind.W)}

        def op(c: int, kind: Kind) -> None:
            seq.append(_A(chunk[c], kind, nxt[(c, kind)]))
            nxt[(c, kind)] += 1

        for _ in range(2 * (p - r) - 1):  # warm-up
            op(0, Kind.F)
        for _ in range(r):
            op(1, Kind.F)
            op(0, Kind.F)
        for _ in range(p - r):
            op(1, Kind.F)
            op(1, Kind.I)
            op(1, Kind.W)
        while nxt[(1, Kind.F)] < nxt[(0, Kind.F)] or nxt[(0, Kind.F)] < n_micro:  # steady
            if nxt[(0, Kind.F)] < n_micro:
                op(0, Kind.F)
            op(0, Kind.I)
            op(0, Kind.W)
            op(1, Kind.F)
            op(1, Kind.I)
            op(1, Kind.W)
        for _ in range(r):  # cool-down: input gradients first, weights fill the tail
            op(0, Kind.I)
            op(1, Kind.I)
        for _ in range(p - r):
            op(0, Kind.I)
            op(0, Kind.W)
        while nxt[(1, Kind.W)] < nxt[(1, Kind.I)]:
            op(1, Kind.W)
        while nxt[(0, Kind.W)] < nxt[(0, Kind.I)]:
            op(0, Kind.W)
        assert all(nxt[(c, Kind.F)] == nxt[(c, Kind.I)] == nxt[(c, Kind.W)] for c in (0, 1)), nxt
        acts.append([a for a in seq if a.mb < M])
    s2r = tuple(s if s < p else S - 1 - s for s in range(S))
    return Schedule("ZBV", M, s2r, acts)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b,
             "zb_h1": zero_bubble_h1, "zbv": zbv}


def make_schedule(name: str, n_ranks: int, n_microbatches: int, n_virtual: int | None = None) -> Schedule:
    """A schedule by name: one of `SCHEDULES` ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")."""
    key = name.lower().replace("-", "_")
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if key == "interleaved_1f1b":
        return interleaved_1f1b(n_ranks, n_microbatches, 2 if n_virtual is None else n_virtual)
    if n_virtual not in (None, 1) and not (key == "zbv" and n_virtual == 2):
        raise ValueError(f"schedule {name!r} has a fixed number of stages per rank; drop n_virtual={n_virtual}")
    return SCHEDULES[key](n_ranks, n_microbatches)


def fuse_backward(schedule: Schedule, stages) -> Schedule:
    """`schedule` with the split backward of `stages` joined again: each `I` of those stages
    becomes a full `B` in its place and their `W`s are dropped (the other stages keep `I`/`W`).
    What a zero-bubble schedule runs on a stage that holds activation-checkpoint regions, which
    allow one backward (runtime/pipeline.py); the result is well formed and, since a `W` is no
    action's dependency and `B` waits on what `I` waited on, as deadlock-free as `schedule`."""
    fuse = frozenset(stages)
    hit = _FUSED.get((id(schedule), fuse))
    if hit is not None and hit[0] is schedule:  # the planner fuses the same few schedules thousands of times
        return hit[1]
    out = schedule  # nothing to join (1f1b, gpipe, interleaved_1f1b, or no such stage): the same object
    if any(a.kind is Kind.I and a.stage in fuse for acts in schedule.actions for a in acts):
        out = Schedule(schedule.name, schedule.n_microbatches, schedule.stage_to_rank,
                       [[_A(a.stage, Kind.B, a.mb) if a.kind is Kind.I and a.stage in fuse else a
                         for a in rank if not (a.kind is Kind.W and a.stage in fuse)] for rank in schedule.actions])
    return _remember(_FUSED, (id(schedule), fuse), schedule, out)


# memos by a (frozen) schedule's identity; an entry holds the schedule, so its id is not reused
_FUSED: dict[tuple[int, frozenset], tuple[Schedule, Schedule]] = {}
_ORDERS: dict[int, tuple[Schedule, tuple]] = {}


def _remember(memo: dict, key, schedule: Schedule, value):
    if len(memo) >= 1024:
        memo.clear()
    memo[key] = (schedule, value)
    return value


def _run_order(schedule: Schedule) -> tuple:
    """(order, peak in flight per rank, blocked actions) of `schedule`, memoised: the order no duration
    changes, per action (rank, action, kind, stage, ((its dependency's position, the boundary crossed or -1), ..))."""
    if (hit := _ORDERS.get(id(schedule))) is not None and hit[0] is schedule:
        return hit[1]
    S, P, s2r = schedule.n_stages, schedule.n_ranks, schedule.stage_to_rank
    bkind = {(a.stage, a.mb): a.kind for acts in schedule.actions for a in acts if a.kind in (Kind.B, Kind.I)}

    def deps(a: Action) -> list[tuple[Action, int]]:  # as simulate's, with the boundary's index for p2p
        s, m = a.stage, a.mb
        if a.kind is Kind.F:
            return [] if s == 0 else [(_A(s - 1, Kind.F, m), s - 1 if s2r[s - 1] != s2r[s] else -1)]
        if a.kind is Kind.W:
            return [(_A(s, Kind.I, m), -1)]
        out = [(_A(s, Kind.F, m), -1)]
        if s < S - 1:
            out.append((_A(s + 1, bkind[(s + 1, m)], m), s if s2r[s + 1] != s2r[s] else -1))
        return out

    at: dict[Action, int] = {}  # action -> its position in `order`
    order, pos, progress = [], [0] * P, True
    while progress:
        progress = False
        for r in range(P):
            acts = schedule.actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                ds = deps(a)
                if any(d not in at for d, _ in ds):
                    break
                at[a] = len(order)
                order.append((r, a, a.kind, a.stage, tuple((at[d], h) for d, h in ds)))
                pos[r] += 1
                progress = True
    peak = tuple(max(itertools.accumulate(((a.kind is Kind.F) - (a.kind in (Kind.B, Kind.W)) for a in acts),
                                          initial=0)) for acts in schedule.actions)  # F holds one, B/W frees
    nxt = [(r, schedule.actions[r][pos[r]]) for r in range(P) if pos[r] < len(schedule.actions[r])]
    blocked = tuple(Blocked(r, a, tuple(d for d, _ in deps(a) if d not in at)) for r, a in nxt)
    return _remember(_ORDERS, id(schedule), schedule, (tuple(order), peak, blocked))


# ------------------------------------------------------------------------------ simulator
@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Blocked:
    """A rank's next action in a deadlock and the actions it waits for."""

    rank: int
    action: Action
    waits_for: tuple[Action, ...]

    def __str__(self) -> str:
        return f"rank {self.rank} blocked at {self.action} waiting for " + ", ".join(map(str, self.waits_for))


@dataclass
class SimResult:
    schedule: Schedule
    timelines: list[list[TimedAction]]  # per rank, in execution order
    busy: list[float]  # compute time per rank
    peak_in_flight: list[int]  # per rank: max micro-batch activations held (F done, B/W not yet)
    deadlock: list[Blocked] | None = None
    makespan: float | None = None  # predicted step time; None on deadlock
    bubble_fraction: float | None = None  # 1 - sum(busy) / (n_ranks * makespan)
    durations: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.deadlock is None

    def raise_if_deadlocked(self) -> None:
        if self.deadlock is not None:
            raise ValueError(f"schedule {self.schedule.name!r} deadlocks: "
                             + "; ".join(map(str, self.deadlock))
                             + ". Reorder the actions so that every wait is satisfied by an earlier action")

    def summary(self) -> str:
        if not self.ok:
            return f"{self.schedule.name}: DEADLOCK: " + "; ".join(map(str, self.deadlock))
        return (f"{self.schedule.name}: makespan {self.makespan:.4g}, bubble {self.bubble_fraction:.1%}, "
                f"peak activations in flight per rank {self.peak_in_flight}")


def _per_stage(name: str, value, n_stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n_stages
    vals = [float(x) for x in value]
    if len(vals) != n_stages:
        what = "stage boundaries" if name == "p2p" else "stages"
        raise ValueError(f"duration {name} has {len(vals)} entries but the schedule has {n_stages} {what}; "
                         f"give one number, or one per {what[:-1]}")
    return vals


def simulate(schedule: Schedule, f: float | Sequence[float] = 1.0, b: float | Sequence[float] = 2.0,
             i: float | Sequence[float] | None = None, w: float | Sequence[float] | None = None,
             p2p: float | Sequence[float] = 0.0) -> SimResult:
    """Dry-run `schedule` without processes.

    Args:
        f, b, i, w: forward, full-backward, input-backward and weight-backward time, one number
            for every stage or one per stage. `i` and `w` default to half of `b`.
        p2p: transfer time of an activation or gradient between stages on different ranks:
            one number, or one per boundary (entry s: between stage s and s + 1). Stages on
            the same rank hand over for free.

    Returns:
        A `SimResult`; `deadlock` lists the blocked actions when the lists cannot all finish.
    """
    S, M, P = schedule.n_stages, schedule.n_microbatches, schedule.n_ranks
    tf, tb = _per_stage("f", f, S), _per_stage("b", b, S)
    ti = _per_stage("i", i, S) if i is not None else [x / 2 for x in tb]
    tw = _per_stage("w", w, S) if w is not None else [x / 2 for x in tb]
    dur = {Kind.F: tf, Kind.B: tb, Kind.I: ti, Kind.W: tw}
    hop = _per_stage("p2p", p2p, S - 1) if not isinstance(p2p, (int, float)) else [float(p2p)] * max(S - 1, 0)
    if any(x < 0 for x in hop) or any(x < 0 for d in dur.values() for x in d):
        raise ValueError(f"durations must be >= 0, got f={tf}, b={tb}, i={ti}, w={tw}, p2p={hop}")
    durations = {"f": tf, "b": tb, "i": ti, "w": tw, "p2p": hop}
    order, peak, deadlock = _run_order(schedule)  # which actions run in which order: no duration changes it
    clock = [0.0] * P
    timelines: list[list[TimedAction]] = [[] for _ in range(P)]
    ends: list[float] = []
    for r, a, kind, s, ds in order:
        start = clock[r]  # the latest of the rank's clock and each dependency's end (+ its transfer)
        for j, h in ds:
            t = ends[j] + (hop[h] if h >= 0 else 0.0)
            if t > start:
                start = t
        end = start + dur[kind][s]
        ends.append(end)
        clock[r] = end
        timelines[r].append(TimedAction(r, a, start, end))
    busy = [sum(t.end - t.start for t in tl) for tl in timelines]
    makespan = None if deadlock else max(clock) if P else 0.0
    bubble = None if deadlock else 1.0 - sum(busy) / (P * makespan) if makespan > 0 else 0.0
    return SimResult(schedule, timelines, busy, list(peak), list(deadlock) or None, makespan, bubble, durations)
