"""Writing a parallelised model back out as a Hugging Face checkpoint, tensor by tensor.

    files = save_pretrained(pmodel, "out/llama-ft", max_shard_size="5GB", dtype=torch.bfloat16)

gives `model.safetensors` (or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`)
and `config.json`, loadable by `transformers.AutoModelForCausalLM.from_pretrained("out/llama-ft")`
and `safetensors.torch.load_file`. Tensors carry the original model's state-dict names and
dtypes; of tied names only the first in state-dict order is written (the one transformers
keeps, e.g. `model.embed_tokens.weight` for a tied `lm_head.weight`); non-persistent buffers
are left out when the original names are known (`like=`, or `global_graph.meta["autopar_state_keys"]`).

How: every rank writes the pieces it holds to a temporary DCP checkpoint beside the target
(runtime/checkpoint_save.py, the same path as `autopar.save`); rank 0 then reads one full
tensor at a time from it (autopar.build.weights.WeightSource: DCP's own reader, one key) and
streams it into safetensors files it writes itself (`write_safetensors`: the format is an
8-byte little-endian header length, a JSON header padded with spaces to 8 bytes, the raw
bytes). Rank 0's peak memory is its shard plus about one full tensor; no rank builds the
whole state dict.

Guarantees: collective (every rank calls it, every rank raises when it fails); atomic: the
files are written into a hidden `.<name>.tmp-<token>` directory beside the target, which
replaces an existing directory only once complete; on any failure (an OSError such as ENOSPC
is re-raised as an OSError naming the target) the previous directory is intact and the
temporary ones are removed.

It reads and writes no `node.meta` keys; it imports only runtime/ and autopar.build.
"""
from __future__ import annotations

import errno as errno_mod
import json
import os
import re
import shutil
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from autopar.build.model_tensors import model_tensors
from autopar.build.weights import WeightSource
from autopar.runtime import checkpoint as ck
from autopar.runtime import checkpoint_files as files
from autopar.runtime.checkpoint_files import SAFETENSORS_DTYPES

__all__ = ["save_pretrained", "write_safetensors", "parse_size", "state_names"]

_ST_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_COPY = 64 << 20  # bytes per write call: a big tensor is written in pieces


