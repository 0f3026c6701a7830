"""Loading distributed checkpoints into a program's engines under any plan, and plain state
dicts in and out.

`load_checkpoint` verifies the checkpoint first (checkpoint_files.verify_checkpoint), plans
what this rank reads (`_plan_load`: DCP targets by key, each found under any of its aliases;
optimizer state by the kinds the manifest recorded), and lets DCP reshard into the DTensors
of checkpoint_entries.py; a parameter held under several names is loaded from whichever name
the checkpoint has. After a load, the engines bring the masters into the model (ZeRO-1/2
all-gather, mixed-precision cast), and the optimizer's hyper-parameters and the loss scaler
come back from the manifest. `read_full_state_dict` reads the whole model in one process
(export); `import_state` fills the engines from a plain state dict, each rank reading only its
own pieces.

Guarantees: loading under any plan gives the saved values bit for bit (same dtype); the
optimizer holds exactly the saved state (state absent from the checkpoint is cleared). A
partial or damaged checkpoint is refused with a CheckpointError (a ValueError) naming what is
missing: files the manifest lists (or, with verify="none", what DCP could not read), a
damaged manifest field, entries this model needs (strict); never DCP's CheckpointException.
A load waits for saves in flight but does not raise their errors (the next save does).

It reads and writes no `node.meta` keys; it imports nothing above runtime/.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from . import checkpoint_files as files
from .checkpoint_entries import (Entry, _agree_errors, _buffers, _check_piece, _DTensorMaker, _like_piece,
                                 _optimizer_of, _Param, _params, engines_of, local_chunk)
from .checkpoint_files import (CheckpointError, SafeFileSystemReader, StateSource, read_manifest, read_metadata,
                               verify_checkpoint)
from .checkpoint_save import settle_pending


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
    settle_pending()
    path = os.path.abspath(str(path))
    check_manifest(path, read_manifest(path))  # its structure, before verification reads it
    manifest = verify_checkpoint(path, verify)
    md = _metadata(path, manifest)
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
    try:
        if dist.is_initialized():
            dcp.load(sd, storage_reader=reader, planner=planner, process_group=files.ckpt_group())
        else:
            _load_no_dist(sd, reader, planner)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        raise _read_error(path, manifest, e) from None
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


def check_manifest(path: str, m: Any) -> dict:
    """`m` if the manifest of the checkpoint at `path` has the structure loading reads (a
    manifest edited by hand, or written by something else, is refused naming the field)."""
    def bad(field: str, want: str, got: Any) -> CheckpointError:
        return CheckpointError(f"{os.path.join(path, files.MANIFEST)} is damaged: {field!r} should be {want}, got "
                               f"{type(got).__name__}; load an earlier checkpoint (latest_checkpoint(root))")

    if not isinstance(m, dict):
        raise bad("the manifest", "a JSON object", m)
    fl = m.get("files", {})
    if not isinstance(fl, dict):
        raise bad("files", "an object {file: {bytes, sha256}}", fl)
    for name, info in fl.items():
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or not isinstance(info.get("sha256"), str):
            raise bad(f"files[{name!r}]", "an object {bytes: integer, sha256: string}", info)
    for field, kind in (("optim_state", dict), ("aliases", list), ("param_groups", list), ("extra", dict),
                        ("layouts", dict), ("global_shapes", dict)):
        if field in m and m[field] is not None and not isinstance(m[field], kind):
            raise bad(field, f"a JSON {'object' if kind is dict else 'list'}", m[field])
    return m


def _metadata(path: str, manifest: dict):
    """DCP's metadata of the checkpoint (state_dict_metadata); CheckpointError naming the file
    when it is missing or unreadable."""
    try:
        return read_metadata(path).state_dict_metadata
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path!r} is incomplete: its .metadata is missing (files present: "
                              f"{sorted(os.listdir(path))[:8]}); load an earlier checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {os.path.join(path, '.metadata')}: {e}") from None


def _read_error(path: str, manifest: dict, e: BaseException) -> CheckpointError:
    """What made DCP fail to read the checkpoint at `path`, in one line: the files the
    manifest lists that are missing or cut short, else the first rank's error."""
    missing, short = [], []
    for name, info in sorted((manifest.get("files") or {}).items()):
        fp = os.path.join(path, name)
        if not os.path.exists(fp):
            missing.append(name)
        elif isinstance(info, dict) and os.path.getsize(fp) != info.get("bytes"):
            short.append(f"{name} ({os.path.getsize(fp)} of {info.get('bytes')} bytes)")
    if missing or short:
        return CheckpointError(f"checkpoint {path!r} is incomplete: " + "; ".join(
            ([f"missing {', '.join(missing[:8])}"] if missing else []) + ([f"truncated {', '.join(short[:8])}"]
                                                                          if short else []))
            + ". Load an earlier checkpoint (latest_checkpoint(root) skips damaged ones)")
    root = e
    if isinstance(e, CheckpointException):
        first = next(iter(e.failures.values()), None)
        root = first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) else e
    text = (str(root).strip().splitlines() or [type(root).__name__])[0][:300]
    return CheckpointError(f"reading checkpoint {path!r} failed: {type(root).__name__}: {text}; verify it with "
                           "verify_checkpoint(path) or load an earlier one")


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
    check_manifest(path, read_manifest(path))
    manifest = verify_checkpoint(path, verify, collective=False)
    md = _metadata(path, manifest)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()
          if k.startswith("model.") and hasattr(m, "size")}
    try:
        _load_no_dist(sd, SafeFileSystemReader(path), DefaultLoadPlanner(allow_partial_load=True))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        raise _read_error(path, manifest, e) from None
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
