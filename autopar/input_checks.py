"""What a user hands `parallelize` and `step`, checked before torch sees it: one clear line
naming the argument and what to change, instead of a traceback from inside torch.

  check_mesh_device(mesh)
        the mesh's device type exists on this machine (a cuda mesh without a GPU is refused).
  check_example_inputs(example_inputs, mesh, plan=None, *, n_microbatches=None)
        parallelize's example inputs: a tensor, a tuple/list of positional inputs or a dict
        of keyword inputs, holding tensors (and None / plain numbers); no empty batch; all on
        one device, a device this mesh can use (meta is fine: capture needs no data);
        integer token ids where the argument is named so (`input_ids`, `position_ids` ...); a
        batch that divides by dp x ep x micro-batches when those are known.
  explain_capture_failure(model, example_inputs) -> ValueError | None
        after a capture failed: runs the model's forward once on fake tensors (no memory,
        no data), with checks at the entry of every embedding, linear, convolution and norm,
        and names the argument and the module that cannot take it (float token ids into an
        nn.Embedding, a last dim a Linear does not expect, a dtype other than the weights',
        an error the model itself raises). None when the forward runs: the failure is the
        capture's, not the inputs'.
  check_captured_graph(global_gm, example_inputs)
        after a capture that worked: the graph would still fail when it runs if an input
        reaches a matrix product, convolution or embedding with the wrong dtype (fake
        tensors do not check dtypes there); names the argument and the module.
  check_step_batch(batch, global_gm, mesh, *, dp_axis="dp", n_microbatches=1)
        `model.step`'s batch against what was captured: the same structure, dtypes, number
        of dims and sizes of the dims after the batch; real data (not meta) on a device the
        mesh uses; rows that divide by dp x ep x micro-batches.

The checks never run the model on real data and never change it (the fake forward runs
under `no_grad` on fake tensors; buffers it updates in place, such as batch norm's running
statistics, are put back). Every error is a
ValueError. Reads the captured graph's placeholders (node.meta["val"]) and
gm.meta["autopar_in_spec"]; writes nothing.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from autopar.runtime._torch_compat import pytree

__all__ = ["check_mesh_device", "check_example_inputs", "explain_capture_failure", "check_captured_graph",
           "check_step_batch", "split_inputs"]

# keyword inputs that are token ids (transformers' names): floating values there cannot work.
# (`labels` is not among them: a regression head takes float labels.)
_ID_NAMES = ("input_ids", "decoder_input_ids", "token_type_ids", "position_ids")


# ------------------------------------------------------------------------ helpers
def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) as parallelize reads `example_inputs`: a dict is keyword inputs, a tuple
    or list positional inputs, anything else the one positional input."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _leaves(example_inputs: Any, root: str) -> list[tuple[str, Any]]:
    """(name, leaf) of every leaf, named as the user wrote them: `example_inputs[0]`,
    `example_inputs['input_ids']` (a lone tensor is `example_inputs`)."""
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list, Mapping)):
        return [(root, example_inputs)]
    flat, _ = pytree.tree_flatten_with_path(example_inputs)
    return [(root + pytree.keystr(path), leaf) for path, leaf in flat]


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)} on {t.device.type}"


def _device_ok(device_type: str) -> bool:
    if device_type in ("cpu", "meta"):
        return True
    mod = getattr(torch, device_type, None)
    avail = getattr(mod, "is_available", None)
    try:
        return bool(avail()) if callable(avail) else False
    except Exception:  # noqa: BLE001 - a backend that cannot answer is not available
        return False


def check_mesh_device(mesh) -> None:
    """ValueError when the mesh's device type is not available on this machine."""
    dt = getattr(mesh, "device_type", "cpu")
    if not _device_ok(dt):
        raise ValueError(f"the mesh runs on {dt!r} but this machine has no {dt} device "
                         f"(torch.{dt}.is_available() is False); build the mesh with "
                         f"autopar.mesh(..., device_type=\"cpu\") to run on CPU processes (gloo), or run on a "
                         f"machine with {dt} devices")


