"""Capture an nn.Module as an ATen-level torch.fx graph: autopar's one IR.

Path 1, `torch.export` (non-strict, training IR): high-level ops stay whole (aten.linear,
aten.rms_norm, aten.scaled_dot_product_attention ...), every node carries its module path.
Path 2 when export fails: `fx.symbolic_trace` (honouring `leaf_modules`) then `make_fx`
(pre-dispatch, module stack recorded) of the traced module. Path 3: `make_fx` of the module
itself. The first that works wins; when none does, the error names the module and the op
that broke each path and suggests `leaf_modules=`.

`leaf_modules=["path.to.sub", ...]` turns untraceable submodules into one opaque node each
(`torch.ops.autopar.leaf`), replicated under every plan; their parameters still train.

Capture runs on the device of the example inputs: meta tensors (and a model built under
`torch.device("meta")`) capture a 70B-parameter model in well under 1 GB of RAM.

The result is normalised to one form whatever the path:
  * a `fx.GraphModule` whose placeholders are the flattened example inputs and whose output
    is a flat tuple (pytree specs in `gm.meta["autopar_in_spec"/"autopar_out_spec"]`);
  * parameters and buffers are `get_attr` nodes named as in the original model;
  * every node has `meta["val"]` (fake tensor) and, through `passes.ir`, the annotation
    `meta["autopar"]` (shape, dtype, module path, parameter name).
  * `gm.meta["autopar_capture"]`: which path worked, seconds taken, errors of failed paths,
    and what capture adjusted on the model while tracing ("adjusted": a transformers
    `config.use_cache` is switched off, since a KV cache is for generation and no capture
    path can return it; it is restored afterwards; a mixed-precision capture's dtype), and
    "compute_dtype" when captured with `compute_dtype=`.

Mixed precision (`compute_dtype=torch.bfloat16` for an fp32 model): the graph is the 16-bit
program the engine runs (parameters and inputs cast, buffers not), traced on fake tensors, so a
model's `.to()` / `type_as` casts and their dtype assertions are the 16-bit ones; the graph
still holds the model's own fp32 tensors (the engine makes its masters from them).

Sequence dims (`dynamic_seq=True`): dim 1 of the inputs as long as the first integer (B, T)
input is symbolic; `sequence_refusal(args, kwargs, world)` says when inputs have no sequence
a context-parallel plan could split (images: dim 1 is channels).
"""
from __future__ import annotations

import contextlib
import os
import time
import traceback
import warnings
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from autopar.runtime._torch_compat import lazy_graph_module, pytree
from torch.export import Dim

from autopar import capture_cache
from autopar.passes import ir
from autopar.runtime import leaf as leaf_rt


class CaptureError(RuntimeError):
    """No capture path worked. The message names the module and op for each path."""


