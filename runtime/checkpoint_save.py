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

Failures: a save that fails on any rank raises `CheckpointSaveError` on every rank (at
`wait()` when async): an ordinary exception (a RuntimeError and an OSError) whose `errno`,
`strerror` and `filename` are those of the first failing rank's OSError (ENOSPC: disk full,
EROFS: read-only file system, EACCES: no permission), with that rank and the checkpoint's
path in its message, never DCP's CheckpointException (a BaseException). Before copying any
tensor, rank 0 checks that it can create files beside `path` (a read-only or forbidden
directory fails at once, even for an asynchronous save). A failed save leaves the previous
checkpoints untouched and removes its staging directory; a save interrupted by a crash (a
killed rank or job) leaves its hidden `.<name>.tmp-<token>` behind, which the next save into
the same directory removes (`clean_staging`; an overwrite interrupted between its renames
gets the previous checkpoint back under its name). An asynchronous save that failed and was
not `wait()`ed for is reported by the next save (which then starts nothing; the one after
runs normally); a failure `wait()` raised is not reported again by the next save.

Guarantees: a save that fails on any rank raises on every rank and leaves the previous
checkpoints untouched (the hidden temporary directory is removed); optimizer state that is
neither element-wise nor scalar, non-tensor state or `extra` that is not plain JSON, is
refused with a ValueError before anything is written.

It reads and writes no `node.meta` keys; it imports nothing above runtime/.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno as errno_mod
import json
import os
import re
import shutil
import uuid
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from . import checkpoint_files as files
from .checkpoint_entries import (Entry, _agree_errors, _buffers, _check_piece, _DTensorMaker, _like_piece,
                                 _model_entries, _optimizer_of, _Param, _params, engines_of)
from .placement import Layout


# --- errors -------------------------------------------------------------------------------------
class CheckpointSaveError(RuntimeError, OSError):
    """A checkpoint save that failed (see the module docstring). `errno`, `strerror` and
    `filename` are those of the failing rank's OSError (None when the cause was another
    error); `rank` is that rank, `path` the checkpoint's."""

    def __init__(self, message: str, *, errno: int | None = None, strerror: str | None = None,
                 filename: str | None = None, rank: int | None = None, path: str | None = None):
        if errno is not None:
            OSError.__init__(self, errno, strerror or os.strerror(errno), filename)
        else:
            OSError.__init__(self, message)
        self.message, self.rank, self.path = message, rank, path

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (_rebuild_save_error, (self.message, self.errno, self.strerror, self.filename, self.rank, self.path))


def _rebuild_save_error(message, errno, strerror, filename, rank, path):
    return CheckpointSaveError(message, errno=errno, strerror=strerror, filename=filename, rank=rank, path=path)


_ADVICE = {errno_mod.ENOSPC: "the disk is full: free space or save to another file system",
           errno_mod.EDQUOT: "the disk quota is exhausted: free space or save elsewhere",
           errno_mod.EROFS: "the file system is read-only: save to a writable directory",
           errno_mod.EACCES: "no permission to write there: save to a directory you can write",
           errno_mod.EPERM: "the operation is not permitted there: save to a directory you can write",
           errno_mod.ENOTDIR: "a part of the path is a file, not a directory: choose another path"}


def _root_error(e: BaseException, depth: int = 0) -> BaseException:
    """The OSError under `e` (DCP wraps each rank's error in a CheckpointException), or `e`."""
    if isinstance(e, OSError) or depth > 8:
        return e
    if isinstance(e, CheckpointException):
        for exc_and_trace in e.failures.values():
            inner = exc_and_trace[0] if isinstance(exc_and_trace, tuple) else exc_and_trace
            if isinstance(inner, BaseException):
                root = _root_error(inner, depth + 1)
                if isinstance(root, OSError):
                    return root
        first = next(iter(e.failures.values()), None)
        if isinstance(first, tuple) and isinstance(first[0], BaseException):
            return _root_error(first[0], depth + 1)
        return e
    for nxt in (e.__cause__, e.__context__):
        if nxt is not None:
            root = _root_error(nxt, depth + 1)
            if isinstance(root, OSError):
                return root
    return e


