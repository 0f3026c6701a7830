"""Saving a distributed checkpoint: `save_checkpoint` gathers the entries of every rank
(checkpoint_entries.py), the optimizer's state and hyper-parameters, and writes them through
DCP into a directory, atomically.

Saves are atomic and loads verified (runtime/checkpoint_files.py: manifest, hashes, the
allow-list metadata reader). `save_checkpoint(..., async_save=True)` copies the local
tensors to CPU memory, returns, and writes (DCP, hashes, manifest, rename) on a background
thread over the checkpoint group; the next save or load waits for it (`wait_pending`).

A parameter held under several names (tied weights; a tied weight on two pipeline stages) is
written under every name. Optimizer hyper-parameters, non-tensor state and the loss scaler go
to the manifest (JSON, `_manifest`), never to a pickle.

Guarantees: a save that fails on any rank raises on every rank (at `wait()` when async) and
leaves the previous checkpoints untouched (the hidden temporary directory is removed);
optimizer state that is neither element-wise nor scalar, non-tensor state or `extra` that is
not plain JSON, is refused with a ValueError before anything is written.

It reads and writes no `node.meta` keys; it imports nothing above runtime/.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import uuid
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from . import checkpoint_files as files
from .checkpoint_entries import (Entry, _agree_errors, _buffers, _check_piece, _DTensorMaker, _like_piece,
                                 _model_entries, _optimizer_of, _Param, _params, engines_of)
from .placement import Layout


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


# --- the optimizer's entries and its part of the manifest --------------------------------
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