def capture(model: nn.Module, example_inputs: Sequence[Any] | Any, *, example_kwargs: dict | None = None,
            leaf_modules: Iterable[str] = (), dynamic_batch: bool = True, dynamic_seq: bool = False,
            dynamic_shapes: Any = None, paths: Sequence[str] = ("export", "symbolic_trace", "make_fx"),
            device: str | torch.device | None = None, compute_dtype: torch.dtype | None = None) -> fx.GraphModule:
    """Capture `model` on `example_inputs` as a normalised ATen-level GraphModule.

    Args:
        model: the module (real, meta or fake parameters).
        example_inputs: a tensor or a tuple of positional inputs.
        example_kwargs: keyword inputs, if the forward takes any.
        leaf_modules: module paths to keep opaque (one node each).
        dynamic_batch: mark dim 0 of every tensor input as dynamic (when export can keep it).
        dynamic_seq: also mark the sequence dim as dynamic: dim 1 of the inputs that share the
            sequence length (the length of dim 1 of the first integer (B, T) input, token ids;
            without one, of the first input of 2 or more dims). Context parallelism runs the
            graph on each rank's chunk of the sequence. `sequence_refusal` says when an input
            set has no sequence to mark.
        dynamic_shapes: passed to torch.export as is (overrides dynamic_batch).
        paths: the capture paths to try, in order.
        device: for a model on the meta device, the device it will run on: the model is traced
            on fake tensors of that device (no memory), so that device-dependent code (a CPU
            branch in transformers' grouped experts, `device=` of factories) is captured as it
            will run. The graph keeps the model's meta tensors. Without it, a meta model is
            traced on meta (enough for planning).
        compute_dtype: capture the program that mixed precision runs (bf16 / fp16 compute with
            masters): every floating parameter, and every floating input, at this dtype; buffers
            as they are. The engine casts exactly these (runtime/zero_engine.py), so the graph's
            casts and dtype assertions (`.to()`, `type_as`: `aten._assert_tensor_metadata`) are
            those of the 16-bit program. Traced on fake tensors (no memory); the graph is bound
            to the model's own tensors, not copies. Inputs keep the caller's dtype as
            placeholders, each cast by a first `aten._to_copy` node, so that a step is fed the
            same batch as the example. `gm.meta["autopar_capture"]["compute_dtype"]` says so.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture needs an nn.Module, got {type(model).__name__}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    on_meta = any(t.is_meta for t in model.parameters())
    cast = compute_dtype is not None and any(p.is_floating_point() and p.dtype != compute_dtype
                                             for p in model.parameters())
    if cast and compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"compute_dtype={compute_dtype}: capture casts to torch.bfloat16, torch.float16 or "
                         "torch.float32 (the dtypes the engine computes in)")
    if (on_meta and device is not None) or cast:
        # capture as it will run: fake tensors of the run's device (a meta model), at the
        # compute dtype (mixed precision); the model's own tensors are put back into the graph
        run_on = torch.device(device) if on_meta and device is not None else None
        with _fake_on(model, run_on, compute_dtype if cast else None) as to_fake:
            try:
                gm = capture(model, pytree.tree_map(to_fake, args), example_kwargs=pytree.tree_map(to_fake, kwargs),
                             leaf_modules=leaf_modules, dynamic_batch=dynamic_batch, dynamic_seq=dynamic_seq,
                             dynamic_shapes=dynamic_shapes, paths=paths)
            except CaptureError as e:
                if not cast:
                    raise
                raise CaptureError(f"at compute_dtype={compute_dtype} (mixed precision runs the model's 16-bit "
                                   f"program, so it is captured at that dtype): {e}") from None
        _restore_meta(gm, model)
        if cast:
            _keep_input_dtypes(gm, (args, kwargs), compute_dtype)
            info = gm.meta.setdefault("autopar_capture", {})
            info["compute_dtype"] = str(compute_dtype).replace("torch.", "")
            info["adjusted"] = list(info.get("adjusted", [])) + [
                f"traced with floating parameters and inputs at {info['compute_dtype']} (mixed precision computes "
                "in it); the graph holds the model's own tensors, which the engine casts"]
            ir.annotate_graph(gm, model)
        return gm
    if on_meta:
        args, kwargs = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    leaf_modules = list(leaf_modules)
    memo_key = None
    if capture_cache.enabled() and not leaf_modules:  # a leaf op names its module instance: never shared
        memo_key, keep = capture_cache.key_of(model, args, kwargs, {
            "leaf_modules": tuple(leaf_modules), "dynamic_batch": dynamic_batch, "dynamic_seq": dynamic_seq,
            "dynamic_shapes": dynamic_shapes, "paths": tuple(paths)})
        hit = capture_cache.lookup(memo_key, model)
        if hit is not None:
            return hit
    names = dict(model.named_modules())
    missing = [p for p in leaf_modules if p not in names]
    if missing:
        raise ValueError(f"leaf_modules {missing} are not submodules of {type(model).__name__}; "
                         f"some of its module paths: {list(names)[1:8]}")
    if leaf_modules:
        dynamic_batch = False  # an opaque leaf's output shape is inferred for the example's shapes
    errors: dict[str, str] = {}
    with leaf_rt.opaque(model, leaf_modules, args, kwargs), _training_config(model) as adjusted:
        for path in paths:
            t0 = time.perf_counter()
            try:
                if path == "export":
                    gm, in_spec, out_spec = _via_export(model, args, kwargs, dynamic_batch, dynamic_shapes, dynamic_seq)
                elif path == "symbolic_trace":
                    gm, in_spec, out_spec = _via_symbolic_trace(model, args, kwargs, leaf_modules)
                elif path == "make_fx":
                    gm, in_spec, out_spec = _via_make_fx(model, model, args, kwargs)
                else:
                    raise ValueError(f"unknown capture path {path!r}; use export, symbolic_trace, make_fx")
            except ValueError as e:
                if "unknown capture path" in str(e):
                    raise
                errors[path] = _summarise(e)
                continue
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                errors[path] = _summarise(e)
                continue
            gm.meta["autopar_in_spec"] = in_spec
            gm.meta["autopar_out_spec"] = out_spec
            gm.meta["autopar_capture"] = {"path": path, "seconds": round(time.perf_counter() - t0, 3),
                                         "failed": errors, "adjusted": adjusted}
            ir.annotate_graph(gm, model)
            if memo_key is not None:
                capture_cache.store(memo_key, keep, gm)
            return gm
    raise CaptureError(_explain(model, errors))


@contextlib.contextmanager
def _fake_on(model: nn.Module, device: torch.device | None, dtype: torch.dtype | None = None):
    """For the duration, swap every meta parameter and buffer of `model` for a fake tensor of
    `device` (same shape, dtype, requires_grad) and, with `dtype`, every floating parameter
    for one of that dtype (on `device` when it is meta, else on its own device; a meta model
    without `device` stays on meta). Yields a function that makes inputs alike: fake (or meta),
    floating ones at `dtype`. Fake tensors hold no memory."""
    from autopar.runtime._torch_compat import FakeTensorMode  # noqa: PLC0415

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    made: dict[int, torch.Tensor] = {}  # one fake per tensor: tied weights stay tied

    def empty(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        where = device or t.device
        if where.type == "meta":
            return torch.empty(t.shape, dtype=dt, device="meta")
        with mode:
            return torch.empty(t.shape, dtype=dt, device=where)

    def fake(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        if id(t) not in made:
            f = empty(t, dt)
            made[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return made[id(t)]

    for mod in model.modules():
        for store, params in ((mod._parameters, True), (mod._buffers, False)):
            for n, t in list(store.items()):
                if t is None:
                    continue
                recast = params and dtype is not None and t.is_floating_point() and t.dtype != dtype
                if (t.is_meta and device is not None) or recast:
                    swapped.append((store, n, t))
                    store[n] = fake(t, dtype if recast else t.dtype)

    on_meta = any(t.is_meta for t in model.parameters())

    def to_fake(x):
        if not isinstance(x, torch.Tensor):
            return x
        dt = dtype if dtype is not None and x.is_floating_point() else x.dtype
        if on_meta and device is None:  # a meta model traced on meta: its inputs too
            return torch.empty(x.shape, dtype=dt, device="meta")
        return empty(x, dt)

    try:
        yield to_fake
    finally:
        for store, n, t in swapped:
            store[n] = t


def _restore_meta(gm: fx.GraphModule, model: nn.Module) -> None:
    """Put the model's own tensors (meta or real) back into a graph captured on fake ones (by name)."""
    originals = dict(model.named_parameters(remove_duplicate=False))
    originals.update(dict(model.named_buffers(remove_duplicate=False)))
    for mod_name, mod in gm.named_modules():
        for store in (mod._parameters, mod._buffers):
            for n, t in list(store.items()):
                full = f"{mod_name}.{n}" if mod_name else n
                if t is not None and full in originals:
                    store[n] = originals[full]