def _failure(e: BaseException, rank: int) -> dict:
    """A rank's failure as plain data (it travels to every rank). DCP reports a failure on
    every rank, naming the ranks that failed: the first of those (with an OSError if any) is
    the one reported."""
    if isinstance(e, CheckpointException) and e.failures:
        ranked = sorted(e.failures.items(), key=lambda kv: kv[0])
        for r, exc_and_trace in ranked:
            inner = exc_and_trace[0] if isinstance(exc_and_trace, tuple) else exc_and_trace
            if isinstance(inner, BaseException) and isinstance(_root_error(inner), OSError):
                return _failure(inner, int(r))
        inner = ranked[0][1][0] if isinstance(ranked[0][1], tuple) else ranked[0][1]
        if isinstance(inner, BaseException):
            return _failure(inner, int(ranked[0][0]))
    root = _root_error(e)
    if isinstance(root, OSError) and root.errno is not None:
        return {"rank": rank, "type": type(root).__name__, "errno": root.errno, "strerror": root.strerror,
                "filename": None if root.filename is None else str(root.filename), "text": str(root)}
    text = str(root).strip().splitlines()[0] if str(root).strip() else ""
    return {"rank": rank, "type": type(root).__name__, "errno": None, "strerror": None, "filename": None,
            "text": text[:500]}


def _save_error(path: str, f: dict, what: str = "saving checkpoint") -> CheckpointSaveError:
    code = f.get("errno")
    cause = f"{f['type']}: {f['text']}"
    if code is not None:
        name = errno_mod.errorcode.get(code, str(code))
        advice = _ADVICE.get(code)
        cause = f"{name} ({f.get('strerror')}) at {f.get('filename') or path!r}" + (f"; {advice}" if advice else "")
    return CheckpointSaveError(f"{what} {path!r} failed on rank {f['rank']}: {cause}. The previous checkpoints are "
                               "untouched and nothing of this save was kept", errno=code, strerror=f.get("strerror"),
                               filename=f.get("filename") or (path if code is not None else None), rank=f["rank"],
                               path=path)


def _agree_failure(path: str, failure: dict | None, what: str = "saving checkpoint") -> None:
    """Raise the first rank's failure on every rank (collective over the checkpoint group)."""
    parts = files.all_gather_object(failure)
    first = next((p for p in parts if p), None)
    if first:
        raise _save_error(path, first, what)


# --- staging directories ------------------------------------------------------------------------
_STAGING = re.compile(r"^\.(?P<base>.+)\.(?P<kind>tmp|old)-(?P<token>[0-9a-f]{12})$")


def clean_staging(root: str, keep: str | None = None) -> list[str]:
    """Remove what interrupted saves left in the directory `root`: staging directories
    (`.<name>.tmp-<token>`) are deleted; a previous checkpoint moved aside by an overwrite
    (`.<name>.old-<token>`) is renamed back to `<name>` when that name is free, else deleted.
    `keep`: a token in use (skipped). Local, no collective: call it on one rank. Returns what
    was done, one line each."""
    done = []
    if not os.path.isdir(root):
        return done
    for name in sorted(os.listdir(root)):
        m = _STAGING.match(name)
        full = os.path.join(root, name)
        if not m or m["token"] == keep or not os.path.isdir(full):
            continue
        target = os.path.join(root, m["base"])
        if m["kind"] == "old" and not os.path.exists(target):
            os.rename(full, target)
            done.append(f"restored {target} (an overwrite was interrupted)")
        else:
            shutil.rmtree(full, ignore_errors=True)
            done.append(f"removed {full} (left by an interrupted save)")
    return done


def _preflight(path: str, token: str) -> None:
    """Rank 0: the directory of `path` exists (made if need be) and takes a new file."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    probe = os.path.join(parent, f".{os.path.basename(path)}.probe-{token}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        raise OSError(e.errno, e.strerror, parent) from None  # the directory is what the user chose
    os.close(fd)
    os.remove(probe)


# --- save ---------------------------------------------------------------------------------------
_EXECUTOR: cf.ThreadPoolExecutor | None = None
_EXECUTOR_PID: int | None = None
_PENDING: list["SaveHandle"] = []
_FAILED: list[tuple["SaveHandle", BaseException]] = []  # failed saves nobody has seen fail yet


class SaveHandle:
    """A save in flight (or done). `wait()` returns the checkpoint's path or raises its error
    (a CheckpointSaveError, every time it is called); an error seen here is not reported again
    by the next save."""

    def __init__(self, path: str, future: cf.Future | None = None):
        self.path, self._future = path, future
        self.seen = False  # the error (if any) was raised to the user by wait()

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def error(self) -> BaseException | None:
        """The save's error once it is done (None while running or when it succeeded)."""
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()

    def wait(self, timeout: float | None = None) -> str:
        if self._future is not None:
            try:
                self._future.result(timeout)
            except cf.TimeoutError:
                raise
            except BaseException:
                self.seen = True
                raise
        return self.path


def _settle() -> None:
    """Wait for the saves in flight; keep the failures nobody has seen for the next save."""
    if _EXECUTOR_PID is not None and _EXECUTOR_PID != os.getpid():
        _PENDING.clear()  # a forked child: the parent's saves are the parent's
        _FAILED.clear()
    while _PENDING:
        h = _PENDING.pop(0)
        if h._future is None:
            continue
        try:
            h._future.result()
        except BaseException as e:  # noqa: BLE001 - kept and reported by the next save
            _FAILED.append((h, e))


