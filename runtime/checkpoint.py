"""Distributed checkpoints through torch.distributed.checkpoint (DCP): save and load the model
and optimizer state of any plan, reshard between plans, import and export plain state dicts.

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

A parameter held under several names (tied weights; a tied weight on two pipeline stages) is
written under every name and loaded from whichever name the checkpoint has. Optimizer
hyper-parameters, non-tensor state and the loss scaler go to the manifest (JSON), never to
a pickle.

Saves are atomic and loads verified (runtime/checkpoint_files.py: manifest, hashes, the
allow-list metadata reader). `save_checkpoint(..., async_save=True)` copies the local
tensors to CPU memory, returns, and writes (DCP, hashes, manifest, rename) on a background
thread over the checkpoint group; the next save or load waits for it. After a load, the
engines bring the masters into the model (ZeRO-1/2 all-gather, mixed-precision cast).

Guarantees: loading under any plan gives the saved values bit for bit (same dtype); the
optimizer holds exactly the saved state (state absent from the checkpoint is cleared).
Limits: element-wise optimizer state only (a state tensor shaped neither like its parameter
nor scalar is refused with a ValueError); expert and context parallel axes are not mapped
yet (they are absent from the runtime too).

It reads and writes no `node.meta` keys; it imports nothing above runtime/ (layouts, shapes
and aliases come in as plain data).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import shutil
import uuid
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from . import checkpoint_files as files
from .checkpoint_files import (CheckpointError, SafeFileSystemReader, StateSource, agree, latest_checkpoint,
                               list_checkpoints, read_manifest, read_metadata, verify_checkpoint, write_state_dict)
from .collectives import chunk_range
from .placement import Layout, Partial, Shard

__all__ = ["save_checkpoint", "load_checkpoint", "SaveHandle", "wait_pending", "read_full_state_dict",
           "import_state", "local_chunk", "engines_of", "CheckpointError", "SafeFileSystemReader", "StateSource",
           "agree", "latest_checkpoint", "list_checkpoints", "read_manifest", "read_metadata", "verify_checkpoint",
           "write_state_dict"]


# --- where a piece lies ---------------------------------------------------------------------
def local_chunk(global_shape: Sequence[int], cuts: Sequence[tuple[str, int]], sizes: Mapping[str, int],
                coords: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the piece cut from `global_shape` by `cuts`, a sequence of
    (mesh axis, tensor dim) applied in order with torch.chunk's convention on what is left."""
    shape, offset = list(global_shape), [0] * len(global_shape)
    for axis, dim in cuts:
        s, e = chunk_range(shape[dim], sizes[axis], coords[axis])
        offset[dim] += s
        shape[dim] = e - s
    return tuple(shape), tuple(offset)


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


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True, v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) or x is None for x in v):
        return True, list(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return True, v.item()
    return False, None


def _rank_info(params: list[_Param], with_optimizer: bool):
    """This rank's optimizer entries and its part of the manifest (state kinds, hyper-parameters)."""
    entries, kinds, groups, scaler = [], {}, [], None
    if not with_optimizer:
        return entries, kinds, groups, scaler
    by_master = {}
    for p in params:
        by_master[id(p.slot.master)] = p
    seen_opts = set()
    for p in params:
        e = p.engine
        inner = _optimizer_of(e)
        if inner is None:
            continue
        if e.scaler is not None and scaler is None:
            scaler = e.scaler.state_dict()
        if id(inner) not in seen_opts:
            seen_opts.add(id(inner))
            for g in inner.param_groups:
                hyper = {}
                for k, v in g.items():
                    ok, jv = _jsonable(v) if k != "params" else (False, None)
                    if ok:
                        hyper[k] = jv
                gnames = sorted({n for m in g["params"] if id(m) in by_master for n in by_master[id(m)].names})
                groups.append({"hyper": hyper, "names": gnames})
        if not p.slot.trainable:
            continue
        st = inner.state.get(p.slot.master, {})
        kind = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                if v.dim() == 0:
                    kind[k] = "scalar"
                    for n in p.names:
                        entries.append(Entry(f"optim.state.{n}.{k}", v.detach(), (), ()))
                elif tuple(v.shape) == tuple(p.slot.master.shape):
                    kind[k] = "param"
                    t = _like_piece(p, v)
                    if t is not None:
                        for n in p.names:
                            entries.append(Entry(f"optim.state.{n}.{k}", t.detach(), p.global_shape, p.cuts))
                else:
                    raise ValueError(f"optimizer state {k!r} of {p.names[0]!r} has shape {tuple(v.shape)}, neither "
                                     f"the parameter's {tuple(p.slot.master.shape)} nor a scalar; autopar checkpoints "
                                     "reshard element-wise optimizer state only (SGD, Adam, AdamW, Adagrad, RMSprop ...)")
            else:
                ok, jv = _jsonable(v)
                if not ok:
                    raise ValueError(f"optimizer state {k!r} of {p.names[0]!r} is a {type(v).__name__}, which a "
                                     "checkpoint cannot store without pickling; keep tensors or plain numbers")
                kind[k] = {"value": jv}
        for n in p.names:
            kinds[n] = kind
    return entries, kinds, groups, scaler


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


# --- DTensors for DCP -----------------------------------------------------------------------
_MESHES: dict = {}


def _ckpt_order(mesh, dp_axes: set[str]) -> list[str]:
    names = list(mesh.axis_names)
    return [a for a in names if a not in dp_axes] + [a for a in names if a in dp_axes]


def _ckpt_mesh(mesh, order: list[str], device_type: str):
    """A DeviceMesh over the job whose dims run in `order` (cuts applied left to right). Built
    once per shape (collective: every rank builds the same meshes in the same order)."""
    if order == list(mesh.axis_names) and device_type == mesh.device_type:
        return mesh.device_mesh
    key = (tuple(mesh.sizes.items()), tuple(order), device_type)
    if key not in _MESHES or _MESHES[key][0] is not dist.group.WORLD:
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.arange(mesh.world_size).reshape(tuple(mesh.sizes.values()))
        grid = grid.permute([list(mesh.axis_names).index(a) for a in order])
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


# --- save ---------------------------------------------------------------------------------------
_EXECUTOR: cf.ThreadPoolExecutor | None = None
_PENDING: list["SaveHandle"] = []


class SaveHandle:
    """A save in flight (or done). `wait()` returns the checkpoint's path or raises its error."""

    def __init__(self, path: str, future: cf.Future | None = None):
        self.path, self._future = path, future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        if self._future is not None:
            self._future.result(timeout)
        return self.path


def wait_pending() -> None:
    """Wait for the save in flight, if any (raises its error)."""
    while _PENDING:
        h = _PENDING.pop(0)
        h.wait()


def save_checkpoint(path: str, engine, mesh, *, layouts: Mapping[str, Any] | None = None,
                    global_shapes: Mapping[str, Sequence[int]] | None = None, aliases: Sequence[Sequence[str]] = (),
                    optimizer: bool = True, step: int | None = None, extra: Mapping[str, Any] | None = None,
                    plan: Mapping[str, Any] | None = None, async_save: bool = False, overwrite: bool = False,
                    pp_axis: str = "pp", io_threads: int = 1) -> SaveHandle:
    """Write the state of `engine` (a program's ZeRO engine or pipeline engines) to the
    directory `path`, atomically. Collective: every rank of the job calls it.

    Args:
        layouts: parameter name -> Layout (or its JSON) of the plan's tensor-parallel placement.
        global_shapes: name -> shape of the unsharded model (needed for every tp-sharded name).
        aliases: groups of names that are one tensor in the original model (tied weights).
        optimizer: also write the engines' optimizer state (when they have an optimizer).
        step, extra: recorded in the manifest (extra must be JSON) and returned by load.
        plan: the plan as JSON data, written to plan.json.
        async_save: copy to CPU memory now, write on a background thread; returns at once.
        overwrite: replace an existing checkpoint at `path` (else ValueError).
    Returns a SaveHandle (already done unless async_save).
    """
    wait_pending()
    path = os.path.abspath(str(path))
    try:
        json.dumps(extra or {})
    except TypeError as e:
        raise ValueError(f"extra must be JSON data (numbers, strings, lists, dicts): {e}") from None
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"{path!r} exists; pass overwrite=True to replace it, or save under a new name "
                         "(e.g. one directory per step)")
    layouts, global_shapes = layouts or {}, global_shapes or {}
    coords = mesh.coords(files.rank())
    try:
        params = _params(engine, mesh, layouts, global_shapes)
        for p in params:
            _check_piece(p, mesh, coords)
        opt_entries, kinds, groups, scaler = _rank_info(params, optimizer)
        entries = _model_entries(params) + _buffers(engine, mesh, layouts, global_shapes) + opt_entries
        err = None
    except (ValueError, AssertionError) as e:
        err = e
    _agree_errors(err)
    dp_axes = {e.axis for e in engines_of(engine)}
    maker = _DTensorMaker(mesh, dp_axes, pp_axis)
    dev = "cpu" if async_save else next((e.tensor.device.type for e in entries), "cpu")
    maker.prepare(entries, dev)
    parts = files.all_gather_object({"kinds": kinds, "groups": groups, "scaler": scaler, "optimizer": bool(kinds or groups),
                                "token": uuid.uuid4().hex[:12]})
    token = parts[0]["token"]  # rank 0's: one temporary directory for all
    manifest = _manifest(parts, mesh, layouts, global_shapes, aliases, params, step, extra, plan, optimizer)
    sd: dict[str, Any] = {}
    for e in entries:
        if e.key in sd:
            continue
        t = e.tensor.to("cpu", copy=True) if async_save else e.tensor
        sd[e.key] = maker(e, t)
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    job = (path, tmp, sd, manifest, plan, overwrite, token, io_threads)
    if not async_save:
        _write(*job)
        return SaveHandle(path)
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-ckpt")
    h = SaveHandle(path, _EXECUTOR.submit(_write, *job))
    _PENDING.append(h)
    return h