def _keep_input_dtypes(gm: fx.GraphModule, example: tuple, dtype: torch.dtype) -> None:
    """A graph traced on inputs cast to `dtype`: each floating input placeholder takes the
    caller's dtype again, and a first `aten._to_copy` node casts it (the engine feeds 16-bit
    inputs already, for which the copy is a plain copy), so that `model.step` takes the batch
    the example inputs describe."""
    flat = pytree.tree_leaves(example)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders):  # a capture path that flattened otherwise: leave it as traced
        return
    last = placeholders[-1] if placeholders else None
    for ph, x in zip(placeholders, flat):
        val = ph.meta.get("val")
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype
                and isinstance(val, torch.Tensor) and val.dtype == dtype):
            continue
        with gm.graph.inserting_after(last):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (ph,), {"dtype": dtype})
        last = cast
        cast.meta = {k: v for k, v in ph.meta.items() if k not in ("val", "tensor_meta", ir.KEY)}
        cast.meta["val"] = val
        ph.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
        ph.meta["val"] = torch.empty_like(val, dtype=x.dtype)
        ph.meta.pop("tensor_meta", None)
    gm.graph.lint()
    gm.recompile()


@contextlib.contextmanager
def _training_config(model: nn.Module):
    """transformers models default to `config.use_cache=True`, which makes a training forward
    build and return a KV cache object (no tensor pytree, so no path can capture it). A KV
    cache serves generation only: it is off while capturing, restored after, and the change is
    listed in `gm.meta["autopar_capture"]["adjusted"]`."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", None) is True}
    for c in configs.values():
        c.use_cache = False
    try:
        yield ["config.use_cache=False (a KV cache is for generation)"] if configs else []
    finally:
        for c in configs.values():
            c.use_cache = True


# --- paths -------------------------------------------------------------------------------
def _token_ids(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x for x in tensors if x.dim() == 2 and not x.is_floating_point() and not x.is_complex()
            and x.dtype != torch.bool]


def sequence_length(args, kwargs) -> int | None:
    """The sequence length of an input set: dim 1 of the first integer (B, T) input (token
    ids), else of the first input of 2 or more dims; None without such an input."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    ids = _token_ids(tensors)
    wide = ids or [x for x in tensors if x.dim() > 1]
    return int(wide[0].shape[1]) if wide else None


