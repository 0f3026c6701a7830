"""Fill this rank's program from a weight source, for a model built on the meta device.

`parallelize` builds the per-rank program of a meta model as of any other: the passes cut
meta tensors, and the ZeRO engines allocate, on the mesh's device, only what this rank keeps
(its tensor-parallel pieces, its pipeline stage, its experts; at ZeRO-3 its rows), left
empty. `materialize` then writes the values into exactly those pieces:

  * a weight source (a `.safetensors` file, a Hugging Face checkpoint directory, a `.pt`
    file, a mapping, an autopar checkpoint directory): each rank reads only its slices
    (`runtime.checkpoint_load.import_state`); buffers the source lacks (non-persistent RoPE
    tables, say) are recomputed by the modules' own code (`init_replay`, values only);
  * `ModuleInit(seed)` (the default): the modules' own initialization replayed one full
    tensor at a time, the same values one process gets from `torch.manual_seed(seed)` and
    building the model on the CPU; pieces it cannot reproduce are named in a warning.

Afterwards nothing this rank computes with is on meta: `check_materialized` raises a
ValueError naming any tensor that still is.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.runtime.checkpoint_entries import engines_of, held_pieces, local_chunk
from autopar.runtime.checkpoint_files import StateSource
from autopar.runtime.checkpoint_load import import_state

from .init_replay import Region, constructor_draws, replay_init


@dataclasses.dataclass(frozen=True)
class ModuleInit:
    """Weights from the modules' own initialization (`reset_parameters`, transformers'
    `initialize_weights`), equal to one process's `torch.manual_seed(seed); build()` on the
    CPU. `seed=None`: the seed of the last `torch.manual_seed` (`torch.initial_seed()`).
    `dtype`: the floating dtype the model had while it was initialized, when it was cast
    afterwards (`build().double()`: torch.float32); default: each tensor's own dtype."""

    seed: int | None = None
    dtype: torch.dtype | None = None  # the floating dtype at init (built in float32, then cast: float32)


@dataclasses.dataclass
class MaterializeReport:
    source: str
    loaded: list[str]
    initialized: list[str]
    recomputed_buffers: list[str]
    not_reproduced: list[str]

    def note(self) -> str:
        parts = [f"weights from {self.source}: {len(self.loaded)} tensors read as slices"
                 if self.loaded else f"weights from {self.source}"]
        if self.initialized:
            parts.append(f"{len(self.initialized)} initialized by the modules' own init, one full tensor at a time")
        if self.recomputed_buffers:
            parts.append("recomputed buffers " + ", ".join(self.recomputed_buffers[:6])
                         + (" ..." if len(self.recomputed_buffers) > 6 else ""))
        if self.not_reproduced:
            parts.append("NOT reproduced (see the warning): " + ", ".join(self.not_reproduced[:6]))
        return "; ".join(parts)


