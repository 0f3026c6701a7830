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
"""
from autopar.runtime.launch import WorldError, run_world


def world(n: int, fn, *args, timeout_s: float = 240.0, **kwargs):
    kwargs.setdefault("backend", "gloo")
    return run_world(n, fn, *args, timeout_s=timeout_s, collective_timeout_s=60.0, **kwargs)


__all__ = ["world", "WorldError"]