def _split_factor(mesh, dp_axis: str | None, n_microbatches: int) -> int:
    sizes = dict(getattr(mesh, "sizes", {}))
    dp = sizes.get(dp_axis, 1) if dp_axis else 1
    return dp * sizes.get("ep", 1) * max(1, int(n_microbatches))


def _split_text(mesh, dp_axis: str | None, n_microbatches: int) -> str:
    sizes = dict(getattr(mesh, "sizes", {}))
    parts = [f"{dp_axis}={sizes.get(dp_axis, 1)}"] if dp_axis else []
    if sizes.get("ep", 1) > 1:
        parts.append(f"ep={sizes['ep']}")
    parts.append(f"micro-batches={n_microbatches}")
    return " x ".join(parts)


# ------------------------------------------------------------------------ parallelize's inputs
def check_example_inputs(example_inputs: Any, mesh, plan=None, *, n_microbatches: int | None = None) -> None:
    """Check parallelize's `example_inputs` for `mesh` (and `plan` when one is given); see the
    module docstring. `n_microbatches`: the pinned count when there is no plan. The batch
    split is checked when it is known: with a plan, or a mesh with fixed axes (a mesh given
    only by its world size is factorised by the planner, which checks it)."""
    check_mesh_device(mesh)
    if example_inputs is None:
        raise ValueError("example_inputs is None; pass the model's inputs for one global batch: a tensor, a tuple "
                         "of its positional inputs, or a dict of its keyword inputs")
    leaves = _leaves(example_inputs, "example_inputs")
    tensors = []
    for name, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append((name, leaf))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            continue
        else:
            hint = " (torch.from_numpy(x))" if type(leaf).__module__.startswith("numpy") else ""
            raise ValueError(f"{name} is a {type(leaf).__module__}.{type(leaf).__name__}; example inputs hold "
                             f"torch tensors{hint}, None or plain numbers")
    if not tensors:
        raise ValueError(f"example_inputs holds no tensor ({type(example_inputs).__name__}); pass the model's "
                         "input tensors for one global batch")
    devices = {t.device.type for _, t in tensors}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device.type}" for n, t in tensors[:4])
        raise ValueError(f"example_inputs are on several devices ({where}); put them all on one device")
    mesh_dev = getattr(mesh, "device_type", "cpu")
    for name, t in tensors:
        dev = t.device.type
        if dev not in ("cpu", "meta", mesh_dev):
            raise ValueError(f"{name} is on {dev} but the mesh runs on {mesh_dev}; move it with "
                             f"{name.rpartition('[')[0] or name}.to({mesh_dev!r}) or use a {dev} mesh")
        if t.dim() > 0 and t.shape[0] == 0:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: an empty batch; pass at least one row per "
                             "data-parallel rank")
        key = name.rpartition("[")[2].strip("]'\"")
        if key in _ID_NAMES and (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"{name} is {_desc(t)}, but {key} are token ids, which are integers; pass "
                             f"{name}.long()")
    check_sequence_split(tensors, mesh)
    dp_axis = getattr(plan, "dp_axis", "dp") if plan is not None else ("dp" if "dp" in mesh.sizes else None)
    micro = plan.n_microbatches if plan is not None else (n_microbatches or 1)
    if plan is None and getattr(mesh, "searched", False):
        return  # the planner chooses dp and micro-batches and checks the batch
    k = _split_factor(mesh, dp_axis, micro)
    if k > 1:
        for name, t in tensors:
            if t.dim() > 0 and t.shape[0] % k:
                good = k * max(1, round(t.shape[0] / k))
                raise ValueError(f"{name} has {t.shape[0]} rows: that number does not divide by "
                                 f"{_split_text(mesh, dp_axis, micro)} = {k}; use a global batch that is a multiple "
                                 f"of {k} (e.g. {good}), or fewer micro-batches")