def _manifest(parts, mesh, layouts, global_shapes, aliases, params, step, extra, plan, optimizer) -> dict:
    kinds, groups, scaler = {}, [], None
    for part in parts:
        kinds.update(part["kinds"])
        scaler = scaler or part["scaler"]
        for g in part["groups"]:
            for h in groups:
                if h["hyper"] == g["hyper"]:
                    h["names"] = sorted(set(h["names"]) | set(g["names"]))
                    break
            else:
                groups.append(dict(g))
    groups_alias = [sorted(set(a)) for a in aliases if len(set(a)) > 1]
    for p in params:
        if len(p.names) > 1 and sorted(p.names) not in groups_alias:
            groups_alias.append(sorted(p.names))
    return {"format": files.FORMAT, "step": step, "extra": dict(extra or {}), "mesh": dict(mesh.sizes),
            "world_size": mesh.world_size, "torch": torch.__version__,
            "layouts": {k: (v.to_json() if isinstance(v, Layout) else dict(v)) for k, v in sorted(layouts.items())},
            "global_shapes": {k: list(v) for k, v in sorted(global_shapes.items())},
            "aliases": sorted(groups_alias), "optimizer": bool(optimizer and any(p["optimizer"] for p in parts)),
            "optim_state": kinds, "param_groups": groups, "loss_scaler": scaler, "plan": plan}


