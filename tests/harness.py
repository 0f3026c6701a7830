"""Test harness for multi-process checks on gloo.

`world(n, fn, *args)` spawns n CPU processes (fork: ~0.1 s a world), runs `fn(rank, n, *args)`
on each and returns the per-rank results. A failing rank re-raises here with its traceback; a
hung world fails after `timeout_s` naming the ranks that did not finish. Put many checks in
one `fn` — spawning is the expensive part.
"""
from autopar.runtime.launch import WorldError, run_world


def world(n: int, fn, *args, timeout_s: float = 240.0, **kwargs):
    return run_world(n, fn, *args, timeout_s=timeout_s, collective_timeout_s=60.0, **kwargs)


__all__ = ["world", "WorldError"]
