"""Replay a meta model's own initialization on real tensors, one full tensor at a time,
keeping only the pieces this rank needs.

A model built under `torch.device("meta")` has shapes and no values. One process building
it on the CPU with seed s draws its values in a fixed order: every module's
`reset_parameters()` as the module is constructed (children before the parent that calls
its own reset at the end of `__init__`), then, for a transformers model, `post_init()`'s
`initialize_weights()`. `replay_init` runs that same sequence *on the meta model* under a
`TorchDispatchMode` that shadows each op touching a meta tensor with the same op on a real
CPU tensor: `normal_` on a meta weight becomes `normal_` on a freshly allocated CPU tensor
of the full shape, drawing from the global CPU generator exactly as the one-process build
did; derived buffers (RoPE tables computed with `device=meta` factories) are computed for
real the same way. When more full tensors are alive than `budget_bytes` allows, the oldest
is cut to the wanted pieces (`keep`) and freed; a later in-place op on it restores those
pieces into a fresh full tensor first, which is exact for elementwise ops (the init
functions of torch and transformers are).

What cannot be reproduced is reported, never hidden: parameters that no init step touched
(`untouched`: a module whose `reset_parameters` is not called by its constructor, or a raw
`nn.Parameter(torch.randn(...))` drawn in a constructor) and parameters revisited by a
non-elementwise op after being cut (`inexact`).

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from autopar.runtime._torch_compat import TorchDispatchMode, pytree

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)

_FACTORY_DEVICE_KW = "device"


def _cut(t: torch.Tensor, region: Region) -> torch.Tensor:
    offset, shape = region
    idx = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return t[idx].clone() if idx else t.clone()


@dataclasses.dataclass
class _Real:
    """The real full tensor behind a model tensor, while it is alive."""

    name: str
    tensor: torch.Tensor


class _Shadow(TorchDispatchMode):
    """Runs every op on meta tensors twice: on meta (what the caller sees) and on the real CPU
    counterparts (what the values are)."""

    def __init__(self, owned: Mapping[int, str], keep: Mapping[str, Sequence[Region]], budget_bytes: int,
                 elementwise: Callable[[Any], bool], only_kept: bool = False,
                 init_dtype: torch.dtype | None = None):
        super().__init__()
        self.init_dtype = init_dtype          # floating tensors are initialized in this dtype
        self.only_kept = only_kept            # tensors not in `keep` are left alone (no values drawn)
        self.owned = dict(owned)              # id(meta tensor of the model) -> name
        self.keep = keep                      # name -> regions this rank keeps
        self.budget = budget_bytes
        self.elementwise = elementwise
        self.live: OrderedDict[int, _Real] = OrderedDict()   # model tensors with a full real tensor
        self.pieces: dict[str, list[torch.Tensor]] = {}      # name -> kept pieces (after a cut)
        self.touched: set[str] = set()
        self.inexact: set[str] = set()
        self.temps: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(meta temp) -> real
        self.views: dict[int, int] = {}  # id(meta temp) -> key of the model tensor it views

    # --- model tensors ------------------------------------------------------------------
    def _live_bytes(self) -> int:
        return sum(r.tensor.numel() * r.tensor.element_size() for r in self.live.values())

    def _evict_to_budget(self, protect: set[int]) -> None:
        protect = protect | {owner for k, owner in self.views.items() if k in self.temps}
        while self._live_bytes() > self.budget:
            victim = next((k for k in self.live if k not in protect), None)
            if victim is None:
                return
            self._cut(victim)

    def _cut(self, key: int) -> None:
        r = self.live.pop(key)
        self.pieces[r.name] = [_cut(r.tensor, reg) for reg in self.keep.get(r.name, ())]

    def _real_of_owned(self, t: torch.Tensor, func) -> torch.Tensor:
        key = id(t)
        name = self.owned[key]
        if key in self.live:
            self.live.move_to_end(key)
            return self.live[key].tensor
        dt = self.init_dtype if self.init_dtype is not None and t.is_floating_point() else t.dtype
        full = torch.empty(t.shape, dtype=dt, device="cpu")
        if name in self.pieces:  # revisited after a cut: restore what this rank keeps
            if not self.elementwise(func):
                self.inexact.add(name)
            for (offset, shape), piece in zip(self.keep.get(name, ()), self.pieces.pop(name)):
                full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].copy_(piece)
        self.live[key] = _Real(name, full)
        return full

    def real(self, t: Any, func) -> Any:
        """The real counterpart of `t` (a non-meta value passes through); None when unknown."""
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        if id(t) in self.owned:
            if self.only_kept and self.owned[id(t)] not in self.keep:
                return None
            self.touched.add(self.owned[id(t)])
            return self._real_of_owned(t, func)
        hit = self.temps.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return None

    def _remember(self, meta_out: Any, real_out: Any) -> None:
        if isinstance(meta_out, torch.Tensor) and meta_out.is_meta and isinstance(real_out, torch.Tensor):
            if id(meta_out) in self.owned:
                return
            key = id(meta_out)
            self.temps[key] = (weakref.ref(meta_out, lambda _r, k=key: self._forget(k)), real_out)
            base = real_out.untyped_storage().data_ptr() if real_out.numel() else None
            owner = next((k for k, r in self.live.items() if base and r.tensor.untyped_storage().data_ptr() == base), None)
            if owner is not None:  # a view of a model tensor: that tensor stays whole while the view lives
                self.views[key] = owner
        elif isinstance(meta_out, (tuple, list)) and isinstance(real_out, (tuple, list)):
            for m, r in zip(meta_out, real_out):
                self._remember(m, r)

    def _forget(self, key: int) -> None:
        self.temps.pop(key, None)
        self.views.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_meta: list[torch.Tensor] = []
        pytree.tree_map(lambda x: flat_meta.append(x) if isinstance(x, torch.Tensor) and x.is_meta else None,
                        (args, kwargs))
        factory_on_meta = not flat_meta and str(kwargs.get(_FACTORY_DEVICE_KW, "")) == "meta"
        if not flat_meta and not factory_on_meta:
            return out
        unknown = False

        def sub(x):
            nonlocal unknown
            if isinstance(x, torch.Tensor):
                r = self.real(x, func)
                if r is None:
                    unknown = True
                return r
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x

        rargs = pytree.tree_map(sub, args)
        rkwargs = pytree.tree_map(sub, kwargs)
        if _FACTORY_DEVICE_KW in rkwargs and str(rkwargs[_FACTORY_DEVICE_KW]) == "meta":
            rkwargs[_FACTORY_DEVICE_KW] = torch.device("cpu")
        if unknown:  # an input with no real value: its result has none either
            return out
        real_out = func(*rargs, **rkwargs)
        self._remember(out, real_out)
        protect = {id(t) for t in flat_meta if id(t) in self.owned}
        self._evict_to_budget(protect)
        return out

    def finish(self) -> dict[str, list[torch.Tensor]]:
        for key in list(self.live):
            self._cut(key)
        self.temps.clear()
        return self.pieces


_ELEMENTWISE_TAGS = (torch.Tag.pointwise,)
_ELEMENTWISE_EXTRA = {"normal_", "uniform_", "fill_", "zero_", "copy_", "bernoulli_", "exponential_",
                      "random_", "geometric_", "log_normal_", "cauchy_", "clamp_", "erfinv_", "mul_", "add_",
                      "sub_", "div_", "masked_fill_", "abs_", "sign_"}


def _is_elementwise(func) -> bool:
    tags = getattr(func, "tags", ())
    name = getattr(getattr(func, "overloadpacket", None), "__name__", str(func))
    return any(t in tags for t in _ELEMENTWISE_TAGS) or name in _ELEMENTWISE_EXTRA


def _init_steps(model: nn.Module) -> list[tuple[str, Callable[[], Any]]]:
    """The initialization one process runs when it builds `model` on the CPU, in order: a
    post-order walk (a module is finished after its children), where a module's constructor
    calls its own `reset_parameters()` and a transformers `PreTrainedModel` ends with
    `post_init()` -> `initialize_weights()` over its subtree (modules a nested model already
    initialized keep their `_is_hf_initialized` flag and are skipped, as in the real build)."""
    steps: list[tuple[str, Callable[[], Any]]] = []
    pretrained = _pretrained_class()

    def post(prefix: str, m: nn.Module) -> None:
        for n, c in m.named_children():
            post(f"{prefix}.{n}" if prefix else n, c)
        if pretrained is not None and isinstance(m, pretrained):
            steps.append((f"{prefix or '<root>'}.initialize_weights", m.initialize_weights))
        elif callable(getattr(type(m), "reset_parameters", None)):
            steps.append((f"{prefix or '<root>'}.reset_parameters", m.reset_parameters))

    post("", model)
    if pretrained is not None and any(isinstance(m, pretrained) for m in model.modules()):
        def clear_flags() -> None:  # a meta build skipped initialization but may have set flags
            for m in model.modules():
                m.__dict__.pop("_is_hf_initialized", None)
            for t in list(model.parameters()) + list(model.buffers()):
                t.__dict__.pop("_is_hf_initialized", None)
        steps.insert(0, ("clear _is_hf_initialized", clear_flags))
    return steps


def _pretrained_class():
    import sys  # noqa: PLC0415

    if "transformers" not in sys.modules:  # a transformers model means transformers is imported
        return None
    try:
        from transformers import PreTrainedModel  # noqa: PLC0415
    except ImportError:
        return None
    return PreTrainedModel


_DRAWS = re.compile(r"\btorch\.(randn|rand|randint|randperm|normal|bernoulli|multinomial)\(|"
                    r"\.(normal_|uniform_|trunc_normal_|kaiming_normal_|kaiming_uniform_|xavier_normal_|"
                    r"xavier_uniform_|orthogonal_|sparse_|random_|bernoulli_|exponential_|geometric_|cauchy_|"
                    r"log_normal_)\(|\b_reset_parameters\(")


def constructor_draws(model: nn.Module) -> list[str]:
    """Module classes of `model` whose constructor draws random numbers itself rather than
    through `reset_parameters()` (`nn.Parameter(torch.randn(...))`, `nn.init.normal_(...)`
    in `__init__`): a replay cannot redo those draws, so the RNG stream of a CPU build, and
    every value drawn after them, is not reproduced. Read from the constructors' source."""
    import inspect  # noqa: PLC0415

    out = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        init = cls.__dict__.get("__init__")
        if init is None or cls.__module__.startswith("torch.nn."):
            continue  # torch's own modules draw only through reset_parameters
        try:
            src = inspect.getsource(init)
        except (OSError, TypeError):
            continue
        code = "\n".join(line.split("#", 1)[0] for line in src.splitlines())
        m = _DRAWS.search(code)
        if m:
            out.append(f"{cls.__name__}.__init__ ({m.group(0).strip('.(')})")
    return out