# ------------------------------------------------------------------------ after a failed capture
class _Found(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _which(t: Any, leaves: list[tuple[str, Any]]) -> str:
    """The example input `t` is (by shape and dtype), or a summary of the inputs."""
    if isinstance(t, torch.Tensor):
        same = [n for n, x in leaves if isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(t.shape)
                and x.dtype == t.dtype]
        if len(same) == 1:
            return same[0]
    return "the example inputs (" + ", ".join(f"{n}: {_desc(x)}" for n, x in leaves
                                               if isinstance(x, torch.Tensor))[:300] + ")"


def _entry_check(name: str, mod: nn.Module, x: Any, leaves) -> str | None:
    """Why module `mod` cannot take `x` (its first input), or None."""
    if not isinstance(x, torch.Tensor):
        return None
    arg = _which(x, leaves)
    mname = name or type(mod).__name__
    if isinstance(mod, nn.Embedding) and (x.is_floating_point() or x.is_complex()):
        return (f"{arg} is {_desc(x)}, but it feeds nn.Embedding {mname!r}, which takes integer token ids; pass "
                f"{arg if not arg.startswith('the example inputs') else 'the ids'}.long()")
    weight = getattr(mod, "weight", None)
    if isinstance(mod, nn.Linear):
        if x.dim() == 0 or (isinstance(x.shape[-1], int) and x.shape[-1] != mod.in_features):
            return (f"{arg} reaches nn.Linear {mname!r} with last dim {tuple(x.shape)[-1:] or '()'}, but it takes "
                    f"{mod.in_features} features; pass inputs whose last dim is {mod.in_features}")
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        want = len(mod.kernel_size) + 2
        if x.dim() not in (want, want - 1):
            return (f"{arg} reaches {type(mod).__name__} {mname!r} with {x.dim()} dims {tuple(x.shape)}, but it takes "
                    f"{want} (batch, channels, ...)")
        if x.shape[-want + 1] != mod.in_channels:
            return (f"{arg} reaches {type(mod).__name__} {mname!r} with {x.shape[-want + 1]} channels, but it takes "
                    f"{mod.in_channels}; pass inputs of shape (batch, {mod.in_channels}, ...)")
    if isinstance(mod, nn.LayerNorm):
        n = len(mod.normalized_shape)
        if tuple(x.shape[-n:]) != tuple(mod.normalized_shape):
            return (f"{arg} reaches nn.LayerNorm {mname!r} with trailing dims {tuple(x.shape[-n:])}, but it normalises "
                    f"{tuple(mod.normalized_shape)}")
    if (isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm)) and isinstance(weight, torch.Tensor)
            and x.is_floating_point() and weight.is_floating_point() and x.dtype != weight.dtype):
        cast = {torch.float32: ".float()", torch.float64: ".double()", torch.float16: ".half()",
                torch.bfloat16: ".bfloat16()"}.get(weight.dtype, f".to({weight.dtype})")
        return (f"{arg} is {_desc(x)}, but {type(mod).__name__} {mname!r} has {str(weight.dtype).replace('torch.', '')} "
                f"weights; pass {arg if not arg.startswith('the example inputs') else 'it'}{cast}")
    if x.is_floating_point() is False and isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm)):
        return (f"{arg} is {_desc(x)}, an integer tensor, but it reaches {type(mod).__name__} {mname!r}, which computes "
                "in floating point; pass float inputs (or token ids to a model that embeds them)")
    return None


def explain_capture_failure(model: nn.Module, example_inputs: Any, name: str = "example_inputs") -> ValueError | None:
    """A ValueError naming the argument and module that cannot take it, or None when the
    model's forward runs on these inputs (see the module docstring). `name`: how the inputs
    are called in the message."""
    from autopar.runtime._torch_compat import FakeTensorMode  # noqa: PLC0415

    if not isinstance(model, nn.Module):
        return None
    args, kwargs = split_inputs(example_inputs)
    leaves = _leaves(example_inputs, name)
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    handles = []

    def pre(mod, inputs):
        name = names.get(id(mod), "")
        stack.append(name)
        why = _entry_check(name, mod, inputs[0] if inputs else None, leaves)
        if why:
            raise _Found(why)

    def post(mod, inputs, out):
        if stack:
            stack.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    # a forward updates buffers in place (batch norm's running statistics, counters), fake mode or
    # not: keep their values and put them back
    kept = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            model(*args, **kwargs)
        return None
    except _Found as f:
        return ValueError(f.message)
    except Exception as e:  # noqa: BLE001 - the model's own error on these inputs, reported with where it arose
        where = stack[-1] if stack else ""
        mod = model.get_submodule(where) if where else model
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        inputs = ", ".join(f"{n}: {_desc(x)}" for n, x in leaves if isinstance(x, torch.Tensor))
        return ValueError(f"the model's forward fails on these example inputs ({inputs}) in module "
                          f"{where or '<root>'!r} ({type(mod).__name__}): {type(e).__name__}: {first}")
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in kept and not torch.equal(b, kept[n]):
                    b.copy_(kept[n])