def sequence_refusal(args, kwargs, world_size: int) -> str:
    """Why capturing these inputs with a dynamic sequence dim would not let the joint planner
    consider context parallelism on `world_size` ranks ("" when it may): cp splits token
    sequences, so the inputs need an integer (B, T) tensor (an image's dim 1 is its channels,
    never a sequence), and some cp > 1 dividing the world must cut T into 2 cp zigzag chunks."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    ids = _token_ids(tensors)
    if not ids:
        shapes = ", ".join(f"{str(x.dtype).replace('torch.', '')} {tuple(x.shape)}" for x in tensors[:4]) or "none"
        return (f"the example inputs have no integer (batch, sequence) tensor of token ids (inputs: {shapes}), so "
                "there is no sequence to split; dim 1 of an image or feature tensor is not one")
    t = int(ids[0].shape[1])
    cps = [k for k in range(2, world_size + 1) if world_size % k == 0]
    if not cps:
        return f"a world of {world_size} rank(s) has no cp degree > 1"
    if not any(t % (2 * k) == 0 for k in cps):
        return (f"the sequence of {t} tokens does not split into 2 x cp zigzag chunks for any cp dividing "
                f"{world_size} ({', '.join(map(str, cps))}); use a length divisible by {2 * cps[0]}")
    return ""


def capture_for_search(model: nn.Module, example_inputs: Sequence[Any] | Any, world_size: int, *,
                       example_kwargs: dict | None = None, cp: bool = True, **options: Any) -> fx.GraphModule:
    """The capture the joint planner searches on for `world_size` ranks: with a symbolic
    sequence dim when context parallelism could be chosen, else static (as `capture`).

    Symbolic when `cp` (False: cp pinned off) and `sequence_refusal` finds a sequence some cp
    splits (token ids, never an image's channels), torch.export keeps dim 1 symbolic, and
    attention can be exchanged on the graph (a scaled_dot_product_attention, and nothing else
    mixes tokens: `passes.context_positions.check_context_parallel`). Otherwise the model is
    captured static, as before (a model without attention gets its usual graph and plans), and
    `gm.meta["autopar_capture"]["sequence"] = {"dynamic": False, "why": ...}` says why: the
    planner's cp explanation quotes it (`search.plan_context`). A model whose export cannot
    keep the sequence symbolic is captured static, never refused. `options`: `capture`'s.
    """
    from autopar.passes.context_positions import SDPA, check_context_parallel  # noqa: PLC0415

    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    options = {k: v for k, v in options.items() if k not in ("dynamic_seq", "paths")}
    why = ("cp is pinned to 1" if not cp else "leaf_modules keep the shapes static (an opaque module's output "
           "shape is inferred for the example's)" if list(options.get("leaf_modules") or ()) else
           sequence_refusal(args, kwargs, world_size))
    if not why:
        try:
            gm = capture(model, args, example_kwargs=kwargs, dynamic_seq=True, paths=("export",), **options)
        except Exception as e:  # noqa: BLE001 - the static capture below is the fallback; it repeats a real error
            why = f"torch.export could not capture the model with a symbolic sequence length ({_first_line(e)})"
        else:
            vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
            if not any(isinstance(v, torch.Tensor) and v.dim() > 1 and isinstance(v.shape[1], torch.SymInt)
                       for v in vals):
                return _sequence_note(gm, "torch.export specialised the sequence length (the model's code fixes it)")
            if not any(n.op == "call_function" and n.target is SDPA for n in gm.graph.nodes):
                why = ("the model has no attention (scaled_dot_product_attention) to exchange the sequence over, "
                       "so context parallelism does not apply")
            else:
                try:
                    check_context_parallel(gm)
                except ValueError as e:
                    why = f"context parallelism cannot run on this graph: {e}"
                else:
                    return _sequence_note(gm, "", dynamic=True)
    return _sequence_note(capture(model, args, example_kwargs=kwargs, dynamic_seq=False, **options), why)


def _sequence_note(gm: fx.GraphModule, why: str, dynamic: bool = False) -> fx.GraphModule:
    gm.meta.setdefault("autopar_capture", {})["sequence"] = {"dynamic": dynamic, "why": why}
    return gm


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _batch_dims(args, kwargs, seq: bool = False):
    t = sequence_length(args, kwargs) if seq else None

    def spec(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return {0: Dim.AUTO, 1: Dim.AUTO} if t is not None and x.dim() > 1 and x.shape[1] == t else {0: Dim.AUTO}
        return None

    return (pytree.tree_map(spec, args, is_leaf=lambda x: isinstance(x, torch.Tensor)),
            pytree.tree_map(spec, kwargs, is_leaf=lambda x: isinstance(x, torch.Tensor)))


def _via_export(model, args, kwargs, dynamic_batch, dynamic_shapes, dynamic_seq=False):
    if dynamic_shapes is None and dynamic_batch:
        a, k = _batch_dims(args, kwargs, dynamic_seq)
        dynamic_shapes = (*a, *([k] if k else [])) if not kwargs else {**dict(zip(_arg_names(model, len(args)), a)), **k}
    ep = torch.export.export(model, args, kwargs or None, strict=False, dynamic_shapes=dynamic_shapes)
    unlifted = ep.module()
    gm = _plain_graph_module(unlifted, unlifted.graph)
    return gm, ep.call_spec.in_spec, ep.call_spec.out_spec


def _arg_names(model, n):
    import inspect

    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [p.name for p in params[:n]]


def _via_symbolic_trace(model, args, kwargs, leaf_modules):
    class _Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return qualname in leaf_modules or super().is_leaf_module(m, qualname)

    graph = _Tracer().trace(model)
    traced = fx.GraphModule(model, graph)
    return _via_make_fx(traced, model, args, kwargs)


def _via_make_fx(fn_module, model, args, kwargs):
    from torch.fx.experimental.proxy_tensor import make_fx

    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    flat_args, in_spec = pytree.tree_flatten((args, kwargs))
    out_spec_box = []

    def f(state, *flat):
        a, k = pytree.tree_unflatten(list(flat), in_spec)
        out = torch.func.functional_call(fn_module, state, a, k)
        flat_out, spec = pytree.tree_flatten(out)
        out_spec_box.append(spec)
        return tuple(flat_out)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fx warns about get_attr targets we add next
        traced = make_fx(f, pre_dispatch=True, record_module_stack=True, tracing_mode="fake")(named, *flat_args)
    graph = traced.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    n_state = len(pytree.tree_leaves(named))
    state_names = list(named)
    for ph, name in zip(placeholders[:n_state], state_names):
        with graph.inserting_before(ph), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the root module is attached below
            ga = graph.get_attr(name)
        ga.meta = dict(ph.meta)
        ph.replace_all_uses_with(ga)
        graph.erase_node(ph)
    gm = _plain_graph_module(model, graph)
    return gm, in_spec, out_spec_box[-1]


def _plain_graph_module(root: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule with flat positional inputs and a flat tuple output; export's guard
    node and pytree codegen are dropped (the specs are kept in gm.meta)."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "call_module" and n.target == "_guards_fn":
            continue
        if n.op == "output":
            outs = pytree.tree_leaves(n.args[0])
            new.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outs))
            continue
        env[n] = new.node_copy(n, lambda x: env[x])
        env[n].meta = dict(n.meta)
    new.lint()
    # lazy: a captured graph is copied, costed and rewritten far more often than it runs; its code
    # is generated when first needed (runtime/_torch_compat.py)
    return lazy_graph_module(root, new, class_name="CapturedGraph")


# --- errors ------------------------------------------------------------------------------
def library_dirs() -> tuple[str, ...]:
    """The real directories of autopar's own packages and of torch: a frame from a file under
    one of them is the toolkit's, not the user's. Decided by where the modules were loaded
    from, never by a substring of the path: a user's clone is itself a folder named autopar."""
    import autopar.passes as passes  # noqa: PLC0415
    import autopar.runtime as runtime  # noqa: PLC0415

    own = os.path.dirname(os.path.abspath(__file__))  # this package's folder (autopar/)
    return (os.path.realpath(own),) + tuple(os.path.realpath(os.path.dirname(m.__file__))
                                            for m in (passes, runtime, torch))


def is_library_file(filename: str, dirs: Sequence[str] | None = None) -> bool:
    """True when `filename` lies inside autopar's or torch's package directories."""
    if filename.startswith("<"):  # <string>, <frozen ...>: no file, so not ours
        return False
    real = os.path.realpath(filename)
    return any(os.path.commonpath((real, d)) == d for d in (dirs or library_dirs()))


def _summarise(e: BaseException) -> str:
    """One paragraph: the exception and the user-code frame nearest to it."""
    tb = traceback.extract_tb(e.__traceback__)
    dirs = library_dirs()
    user = [f for f in tb if not is_library_file(f.filename, dirs)]
    where = f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].name}: {user[-1].line})" if user else ""
    msg = str(e).strip().splitlines()
    head = " ".join(msg[:3])[:600] if msg else type(e).__name__
    return f"{type(e).__name__}: {head}{where}"


def _explain(model: nn.Module, errors: dict[str, str]) -> str:
    culprit = _culprit_module(model, errors)
    lines = [f"could not capture {type(model).__name__} with any path:"]
    for path, err in errors.items():
        lines.append(f"  {path}: {err}")
    hint = f"leaf_modules=[{culprit!r}]" if culprit else "leaf_modules=['<path of the submodule>']"
    lines.append(f"The failing code is in module {culprit or '<unknown>'!r}. If that submodule cannot be "
                 f"traced, keep it opaque: autopar.capture(model, inputs, {hint}) "
                 "(it then runs replicated on every rank).")
    return "\n".join(lines)


def _culprit_module(model: nn.Module, errors: dict[str, str]) -> str | None:
    """The deepest submodule whose forward's source file and line appear in an error."""
    import inspect

    best = None
    for name, mod in model.named_modules():
        if not name:
            continue
        try:
            src, start = inspect.getsourcelines(type(mod).forward)
            fname = inspect.getsourcefile(type(mod).forward)
        except (OSError, TypeError):
            continue
        for err in errors.values():
            for ln in range(start, start + len(src)):
                if f"{fname}:{ln} " in err:
                    if best is None or name.count(".") > best.count("."):
                        best = name
    return best