@contextlib.contextmanager
def _untied_while_initializing(model: nn.Module):
    """transformers ties weights (`lm_head.weight` -> `embed_tokens.weight`) only after
    `initialize_weights()` has drawn into both separately; a model built on meta is already
    tied. While replaying, each tie target gets a scratch tensor of its own, so the draws land
    where the real build's did and the tied value is the source's."""
    pretrained = _pretrained_class()
    swapped, scratch = [], []
    for top in model.modules():
        if pretrained is None or not isinstance(top, pretrained):
            continue
        ties = getattr(top, "all_tied_weights_keys", None) or {}
        for target, source in dict(ties).items():
            try:
                t, src = top.get_parameter(target), top.get_parameter(source)
            except AttributeError:
                continue
            if t is not src or not t.is_meta:
                continue
            owner, _, attr = target.rpartition(".")
            mod = top.get_submodule(owner) if owner else top
            swapped.append((mod, attr, t))
            mod._parameters[attr] = nn.Parameter(torch.empty_like(t), requires_grad=t.requires_grad)
            scratch.append((target, mod._parameters[attr]))
    try:
        yield scratch
    finally:
        for mod, attr, t in swapped:
            mod._parameters[attr] = t


@dataclasses.dataclass
class InitResult:
    pieces: dict[str, list[torch.Tensor]]   # name -> the kept pieces, in the order of keep[name]
    untouched: list[str]                    # wanted tensors no init step wrote
    inexact: list[str]                      # revisited by a non-elementwise op after a cut
    steps: list[str]