_MATMULS = {"aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
            "aten.matmul.default", "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
            "aten.convolution.default", "aten.baddbmm.default"}


def check_captured_graph(global_gm, example_inputs: Any) -> None:
    """ValueError when the captured graph would fail at its first real run because of the
    inputs' dtypes (see the module docstring)."""
    from autopar.passes import ir  # noqa: PLC0415

    leaves = _leaves(example_inputs, "example_inputs")
    tensor_names = [n for n, x in leaves if isinstance(x, torch.Tensor)]
    placeholders = [n for n in global_gm.graph.nodes if n.op == "placeholder"]
    names = {}
    for i, ph in enumerate(placeholders):
        if i < len(leaves):
            names[ph] = leaves[i][0]

    def val(a):
        v = a.meta.get("val") if hasattr(a, "meta") else None
        return v if isinstance(v, torch.Tensor) else None

    def source(a) -> str:
        seen = a
        while seen.op == "call_function" and seen.args and hasattr(seen.args[0], "op") and len(seen.all_input_nodes) == 1:
            seen = seen.args[0]  # through views and casts of one input
        return names.get(seen, "an input" if not tensor_names else f"a tensor computed from {', '.join(tensor_names)}")

    for n in global_gm.graph.nodes:
        if n.op != "call_function":
            continue
        op = str(n.target)
        where = (ir.get_info(n).module if ir.get_info(n) else "") or "<root>"
        if op == "aten.embedding.default" and len(n.args) > 1 and hasattr(n.args[1], "op"):
            v = val(n.args[1])
            if v is not None and (v.is_floating_point() or v.is_complex()):
                raise ValueError(f"{source(n.args[1])} is {str(v.dtype).replace('torch.', '')}, but it feeds the "
                                 f"embedding in module {where!r}, which takes integer token ids; pass it as .long()")
        elif op in _MATMULS:
            ts = [(a, val(a)) for a in n.args if hasattr(a, "op") and val(a) is not None]
            dtypes = {v.dtype for _, v in ts if v.is_floating_point()}
            if len(dtypes) > 1:
                weight = next(((a, v) for a, v in ts if a.op == "get_attr"), ts[-1])
                other = next((a, v) for a, v in ts if v.dtype != weight[1].dtype)
                wd = str(weight[1].dtype).replace("torch.", "")
                raise ValueError(f"{source(other[0])} reaches {op.split('.')[1]} in module {where!r} as "
                                 f"{str(other[1].dtype).replace('torch.', '')}, but its weight is {wd}: torch "
                                 f"will refuse to multiply them; pass the input as {wd}")


# ------------------------------------------------------------------------ step's batch
_VALS: Any = None  # a weakref.WeakKeyDictionary: graph module -> its placeholders' values (step runs every iteration)


def _captured(global_gm) -> list[Any]:
    global _VALS
    import weakref  # noqa: PLC0415

    if _VALS is None:
        _VALS = weakref.WeakKeyDictionary()
    vals = _VALS.get(global_gm)
    if vals is None:
        vals = [n.meta.get("val") for n in global_gm.graph.nodes if n.op == "placeholder"]
        _VALS[global_gm] = vals
    return vals