def _write(path, tmp, sd, manifest, plan, overwrite, token, io_threads) -> str:
    rank = files.rank()
    error = None
    try:
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=io_threads,
                                  overwrite=False)
        if dist.is_initialized():
            dcp.save(sd, storage_writer=writer, process_group=files.ckpt_group())
        else:
            import warnings  # noqa: PLC0415

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
                dcp.save(sd, storage_writer=writer, no_dist=True)
        mine = {}
        for name in sorted(os.listdir(tmp)):
            if name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata"):
                fp = os.path.join(tmp, name)
                mine[name] = {"bytes": os.path.getsize(fp), "sha256": files.sha256(fp)}
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        mine, error = {}, f"rank {rank}: {type(e).__name__}: {e}"
    parts = files.all_gather_object({"files": mine, "error": error})
    errors = [p["error"] for p in parts if p["error"]]
    status = None
    if rank == 0:
        try:
            if errors:
                raise RuntimeError("; ".join(errors))
            listing = {}
            for p in parts:
                listing.update(p["files"])
            files.write_json(os.path.join(tmp, files.PLAN_FILE), plan)
            files.write_json(os.path.join(tmp, files.MANIFEST), {**manifest, "files": listing})
            files.fsync_dir(tmp)
            old = None
            if os.path.exists(path):
                if not overwrite:
                    raise ValueError(f"{path!r} appeared during the save; not replacing it")
                old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{token}")
                os.rename(path, old)
            os.rename(tmp, path)
            files.fsync_dir(os.path.dirname(path))
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            status = f"{type(e).__name__}: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
    status = files.all_gather_object(status)[0]
    if status:
        raise RuntimeError(f"saving checkpoint {path!r} failed, the previous checkpoints are untouched: {status}")
    return path