def open_weights(weights: Any, model: nn.Module, *, strict: bool = True) -> Any:
    """The weight source `parallelize` fills from, checked against `model` before anything is
    built: a `ModuleInit` stays as it is; anything else opens as a `WeightSource` and (strict)
    must hold every parameter and persistent buffer of `model` with its shape and a dtype
    that converts, and a config.json of the same architecture: one ValueError names every
    problem."""
    if weights is None or isinstance(weights, ModuleInit):
        return weights
    from .weights import WeightSource  # noqa: PLC0415

    src = weights if isinstance(weights, WeightSource) else WeightSource(weights)
    sd = model.state_dict(keep_vars=True)
    if src.kind in ("hf", "safetensors"):  # transformers' on-disk layout (per-expert MoE weights ...)
        from .hf_conversion import conversion_for, converted_source  # noqa: PLC0415

        src = converted_source(src, conversion_for(model), list(sd))
    if strict:
        by_id: dict[int, list[str]] = {}
        for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
            by_id.setdefault(id(t), []).append(n)
        cfg = getattr(model, "config", None)
        expected_config = None
        if cfg is not None and getattr(cfg, "model_type", None):
            expected_config = {"model_type": cfg.model_type, "architectures": [type(model).__name__]}
        expected = {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
        for n, b in model.named_buffers(remove_duplicate=False):  # non-persistent ones: welcome when present
            if n not in expected and n in src:
                expected[n] = (tuple(b.shape), b.dtype)
        src.check(expected,
                  aliases=[g for g in by_id.values() if len(g) > 1], expected_config=expected_config)
    return src


def load_into(model: nn.Module, weights: Any) -> list[str]:
    """Fill a real, one-process `model` from a weight source, checked as `parallelize` checks
    it, one tensor at a time (the reference runs of `autopar verify`). Returns the names filled."""
    src = open_weights(weights, model)
    sd = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for n, t in sd.items():
        by_id.setdefault(id(t), []).append(n)
    found = src.resolve(list(sd), [g for g in by_id.values() if len(g) > 1])
    done = []
    with torch.no_grad():
        for n, t in sd.items():
            if found.get(n) is not None:
                t.copy_(src.read(found[n], (0,) * t.dim(), tuple(t.shape), t.dtype))
                done.append(n)
    return done


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def describe_source(weights: Any) -> str:
    if weights is None or isinstance(weights, ModuleInit):
        seed = getattr(weights, "seed", None)
        return f"the modules' own init (seed {torch.initial_seed() if seed is None else seed})"
    if isinstance(weights, Mapping):
        return f"a state dict of {len(weights)} tensors"
    if isinstance(weights, (str, os.PathLike)):
        return repr(os.fspath(weights))
    path = getattr(weights, "path", None)
    return f"{getattr(weights, 'kind', '')} {path!r}".strip() if path else type(weights).__name__


class _PieceSource(StateSource):
    """The pieces `replay_init` kept, served to `import_state` like any state-dict source."""

    def __init__(self, pieces: Mapping[str, Sequence[torch.Tensor]], regions: Mapping[str, Sequence[Region]],
                 shapes: Mapping[str, Sequence[int]]):
        self._pieces = {n: dict(zip((tuple(map(tuple, r)) for r in regions[n]), ts)) for n, ts in pieces.items()}
        self._shapes = {n: tuple(s) for n, s in shapes.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._pieces

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        return self._pieces[name][(tuple(offset), tuple(shape))]


def _regions(pieces, mesh, coords) -> tuple[dict[str, list[Region]], dict[str, tuple[int, ...]]]:
    regions: dict[str, list[Region]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for names, _t, gshape, cuts in pieces:
        shape, offset = local_chunk(gshape, cuts, mesh.sizes, coords)
        for n in names:
            if (offset, shape) not in regions.setdefault(n, []):
                regions[n].append((offset, shape))
            shapes[n] = tuple(gshape)
    return regions, shapes


def _fill_buffers(pieces, names: set[str], kept: Mapping[str, Sequence[torch.Tensor]],
                  regions: Mapping[str, Sequence[Region]], mesh, coords) -> list[str]:
    done = []
    with torch.no_grad():
        for ns, t, gshape, cuts in pieces:
            n = ns[0]
            if n not in names or n not in kept:
                continue
            shape, offset = local_chunk(gshape, cuts, mesh.sizes, coords)
            by_region = dict(zip((tuple(map(tuple, r)) for r in regions[n]), kept[n]))
            t.copy_(by_region[(offset, shape)].reshape(t.shape))
            done.append(n)
    return done


def materialize(engine, mesh, model: nn.Module, weights: Any, *, layouts: Mapping[str, Any],
                global_shapes: Mapping[str, Sequence[int]], aliases: Sequence[Sequence[str]] = (),
                strict: bool = True) -> MaterializeReport:
    """Write values into every tensor this rank's program holds (see the module docstring).

    Args:
        engine: the program's engine (`program.engine`; a pipeline's has one per stage).
        model: the user's model on meta (its modules' code recomputes buffers and, for
            `ModuleInit`, draws the initial values).
        weights: a source (path, mapping) or a `ModuleInit` (None: `ModuleInit()`).
        layouts, global_shapes, aliases: the plan's parameter layouts, the unsharded shapes
            and the tied-name groups (as `autopar.checkpoint_api` describes a ParallelModel).
    Returns: what was read, initialized and recomputed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    coords = mesh.coords(rank)
    pieces = held_pieces(engine, mesh, layouts, global_shapes)
    regions, shapes = _regions(pieces, mesh, coords)
    buffer_names = {ns[0] for ns, t, _g, _c in pieces if not isinstance(t, nn.Parameter) and _is_buffer(engine, ns[0])}
    report = MaterializeReport(describe_source(weights), [], [], [], [])
    if weights is None or isinstance(weights, ModuleInit):
        res = replay_init(model, regions, seed=getattr(weights, "seed", None), init_dtype=getattr(weights, "dtype", None))
        draws = constructor_draws(model)
        _warn_not_reproduced(res.untouched, res.inexact, draws)
        report.not_reproduced = sorted(set(res.untouched) | set(res.inexact)) + draws
        src = _PieceSource(res.pieces, regions, shapes)
        report.initialized = import_state(engine, mesh, src, layouts=layouts, global_shapes=global_shapes,
                                          aliases=aliases, strict=True)
        report.recomputed_buffers = _fill_buffers(pieces, buffer_names - set(report.initialized), res.pieces,
                                                  regions, mesh, coords)
    else:
        src = weights if isinstance(weights, StateSource) else StateSource(weights)
        report.loaded = import_state(engine, mesh, src, layouts=layouts, global_shapes=global_shapes,
                                     aliases=aliases, strict=strict)
        on_meta = {n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
        missing_buffers = {n for n in buffer_names if n not in report.loaded and n in on_meta}
        if missing_buffers:  # non-persistent buffers (RoPE tables ...): the modules' own code computes them
            want = {n: regions[n] for n in missing_buffers}
            res = replay_init(model, want, only_kept=True)
            report.recomputed_buffers = _fill_buffers(pieces, missing_buffers, res.pieces, regions, mesh, coords)
            lost = sorted(missing_buffers - set(report.recomputed_buffers))
            if lost:
                raise ValueError(f"the buffers {lost[:8]} are neither in {report.source} nor computed by their "
                                 "modules' reset_parameters / initialize_weights; give them in the weights, or "
                                 "build the model on the CPU")
    check_materialized(engine)
    return report


def _is_buffer(engine, name: str) -> bool:
    for e in engines_of(engine):
        try:
            e.module.get_buffer(name)
            return True
        except AttributeError:
            continue
    return False


def _warn_not_reproduced(untouched: Sequence[str], inexact: Sequence[str], draws: Sequence[str] = ()) -> None:
    if draws:
        warnings.warn(f"{list(draws)[:6]} draw random numbers in their constructors, outside reset_parameters: a replay "
                      "on meta cannot redo those draws, so the values are a valid initialization by the modules' own "
                      "init but NOT those of one process building the model on the CPU with the same seed; give "
                      "weights= a checkpoint for bit-equal values", stacklevel=3)
    if untouched:
        warnings.warn(f"no reset_parameters / initialize_weights of the model writes {list(untouched)[:8]}: they are "
                      "zeros, NOT what one process building the model on the CPU would draw (a constructor that "
                      "draws with torch.randn directly cannot be replayed on meta); give weights= a checkpoint, or "
                      "add a reset_parameters that initializes them", stacklevel=3)
    if inexact:
        warnings.warn(f"the initialization of {list(inexact)[:8]} revisits them with a non-elementwise op after other "
                      "tensors were initialized; their values may differ from one process's", stacklevel=3)


def check_materialized(engine) -> None:
    """ValueError naming every tensor of the program still on the meta device."""
    left = []
    for e in engines_of(engine):
        for name, t in list(e.module.named_parameters(remove_duplicate=False)) + \
                list(e.module.named_buffers(remove_duplicate=False)):
            if t is not None and t.is_meta:
                left.append(name)
        for s in e.slots:
            if s.master is not None and s.master.is_meta:
                left.append(f"{s.name} (optimizer master)")
    if left:
        raise ValueError(f"{len(left)} tensors are still on the meta device after loading the weights: {left[:10]}; "
                         "give weights= a source that has them")
