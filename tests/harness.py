"""Test harness for multi-process checks on gloo.

`world(n, fn, *args)` spawns n CPU processes (fork: ~0.1 s a world), runs `fn(rank, n, *args)`
on each and returns the per-rank results. A failing rank re-raises here with its traceback; a
hung world fails after `timeout_s` naming the ranks that did not finish. Put many checks in
one `fn` — spawning is the expensive part.

The worlds are CPU worlds on any machine: their default group is gloo, so `autopar.mesh()`
and the worker pick the CPU (`runtime.mesh.default_device_type`) even where a GPU is visible,
and a world forked after this process initialised CUDA never touches it. A test that wants
the GPU runs NCCL (`backend="nccl"`): `run_world` spawns instead of forking once CUDA is
initialised here.

Ranks start warm. Forked ranks (CPU torch): `warm_parent()`, called by conftest.py before the
first tests/dist test, warms this process once. Fork-server ranks (a GPU build of torch, e.g.
Python 3.12 with PyPI's default torch): the server also imports `FORK_SERVER_MODULES`
(transformers, the planner, the zoo check) once, instead of every rank of every world
importing them again (~5 CPU-s a rank with transformers).

`capture_before_fork(model, example_inputs, cp=..., search_world=...)`: a module's fixture
captures each model structure its cells train once, before its world forks; every rank then
finds the graph in autopar's capture memo (2-5 CPU-s a rank a structure saved), and the fusion
rules' kernel output types of that graph in their memo (`warm_fusion_types`).
"""
import os

from autopar.runtime.launch import WorldError, default_start_method, preload_in_fork_server, run_world

# what ranks import besides torch and autopar; none initialises CUDA on import (a fork server
# must not), a missing one is skipped by the server
FORK_SERVER_MODULES = ("transformers", "transformers.modeling_utils", "networkx", "sympy", "scipy.optimize",
                       "torch.export", "torch.distributed.checkpoint", "autopar.search.planner",
                       "autopar.tools.planning", "autopar.tools.zoo_check", "autopar.search.plan_text",
                       "autopar.tools.plan_view", "autopar.build.gantt", "autopar.build.pipeline")
preload_in_fork_server(*FORK_SERVER_MODULES)

_warmed = False


def world(n: int, fn, *args, timeout_s: float = 240.0, **kwargs):
    """A gloo world of `n` ranks running `fn`. Started afresh once when gloo's own transport
    crashed while a group connected (runtime/launch.TRANSPORT_SETUP_CRASH; printed when it
    happens): an overloaded 2-core CI machine hit it once, in a test unrelated to the crash."""
    kwargs.setdefault("backend", "gloo")
    kwargs.setdefault("transport_retries", 1)
    return run_world(n, fn, *args, timeout_s=timeout_s, collective_timeout_s=60.0, **kwargs)


def warm_parent() -> None:
    """Once per process, when ranks fork from this process: import what a rank imports
    (FORK_SERVER_MODULES too) and run one capture and one joint plan of gpt-tiny on meta, so
    that every forked rank inherits the warmed imports, torch.export's first-call set-up and
    the pure memo tables (sympy dims, small schedules) instead of paying them again (~2 CPU-s a
    rank). The planner's in-memory
    plan cache is cleared afterwards: no rank reuses the warm-up's plan. No backward pass runs
    and CUDA is not initialised. Does nothing where ranks do not fork from this process (a GPU
    build of torch: fork server, which imports FORK_SERVER_MODULES instead) or with
    AUTOPAR_TEST_WARM=0."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    if os.environ.get("AUTOPAR_TEST_WARM", "1") == "0":
        return
    if not _forks():
        return
    import importlib

    import autopar.search.planner as planner
    from autopar.tools.model_source import resolve
    from autopar.tools.planning import plan_model

    for name in FORK_SERVER_MODULES:  # what ranks import lazily (scipy.optimize for the sharding ILP: 0.3 CPU-s a rank)
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    try:
        plan_model(resolve("gpt-tiny"), world_size=4)
    except Exception:  # noqa: BLE001 - only a speed-up: the tests themselves report any real failure
        pass
    finally:
        planner.clear_cache()


def _forks() -> bool:
    return (os.environ.get("AUTOPAR_START_METHOD") or default_start_method("gloo")) == "fork"


def capture_before_fork(model, example_inputs, *, cp: bool = False, search_world: int | None = None) -> None:
    """Capture `model` here as `autopar.parallelize(model, mesh, example_inputs=...)` will on
    every rank (`cp`: the mesh has a cp axis, so the sequence dim is dynamic; `search_world`: the
    mesh is `autopar.mesh(world_size=N)`, whose joint planner captures for the search), so that
    ranks forked from this process find the graph in autopar's capture memo instead of each
    running torch.export again (2-5 CPU-s a rank per structure, 4 ranks on 2 cores). Changes
    nothing a rank computes: a hit is the same graph bound to the rank's own model
    (autopar/capture_cache.py). Does nothing where ranks do not fork from this process, or with
    AUTOPAR_TEST_WARM=0; a capture that fails here is left for the ranks to report."""
    if os.environ.get("AUTOPAR_TEST_WARM", "1") == "0" or not _forks():
        return
    import importlib
    from collections.abc import Mapping

    capture_mod = importlib.import_module("autopar.capture")  # the module (autopar.capture is the function)
    if isinstance(example_inputs, Mapping):  # model(**batch), as parallelize reads a dict
        args, kwargs = (), dict(example_inputs)
    else:
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        kwargs = {}
    try:
        if search_world is not None and hasattr(capture_mod, "capture_for_search"):
            gm = capture_mod.capture_for_search(model, args, search_world, example_kwargs=kwargs)
        else:
            gm = capture_mod.capture(model, args, example_kwargs=kwargs, dynamic_seq=cp)
        warm_fusion_types(gm)
    except Exception:  # noqa: BLE001 - only a speed-up: the ranks report any real failure
        pass


def warm_fusion_types(gm) -> None:
    """Match every fusion rule on `gm` here, so that the kernels' output types (each one a torch
    reference run on fake tensors: 0.05-0.07 CPU-s a graph for hf-llama tiny, 0.002 warm) are
    in the process-wide memo (`passes.rules.fusion_match`) that forked ranks inherit: their fusion
    search matches the same graph (a capture-memo hit) and finds every type there. The matches
    themselves are not kept; a rank computes its own."""
    from autopar.passes.rules.fusion_table import find_matches

    find_matches(gm)


__all__ = ["FORK_SERVER_MODULES", "capture_before_fork", "warm_fusion_types", "world", "warm_parent", "WorldError"]