def parse_size(size: str | int) -> int:
    """Bytes in `size`: an int, or "5GB" (10^9), "500MiB" (2^20) ... as transformers reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"max_shard_size={size!r} is not a size; give bytes (an int) or e.g. '5GB', '500MiB'")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


# --- the safetensors format, streamed -----------------------------------------------------------
def write_safetensors(path: str, specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
                      read: Callable[[str], torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write the safetensors file `path` holding `specs` (name, shape, dtype), asking `read(name)`
    for one tensor at a time and dropping it once written. The header is written first (it
    needs only shapes and dtypes); data go widest dtype first, so each tensor starts aligned
    to its element size. Returns the bytes written."""
    if sys.byteorder != "little":
        raise OSError(errno_mod.ENOTSUP, "safetensors stores little-endian data; this machine is big-endian", path)
    order = sorted(range(len(specs)), key=lambda i: (-specs[i][2].itemsize, i))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **dict(metadata or {})}}
    at = 0
    for i in order:
        name, shape, dtype = specs[i]
        if dtype not in _ST_NAME:
            raise ValueError(f"{name!r} has dtype {dtype}, which safetensors cannot store")
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        header[name] = {"dtype": _ST_NAME[dtype], "shape": [int(d) for d in shape], "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i in order:
            name, shape, dtype = specs[i]
            t = read(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise AssertionError(f"{name}: read {tuple(t.shape)} {t.dtype}, the header says {tuple(shape)} {dtype}")
            flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            del t
            for s in range(0, flat.numel(), _COPY):
                f.write(memoryview(flat[s:s + _COPY].numpy()))
            del flat
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + at


# --- what to write: names, dtypes ----------------------------------------------------------------
def _check_parallel_model(pmodel: Any) -> None:
    for attr in ("global_graph", "engine", "mesh", "plan"):
        if not hasattr(pmodel, attr):
            raise TypeError(f"expected the model returned by autopar.parallelize, got {type(pmodel).__name__} "
                            f"(it has no {attr!r}); for a plain transformers model call its own save_pretrained")


def state_names(pmodel: Any, like: torch.nn.Module | Mapping[str, Any] | Iterable[str] | None = None) -> list[str]:
    """The names a Hugging Face checkpoint of `pmodel` holds, in state-dict order: the original
    model's state-dict keys (`like`: the model, its state dict or its keys; else those capture
    recorded in `global_graph.meta["autopar_state_keys"]`; else every parameter and buffer of
    the captured graph, non-persistent buffers included), keeping of each group of tied names
    only the first."""
    gm = pmodel.global_graph
    if like is None:
        like = gm.meta.get("autopar_state_keys")
    if like is None:
        keys = list(gm.state_dict(keep_vars=True))
    elif isinstance(like, torch.nn.Module):
        keys = list(like.state_dict(keep_vars=True))
    else:
        keys = list(like.keys() if isinstance(like, Mapping) else like)
    have = dict(gm.named_parameters(remove_duplicate=False))
    have.update(gm.named_buffers(remove_duplicate=False))
    lacking = [k for k in keys if k not in have]
    if lacking:
        raise ValueError(f"the parallelised model has no {lacking[:10]}"
                         + (f" and {len(lacking) - 10} more" if len(lacking) > 10 else "")
                         + "; `like` is not the model that was parallelised")
    seen: set[int] = set()
    out = []
    for k in keys:
        if id(have[k]) not in seen:
            seen.add(id(have[k]))
            out.append(k)
    return out


def _shards(specs: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list]:
    """transformers' rule: fill a shard in order until the next tensor would overflow it; a
    tensor bigger than the limit gets a shard of its own."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(torch.Size(spec[1]).numel()) * spec[2].itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


# --- the collective entry point ------------------------------------------------------------------
def save_pretrained(pmodel: Any, directory: str | os.PathLike, *, max_shard_size: str | int = "5GB",
                    dtype: torch.dtype | None = None, config: Any = None,
                    like: torch.nn.Module | Mapping[str, Any] | Iterable[str] | None = None) -> list[str]:
    """Write `pmodel` (returned by autopar.parallelize) as a Hugging Face checkpoint directory.

    Args:
        directory: the checkpoint directory; an existing one is replaced once the new one is
            complete.
        max_shard_size: bytes per safetensors file (an int, or "5GB", "500MiB" ...).
        dtype: cast floating-point tensors to it (others keep their dtype); default: each
            tensor's dtype in the original model.
        config: written as config.json: a transformers config (`save_pretrained` /
            `to_json_file`) or a dict; default `pmodel.config` when it has one.
        like: the original model (or its state dict, or its keys): write exactly its names.
    Returns the paths written (on every rank). Collective.
    """
    directory = os.path.abspath(os.fspath(directory))
    max_bytes = parse_size(max_shard_size)
    if dtype is not None and dtype not in _ST_NAME:
        raise ValueError(f"dtype={dtype} cannot be stored in safetensors; use one of {sorted(map(str, _ST_NAME))}")
    if config is None:
        config = getattr(pmodel, "config", None)
    if config is not None and not (isinstance(config, Mapping) or hasattr(config, "to_json_file")
                                   or hasattr(config, "save_pretrained")):
        raise ValueError(f"config must be a dict or a transformers config, got {type(config).__name__}")
    _check_parallel_model(pmodel)
    info = model_tensors(pmodel.global_graph, pmodel.plan)
    names = state_names(pmodel, like)
    tensors = dict(pmodel.global_graph.named_parameters(remove_duplicate=False))
    tensors.update(pmodel.global_graph.named_buffers(remove_duplicate=False))
    specs = [(n, tuple(tensors[n].shape), dtype if dtype is not None and tensors[n].is_floating_point()
              else tensors[n].dtype) for n in names]
    parent, base = os.path.split(directory)
    token = files.agree(os.urandom(6).hex() if files.rank() == 0 else None)
    staged = os.path.join(parent, f".{base}.dcp-{token}")
    out_tmp = os.path.join(parent, f".{base}.tmp-{token}")
    try:
        ck.save_checkpoint(staged, pmodel.engine, pmodel.mesh, **info, optimizer=False)
    except Exception:
        if files.rank() == 0:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    written: list[str] = []
    err = None
    if files.rank() == 0:
        try:
            written = _write_directory(staged, out_tmp, directory, specs, info["aliases"], max_bytes, config,
                                       dtype, token)
        except OSError as e:
            err = ("OSError", e.errno, f"{e.strerror or e} ({e.filename})" if e.filename else str(e))
        except Exception as e:  # noqa: BLE001 - reported on every rank
            err = (type(e).__name__, None, str(e))
        finally:
            shutil.rmtree(staged, ignore_errors=True)
            if err is not None:
                shutil.rmtree(out_tmp, ignore_errors=True)
    err, written = files.agree((err, written))
    if err is not None:
        kind, code, msg = err
        text = f"writing the Hugging Face checkpoint {directory!r} failed; what was there is untouched: {msg}"
        if kind == "OSError":
            raise OSError(code, text, directory)
        raise (ValueError if kind == "ValueError" else RuntimeError)(f"{text} ({kind})")
    return written


def _write_directory(staged: str, out_tmp: str, directory: str, specs: list, aliases: Sequence[Sequence[str]],
                     max_bytes: int, config: Any, dtype: torch.dtype | None, token: str) -> list[str]:
    """Rank 0: stream the staged DCP checkpoint into safetensors files in `out_tmp`, then move
    it to `directory` (replacing what was there only now)."""
    src = WeightSource(staged, verify="size")
    # a tied weight may be held under any of its names (a pipeline stage knows one of them)
    found = src.resolve([n for n, _, _ in specs], aliases)
    absent = [n for n, s in found.items() if s is None]
    if absent:
        raise AssertionError(f"the staged checkpoint lacks {absent[:10]} (under every tied name)")
    shards = _shards(specs, max_bytes)
    os.makedirs(out_tmp)
    n = len(shards)
    shapes = {name: shape for name, shape, _ in specs}
    dtypes = {name: dt for name, _, dt in specs}

    def read(name: str) -> torch.Tensor:
        return src.read(found[name], (0,) * len(shapes[name]), shapes[name], dtypes[name])

    rel, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_safetensors(os.path.join(out_tmp, fname), shard, read)
        rel.append(fname)
        for name, shape, dt in shard:
            weight_map[name] = fname
            total += int(torch.Size(shape).numel()) * dt.itemsize
    if n > 1:
        index = {"metadata": {"total_size": total,
                              "total_parameters": sum(int(torch.Size(s).numel()) for _, s, _ in specs)},
                 "weight_map": dict(sorted(weight_map.items()))}
        files.write_json(os.path.join(out_tmp, "model.safetensors.index.json"), index)
        rel.append("model.safetensors.index.json")
    if config is not None:
        _write_config(config, out_tmp, dtype)
        rel.append("config.json")
    files.fsync_dir(out_tmp)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{directory!r} exists and is not a directory; give a directory path")
    files.swap_into_place(out_tmp, directory, token)
    return [os.path.join(directory, r) for r in rel]


def _write_config(config: Any, out_dir: str, dtype: torch.dtype | None) -> None:
    path = os.path.join(out_dir, "config.json")
    if isinstance(config, Mapping):
        files.write_json(path, dict(config))
    elif hasattr(config, "to_json_file"):
        config.to_json_file(path)
    else:
        config.save_pretrained(out_dir)
    if not os.path.isfile(path):
        raise ValueError(f"{type(config).__name__}.save_pretrained wrote no config.json into {out_dir!r}")
    if dtype is not None:  # the tensors' dtype, as transformers records it
        with open(path) as f:
            cfg = json.load(f)
        name = str(dtype).removeprefix("torch.")
        cfg["dtype"] = name
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = name
        files.write_json(path, cfg)
