"""Opening and checking a weight source: where a model built on `meta` gets its values.

    src = WeightSource("hf_dir/")                       # or a .safetensors file, an autopar.save
    src.check(expected, aliases=tied, expected_config={"model_type": "llama"})   # one ValueError
    piece = src.read("lm_head.weight", offset=(64, 0), shape=(64, 512), dtype=torch.bfloat16)

A source is a single `.safetensors` file, a Hugging Face checkpoint directory (config.json +
model.safetensors, or shards + `model.safetensors.index.json`, whose weight_map is used), a
directory written by `autopar.save` (DCP; recognised by its `autopar_manifest.json`), a
mapping name -> tensor, or a `.pt`/`.bin` file. `WeightSource` extends the runtime's
`StateSource` (runtime/checkpoint_files.py), so it also goes wherever a StateSource does
(`import_state`).

Guarantees: opening reads headers and metadata only, and refuses truncated or corrupt
safetensors files, an index naming a missing shard and an unreadable directory (naming the
path); `read` reads only the requested slice (safetensors `get_slice`; DCP through its own
load with a planner that asks for exactly that chunk), converting the dtype on the fly;
`check` raises one ValueError listing every mismatch before anything is filled.

It reads and writes no `node.meta` keys; it imports only runtime/.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autopar.runtime.checkpoint_files import (MANIFEST, SafeFileSystemReader, StateSource, read_metadata,
                                              verify_checkpoint)

__all__ = ["WeightSource", "DcpTensors", "dtype_kind"]

_LIST = 10  # names shown per kind of problem


def dtype_kind(dtype: torch.dtype) -> str:
    """The family a dtype converts within without losing its meaning: float, complex, int, bool."""
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "int"


class _ReadOnce(SafeFileSystemReader):
    """The allow-list DCP reader, reading `.metadata` once for many single-tensor loads."""

    def __init__(self, path: str, metadata: Any):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _ChunkPlanner(DefaultLoadPlanner):
    """Plans the reads of one chunk (`offset`, `out.shape`) of one DCP key into `out`; DCP
    copies (and casts) each overlapping saved piece straight into it."""

    def __init__(self, key: str, offset: Sequence[int], out: torch.Tensor):
        super().__init__(allow_partial_load=True)
        self._key, self._offset, self._out = key, tuple(offset), out

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata[self._key]
        chunk = ChunkStorageMetadata(offsets=torch.Size(self._offset), sizes=self._out.shape)
        return LoadPlan(create_read_items_for_chunk_list(self._key, md, [chunk]))

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        return self._out  # read items' dest offsets are relative to the requested chunk


class DcpTensors:
    """The model tensors of an autopar checkpoint directory (`model.<name>` keys of DCP), read
    one chunk at a time. `verify`: "size" (the default: catches truncation cheaply), "full"
    (SHA-256 of every file) or "none"."""

    def __init__(self, path: str, verify: str = "size"):
        self.path = path
        self.manifest = verify_checkpoint(path, verify, collective=False)
        md = read_metadata(path)
        self.tensors: dict[str, TensorStorageMetadata] = {
            k[len("model."):]: m for k, m in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        self._reader = _ReadOnce(path, md)

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int], dtype: torch.dtype | None = None
             ) -> torch.Tensor:
        m = self.tensors[name]
        out = torch.empty(tuple(shape), dtype=dtype or m.properties.dtype)
        if out.numel() == 0:
            return out
        key = f"model.{name}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
            dcp.load({key: out}, storage_reader=self._reader, planner=_ChunkPlanner(key, offset, out), no_dist=True)
        return out


class WeightSource(StateSource):
    """A weight source, opened and checked (see the module docstring for the kinds).

    `names()`, `name in src`, `shape(name)`, `dtype(name)` come from headers and metadata;
    `read(name, offset, shape, dtype=None)` reads that slice only; `check(expected, ...)`
    compares the whole source with what the model expects. `config` is the directory's
    config.json (a dict) or None; `kind` is "safetensors", "hf", "dcp", "mapping" or "torch"."""

    def __init__(self, source: Any, *, verify: str = "size"):
        self.config: dict | None = None
        self._dcp: DcpTensors | None = None
        if isinstance(source, Mapping):
            super().__init__(source)
            self.kind = "mapping"
            return
        path = os.path.abspath(os.fspath(source))
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST)):
            super().__init__({})
            self.path, self.kind = path, "dcp"
            self._dcp = DcpTensors(path, verify)
        else:
            super().__init__(path)
            self.kind = "hf" if os.path.isdir(path) else "safetensors" if self._map is None else "torch"
        if os.path.isdir(path):
            self.config = _read_config(path)

    def __repr__(self) -> str:
        return f"WeightSource({self.kind}: {self.path or 'mapping'}, {len(self.names())} tensors)"

    # --- what the source holds ----------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._dcp.tensors) if self._dcp is not None else super().names()

    def __contains__(self, name: str) -> bool:
        return name in self._dcp.tensors if self._dcp is not None else super().__contains__(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._dcp is not None:
            return tuple(self._dcp.tensors[name].size)
        return super().shape(name)

    def dtype(self, name: str) -> torch.dtype:
        if self._dcp is not None:
            return self._dcp.tensors[name].properties.dtype
        return super().dtype(name)

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int], dtype: torch.dtype | None = None
             ) -> torch.Tensor:
        if self._dcp is None:
            return super().read(name, offset, shape, dtype)
        full = self.shape(name)
        if len(offset) != len(full) or len(shape) != len(full) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(offset, shape, full)):
            raise ValueError(f"cannot read a piece of shape {tuple(shape)} at offset {tuple(offset)} of {name!r}, "
                             f"whose shape is {full}")
        return self._dcp.read(name, offset, shape, dtype)

    # --- does it fit the model ----------------------------------------------------------------
    def resolve(self, expected: Iterable[str], aliases: Iterable[Sequence[str]] = ()) -> dict[str, str | None]:
        """Expected name -> the name the source holds it under (itself, else the first of its
        aliases the source has; tied weights are saved under one name), None when absent."""
        groups = _alias_map(aliases)
        return {n: next((c for c in [n, *groups.get(n, ())] if c in self), None) for n in expected}

    def check(self, expected: Mapping[str, tuple[Sequence[int], torch.dtype]], *,
              aliases: Iterable[Sequence[str]] = (), expected_config: Mapping[str, Any] | None = None,
              allow_unexpected: bool = False) -> dict[str, str]:
        """Raise one ValueError naming every way the source does not fit `expected` (name ->
        (shape, dtype) of the model's parameters and persistent buffers): missing and
        unexpected tensors, shape mismatches (both shapes), dtypes that do not convert (an
        integer tensor for a float parameter), and a config.json whose model_type or
        architectures differ from `expected_config`'s. `aliases`: groups of names that are one
        tensor (tied weights): any of them satisfies the others, and none is unexpected.
        Returns expected name -> source name."""
        aliases = [tuple(g) for g in aliases]
        found = self.resolve(expected, aliases)
        problems: list[str] = []
        bad_config = self._config_problem(expected_config)
        if bad_config:
            problems.append(bad_config)
        missing = [n for n, s in found.items() if s is None]
        if missing:
            problems.append(f"missing {len(missing)} tensors: {_few(missing)}")
        covered = set(expected) | {n for g in aliases for n in g if set(g) & set(expected)}
        unexpected = [n for n in self.names() if n not in covered]
        if unexpected and not allow_unexpected:
            problems.append(f"unexpected {len(unexpected)} tensors the model does not have: {_few(unexpected)}")
        shapes, kinds = [], []
        for n, s in found.items():
            if s is None:
                continue
            want_shape, want_dtype = expected[n]
            if self.shape(s) != tuple(want_shape):
                shapes.append(f"{_as(n, s)} is {list(self.shape(s))} in the source but {list(want_shape)} in the model")
            if dtype_kind(self.dtype(s)) != dtype_kind(want_dtype):
                kinds.append(f"{_as(n, s)} is {_dt(self.dtype(s))} in the source but the model's is {_dt(want_dtype)}")
        if shapes:
            problems.append(f"{len(shapes)} shape mismatches: " + "; ".join(shapes[:_LIST]) + _more(shapes))
        if kinds:
            problems.append(f"{len(kinds)} dtypes that do not convert: " + "; ".join(kinds[:_LIST]) + _more(kinds))
        if problems:
            raise ValueError(f"the weights in {self.path or 'the given mapping'} do not fit the model ("
                             f"{len(expected)} tensors expected, {len(self.names())} in the source): "
                             + " | ".join(problems) + ". Give this model's own checkpoint (or rename the source's "
                             "keys to the model's state-dict names)")
        return {n: s for n, s in found.items() if s is not None}

    def _config_problem(self, expected_config: Mapping[str, Any] | None) -> str | None:
        if not expected_config or self.config is None:
            return None
        bad = []
        want, have = expected_config.get("model_type"), self.config.get("model_type")
        if want and have and want != have:
            bad.append(f"model_type {have!r} (the model is {want!r})")
        want, have = expected_config.get("architectures"), self.config.get("architectures")
        if want and have and not set(want) & set(have):
            bad.append(f"architectures {list(have)} (the model is {list(want)})")
        if not bad:
            return None
        return "its config.json is of another model: " + ", ".join(bad)


def _read_config(path: str) -> dict | None:
    fp = os.path.join(path, "config.json")
    if not os.path.isfile(fp):
        return None
    try:
        with open(fp) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{fp!r} is not readable JSON ({e}); fix or remove it") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{fp!r} holds a JSON {type(cfg).__name__}, not a config object")
    return cfg


def _alias_map(aliases: Iterable[Sequence[str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for g in aliases:
        for n in g:
            out.setdefault(n, []).extend(m for m in g if m != n and m not in out[n])
    return out


def _as(name: str, source_name: str) -> str:
    return repr(name) if name == source_name else f"{name!r} (as {source_name!r})"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _few(names: Sequence[str]) -> str:
    return str(list(names[:_LIST])) + _more(names)


def _more(items: Sequence[Any]) -> str:
    return f" and {len(items) - _LIST} more" if len(items) > _LIST else ""
