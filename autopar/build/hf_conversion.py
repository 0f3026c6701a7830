"""A Hugging Face checkpoint seen under the model's own tensor names, slice by slice.

transformers 5 keeps some weights in memory in another layout than its checkpoints: the MoE
families (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, GLM-MoE ...) store one `experts.<e>.gate_proj`
/ `up_proj` / `down_proj` per expert on disk and fuse them in memory into grouped
`experts.gate_up_proj` (E, 2I, H) and `experts.down_proj` (E, H, I). transformers describes
each model type's conversion as data (`transformers.conversion_mapping`: `WeightRenaming`
regexes, and `WeightConverter`s whose operations are `MergeModulelist(dim)` — stack the
per-expert tensors — and `Concatenate(dim)` — join the source patterns). `converted_source`
reads that description and presents the checkpoint under the in-memory names without ever
building a fused tensor: a slice of a target is composed of the slices of the sources it
overlaps, so each rank still reads only its own rows (an expert-parallel rank reads only its
experts). A conversion with any other operation is refused with a clear error naming it.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .weights import WeightSource


@dataclass(frozen=True)
class _Leaf:
    key: str

    def shape(self, src) -> tuple[int, ...]:
        return tuple(src.shape(self.key))

    def read(self, src, offset, shape, dtype):
        return src.read(self.key, tuple(offset), tuple(shape), dtype)


@dataclass(frozen=True)
class _Join:
    """Parts joined along `dim`: stacked (`stack=True`, each part gains that dim) or concatenated."""

    parts: tuple
    dim: int
    stack: bool

    def _sizes(self, src) -> list[int]:
        return [1 if self.stack else p.shape(src)[self.dim] for p in self.parts]

    def shape(self, src) -> tuple[int, ...]:
        inner = list(self.parts[0].shape(src))
        if self.stack:
            return tuple(inner[:self.dim] + [len(self.parts)] + inner[self.dim:])
        inner[self.dim] = sum(self._sizes(src))
        return tuple(inner)

    def read(self, src, offset, shape, dtype):
        lo, hi = offset[self.dim], offset[self.dim] + shape[self.dim]
        pieces, start = [], 0
        for part, size in zip(self.parts, self._sizes(src)):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                off, shp = list(offset), list(shape)
                if self.stack:
                    del off[self.dim], shp[self.dim]
                    pieces.append(part.read(src, off, shp, dtype).unsqueeze(self.dim))
                else:
                    off[self.dim], shp[self.dim] = a - start, b - a
                    pieces.append(part.read(src, off, shp, dtype))
            start += size
        return torch.cat(pieces, self.dim)


class ConvertedSource(WeightSource):
    """`base` under the in-memory names a transformers conversion mapping gives (see the module
    docstring). Names the mapping does not touch pass through."""

    def __init__(self, base: WeightSource, targets: dict[str, Any]):
        self.__dict__.update(base.__dict__)  # path, kind, config and the readers of the base
        self._base, self._targets = base, targets
        used = {leaf.key for t in targets.values() for leaf in _leaves(t)}
        self._passthrough = [n for n in base.names() if n not in used]

    def __repr__(self) -> str:
        return f"ConvertedSource({self._base!r}, {len(self._targets)} converted tensors)"

    def names(self) -> list[str]:
        return self._passthrough + list(self._targets)

    def __contains__(self, name: str) -> bool:
        return name in self._targets or (name in self._base and name in set(self._passthrough))

    def shape(self, name: str) -> tuple[int, ...]:
        t = self._targets.get(name)
        return t.shape(self._base) if t is not None else self._base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        t = self._targets.get(name)
        return self._base.dtype(_leaves(t)[0].key) if t is not None else self._base.dtype(name)

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int], dtype: torch.dtype | None = None
             ) -> torch.Tensor:
        t = self._targets.get(name)
        if t is None:
            return self._base.read(name, offset, shape, dtype)
        full = t.shape(self._base)
        if not shape:
            return t.read(self._base, (), (), dtype)
        if len(offset) != len(full) or any(o < 0 or o + s > d for o, s, d in zip(offset, shape, full)):
            raise ValueError(f"cannot read a piece of shape {tuple(shape)} at offset {tuple(offset)} of {name!r}, "
                             f"whose shape is {full}")
        return t.read(self._base, list(offset), list(shape), dtype)


def _leaves(t) -> list[_Leaf]:
    return [t] if isinstance(t, _Leaf) else [x for p in t.parts for x in _leaves(p)]


def conversion_for(model: Any) -> list | None:
    """transformers' conversion mapping for `model` (by class name, then model_type), or None."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "model_type", None):
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: PLC0415
    except ImportError:
        return None
    return get_checkpoint_conversion_mapping(type(model).__name__) or get_checkpoint_conversion_mapping(cfg.model_type)


def converted_source(src: WeightSource, mapping: list, expected: Sequence[str]) -> WeightSource:
    """`src` seen under the model's names (`expected`) through `mapping`; `src` itself when the
    checkpoint already uses them (a checkpoint written by autopar.save_pretrained, say)."""
    if not mapping or all(n in src for n in expected):
        return src
    names = list(src.names())
    renamed = {n: n for n in names}
    targets: dict[str, Any] = {}
    for rule in mapping:
        kind = type(rule).__name__
        ops = [type(o).__name__ for o in getattr(rule, "operations", [])]
        if kind == "WeightRenaming":
            for s_pat, t_pat in zip(rule.source_patterns, rule.target_patterns):
                renamed = {re.sub(s_pat, t_pat, k): v for k, v in renamed.items()}
            continue
        if kind != "WeightConverter":
            raise ValueError(f"the checkpoint's conversion to {type(src).__name__} uses {kind}, which autopar "
                             "cannot read slice by slice; convert the checkpoint with transformers first "
                             "(from_pretrained + save_pretrained)")
        unknown = [o for o in ops if o not in ("MergeModulelist", "Concatenate")]
        if unknown:
            raise ValueError(f"the checkpoint's conversion {rule.source_patterns} -> {rule.target_patterns} uses "
                             f"{unknown}, which autopar cannot read slice by slice; convert the checkpoint with "
                             "transformers first (from_pretrained + save_pretrained)")
        merge = next((o.dim for o in rule.operations if type(o).__name__ == "MergeModulelist"), None)
        cat = next((o.dim for o in rule.operations if type(o).__name__ == "Concatenate"), None)
        pats = [re.compile("(.*?)" + re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in rule.source_patterns]
        groups: dict[str, list[dict[int, str]]] = {}
        for new, old in list(renamed.items()):
            for i, pat in enumerate(pats):
                m = pat.match(new)
                if m is None:
                    continue
                prefix = m.group(1)
                expert = int(m.group(2)) if pat.groups > 1 else 0
                groups.setdefault(prefix, [dict() for _ in pats])[i][expert] = old
                del renamed[new]
                break
        for prefix, per_pattern in groups.items():
            parts = []
            for experts in per_pattern:
                leaves = tuple(_Leaf(experts[e]) for e in sorted(experts))
                parts.append(_Join(leaves, merge, stack=True) if merge is not None else leaves[0])
            tgt = prefix + rule.target_patterns[0].lstrip(".") if prefix.endswith(".") or not prefix \
                else prefix + rule.target_patterns[0]
            targets[tgt] = _Join(tuple(parts), cat, stack=False) if cat is not None and len(parts) > 1 else parts[0]
    for new, old in renamed.items():
        if new != old:
            targets[new] = _Leaf(old)
    return ConvertedSource(src, targets)
