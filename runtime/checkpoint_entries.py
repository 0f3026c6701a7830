"""What a rank holds, as checkpoint entries, and how they reach DCP: the part of autopar's
distributed checkpoints shared by the save path (checkpoint_save.py) and the load path
(checkpoint_load.py).

What a rank holds is described as *entries*: (checkpoint key, local tensor, global shape, the
cuts that made the piece). A piece is cut by `torch.chunk` along each cut in order — first
the plan's tensor-parallel placement (`{tp: S(d)}`), then ZeRO's rows (dim 0 of the tp-local
tensor over the dp axis, runtime/zero_shard.py). Each entry becomes a DTensor on a
DeviceMesh whose dims run in the same order (pp, sharding axes, dp last) — DTensor's
left-to-right nested sharding is exactly that convention — so DCP's own planner reshards
between plans: a piece is written once (replicas deduplicated) and read by whichever ranks
of another plan overlap it. Keys are the original model's names:

    model.<name>                    parameters (from the fp32 masters) and persistent buffers
    optim.state.<name>.<key>        optimizer state: tensors shaped like the parameter are cut
                                    like it, scalars (Adam's step) are replicated

Also here: `_agree_errors`, which makes every rank raise when any rank failed to build its
entries (save and load both call it before their first collective).

Guarantees: an entry's tensor is exactly the piece `local_chunk(global_shape, cuts, ...)`
names (`_check_piece` asserts it before every save and checkpoint load); a partial parameter is refused
with a ValueError naming it.

It reads and writes no `node.meta` keys; it imports nothing above runtime/ (layouts, shapes
and aliases come in as plain data).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint_files import CheckpointError
from .collectives import chunk_range
from .placement import Layout, Partial, Shard


# --- where a piece lies ---------------------------------------------------------------------
def local_chunk(global_shape: Sequence[int], cuts: Sequence[tuple[str, int]], sizes: Mapping[str, int],
                coords: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the piece cut from `global_shape` by `cuts`, a sequence of
    (mesh axis, tensor dim) applied in order with torch.chunk's convention on what is left."""
    shape, offset = list(global_shape), [0] * len(global_shape)
    for axis, dim in cuts:
        s, e = chunk_range(shape[dim], *axis_size_index(axis, sizes, coords))
        offset[dim] += s
        shape[dim] = e - s
    return tuple(shape), tuple(offset)


def axis_size_index(axis: str, sizes: Mapping[str, int], coords: Mapping[str, int]) -> tuple[int, int]:
    """(size, this rank's index) along `axis`; a joined axis ("dp+cp": ZeRO shards under context
    parallelism) counts row-major over its parts, as `runtime.mesh.Mesh.index` does."""
    if "+" not in axis:
        return sizes[axis], coords[axis]
    n, i = 1, 0
    for part in axis.split("+"):
        n, i = n * sizes[part], i * sizes[part] + coords[part]
    return n, i


@dataclasses.dataclass
class Entry:
    """One tensor this rank holds: `tensor` is the piece of the global tensor `key` at
    `local_chunk(global_shape, cuts, ...)`."""

    key: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    cuts: tuple[tuple[str, int], ...]


@dataclasses.dataclass
class _Param:
    """A distinct parameter of one engine slot, as the checkpoint sees it."""

    names: list[str]  # slot name first, then aliases
    engine: Any
    slot: Any
    tensor: torch.Tensor | None  # the piece to save/load (None: this rank holds none of a 0-d param)
    global_shape: tuple[int, ...]
    cuts: tuple[tuple[str, int], ...]
    via_param: bool  # loaded into the module parameter itself (not the master)


def engines_of(engine) -> list:
    """The ZeRO engines behind a program's `engine` (a pipeline has one per local stage)."""
    return [engine.engines[s] for s in sorted(engine.engines)] if hasattr(engine, "engines") else [engine]


def _layout(layouts: Mapping[str, Any], names: Sequence[str]) -> Layout | None:
    for n in names:
        lay = layouts.get(n)
        if lay is not None:
            return lay if isinstance(lay, Layout) else Layout.from_json(lay)
    return None


def _shape_of(global_shapes: Mapping[str, Sequence[int]], names: Sequence[str], fallback: Sequence[int],
              tp_cuts) -> tuple[int, ...]:
    """The unsharded shape of `names[0]`: given, or (when nothing cuts it over tp) `fallback`,
    the shape the engine sees before ZeRO's rows."""
    for n in names:
        if n in global_shapes:
            return tuple(int(s) for s in global_shapes[n])
    if tp_cuts:
        raise ValueError(f"no global shape given for {names[0]!r}, which is sharded {tp_cuts}; pass "
                         "global_shapes (the unsharded model's shapes, e.g. from the captured graph)")
    return tuple(int(s) for s in fallback)