def settle_pending() -> None:
    """Wait for the saves in flight without raising (a load must not read a half-written
    checkpoint); a failure nobody has seen is kept for the next save to report."""
    _settle()


def wait_pending() -> None:
    """Wait for the saves in flight, if any; raise (once) the error of one that failed and
    whose `wait()` nobody called."""
    _settle()
    failed = [(h, e) for h, e in _FAILED if not h.seen]  # an error wait() raised is not reported again
    _FAILED.clear()
    if failed:
        h, e = failed[0]
        raise CheckpointSaveError(f"the asynchronous save to {h.path!r} failed and was not waited for: {e}. Nothing "
                                  "of this new save was started; call it again to save (later saves are not "
                                  "affected)", errno=getattr(e, "errno", None), strerror=getattr(e, "strerror", None),
                                  filename=getattr(e, "filename", None), rank=getattr(e, "rank", None),
                                  path=h.path) from e


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
    Raises CheckpointSaveError when writing fails (see the module docstring), ValueError for
    bad arguments (before anything is written).
    """
    wait_pending()
    path = os.path.abspath(str(path))
    try:
        json.dumps(extra or {}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be JSON data (numbers, strings, lists, dicts): {e}") from None
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise ValueError(f"step must be an integer or None, got {step!r} ({type(step).__name__})")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path!r} is a file; a checkpoint is a directory: save under another name")
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
    parts = files.all_gather_object({"kinds": kinds, "groups": groups, "scaler": scaler, "optimizer": bool(kinds or groups),
                                "token": uuid.uuid4().hex[:12]})
    token = parts[0]["token"]  # rank 0's: one temporary directory for all
    failure = None
    if files.rank() == 0:
        try:
            _preflight(path, token)
        except OSError as e:
            failure = _failure(e, 0)
    _agree_failure(path, failure)
    dp_axes = {e.axis for e in engines_of(engine)}
    maker = _DTensorMaker(mesh, dp_axes, pp_axis)
    dev = "cpu" if async_save else next((e.tensor.device.type for e in entries), "cpu")
    maker.prepare(entries, dev)
    manifest = _manifest(parts, mesh, layouts, global_shapes, aliases, params, step, extra, plan, optimizer)
    sd: dict[str, Any] = {}
    for e in entries:
        if e.key in sd:
            continue
        t = e.tensor.to("cpu", copy=True) if async_save else e.tensor
        sd[e.key] = maker(e, t)
    parent, base = os.path.split(path)
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    job = (path, tmp, sd, manifest, plan, overwrite, token, io_threads)
    if not async_save:
        _write(*job)
        return SaveHandle(path)
    global _EXECUTOR, _EXECUTOR_PID
    if _EXECUTOR is None or _EXECUTOR_PID != os.getpid():
        # a process forked from one that saved asynchronously inherits the executor but not its
        # thread: work submitted there would never run
        _EXECUTOR = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-ckpt")
        _EXECUTOR_PID = os.getpid()
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
    """Write `sd` into the staging directory `tmp`, hash it, and (rank 0) write the manifest and
    rename it to `path`. Collective. Every rank raises the same CheckpointSaveError when any
    rank failed; the staging directory is then removed."""
    rank = files.rank()
    failure = None
    try:
        if rank == 0:
            clean_staging(os.path.dirname(path), keep=token)  # what a crashed save left behind
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
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException; reported below
        mine, failure = {}, _failure(e, rank)
    try:
        parts = files.all_gather_object({"files": mine, "failure": failure})
    except Exception as e:  # noqa: BLE001 - a rank stopped answering: keep nothing
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(path, {"rank": rank, "type": type(e).__name__, "errno": None,
                                 "text": f"another rank stopped answering during the save ({e})"}) from None
    failures = [p["failure"] for p in parts if p["failure"]]
    status = failures[0] if failures else None
    if rank == 0:
        try:
            if status is None:
                _commit(path, tmp, parts, manifest, plan, overwrite, token)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            status = _failure(e, 0)
        if status is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    status = files.all_gather_object(status)[0]
    if status:
        raise _save_error(path, status)
    return path


def _commit(path, tmp, parts, manifest, plan, overwrite, token) -> None:
    """Rank 0: the manifest into the staging directory, then the rename into place."""
    listing = {}
    for p in parts:
        listing.update(p["files"])
    files.write_json(os.path.join(tmp, files.PLAN_FILE), plan)
    files.write_json(os.path.join(tmp, files.MANIFEST), {**manifest, "files": listing})
    files.fsync_dir(tmp)
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"{path!r} appeared during the save; not replacing it")
    files.swap_into_place(tmp, path, token)  # the previous checkpoint stays whole until then


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