# --- load -----------------------------------------------------------------------------------------
def _candidates(names: Sequence[str], alias_groups: Iterable[Sequence[str]]) -> list[str]:
    out = list(names)
    for g in alias_groups:
        if any(n in g for n in names):
            out += [n for n in g if n not in out]
    return out


def load_checkpoint(path: str, engine, mesh, *, layouts: Mapping[str, Any] | None = None,
                    global_shapes: Mapping[str, Sequence[int]] | None = None, aliases: Sequence[Sequence[str]] = (),
                    optimizer: bool = True, strict: bool = True, verify: str = "full",
                    pp_axis: str = "pp") -> dict:
    """Fill `engine`'s parameters, buffers and (with `optimizer`) optimizer state from the
    checkpoint at `path`, whatever plan wrote it. Collective. Returns the manifest.
    `strict`: every parameter and buffer must be in the checkpoint (and its optimizer state,
    when `optimizer` and the checkpoint has one)."""
    wait_pending()
    path = os.path.abspath(str(path))
    manifest = verify_checkpoint(path, verify)
    md = read_metadata(path).state_dict_metadata
    layouts, global_shapes = layouts or {}, global_shapes or {}
    alias_groups = list(aliases) + list(manifest.get("aliases", []))
    try:
        params = _params(engine, mesh, layouts, global_shapes)
        planned, err = _plan_load(path, engine, mesh, params, md, manifest, layouts, global_shapes, alias_groups,
                                  optimizer, strict), None
    except (ValueError, AssertionError) as e:  # CheckpointError is a ValueError
        planned, err = None, e
    _agree_errors(err)
    targets, copies, new_state, want_opt = planned
    dp_axes = {e.axis for e in engines_of(engine)}
    maker = _DTensorMaker(mesh, dp_axes, pp_axis)
    maker.prepare(targets.values(), next((e.tensor.device.type for e in targets.values()), "cpu"))
    sd = {k: maker(e, e.tensor) for k, e in targets.items()}
    reader = SafeFileSystemReader(path)
    planner = DefaultLoadPlanner(allow_partial_load=True)
    if dist.is_initialized():
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=files.ckpt_group())
    else:
        _load_no_dist(sd, reader, planner)
    with torch.no_grad():
        for key, t in copies:
            t.copy_(targets[key].tensor)
    _after_fill(engine, params)
    if optimizer:
        for inner, master, state in new_state:
            st = inner.state[master]
            st.clear()
            st.update(state)
        if want_opt or not strict:
            _restore_hyper(params, manifest, alias_groups)
    return manifest


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