def check_step_batch(batch: Any, global_gm, mesh, *, dp_axis: str | None = "dp", n_microbatches: int = 1) -> None:
    """Check `model.step`'s `batch=(inputs, targets)` against the captured graph (see the
    module docstring); ValueError naming the part of the batch and what to change."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("model.step takes batch=(inputs, targets): inputs as given to parallelize's "
                         f"example_inputs, targets what loss_fn needs; got {type(batch).__name__}"
                         + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    inputs, targets = batch
    args, kwargs = split_inputs(inputs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    want_spec = global_gm.meta.get("autopar_in_spec")
    named = _leaves(inputs, "batch[0]")
    if want_spec is not None and spec != want_spec:
        raise ValueError(f"batch[0] does not have the structure of parallelize's example_inputs: got {len(flat)} "
                         f"inputs ({type(inputs).__name__}), captured {want_spec.num_leaves}; pass the inputs in the "
                         "same form (a tensor, a tuple of positional inputs, or a dict with the same keys)")
    vals = _captured(global_gm)
    k = _split_factor(mesh, dp_axis, n_microbatches)
    mesh_dev = getattr(mesh, "device_type", "cpu")
    tgt = [(n, t) for n, t in _leaves(targets, "batch[1]") if isinstance(t, torch.Tensor)]
    for i, x in enumerate(flat):
        name = named[i][0] if i < len(named) else f"batch[0] input {i}"
        want = vals[i] if i < len(vals) else None
        if not isinstance(x, torch.Tensor):
            continue
        if x.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: step trains on real data; pass tensors on {mesh_dev}")
        if x.device.type not in ("cpu", mesh_dev):
            raise ValueError(f"{name} is on {x.device.type} but the mesh runs on {mesh_dev}; move it with "
                             f".to({mesh_dev!r})")
        if isinstance(want, torch.Tensor):
            if x.dtype != want.dtype:
                raise ValueError(f"{name} is {_desc(x)}, but the model was captured with "
                                 f"{str(want.dtype).replace('torch.', '')} there; pass "
                                 f"{name}.to({want.dtype})")
            if x.dim() != want.dim():
                raise ValueError(f"{name} has {x.dim()} dims {tuple(x.shape)}, but the model was captured with "
                                 f"{want.dim()} ({_shape_text(want)}); pass inputs shaped like the example inputs")
            for d in range(1, x.dim()):
                w = want.shape[d]
                if isinstance(w, int) and x.shape[d] != w:
                    raise ValueError(f"{name} has shape {tuple(x.shape)}, but the model was captured with "
                                     f"{_shape_text(want)}: dim {d} must be {w}; keep the sizes after the batch "
                                     "dim of the example inputs (or parallelize again with the new shape)")
        if x.dim() > 0 and k > 1 and x.shape[0] % k:
            raise ValueError(f"{name} has {x.shape[0]} rows: that number does not divide by "
                             f"{_split_text(mesh, dp_axis, n_microbatches)} = {k}; use a global batch that is a "
                             f"multiple of {k}")
    for name, t in tgt:
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: step trains on real data; pass targets on {mesh_dev}")
    check_sequence_split([(n, x) for n, x in named if isinstance(x, torch.Tensor)] + tgt, mesh)


def check_sequence_split(tensors: list[tuple[str, torch.Tensor]], mesh) -> None:
    """Under context parallelism (a cp axis > 1) the sequence (dim 1 of the first input of 2+
    dims) splits into 2 x cp equal zigzag chunks, and every tensor of the batch with that many
    tokens in dim 1 is split with it."""
    sizes = getattr(mesh, "sizes", {}) or {}
    cp = sizes.get("cp", 1)
    seq = [(n, t) for n, t in tensors if t.dim() > 1]
    if cp < 2 or not seq:
        return
    name, t = seq[0]
    n = t.shape[1]
    if n % (2 * cp):
        good = 2 * cp * max(1, -(-n // (2 * cp)))
        raise ValueError(f"{name} has a sequence of {n} tokens (dim 1), which does not split into 2 x cp = {2 * cp} "
                         f"equal chunks (context parallelism gives each cp rank two of them, zigzag); use a "
                         f"sequence length that is a multiple of {2 * cp} (e.g. pad to {good})")


def _shape_text(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) if isinstance(s, int) else "batch" for s in t.shape) + ")"