def _tp_cuts(layout: Layout | None, mesh, name: str) -> tuple[tuple[str, int], ...]:
    if layout is None:
        return ()
    cuts = []
    for axis, p in layout.axes:
        if isinstance(p, Partial):
            raise ValueError(f"{name!r} has placement {p} on {axis}: a partial parameter cannot be checkpointed")
        if isinstance(p, Shard) and mesh.size(axis) > 1:
            cuts.append((axis, p.dim))
    order = list(mesh.axis_names)  # cut in mesh order, as the DTensor's mesh dims run
    return tuple(sorted(cuts, key=lambda c: order.index(c[0])))


def _params(engine, mesh, layouts, global_shapes) -> list[_Param]:
    out = []
    for e in engines_of(engine):
        rows_sharded = e.stage >= 1 and e.k > 1
        for s in e.slots:
            names = [s.name, *s.aliases]
            tp = _tp_cuts(_layout(layouts, names), mesh, s.name)
            if rows_sharded and e.stage in (1, 2) and not s.trainable:
                local, via_param, rows = s.param, True, False  # full (tp-local) parameter, never stepped
            else:
                local, via_param, rows = s.master, False, rows_sharded
            gshape = _shape_of(global_shapes, names, s.info.shape, tp)
            if len(gshape) == 0:  # a 0-d parameter: one row; stage 3 keeps it on dp index 0 only
                if rows and e.stage == 3:
                    t = s.master.reshape(()) if s.master.numel() == 1 else None
                else:
                    t = local.reshape(())
                out.append(_Param(names, e, s, t, (), (), via_param))
                continue
            cuts = tp + ((e.axis, 0),) if rows else tp
            out.append(_Param(names, e, s, local, gshape, cuts, via_param))
    return out


def held_pieces(engine, mesh, layouts: Mapping[str, Any], global_shapes: Mapping[str, Sequence[int]]
                ) -> list[tuple[list[str], torch.Tensor, tuple[int, ...], tuple[tuple[str, int], ...]]]:
    """Every tensor this rank holds, as (names, local tensor, global shape, cuts): the pieces
    of parameters that the checkpoint reads and writes (names: the slot's, then its aliases)
    and every buffer of the program's modules, non-persistent ones included (RoPE tables are
    state a model built on meta must have computed before its first step)."""
    out = [(p.names, p.tensor, p.global_shape, p.cuts) for p in _params(engine, mesh, layouts, global_shapes)
           if p.tensor is not None]
    for e in engines_of(engine):
        pnames = {n for s in e.slots for n in [s.name, *s.aliases]}
        for name, b in e.module.named_buffers(remove_duplicate=False):
            if name in pnames or b is None:
                continue
            tp = _tp_cuts(_layout(layouts, [name]), mesh, name)
            out.append(([name], b, _shape_of(global_shapes, [name], b.shape, tp), tp))
    return out


def _check_piece(p: _Param, mesh, coords) -> None:
    if p.tensor is None or not p.global_shape:
        return
    want, _ = local_chunk(p.global_shape, p.cuts, mesh.sizes, coords)
    if tuple(p.tensor.shape) != want:
        raise AssertionError(f"{p.names[0]}: this rank holds shape {tuple(p.tensor.shape)} but global shape "
                             f"{p.global_shape} cut by {p.cuts} gives {want}; the layouts do not describe the program")


def _buffers(engine, mesh, layouts, global_shapes) -> list[Entry]:
    out = []
    for e in engines_of(engine):
        pnames = {n for s in e.slots for n in [s.name, *s.aliases]}
        for name, b in e.module.state_dict(keep_vars=True).items():
            if name in pnames or not isinstance(b, torch.Tensor):
                continue
            tp = _tp_cuts(_layout(layouts, [name]), mesh, name)
            out.append(Entry(f"model.{name}", b.detach(), _shape_of(global_shapes, [name], b.shape, tp), tp))
    return out


def _optimizer_of(e):
    opt = getattr(e, "optimizer", None)
    return getattr(opt, "optim", None)  # the torch optimizer over the engine's masters


def _like_piece(p: _Param, v: torch.Tensor) -> torch.Tensor | None:
    """The piece of optimizer state `v` (shaped like the master) that matches `p.tensor`."""
    if p.global_shape:
        return v
    if p.tensor is None:
        return None
    return v.reshape(())