def _plan_load(path, engine, mesh, params, md, manifest, layouts, global_shapes, alias_groups, optimizer, strict):
    """What this rank reads: DCP targets by key, extra copies (one key held twice), the new
    optimizer state per master, and whether optimizer state is restored. Local (no collective)."""
    coords = mesh.coords(files.rank())
    for p in params:
        _check_piece(p, mesh, coords)
    missing, targets, copies = [], {}, []

    def add(entry_key_names, e: Entry, prefix: str):
        for n in entry_key_names:
            key = f"{prefix}{n}"
            if key in md:
                have = tuple(md[key].size)
                if have != e.global_shape:
                    raise CheckpointError(f"{key} has shape {have} in {path!r} but {e.global_shape} in this model; "
                                          "the checkpoint is of another model")
                if key in targets:
                    copies.append((key, e.tensor))
                else:
                    targets[key] = e
                    e.key = key
                return True
        return False

    for p in params:
        if p.tensor is None:
            continue
        if not add(_candidates(p.names, alias_groups), Entry("", p.tensor, p.global_shape, p.cuts), "model."):
            missing.append(p.names[0])
    for b in _buffers(engine, mesh, layouts, global_shapes):
        name = b.key[len("model."):]
        if not add([name], b, "model."):
            missing.append(name)
    new_state = []
    want_opt = optimizer and manifest.get("optimizer")
    if optimizer and not manifest.get("optimizer") and strict and any(_optimizer_of(p.engine) for p in params):
        raise CheckpointError(f"{path!r} holds no optimizer state; load with optimizer=None (or strict=False) "
                              "to restore the model only")
    if want_opt:
        kinds = manifest.get("optim_state", {})
        for p in params:
            inner = _optimizer_of(p.engine)
            if inner is None or not p.slot.trainable:
                continue
            names = _candidates(p.names, alias_groups)
            name = next((n for n in names if n in kinds), None)
            state: dict[str, Any] = {}
            old = inner.state.get(p.slot.master, {})
            for k, kind in (kinds.get(name) or {}).items():
                if isinstance(kind, dict):
                    state[k] = kind["value"]
                    continue
                key = f"optim.state.{name}.{k}"
                if key not in md:
                    missing.append(key)
                    continue
                meta = md[key]
                if kind == "param":
                    ref = old.get(k) if isinstance(old.get(k), torch.Tensor) else p.slot.master
                    t = torch.empty(p.slot.master.shape, dtype=ref.dtype, device=ref.device)
                    piece = _like_piece(p, t)
                    if piece is not None:
                        add([key[len("optim.state."):]], Entry("", piece, p.global_shape, p.cuts), "optim.state.")
                else:
                    ref = old.get(k)
                    fused = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
                    dev = ref.device if isinstance(ref, torch.Tensor) else (p.slot.master.device if fused else "cpu")
                    dt = ref.dtype if isinstance(ref, torch.Tensor) else meta.properties.dtype
                    t = torch.empty(tuple(meta.size), dtype=dt, device=dev)
                    add([key[len("optim.state."):]], Entry("", t, tuple(meta.size), ()), "optim.state.")
                state[k] = t
            new_state.append((inner, p.slot.master, state))
    if missing and strict:
        raise CheckpointError(f"{path!r} has no entry for {sorted(set(missing))[:10]}"
                              + (f" and {len(set(missing)) - 10} more" if len(set(missing)) > 10 else "")
                              + "; pass strict=False to leave them as they are")
    return targets, copies, new_state, want_opt


def _load_no_dist(sd, reader, planner) -> None:
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
        dcp.load(sd, storage_reader=reader, planner=planner, no_dist=True)


def _after_fill(engine, params: list[_Param]) -> None:
    """Bring what was written into the masters (or parameters) into the model: all-gather
    ZeRO-1/2 rows, cast mixed-precision masters; drop stale gradients."""
    with torch.no_grad():
        for p in params:
            if p.via_param and p.slot.master is not p.slot.param:
                i = p.slot.info
                full = p.slot.param.detach().reshape(i.rows, *i.shape[1:]) if i.shape else p.slot.param.detach().reshape(1)
                p.slot.master.copy_(full[i.start:i.end].reshape(p.slot.master.shape))
        for e in engines_of(engine):
            e._write_back()  # noqa: SLF001 - the engine's own "masters -> model" step (collective at ZeRO 1-2)
            e.zero_grad(True)


