"""The on-disk side of autopar checkpoints (runtime/checkpoint.py writes and reads them).

A checkpoint is a directory: DCP's files (`.metadata`, `__<rank>_<n>.distcp`), `plan.json`,
and `autopar_manifest.json` — format, step, user `extra`, mesh, layouts, optimizer
hyper-parameters and non-tensor state, loss scaler, and the size and SHA-256 of every file.
Each rank hashes the files it wrote; rank 0 writes the manifest (fsync'd) into the hidden
temporary directory and only then renames it into place, so a directory with a manifest is
complete, and a crash leaves at most a hidden `.<name>.tmp-<token>` directory.

Reading trusts nothing it has not checked: `verify_checkpoint` compares sizes (truncation)
and hashes (corruption) with the manifest before DCP reads anything, splitting the hashing
over the ranks; DCP's `.metadata` is a pickle and is read by `SafeFileSystemReader`, whose
unpickler builds only DCP's metadata classes, torch sizes and dtypes (tensors themselves are
read by DCP with `torch.load(weights_only=True)`); plain state dicts are read from
safetensors (`get_slice`: only the requested piece) or `torch.load(weights_only=True,
mmap=True)` (`StateSource`), and written atomically (`write_state_dict`).

The coordination helpers (`ckpt_group`, `all_gather_object`, `agree`) run over one gloo
group of the whole job that only checkpoints use, so a save on a background thread never
interleaves with the training's collectives.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import uuid
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from .mesh import host_group

FORMAT = "autopar-checkpoint/1"
MANIFEST = "autopar_manifest.json"
PLAN_FILE = "plan.json"
_HASH_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, truncated, corrupted or incompatible."""


# --- the checkpoint group ------------------------------------------------------------------------
def ckpt_group(timeout_s: float | None = None):
    """The gloo group DCP talks over (a host group of its own, so a background save never
    interleaves with the training's collectives)."""
    return host_group("checkpoint", timeout_s)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather_object(obj):
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=ckpt_group())  # our own processes' plain data, in memory
    return out


def agree(obj):
    """Rank 0's `obj` on every rank (collective over the checkpoint group; plain data)."""
    return all_gather_object(obj)[0]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_HASH_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def swap_into_place(tmp: str, path: str, token: str) -> None:
    """Rename the finished directory `tmp` to `path`. A directory already at `path` is moved
    aside first, put back if the rename fails, and removed only once the new one is in place,
    so `path` always names a complete directory."""
    old = None
    if os.path.lexists(path):
        old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{token}")
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)
        raise
    fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- safe metadata ----------------------------------------------------------------------------
