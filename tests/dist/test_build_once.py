"""The build's work done once instead of once a rank, and graphs compiled only when they run.

* `autopar.build.rank0.on_rank0`: every rank gets rank 0's answer (a rank-dependent function
  proves whose answer it is); a ValueError on rank 0 is raised on every rank with its class and
  message (a ValueError subclass stays that class); any other exception is a RuntimeError on the
  others naming the work; an answer that does not pickle fails on every rank, not only on rank 0.
  Through `parallelize`: a mesh with an ep axis for a model without experts fails on both ranks
  with rank 0's message.
* `autopar.checkpoint_api.gather_state_dict` (what `export_state_dict` now returns, without a
  temporary checkpoint) equals the checkpoint round trip it replaces (`save_checkpoint` then
  `read_full_state_dict`): the same names, dtypes, shapes and bit-for-bit values, after an AdamW
  step, under dp x tp ZeRO-3, pp x dp ZeRO-1 (tied embedding on two stages), dp=4 ZeRO-2 and
  tp x pp, on 4 gloo ranks (fp64 gpt-tiny-tied).
* Lazy graph modules (`runtime._torch_compat.lazy_graph_module`): a capture-memo hit and its rank
  copy generate no code until called, and their output then equals the eager module's; a module
  compiled by `compile_graph_modules` runs its forward hooks once on the first call.
"""
from __future__ import annotations

import os

import pytest
import torch

from autopar import models
from harness import capture_before_fork, world

MODEL = "gpt-tiny-tied"
EXPORT_MESHES = [dict(dp=2, tp=2, zero=3), dict(pp=2, dp=2, zero=1), dict(dp=4, zero=2), dict(tp=2, pp=2, zero=0)]


class _Tagged(ValueError):
    """A ValueError subclass: must reach the other ranks as itself."""


def _answers(rank: int, n: int) -> dict:
    from autopar.build.rank0 import on_rank0

    out = {"value": on_rank0(lambda: {"from": rank}, what="a test value")}
    for name, exc in (("tagged", _Tagged("bad size 3; use 4")), ("runtime", KeyError("k"))):
        def fail(e=exc):
            raise e
        try:
            on_rank0(fail, what="the failing test work")
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
            out[name] = (type(e).__name__, str(e))
    try:
        on_rank0(lambda: (lambda: 0), what="an unpicklable answer")  # a lambda does not pickle
        out["unpicklable"] = None
    except Exception as e:  # noqa: BLE001
        out["unpicklable"] = type(e).__name__
    import autopar

    spec = models.get(MODEL)
    (x,), _y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = spec.build()
    try:
        autopar.parallelize(model, autopar.mesh(ep=2), example_inputs=x)
        out["ep"] = None
    except ValueError as e:
        out["ep"] = str(e)
    return out


def test_every_rank_takes_rank0s_answer_and_raises_rank0s_error():
    spec = models.get(MODEL)
    (x,), _y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    capture_before_fork(spec.build(), x)
    r0, r1 = world(2, _answers)
    assert r0["value"] == r1["value"] == {"from": 0}
    assert r0["tagged"] == r1["tagged"] == ("_Tagged", "bad size 3; use 4")
    assert r0["runtime"][0] == "KeyError"
    assert r1["runtime"][0] == "RuntimeError" and "the failing test work failed on rank 0: KeyError" in r1["runtime"][1]
    assert r0["unpicklable"] is not None and r1["unpicklable"] == "RuntimeError"
    assert r0["ep"] and r0["ep"] == r1["ep"], (r0["ep"], r1["ep"])


def _exports(rank: int, n: int, tmp: str) -> list:
    import autopar
    from autopar.checkpoint_api import _model_info, gather_state_dict
    from autopar.runtime import checkpoint as ck

    spec = models.get(MODEL)
    out = []
    for i, c in enumerate(EXPORT_MESHES):
        torch.manual_seed(0)
        model = spec.build().double()
        axes = {k: v for k, v in c.items() if k != "zero"}
        (x,), y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
        pm = autopar.parallelize(model, autopar.mesh(**axes), example_inputs=x, zero_stage=c["zero"],
                                 n_microbatches=2 if "pp" in axes else None)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
        pm.step(((x,), y), spec.loss_fn)
        opt.step()
        info = _model_info(pm)
        mem = gather_state_dict(pm.engine, pm.mesh, **info)
        d = os.path.join(tmp, f"cell{i}")
        ck.save_checkpoint(d, pm.engine, pm.mesh, **info, optimizer=False)
        disk = ck.read_full_state_dict(d, verify="size") if rank == 0 else {}
        out.append((mem, disk))
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    spec = models.get(MODEL)
    (x,), _y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    capture_before_fork(spec.build().double(), x)
    return world(4, _exports, str(tmp_path_factory.mktemp("export")))


def test_the_in_memory_export_equals_the_checkpoint_round_trip_bit_for_bit(exports):
    for c, (mem, disk) in zip(EXPORT_MESHES, exports[0]):
        assert disk, c
        assert set(mem) == set(disk), (c, sorted(set(mem) ^ set(disk)))
        for k, v in disk.items():
            assert mem[k].dtype == v.dtype and mem[k].shape == v.shape, (c, k)
            assert torch.equal(mem[k], v), (c, k)
    for rank_out in exports[1:]:
        assert all(mem == {} and disk == {} for mem, disk in rank_out)


def test_memo_hits_and_rank_copies_generate_code_only_when_they_run():
    from autopar.build.program import rank_copy
    from autopar.capture import capture
    from autopar.runtime._torch_compat import compile_graph_modules, lazy_graph_module

    spec = models.get(MODEL)
    (x,), _y = spec.example_batch(2, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = spec.build().double()
    capture(model, (x,))
    hit = capture(model, (x,))  # the memo's copy
    assert hit.meta["autopar_capture"].get("cached")
    local = rank_copy(hit)
    for gm in (hit, local):
        assert "_code" not in gm.__dict__, "the code was generated before the module ran"
    with torch.no_grad():
        want = model(x)
        got = local(x)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # fp64, same ops: equal
    assert "_code" in local.__dict__  # the first call generated it

    calls = []
    fresh = lazy_graph_module(hit, hit.graph)
    fresh.register_forward_pre_hook(lambda _m, _a: calls.append(1))
    compile_graph_modules(fresh)
    with torch.no_grad():
        fresh(x)
    assert calls == [1]
