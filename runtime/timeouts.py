"""The job's collective timeout: one number of seconds that every collective autopar issues
waits at most before it fails.

Resolution (`collective_timeout_s`): an explicit argument, else the environment variable
`AUTOPAR_COLLECTIVE_TIMEOUT_S`, else `DEFAULT_COLLECTIVE_TIMEOUT_S` (60 s). autopar uses it
where it starts a job's default process group (`launch.init_job_process_group`,
`faults.init_restartable`, `launch.run_world`), and the mesh's axis groups (`mesh.Mesh`)
take `group_timeout(device_type)`: the environment variable when it is set, else the
default group's own timeout, except torch's built-in default (30 minutes, which nobody
chose: a script that calls `init_process_group()` without a timeout) or an unreadable one,
which become the 60 s default. A timed-out collective raises on the ranks that wait;
`collective_errors` names it.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import datetime
import os

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
ENV_VAR = "AUTOPAR_COLLECTIVE_TIMEOUT_S"


def collective_timeout_s(timeout_s: float | None = None) -> float:
    """Seconds a collective may wait: `timeout_s` when given, else $AUTOPAR_COLLECTIVE_TIMEOUT_S,
    else 60. A value that is not a positive number is a ValueError naming where it came from."""
    if timeout_s is not None:
        where, raw = "timeout_s", timeout_s
    elif os.environ.get(ENV_VAR, "").strip():
        where, raw = ENV_VAR, os.environ[ENV_VAR].strip()
    else:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{where}={raw!r} is not a collective timeout; give a positive number of seconds "
                         f"(e.g. {ENV_VAR}=120), or leave it unset for {DEFAULT_COLLECTIVE_TIMEOUT_S:.0f} s")
    return value


def _torch_default_timeouts() -> set[datetime.timedelta]:
    from torch.distributed import constants

    out = {constants.default_pg_timeout}
    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if nccl is not None:
        out.add(nccl)
    return out


def group_timeout(device_type: str) -> datetime.timedelta:
    """The timeout for process groups autopar makes inside a running job (the mesh's axis
    groups): see the module docstring."""
    if os.environ.get(ENV_VAR, "").strip():
        return datetime.timedelta(seconds=collective_timeout_s())
    from ._torch_compat import default_group_timeout

    job = default_group_timeout(device_type)
    if job is None or job in _torch_default_timeouts():
        return datetime.timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    return job


__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "ENV_VAR", "collective_timeout_s", "group_timeout"]