def _restore_hyper(params: list[_Param], manifest: dict, alias_groups) -> None:
    groups = manifest.get("param_groups", [])
    names_of = {id(p.slot.master): set(_candidates(p.names, alias_groups)) for p in params}
    seen = set()
    for e in {id(p.engine): p.engine for p in params}.values():
        inner = _optimizer_of(e)
        if inner is None or id(inner) in seen:
            continue
        seen.add(id(inner))
        for g in inner.param_groups:
            names = set().union(*[names_of.get(id(m), set()) for m in g["params"]])
            src = next((h for h in groups if names & set(h["names"])), None)
            if src is None:
                continue
            for k, v in src["hyper"].items():
                cur = g.get(k)
                if isinstance(cur, torch.Tensor):
                    cur.fill_(v)
                elif isinstance(cur, tuple):
                    g[k] = tuple(v)
                else:
                    g[k] = v
    scaler = manifest.get("loss_scaler")
    if scaler:
        for e in {id(p.engine): p.engine for p in params}.values():
            if e.scaler is not None:
                e.scaler.load_state_dict(scaler)


# --- plain state dicts: export and import ------------------------------------------------------------
def read_full_state_dict(path: str, *, verify: str = "full", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict of the checkpoint at `path`, in this process (no collective;
    it holds the whole model): every name of the original model, tied names included."""
    path = os.path.abspath(str(path))
    manifest = verify_checkpoint(path, verify, collective=False)
    md = read_metadata(path).state_dict_metadata
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()
          if k.startswith("model.") and hasattr(m, "size")}
    _load_no_dist(sd, SafeFileSystemReader(path), DefaultLoadPlanner(allow_partial_load=True))
    out = {k[len("model."):]: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in sd.items()}
    for group in manifest.get("aliases", []):
        have = next((n for n in group if n in out), None)
        if have is not None:
            for n in group:
                out.setdefault(n, out[have])
    return out


def import_state(engine, mesh, source: Any, *, layouts: Mapping[str, Any] | None = None,
                 global_shapes: Mapping[str, Sequence[int]] | None = None, aliases: Sequence[Sequence[str]] = (),
                 key_map: Mapping[str, str] | Callable[[str], str] | None = None, strict: bool = True) -> list[str]:
    """Fill `engine`'s parameters and buffers from a plain state dict (see StateSource), each
    rank reading only its own pieces. Collective only where ZeRO 1-2 gathers rows afterwards.
    `key_map`: our name -> the source's name (a mapping or a function). Buffers the source
    does not have keep their values (state dicts leave out non-persistent buffers). Returns
    the names loaded; ValueError naming missing parameters (strict) or mis-shaped entries."""
    src = source if isinstance(source, StateSource) else StateSource(source)
    layouts, global_shapes = layouts or {}, global_shapes or {}
    coords = mesh.coords(files.rank())
    params = _params(engine, mesh, layouts, global_shapes)

    def source_name(names):
        for n in names:
            s = key_map(n) if callable(key_map) else (key_map or {}).get(n, n)
            if s in src:
                return s
        return None

    loaded, missing = [], []
    items = [(_candidates(p.names, aliases), p.tensor, p.global_shape, p.cuts, True) for p in params
             if p.tensor is not None]
    items += [([b.key[len("model."):]], b.tensor, b.global_shape, b.cuts, False)
              for b in _buffers(engine, mesh, layouts, global_shapes)]
    with torch.no_grad():
        for names, t, gshape, cuts, is_param in items:
            s = source_name(names)
            if s is None:
                if is_param:  # state dicts leave out non-persistent buffers (RoPE tables ...): keep ours
                    missing.append(names[0])
                continue
            have = src.shape(s)
            if have != tuple(gshape):
                raise ValueError(f"{s!r} has shape {have} in the source but {names[0]!r} is {tuple(gshape)} in the "
                                 "model; it is another model's state dict (use key_map to rename keys)")
            shape, offset = local_chunk(gshape, cuts, mesh.sizes, coords)
            t.copy_(src.read(s, offset, shape).reshape(t.shape))
            loaded.append(names[0])
    if missing and strict:
        raise ValueError(f"the state dict has no entry for {missing[:10]}"
                         + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
                         + "; pass strict=False to leave them as they are, or key_map to rename")
    _after_fill(engine, params)
    return loaded