def _model_entries(params: list[_Param]) -> list[Entry]:
    out = []
    for p in params:
        if p.tensor is None:
            continue
        for n in p.names:
            out.append(Entry(f"model.{n}", p.tensor.detach(), p.global_shape, p.cuts))
    return out


# --- errors, shared by save and load ----------------------------------------------------
def _agree_errors(err: BaseException | None) -> None:
    """Raise on every rank when any rank failed (a rank that raised alone would leave the others
    waiting in the next collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if err is not None:
            raise err
        return
    parts = files.all_gather_object(None if err is None else (isinstance(err, CheckpointError), str(err)))
    if err is not None:
        raise err
    bad = [(r, p) for r, p in enumerate(parts) if p is not None]
    if bad:
        cls = CheckpointError if any(p[0] for _, p in bad) else ValueError
        raise cls("; ".join(f"rank {r}: {p[1]}" for r, p in bad[:4]))


# --- DTensors for DCP -----------------------------------------------------------------------
_MESHES: dict = {}


def _ckpt_order(mesh, dp_axes: set[str]) -> list[str]:
    """The checkpoint mesh's dims: the mesh's axes, the data axes last; a joined data axis
    ("dp+cp": ZeRO shards under context parallelism) is one dim in place of its parts."""
    names = list(mesh.axis_names)
    for joined in sorted(a for a in dp_axes if "+" in a):
        parts = joined.split("+")
        names = [joined if a == parts[0] else a for a in names if a == parts[0] or a not in parts]
    return [a for a in names if a not in dp_axes] + [a for a in names if a in dp_axes]


def _ckpt_mesh(mesh, order: list[str], device_type: str):
    """A DeviceMesh over the job whose dims run in `order` (cuts applied left to right; a joined
    dim counts its parts row-major, as `runtime.mesh.Mesh.index`). Built once per shape
    (collective: every rank builds the same meshes in the same order)."""
    if order == list(mesh.axis_names) and device_type == mesh.device_type:
        return mesh.device_mesh
    key = (tuple(mesh.sizes.items()), tuple(order), device_type)
    if key not in _MESHES or _MESHES[key][0] is not dist.group.WORLD:
        from torch.distributed.device_mesh import DeviceMesh

        names = list(mesh.axis_names)
        flat = [part for a in order for part in a.split("+")]
        grid = torch.arange(mesh.world_size).reshape(tuple(mesh.sizes.values()))
        grid = grid.permute([names.index(a) for a in flat])
        grid = grid.reshape([math.prod(mesh.sizes[p] for p in a.split("+")) for a in order])
        _MESHES[key] = (dist.group.WORLD, DeviceMesh(device_type, grid, mesh_dim_names=tuple(order)))
    return _MESHES[key][1]


class _DTensorMaker:
    """Turns entries into what DCP gets: a plain tensor when nothing is cut, else a DTensor on
    the checkpoint mesh (without the pp axis: a stage's tensors live on one pp index)."""

    def __init__(self, mesh, dp_axes: set[str], pp_axis: str = "pp"):
        self.mesh, self.pp_axis = mesh, pp_axis
        self.order = _ckpt_order(mesh, dp_axes)
        self.dims = [a for a in self.order if a != pp_axis]
        self.subs: dict[str, Any] = {}

    def prepare(self, entries: Iterable[Entry], device_type: str) -> None:
        """Build the meshes when any rank needs them (collective: every rank builds them)."""
        if not (dist.is_initialized() and self.mesh.world_size > 1):
            return
        flag = torch.tensor([1 if any(e.cuts for e in entries) else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=files.ckpt_group())
        if flag.item():
            dm = _ckpt_mesh(self.mesh, self.order, device_type)
            if self.pp_axis in self.order and self.dims:
                dm = dm[tuple(self.dims)] if len(self.dims) > 1 else dm[self.dims[0]]
            self.subs[device_type] = dm

    def __call__(self, e: Entry, tensor: torch.Tensor):
        if not e.cuts:
            return tensor
        from torch.distributed.tensor import DTensor, Replicate, Shard as DShard

        sub = self.subs.get(tensor.device.type)
        if sub is None:
            raise AssertionError(f"{e.key}: no checkpoint mesh prepared for device {tensor.device.type}")
        cut = dict(e.cuts)
        placements = [DShard(cut[a]) if a in cut else Replicate() for a in self.dims]
        stride = torch.empty(e.global_shape, device="meta").stride()
        return DTensor.from_local(tensor, sub, placements, run_check=False, shape=torch.Size(e.global_shape),
                                  stride=stride)
