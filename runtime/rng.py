"""Train/eval mode and model-parallel random numbers: what the rewritten graph's random and
mode-dependent ops read while a program runs.

Mode. `aten.dropout(x, p, True)` and `aten.batch_norm(..., training=True, ...)` bake the
mode they were captured in. `passes.mark_random` rewrites them into the functions of this
file (`dropout`, `feature_dropout`, `attention`, `batch_norm`, `count_batch`, `sync_batch_norm`,
`update_running_stats_in_training`), which read the mode of the program that runs them: a
program runs its graph inside `tracker.fork(training=self.training)`, so `pm.train()` /
`pm.eval()` switch them as `nn.Module.train()` / `.eval()` switch PyTorch's modules (dropout
off, batch norm on running statistics, which it does not update). Outside any program the
mode is training (what a graph captured in training mode did).

Random numbers, as Megatron-LM's model-parallel RNG tracker (`tensor_parallel/random.py`:
`CudaRNGStatesTracker.fork` swaps the default generator's state for a tracked one and back):
a program owns an `RNGTracker` whose state replaces the default CPU generator's while the
program runs (`fork`). That state is seeded from the job's seed mixed with this rank's
coordinates on the data axes (dp, ep: ranks that see different rows draw different masks) and
the pipeline axis (stages are independent), and NOT with its tensor-parallel coordinate: tp
peers run the same graph in the same order, so they draw the same numbers. Each dropout call
draws one 63-bit seed from that state and makes its mask with a fresh generator from it;
a dropout on a tensor sharded over mesh axes (`axes`, written by the pass from the shard
pass's layout) first mixes in this rank's coordinates on those axes, so tp ranks draw the
same mask on a replicated activation and different masks on a sharded one.

Why the default generator and not a private one: activation checkpointing
(`torch.utils.checkpoint`, passes/recompute.py) saves and restores the default generators
around recomputation, so a recomputed dropout draws the seed, hence the mask, it drew in
forward. The job's seed: `RNGTracker(seed=None)` takes rank 0's `torch.initial_seed()` (one
broadcast on the host group), so per-rank seeds cannot make tp peers drift apart; the same
seed gives the same run. `tracker.manual_seed(s)` re-seeds (same `s` on every rank).

Reads and writes no `node.meta` keys (it runs; `passes.mark_random` rewrites).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from . import sync_bn  # noqa: F401 - registers autopar::sync_batch_norm / update_running_stats

__all__ = ["RNGTracker", "is_training", "shared_seed", "mix", "dropout", "feature_dropout", "attention", "batch_norm",
           "count_batch", "sync_batch_norm", "update_running_stats_in_training", "DATA_AXES", "STAGE_AXIS"]

DATA_AXES = ("dp", "ep")  # ranks along these see different rows of the batch
STAGE_AXIS = "pp"
_MASK64 = (1 << 64) - 1


class _State:
    training = True  # the mode of the running program (True outside any program)
    tracker: "RNGTracker | None" = None  # the tracker whose state the default generator holds


def is_training() -> bool:
    """The mode the running program was put in (`pm.train()` / `pm.eval()`)."""
    return _State.training


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over them): different inputs give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h >> 1


def shared_seed() -> int:
    """Rank 0's `torch.initial_seed()`, on every rank (this rank's own without a process group)."""
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        from .mesh import host_group  # noqa: PLC0415 - only with a process group

        dist.broadcast(seed, src=0, group=host_group())
    return int(seed.item())


class RNGTracker:
    """The random state of one rank's program (see the module docstring).

    Args:
        coords: this rank's index on each mesh axis ({"dp": 1, "tp": 0, "pp": 0}).
        seed: the job's seed; None: rank 0's `torch.initial_seed()` (a collective on the host group).
        data_axes: axes along which ranks see different rows (their coordinates seed the state).
    """

    def __init__(self, coords: dict[str, int], seed: int | None = None, data_axes: tuple[str, ...] = DATA_AXES):
        self.coords = dict(coords)
        self.data_axes = tuple(a for a in data_axes if a)
        self.manual_seed(shared_seed() if seed is None else seed)

    @classmethod
    def for_mesh(cls, mesh, dp_axis: str | None = "dp", seed: int | None = None) -> "RNGTracker":
        rank = dist.get_rank() if dist.is_initialized() else 0
        coords = mesh.coords(rank) if dist.is_initialized() else {a: 0 for a in mesh.sizes}
        data = tuple((dp_axis or "dp").split("+"))  # a joined axis ("dp+cp") seeds by each part
        return cls(coords, seed, tuple(dict.fromkeys(data + DATA_AXES)))

    def manual_seed(self, seed: int) -> None:
        """Start over from `seed` (give every rank the same one)."""
        self.seed = int(seed)
        key = [self.coords.get(a, 0) for a in self.data_axes] + [self.coords.get(STAGE_AXIS, 0)]
        g = torch.Generator()
        g.manual_seed(mix(self.seed, *key))
        self.state = g.get_state()

    def salt(self, axes: str) -> int:
        """This rank's coordinates on `axes` ("tp,sp"), mixed; 0 for no axes."""
        names = [a for a in axes.split(",") if a]
        return mix(*(self.coords.get(a, 0) for a in names), len(names)) if names else 0

    def get_state(self) -> dict:
        return {"seed": self.seed, "state": self.state.clone()}

    def set_state(self, state: dict) -> None:
        self.seed, self.state = int(state["seed"]), state["state"].clone()

    @contextlib.contextmanager
    def fork(self, training: bool = True) -> Iterator[None]:
        """Run with this tracker's state in the default CPU generator and the program's mode;
        the state advanced by the draws is kept, the caller's generator state restored.
        Re-entrant (a step that calls forward)."""
        prev_mode, prev_tracker = _State.training, _State.tracker
        _State.training = bool(training)
        if prev_tracker is self:
            try:
                yield
            finally:
                _State.training = prev_mode
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        _State.tracker = self
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)
            _State.training, _State.tracker = prev_mode, prev_tracker