_META_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE = {(_META_MODULE, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                     "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                     "StorageMeta", "_MEM_FORMAT_ENCODING")}
_SAFE |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
          ("torch", "Size"), ("collections", "OrderedDict")}
_SAFE |= {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch sizes and dtypes, and nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"the checkpoint's .metadata asks to build {module}.{name}, which is not DCP "
                              "metadata; refusing to unpickle it (a checkpoint holds tensors and DCP's "
                              "metadata only)")


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` is read by an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = os.path.join(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            data = f.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
            raise CheckpointError(f"{path} is not readable DCP metadata ({type(e).__name__}: {e})") from None
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str):
    """DCP's metadata of the checkpoint at `path` (read safely)."""
    return SafeFileSystemReader(path).read_metadata()


# --- verification and discovery ---------------------------------------------------------------
def read_manifest(path: str) -> dict:
    mp = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"there is no checkpoint directory at {path!r}")
    if not os.path.exists(mp):
        raise CheckpointError(f"{path!r} is not a complete autopar checkpoint: {MANIFEST} is missing (a save that "
                              "did not finish leaves none); load an earlier one, e.g. latest_checkpoint(root)")
    try:
        with open(mp) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mp} is damaged ({e}); load an earlier checkpoint") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{mp} has format {m.get('format') if isinstance(m, dict) else '?'!r}, expected "
                              f"{FORMAT!r}; it was not written by this version of autopar")
    return m


def _file_problems(path: str, manifest: dict, names: Iterable[str], hashes: bool) -> list[str]:
    bad = []
    for rel in names:
        want = manifest["files"][rel]
        fp = os.path.join(path, rel)
        if not os.path.exists(fp):
            bad.append(f"{rel}: missing")
            continue
        size = os.path.getsize(fp)
        if size != want["bytes"]:
            bad.append(f"{rel}: truncated or overwritten ({size} bytes, the manifest says {want['bytes']})")
            continue
        if hashes and sha256(fp) != want["sha256"]:
            bad.append(f"{rel}: corrupted (SHA-256 differs from the manifest)")
    return bad


def verify_checkpoint(path: str, level: str = "full", *, collective: bool = True) -> dict:
    """Check the checkpoint at `path` and return its manifest; CheckpointError naming every bad
    file otherwise. `level`: "full" (sizes and SHA-256; the files are split over the ranks
    when `collective` and torch.distributed is running), "size" (sizes only, catches
    truncation), "none" (the manifest only)."""
    if level not in ("full", "size", "none"):
        raise ValueError(f"verify must be 'full', 'size' or 'none', got {level!r}")
    m = read_manifest(path)
    if level == "none":
        return m
    files = sorted(m.get("files", {}))
    if ".metadata" not in files:
        raise CheckpointError(f"{path!r}: the manifest lists no .metadata; the checkpoint is incomplete")
    spread = collective and dist.is_initialized() and dist.get_world_size() > 1
    mine = files[rank()::world()] if spread else files
    bad = _file_problems(path, m, mine, level == "full")
    if spread:
        bad = sorted(b for part in all_gather_object(bad) for b in part)
    if bad:
        raise CheckpointError(f"checkpoint {path!r} is damaged; refusing to load it: " + "; ".join(bad[:8])
                              + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else "")
                              + ". Load an earlier checkpoint (latest_checkpoint(root) skips damaged ones)")
    return m


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoint directories under `root` that have a manifest, oldest
    first; hidden (temporary) directories are skipped."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        p = os.path.join(root, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(p, MANIFEST)):
            continue
        try:
            step = read_manifest(p).get("step")
        except CheckpointError:
            step = None
        out.append((step if isinstance(step, int) else -1, p))
    return sorted(out)


def latest_checkpoint(root: str, verify: str = "size") -> str | None:
    """The newest checkpoint under `root` (by step, then name) that passes `verify`; None if
    there is none. Local (no collective): every rank sees the same files and answers alike."""
    for _step, p in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(p, verify, collective=False)
            return p
        except CheckpointError:
            continue
    return None


def write_state_dict(sd: Mapping[str, torch.Tensor], path: str, metadata: Mapping[str, str] | None = None) -> str:
    """Write a plain state dict atomically: safetensors for a `.safetensors` path, else
    torch.save (loadable with torch.load(weights_only=True)). Tied entries are stored as
    separate copies (safetensors refuses shared storage)."""
    path = os.path.abspath(str(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    seen, plain = set(), {}
    for k, v in sd.items():
        t = v.detach().to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        plain[k] = t.clone() if ptr in seen else t
        if ptr is not None:
            seen.add(ptr)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(plain, tmp, metadata={"format": "pt", **dict(metadata or {})})
    else:
        torch.save(plain, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


# --- plain state dicts: safetensors files read slice by slice ----------------------------------
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}  # safetensors' dtype names (the format's spec) -> torch
_MAX_HEADER = 100_000_000  # safetensors refuses larger headers too


def read_safetensors_header(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of the safetensors file at `path`, from its header alone, after
    checking that the file holds every byte the header names: ValueError naming the file when
    it is truncated, has trailing bytes, or its header is not valid safetensors."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            raw = f.read(n) if 0 <= n <= min(size - 8, _MAX_HEADER) else b""
    except OSError as e:
        raise OSError(e.errno, f"cannot read the safetensors file {path!r}: {e.strerror}", path) from None
    if n < 0 or n > size - 8:
        raise ValueError(f"{path!r} is truncated: {size} bytes, too few for the safetensors header its first 8 bytes "
                         "announce; the file was cut short (an interrupted download or copy): fetch or save it again")
    if n > _MAX_HEADER:
        raise ValueError(f"{path!r} announces a {n}-byte header (safetensors allows {_MAX_HEADER}); it is damaged or "
                         "not a safetensors file")
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        out, end = {}, 0
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(e["dtype"])
            if dtype is None:
                raise ValueError(f"{name!r} has dtype {e['dtype']!r}, which torch cannot hold")
            shape = tuple(int(d) for d in e["shape"])
            begin, stop = (int(o) for o in e["data_offsets"])
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            if stop - begin != nbytes or begin < 0:
                raise ValueError(f"{name!r} spans bytes [{begin}, {stop}) but shape {list(shape)} of {e['dtype']} "
                                 f"takes {nbytes}")
            out[name], end = (shape, dtype), max(end, stop)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path!r} has a corrupt safetensors header ({type(e).__name__}: {e}); the file is damaged: "
                         "fetch or save it again") from None
    want = 8 + n + end
    if size < want:
        raise ValueError(f"{path!r} is truncated: {size} bytes, but its header places tensor data up to byte {want}; "
                         "the file was cut short (an interrupted download or copy): fetch or save it again")
    if size > want:
        raise ValueError(f"{path!r} has {size - want} bytes after the last tensor its header names ({size} bytes, "
                         f"{want} expected); it was overwritten or appended to: fetch or save it again")
    return out


class StateSource:
    """A plain state dict to import from, read piece by piece: a mapping name -> tensor, a
    `.safetensors` file, a directory of them (transformers' checkpoints: when a
    `*.safetensors.index.json` is there, its weight_map says which file holds which tensor),
    or a `.pt`/`.bin` file (memory-mapped, weights_only). Safetensors files are checked
    against their headers when opened (truncation, corruption: ValueError naming the file);
    only the requested slices are read, through safetensors' `get_slice`."""

    def __init__(self, source: Any):
        self._map: Mapping[str, Any] | None = None
        self._files: dict[str, str] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._handles: dict[str, Any] = {}
        self.path: str | None = None
        if isinstance(source, Mapping):
            self._map = source
            return
        path = self.path = os.path.abspath(os.fspath(source))
        if os.path.isdir(path):
            self._open_dir(path)
        elif path.endswith(".safetensors") and os.path.isfile(path):
            self._add_file(path, None)
        elif os.path.isfile(path):
            self._map = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            raise ValueError(f"there is no state dict at {path!r}")

    def _open_dir(self, path: str) -> None:
        try:
            listing = sorted(os.listdir(path))
        except OSError as e:
            raise OSError(e.errno, f"cannot read the weights directory {path!r}: {e.strerror}", path) from None
        indexes = [f for f in listing if f.endswith(".safetensors.index.json")]
        if len(indexes) > 1 and "model.safetensors.index.json" in indexes:
            indexes = ["model.safetensors.index.json"]
        if len(indexes) > 1:
            raise ValueError(f"{path!r} has several safetensors indexes {indexes}; give the one to read by moving "
                             "the others away")
        if indexes:
            index = os.path.join(path, indexes[0])
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                by_file: dict[str, list[str]] = {}
                for name, rel in weight_map.items():
                    by_file.setdefault(str(rel), []).append(str(name))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{index!r} is not a readable safetensors index ({type(e).__name__}: {e})") from None
            for rel, names in sorted(by_file.items()):
                fp = os.path.join(path, rel)
                if not os.path.isfile(fp):
                    raise ValueError(f"{index!r} maps {len(names)} tensors (e.g. {names[0]!r}) to the shard {rel!r}, "
                                     f"but {fp!r} does not exist; the checkpoint is incomplete: copy the missing shard")
                self._add_file(fp, names, index)
            return
        shards = [f for f in listing if f.endswith(".safetensors")]
        if not shards:
            raise ValueError(f"{path!r} has no .safetensors files; give a file, a directory of safetensors "
                             "shards, or a state dict")
        for f in shards:
            self._add_file(os.path.join(path, f), None)

    def _add_file(self, fp: str, names: Sequence[str] | None, index: str | None = None) -> None:
        header = read_safetensors_header(fp)
        if names is not None:
            lacking = [n for n in names if n not in header]
            if lacking:
                raise ValueError(f"{index!r} maps {lacking[:5]} to {fp!r}, which does not hold them; the index and "
                                 "the shards are from different saves")
        for name in (names if names is not None else header):
            if name in self._files:
                raise ValueError(f"{name!r} is in both {self._files[name]!r} and {fp!r}; the directory mixes two "
                                 "checkpoints: keep one")
            self._files[name], self._meta[name] = fp, header[name]

    def _open(self, f: str):
        if f not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[f] = safe_open(f, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                raise ValueError(f"safetensors cannot open {f!r}: {e}") from None
        return self._handles[f]

    def names(self) -> list[str]:
        """Every tensor name the source holds."""
        return list(self._map) if self._map is not None else list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._map if self._map is not None else name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        if self._map is not None:
            return tuple(self._map[name].shape)
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        if self._map is not None:
            return self._map[name].dtype
        return self._meta[name][1]

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int], dtype: torch.dtype | None = None
             ) -> torch.Tensor:
        """The piece of `name` at `offset` of size `shape` (a new CPU tensor in `dtype` when
        given; from a mapping without `dtype`, a view of the given tensor)."""
        full = self.shape(name)
        if len(offset) != len(full) or len(shape) != len(full) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(offset, shape, full)):
            raise ValueError(f"cannot read a piece of shape {tuple(shape)} at offset {tuple(offset)} of {name!r}, "
                             f"whose shape is {full}")
        idx = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        if self._map is not None:
            t = self._map[name]
            t = t[idx] if idx else t
        else:
            sl = self._open(self._files[name]).get_slice(name)
            t = sl[idx] if idx else sl[...]
        return t if dtype is None or t.dtype == dtype else t.to(dtype)
