"""Collective timeouts and failure naming, without processes: the timeout's resolution
(argument, AUTOPAR_COLLECTIVE_TIMEOUT_S, 60 s), the mesh groups' timeout in a one-rank job,
the graph node read from fx's generated code, and which errors are renamed."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.runtime import collective_errors as E
from autopar.runtime.timeouts import DEFAULT_COLLECTIVE_TIMEOUT_S, ENV_VAR, collective_timeout_s, group_timeout


def test_collective_timeout_is_60_s_unless_given_or_set_in_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert DEFAULT_COLLECTIVE_TIMEOUT_S == 60.0 and collective_timeout_s() == 60.0
    monkeypatch.setenv(ENV_VAR, "7.5")
    assert collective_timeout_s() == 7.5
    assert collective_timeout_s(12) == 12.0  # an argument wins
    for bad in ("abc", "0", "-3", "inf"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{ENV_VAR}='{bad}' is not a collective timeout"):
            collective_timeout_s()
    with pytest.raises(ValueError, match="timeout_s=0 is not a collective timeout"):
        collective_timeout_s(0)


@pytest.mark.parametrize("job_s, env, want_s", [(None, None, 60.0), (7.0, None, 7.0), (7.0, "11", 11.0)])
def test_mesh_groups_time_out_as_the_job_does_or_after_60_s_under_torchs_untouched_default(monkeypatch, job_s, env,
                                                                                          want_s):
    monkeypatch.delenv(ENV_VAR, raising=False)
    if env:
        monkeypatch.setenv(ENV_VAR, env)
    kw = {} if job_s is None else {"timeout": datetime.timedelta(seconds=job_s)}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, **kw)
    try:
        assert group_timeout("cpu") == datetime.timedelta(seconds=want_s)
    finally:
        dist.destroy_process_group()


def _timed_out(*args, group=None, async_op=False):
    raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")


def _gather(x):  # what a graph collective does: issue the communication, which fails here
    E.issue("all_gather", _timed_out, x, axis="tp", seq=4)
    return x


torch.fx.wrap("_gather")


class _Net(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        return _gather(y) * 2


def test_a_failed_collective_inside_a_graph_names_the_op_the_step_and_the_node():
    gm = fx.symbolic_trace(_Net())
    node = next(n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is _gather)
    with E.where("step 3"), E.where("micro-batch 1/2 forward"):
        with pytest.raises(E.CollectiveError) as ei:
            gm(torch.ones(2))
    msg = str(ei.value)
    assert msg.startswith(f"rank 0: collective all_gather on axis 'tp' #4 failed at step 3 > "
                          f"micro-batch 1/2 forward > graph node {node}: no other rank takes part"), msg
    assert "torch says: Timed out waiting 5000ms" in msg
    assert isinstance(ei.value, RuntimeError) and isinstance(ei.value.__cause__, RuntimeError)
    assert E.current_where() == ()


def test_errors_that_are_not_communication_failures_pass_unchanged():
    def shape_error(*args, group=None, async_op=False):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="mat1 and mat2") as ei:
        E.issue("all_reduce", shape_error, axis="dp")
    assert not isinstance(ei.value, E.CollectiveError)
    with pytest.raises(ValueError, match="bad"):
        with E.failed("all_reduce", axis="dp"):
            raise ValueError("bad")


def test_an_asynchronous_collective_is_named_when_waited_for_with_the_step_it_was_launched_in():
    class Work:
        def wait(self):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:5788")

    with E.where("step 2"), E.where("micro-batch 1/1 backward"):
        w = E.issue("reduce_scatter", lambda *a, group=None, async_op=False: Work(), axis="dp", seq=9, async_op=True)
    assert isinstance(w, E.NamedWork)
    with E.where("step 2"), E.where("gradient reduction"):
        with pytest.raises(E.CollectiveError, match=r"reduce_scatter on axis 'dp' #9 failed at step 2 > micro-batch "
                                                    r"1/1 backward \(waited for in step 2 > gradient reduction\)"):
            w.wait()