# --- what the rewritten graph calls ---------------------------------------------------------
def _draw(axes: str) -> int:
    """One seed from the default CPU generator (the tracker's state while a program runs),
    mixed with this rank's coordinates on `axes`."""
    seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64).item())
    tracker = _State.tracker
    return mix(seed, tracker.salt(axes)) if axes and tracker is not None else seed


def _generator(device: torch.device, axes: str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(_draw(axes))
    return g


def dropout(x: torch.Tensor, p: float, axes: str = "") -> torch.Tensor:
    """`aten.dropout(x, p, training)` in the program's mode; `axes`: mesh axes `x` is sharded on."""
    if not _State.training or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    mask = torch.empty_like(x).bernoulli_(1 - p, generator=_generator(x.device, axes))
    return x * mask.div_(1 - p)


def feature_dropout(x: torch.Tensor, p: float, axes: str = "") -> torch.Tensor:
    """`aten.feature_dropout` (nn.Dropout1d/2d/3d): one draw per (sample, channel)."""
    if not _State.training or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    shape = tuple(x.shape[:2]) + (1,) * (x.dim() - 2)
    mask = x.new_empty(shape).bernoulli_(1 - p, generator=_generator(x.device, axes))
    return x * mask.div_(1 - p)


def attention(q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool, axes: str = ""):
    """`aten.scaled_dot_product_attention` with dropout on its probabilities in training only,
    drawn from a seed of the tracker's (mixed with this rank's coordinates on `axes`: heads
    sharded over tp draw different masks). The kernel draws from the device's default
    generator, so it runs with that generator seeded and restored afterwards."""
    kw = {"scale": scale} if scale is not None else {}
    if enable_gqa:
        kw["enable_gqa"] = True
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    if not _State.training or dropout_p == 0:
        return sdpa(q, k, v, attn_mask, 0.0, is_causal, **kw)
    seed = _draw(axes)
    dev = q.device
    with torch.random.fork_rng(devices=[dev] if dev.type != "cpu" else [], device_type=dev.type):
        if dev.type == "cpu":
            torch.default_generator.manual_seed(seed)
        else:
            with torch.get_device_module(dev.type).device(dev):
                torch.get_device_module(dev.type).manual_seed(seed)
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kw)


def batch_norm(x, weight, bias, running_mean, running_var, momentum: float, eps: float, cudnn: bool):
    """`aten.batch_norm` with running statistics, in the program's mode: batch statistics (and
    running-statistics update) in training, the running statistics in eval."""
    return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var, _State.training,
                                             momentum, eps, cudnn)


@torch.library.custom_op("autopar::count_batch", mutates_args=("num_batches_tracked",))
def count_batch(num_batches_tracked: torch.Tensor, k: int) -> None:
    """BatchNorm's `num_batches_tracked += 1`, in training only. An op whose schema says it
    writes the buffer, so recomputation refuses a region around it, as around `add_`."""
    if _State.training:
        num_batches_tracked.add_(k)


@count_batch.register_fake
def _(num_batches_tracked, k):
    return None


def sync_batch_norm(x, weight, bias, eps: float, axes: str, running_mean, running_var):
    """`autopar::sync_batch_norm` in training; in eval, batch norm on the running statistics
    (no collective) and zeros for the statistics (which the update below ignores in eval)."""
    if _State.training:
        return torch.ops.autopar.sync_batch_norm.default(x, weight, bias, eps, axes)
    y = torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var, False, 0.0, eps, False)
    stat = x.new_zeros((x.shape[1],), dtype=torch.promote_types(x.dtype, torch.float32))
    return y, stat, stat, stat


@torch.library.custom_op("autopar::update_running_stats_in_training", mutates_args=("running_mean", "running_var"))
def update_running_stats_in_training(running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                                     mean: torch.Tensor, unbiased_var: torch.Tensor, momentum: float) -> None:
    """`autopar::update_running_stats` in training; nothing in eval. An autopar op, so that
    recomputation (passes/recompute.py) keeps it rather than moving the statistics twice."""
    if _State.training:
        torch.ops.autopar.update_running_stats.default(running_mean, running_var, mean, unbiased_var, momentum)


@update_running_stats_in_training.register_fake
def _(running_mean, running_var, mean, unbiased_var, momentum):
    return None