def replay_init(model: nn.Module, keep: Mapping[str, Sequence[Region]], *, seed: int | None = None,
                budget_bytes: int | None = None, names: Iterable[tuple[str, torch.Tensor]] | None = None,
                only_kept: bool = False, init_dtype: torch.dtype | None = None) -> InitResult:
    """Run `model`'s own initialization (see the module docstring) on its meta tensors and
    return the pieces `keep` names: {name: [(offset, shape), ...]}. The global CPU generator is
    seeded with `seed` (default: `torch.initial_seed()`, the seed of the last manual_seed)
    inside `torch.random.fork_rng`, so the caller's RNG state is left as it was.
    `only_kept`: compute only what `keep` names (buffers, say); other tensors draw nothing.
    `init_dtype`: the dtype floating tensors had while the model was initialized (a model
    built in float32 and cast to float64 afterwards draws float32 numbers); the pieces come
    back in each tensor's own dtype."""
    tensors = list(names) if names is not None else \
        list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    owned: dict[int, str] = {}
    for n, t in tensors:
        if t.is_meta:
            owned.setdefault(id(t), n)
    # aliases (tied weights) share one tensor: keep under the first name
    canon_keep: dict[str, list[Region]] = {}
    for n, t in tensors:
        if id(t) in owned and n in keep:
            canon_keep.setdefault(owned[id(t)], [])
            for r in keep[n]:
                if r not in canon_keep[owned[id(t)]]:
                    canon_keep[owned[id(t)]].append(r)
    largest = max((t.numel() * t.element_size() for _, t in tensors if t.is_meta), default=0)
    budget = budget_bytes if budget_bytes is not None else max(2 * largest, 64 << 20)
    steps = _init_steps(model)
    with torch.random.fork_rng(devices=[]), _untied_while_initializing(model) as scratch:
        for name, t in scratch:  # drawn into, then dropped: the real build's draws happen here too
            owned[id(t)] = f"<untied {name}>"
        shadow = _Shadow(owned, canon_keep, budget, _is_elementwise, only_kept, init_dtype)
        torch.manual_seed(torch.initial_seed() if seed is None else seed)
        with torch.no_grad(), shadow:
            for _, fn in steps:
                fn()
        pieces = shadow.finish()
    by_alias: dict[str, list[torch.Tensor]] = {}
    for n, t in tensors:
        canon = owned.get(id(t))
        if canon is None or n not in keep:
            continue
        got = dict(zip(map(tuple, canon_keep.get(canon, [])), pieces.get(canon, [])))
        # never written by any init step: zeros (the same on every rank; the caller warns)
        by_alias[n] = [got[tuple(r)].to(t.dtype) if tuple(r) in got else torch.zeros(r[1], dtype=t.dtype)
                       for r in keep[n]]
    untouched = sorted({n for n, t in tensors if id(t) in owned and owned[id(t)] not in shadow.touched and n in keep})
    return InitResult(by_alias, untouched, sorted(shadow.inexact), [s for s, _ in steps])
