"""Checkpoints of parallelised models: the user's entry points over runtime/checkpoint.py.

    autopar.save(model, "ckpt/step_100", optimizer=opt, step=100)        # collective, atomic
    h = autopar.save(model, "ckpt/step_200", optimizer=opt, async_save=True); ...; h.wait()
    autopar.load(model, autopar.latest_checkpoint("ckpt"), optimizer=opt)  # any plan wrote it
    autopar.export_state_dict(model, "model.safetensors")   # loads into the original nn.Module
    autopar.import_state_dict(model, "hf_dir/")              # each rank reads only its pieces

A checkpoint written under one plan loads under any other (dp, tp, pp, ZeRO stage, mesh
size): this layer hands the runtime what it cannot know — the plan's tensor-parallel layouts,
the unsharded shapes and the tied names of the captured model — as plain data.

Failures: a save that cannot write raises `CheckpointSaveError` (a RuntimeError and an
OSError: its errno, e.g. ENOSPC or EROFS, and the path) on every rank and keeps nothing of
itself; the previous checkpoints are untouched. Staging directories of saves a crash
interrupted are removed by the next save into the same directory (or `clean_staging(root)`).
A damaged or partial checkpoint is refused by `load` with a CheckpointError naming what is
missing.

Faults: `init_restartable()` starts a torchrun job so that `--max-restarts` can restart it;
`fault_guard(timeout_s)` names a rank that stopped answering when a collective fails;
`bounded_mesh(timeout_s, dp=.., tp=..)` is `autopar.mesh` whose groups time out, so that a
collective waiting on such a rank does fail (and in bounded time).

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from autopar.runtime import checkpoint as ck
from autopar.runtime.checkpoint_entries import engines_of, held_pieces, local_chunk
from autopar.runtime.checkpoint_files import all_gather_object, ckpt_group
from autopar.runtime.checkpoint_files import rank as ckpt_rank
from autopar.runtime.checkpoint import CheckpointError, SaveHandle, latest_checkpoint, verify_checkpoint
from autopar.runtime.checkpoint import CheckpointSaveError, clean_staging
from autopar.runtime.faults import FaultGuard, RankUnresponsiveError, bounded_device_mesh, init_restartable
from autopar.runtime.mesh import Mesh, make_mesh

__all__ = ["save", "load", "latest_checkpoint", "verify_checkpoint", "export_state_dict", "gather_state_dict",
           "import_state_dict",
           "fault_guard", "bounded_mesh", "init_restartable", "CheckpointError", "CheckpointSaveError",
           "RankUnresponsiveError", "SaveHandle", "clean_staging"]


def _model_info(model) -> dict[str, Any]:
    """Layouts, unsharded shapes and tied-name groups of a ParallelModel, as plain data."""
    if not all(hasattr(model, a) for a in ("global_graph", "engine", "mesh", "plan")):  # a ParallelModel
        raise TypeError(f"expected the model returned by autopar.parallelize, got {type(model).__name__}; "
                        "for a plain nn.Module use torch.distributed.checkpoint or torch.save directly")
    from autopar.build.model_tensors import model_tensors  # noqa: PLC0415

    return model_tensors(model.global_graph, model.plan)


def _check_path(path, what: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{what}: the checkpoint path must be a string or os.PathLike, got {type(path).__name__}")
    if not os.fspath(path):
        raise ValueError(f"{what}: the checkpoint path is empty; give a directory such as 'ckpt/step_100'")


def _with_optimizer(model, optimizer) -> bool:
    if optimizer is None:
        return False
    if optimizer is not getattr(model.engine, "optimizer", None):
        raise ValueError("optimizer is not the one autopar.optimizer(model, ...) made for this model; pass that "
                         "optimizer (or none, to save or load the model alone)")
    return True


def save(model, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
         extra: Mapping[str, Any] | None = None, async_save: bool = False, overwrite: bool = False) -> SaveHandle:
    """Save `model` (and `optimizer`, made by autopar.optimizer) into the directory `path`.

    Collective: call it on every rank. Atomic: the directory appears complete or not at all.
    `step` and `extra` (JSON data) come back from `load`. With `async_save`, tensors are copied
    to CPU memory and written in the background: the returned handle's `wait()` finishes it
    (the next save or load waits for it too).

    Raises CheckpointSaveError when writing fails (the OSError's errno and path; nothing kept);
    the next save reports an asynchronous save that failed unseen. ValueError for bad
    arguments, before anything is written."""
    _check_path(path, "save")
    info = _model_info(model)
    return ck.save_checkpoint(os.fspath(path), model.engine, model.mesh, **info,
                              optimizer=_with_optimizer(model, optimizer), step=step, extra=extra,
                              plan=json.loads(model.plan.to_json()), async_save=async_save, overwrite=overwrite)


def load(model, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True,
         verify: str = "full") -> dict[str, Any]:
    """Load a checkpoint written under any plan into `model` (and `optimizer`).

    Collective. The checkpoint is checked first (`verify`: "full" = sizes and SHA-256 of every
    file, "size", "none"); a damaged one raises CheckpointError naming the bad files. Returns
    {"step", "extra", "mesh", "plan"} as saved."""
    if path is None:
        raise ValueError("no checkpoint path given (latest_checkpoint(root) returns None when the root has "
                         "no complete checkpoint)")
    _check_path(path, "load")
    if verify not in ("full", "size", "none"):
        raise ValueError(f"verify must be 'full', 'size' or 'none', got {verify!r}")
    info = _model_info(model)
    m = ck.load_checkpoint(os.fspath(path), model.engine, model.mesh, **info,
                           optimizer=_with_optimizer(model, optimizer), strict=strict, verify=verify)
    return {"step": m.get("step"), "extra": m.get("extra", {}), "mesh": m.get("mesh"), "plan": m.get("plan")}


def export_state_dict(source, path: str | os.PathLike | None = None, *, dtype: torch.dtype | None = None,
                      like: torch.nn.Module | Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The full state dict of the original, unparallelised model (tied names included), from a
    ParallelModel (collective: every rank sends rank 0 the pieces it is the first to hold, in
    memory, and rank 0 assembles them; the names and values a checkpoint of the model holds) or
    from a checkpoint directory (one process). Written to `path` by rank 0 when given:
    safetensors for `.safetensors`, else torch.save. Returns the dict on rank 0, {} elsewhere.

    `like`: the original model (or its state dict): keep exactly its keys, so that
    `model.load_state_dict(...)` is strict-clean (a captured graph keeps buffers the original
    marks non-persistent, such as RoPE tables); ValueError naming keys the export lacks."""
    if isinstance(source, (str, os.PathLike)):
        sd = _keep_like(ck.read_full_state_dict(os.fspath(source), dtype=dtype), like)
        if path is not None:
            ck.write_state_dict(sd, os.fspath(path))
        return sd
    info = _model_info(source)
    sd, err = gather_state_dict(source.engine, source.mesh, **info), None
    if ckpt_rank() == 0:
        try:
            sd = _keep_like({k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
                             for k, v in sd.items()}, like)
            if path is not None:
                ck.write_state_dict(sd, os.fspath(path))
        except Exception as e:  # noqa: BLE001 - reported on every rank
            err = f"{type(e).__name__}: {e}"
    err = ck.agree(err)
    if err:
        raise RuntimeError(f"exporting the state dict failed on rank 0: {err}")
    return sd


def gather_state_dict(engine, mesh, *, layouts: Mapping[str, Any], global_shapes: Mapping[str, Any],
                      aliases: Sequence[Sequence[str]] = ()) -> dict[str, torch.Tensor]:
    """The model's full state dict on rank 0 ({} elsewhere), gathered in memory: what
    `autopar.save` writes under `model.` and `read_full_state_dict` reads back (every parameter
    from the engine's masters under each of its names, the persistent buffers, then every name of
    a tied group), without the round trip through a checkpoint directory. Collective over the
    checkpoint group: every rank lists its pieces (`runtime.checkpoint_entries.held_pieces`),
    each piece goes to rank 0 from the lowest rank holding it (replicas are sent once), rank 0
    copies them into full tensors on the CPU. Its peak is the full model (as reading the
    temporary checkpoint back was)."""
    ck.wait_pending()  # an asynchronous save still writing talks over the same group
    coords = mesh.coords(ckpt_rank())
    mine: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    err = None
    try:
        skip = _non_persistent_buffers(engine)
        for names, t, gshape, cuts in held_pieces(engine, mesh, layouts, global_shapes):
            local, offset = local_chunk(gshape, cuts, mesh.sizes, coords) if gshape else ((), ())
            if tuple(t.shape) != tuple(local):
                raise AssertionError(f"{names[0]}: this rank holds shape {tuple(t.shape)} but global shape "
                                     f"{gshape} cut by {cuts} gives {local}; the layouts do not describe the program")
            for n in names:
                if n in skip or (n, offset) in mine:
                    continue
                mine[(n, offset)] = t.detach()
                shapes[n] = (tuple(gshape), t.dtype)
    except (ValueError, AssertionError) as e:
        err = f"{type(e).__name__}: {e}"
    listed = all_gather_object((err, list(mine)))
    bad = [f"rank {r}: {e}" for r, (e, _keys) in enumerate(listed) if e]
    if bad:
        raise ValueError("exporting the state dict: " + "; ".join(bad[:4]))
    first: dict[tuple[str, tuple[int, ...]], int] = {}
    for r, (_e, keys) in enumerate(listed):
        for k in keys:
            first.setdefault(tuple((k[0], tuple(k[1]))), r)
    send = [(k, shapes[k[0]], v.to("cpu")) for k, v in mine.items() if first[k] == ckpt_rank()]
    parts = [send]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size() if ckpt_rank() == 0 else None
        dist.gather_object(send, parts, dst=0, group=ckpt_group())
    if ckpt_rank() != 0:
        return {}
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for (name, offset), (gshape, dt), piece in part:
            full = out.get(name)
            if full is None:
                full = out[name] = torch.empty(gshape, dtype=dt)
            view = full
            for d, (o, n) in enumerate(zip(offset, piece.shape)):
                view = view.narrow(d, o, n)
            view.copy_(piece)
    for group in aliases:
        have = next((n for n in group if n in out), None)
        if have is not None:
            for n in group:
                out.setdefault(n, out[have])
    return out


def _non_persistent_buffers(engine) -> set[str]:
    """Buffers of the program's modules that their state dict leaves out (a checkpoint does too)."""
    out: set[str] = set()
    for e in engines_of(engine):
        kept = set(e.module.state_dict(keep_vars=True))
        trained = {n for s in e.slots for n in [s.name, *s.aliases]}
        out |= {n for n, _b in e.module.named_buffers(remove_duplicate=False) if n not in kept and n not in trained}
    return out


def _keep_like(sd: dict[str, torch.Tensor], like) -> dict[str, torch.Tensor]:
    if like is None:
        return sd
    keys = list(like.state_dict().keys() if isinstance(like, torch.nn.Module) else like.keys())
    lacking = [k for k in keys if k not in sd]
    if lacking:
        raise ValueError(f"the exported state has no {lacking[:10]}; `like` is not the model that was parallelised")
    return {k: sd[k] for k in keys}


def import_state_dict(model, source, *, strict: bool = True,
                      key_map: Mapping[str, str] | Callable[[str], str] | None = None) -> list[str]:
    """Fill `model`'s parameters and buffers from a plain state dict: a mapping, a `.safetensors`
    file, a directory of safetensors shards (a transformers checkpoint) or a `.pt`/`.bin` file.
    Every rank reads only the slices it holds; nothing holds the full model. `key_map` renames
    (our name -> the source's). Tied names fall back to each other. Returns the names filled."""
    info = _model_info(model)
    return ck.import_state(model.engine, model.mesh, source, **info, key_map=key_map, strict=strict)


def fault_guard(timeout_s: float = 30.0) -> FaultGuard:
    """A context for each training step: when a collective inside fails, the surviving ranks
    raise RankUnresponsiveError naming the ranks that stopped answering (within `timeout_s`).
    Collective to create. Pair it with `bounded_mesh` so that waiting collectives do fail."""
    if not dist.is_initialized():
        raise ValueError("fault_guard needs a running job (torch.distributed initialised, e.g. under torchrun)")
    return FaultGuard(timeout_s)


def bounded_mesh(timeout_s: float, *, device_type: str | None = None, **axes: int) -> Mesh:
    """`autopar.mesh(**axes)` whose process groups time out after `timeout_s`, so that a
    collective waiting on a rank that stopped answering fails instead of waiting 30 minutes."""
    shape = make_mesh(device_type=device_type, **axes)
    dm = bounded_device_mesh(shape.sizes, timeout_s, shape.device_type)
    return make_mesh(device_mesh=dm)
