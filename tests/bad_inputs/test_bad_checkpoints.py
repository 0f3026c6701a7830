"""Checkpoints on failing disks and after crashes: the OSError surfaces, nothing is lost.

Every failing save is checked for: the error class (CheckpointSaveError: a RuntimeError and an
OSError, never DCP's BaseException), its errno and path, that the directory is exactly as it
was before the save (the previous checkpoint intact and loadable, no staging directory left),
and that later saves work. The faults: a read-only directory (a read-only bind mount, or an
injected EROFS), a forbidden one (injected EACCES: root ignores permissions), a full disk (a
small tmpfs, or DCP streams that raise ENOSPC), a rank failing alone, and a rank killed in the
middle of a save (a gloo world of 2 whose rank 1 exits while hashing its file). Loading a
partial or damaged checkpoint names what is missing. See conftest.py for the fault kinds.
"""
from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

import autopar
from autopar import checkpoint_api as api
from autopar import models
from autopar.runtime import checkpoint_files as files
from harness import WorldError, world

MODEL = "mlp-tiny"  # 42 KB a checkpoint without optimizer state, 130 KB with AdamW's


def _trained(mesh_kw=None):
    spec = models.get(MODEL)
    torch.manual_seed(0)
    (x,), y = spec.example_batch(4, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(spec.build(), autopar.mesh(**(mesh_kw or {"dp": 1}), device_type="cpu"),
                             example_inputs=x)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    pm.step(((x,), y), spec.loss_fn)
    opt.step()
    opt.zero_grad()
    return pm, opt


@pytest.fixture(scope="module")
def trained():
    return _trained()


def _params(pm) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pm.program.module.named_parameters()}


def _assert_loads(pm, opt, path: str, step: int, atol: float = 0.0) -> None:
    """The checkpoint loads, and holds the parameters `pm` has (bit-equal when `pm` saved it)."""
    before = _params(pm)
    info = api.load(pm, path, optimizer=opt)
    assert info["step"] == step
    for k, v in _params(pm).items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=atol)


# --- failing disks -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, err", [("mount", errno.EROFS), ("injected", errno.EROFS), ("injected", errno.EACCES)])
def test_save_into_a_read_only_or_forbidden_directory_raises_its_oserror_with_the_path(trained, failing_dir, kind,
                                                                                    err, unchanged):
    pm, opt = trained
    root = failing_dir(kind, err, setup=lambda d: api.save(pm, f"{d}/step_1", optimizer=opt, step=1))
    for async_save in (False, True):  # an asynchronous save fails at once too: the directory is checked first
        with unchanged(root), pytest.raises(api.CheckpointSaveError) as e:
            api.save(pm, f"{root}/step_2", optimizer=opt, step=2, async_save=async_save)
        assert isinstance(e.value, OSError) and isinstance(e.value, RuntimeError) and e.value.errno == err
        assert e.value.filename and e.value.filename.startswith(root)
        msg = str(e.value)
        assert errno.errorcode[err] in msg and f"{root}/step_2" in msg and "previous checkpoints are untouched" in msg
        assert ("read-only" if err == errno.EROFS else "permission") in msg
    assert sorted(os.listdir(root)) == ["step_1"]
    _assert_loads(pm, opt, f"{root}/step_1", 1)


@pytest.mark.parametrize("kind", ["mount", "injected"])
def test_save_onto_a_full_disk_raises_enospc_and_keeps_nothing_of_itself(trained, failing_dir, kind, unchanged):
    pm, opt = trained
    root = failing_dir(kind, errno.ENOSPC, setup=lambda d: api.save(pm, f"{d}/step_1", optimizer=opt, step=1))
    with unchanged(root), pytest.raises(api.CheckpointSaveError) as e:
        api.save(pm, f"{root}/step_2", optimizer=opt, step=2)
    assert e.value.errno == errno.ENOSPC and e.value.rank == 0
    assert "ENOSPC" in str(e.value) and "the disk is full" in str(e.value) and f"{root}/step_2" in str(e.value)
    assert sorted(os.listdir(root)) == ["step_1"]  # no .step_2.tmp-* staging directory
    _assert_loads(pm, opt, f"{root}/step_1", 1)


def test_a_failed_async_save_is_reported_at_wait_once_and_later_saves_work(trained, failing_dir, tmp_path):
    pm, opt = trained
    full = failing_dir("injected", errno.ENOSPC)
    h = api.save(pm, f"{full}/step_2", optimizer=opt, step=2, async_save=True)
    with pytest.raises(api.CheckpointSaveError) as e:
        h.wait()
    assert e.value.errno == errno.ENOSPC and "ENOSPC" in str(e.value)
    with pytest.raises(api.CheckpointSaveError):  # wait() keeps answering with the same error
        h.wait()
    assert os.listdir(full) == []
    good = str(tmp_path / "good")
    assert api.save(pm, f"{good}/step_3", optimizer=opt, step=3).wait() == f"{good}/step_3"  # not poisoned
    assert api.save(pm, f"{good}/step_4", optimizer=opt, step=4, async_save=True).wait() == f"{good}/step_4"
    _assert_loads(pm, opt, f"{good}/step_4", 4)


def test_a_failed_async_save_nobody_waited_for_is_reported_by_the_next_save_only(trained, failing_dir, tmp_path,
                                                                               unchanged):
    pm, opt = trained
    full = failing_dir("injected", errno.ENOSPC)
    api.save(pm, f"{full}/step_2", optimizer=opt, step=2, async_save=True)  # its handle is dropped
    good = tmp_path / "good"
    good.mkdir()
    with unchanged(good), pytest.raises(api.CheckpointSaveError) as e:
        api.save(pm, f"{good}/step_3", optimizer=opt, step=3)
    msg = str(e.value)
    assert f"{full}/step_2" in msg and "was not waited for" in msg and "Nothing of this new save was started" in msg
    assert e.value.errno == errno.ENOSPC
    api.save(pm, f"{good}/step_3", optimizer=opt, step=3)  # reported once: the same call now saves
    assert sorted(os.listdir(good)) == ["step_3"]
    _assert_loads(pm, opt, f"{good}/step_3", 3)


# --- crashes -------------------------------------------------------------------------------------
def test_the_next_save_removes_what_a_crash_left_and_restores_an_interrupted_overwrite(trained, tmp_path):
    pm, opt = trained
    root = str(tmp_path / "ck")
    api.save(pm, f"{root}/step_1", optimizer=opt, step=1)
    # a save killed while writing, and an overwrite of step_1 killed between its two renames
    os.makedirs(f"{root}/.step_2.tmp-0123456789ab")
    open(f"{root}/.step_2.tmp-0123456789ab/__0_0.distcp", "wb").write(b"half")
    os.rename(f"{root}/step_1", f"{root}/.step_1.old-abcdef012345")
    os.makedirs(f"{root}/.step_1.tmp-abcdef012345")
    assert api.latest_checkpoint(root) is None  # nothing complete is visible
    api.save(pm, f"{root}/step_3", optimizer=opt, step=3)
    assert sorted(os.listdir(root)) == ["step_1", "step_3"]
    assert api.latest_checkpoint(root) == f"{root}/step_3"
    _assert_loads(pm, opt, f"{root}/step_1", 1)


def _kill_mid_save(rank, ws, root):
    pm, opt = _trained({"dp": 2})
    api.save(pm, f"{root}/step_1", optimizer=opt, step=1)
    # the job is killed (both ranks, as by SIGKILL or a node loss) after writing its data files and
    # before the manifest: nobody is left to clean up
    files.sha256 = lambda p: os._exit(9)
    api.save(pm, f"{root}/step_2", optimizer=opt, step=2)
    return "finished"


def test_ranks_killed_mid_save_leave_staging_that_the_next_save_removes(tmp_path):
    root = str(tmp_path / "ck")
    with pytest.raises(WorldError, match="exited with code 9"):
        world(2, _kill_mid_save, root, timeout_s=120)
    left = sorted(os.listdir(root))
    assert left[0].startswith(".step_2.tmp-") and left[1:] == ["step_1"], left
    files.verify_checkpoint(f"{root}/step_1", collective=False)  # the previous checkpoint is whole
    pm, opt = _trained()
    # written by dp=2, read by one process trained alike: equal up to the summation order of dp=2's
    # gradient average (one AdamW step of lr 1e-2 moves parameters by ~1e-2; 1e-6 is far below)
    _assert_loads(pm, opt, f"{root}/step_1", 1, atol=1e-6)
    api.save(pm, f"{root}/step_3", optimizer=opt, step=3)
    assert sorted(os.listdir(root)) == ["step_1", "step_3"]


def _one_rank_fails(rank, ws, root):
    import contextlib

    from torch.distributed.checkpoint import filesystem as dfs

    pm, opt = _trained({"dp": 2})
    api.save(pm, f"{root}/step_1", optimizer=opt, step=1)
    real = dfs.FileSystem.create_stream

    @contextlib.contextmanager
    def full(self, path, mode):  # rank 1's disk is full
        with real(self, path, mode) as s:
            def write(b):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            s.write = write
            yield s
    out = {}
    if rank == 1:
        dfs.FileSystem.create_stream = full
    try:
        api.save(pm, f"{root}/step_2", optimizer=opt, step=2)
    except api.CheckpointSaveError as e:
        out["sync"] = (e.errno, e.rank, str(e))
    h = api.save(pm, f"{root}/step_3", optimizer=opt, step=3, async_save=True)
    try:
        h.wait()
    except api.CheckpointSaveError as e:
        out["async"] = (e.errno, e.rank, str(e))
    dfs.FileSystem.create_stream = real
    api.save(pm, f"{root}/step_4", optimizer=opt, step=4)  # neither failure poisons this one
    out["listing"] = sorted(os.listdir(root))
    return out


def test_a_rank_failing_alone_fails_the_save_on_every_rank_with_its_errno(tmp_path):
    root = str(tmp_path / "ck")
    res = world(2, _one_rank_fails, root, timeout_s=180)
    for r in res:
        for what in ("sync", "async"):
            code, rank, msg = r[what]
            assert code == errno.ENOSPC and rank == 1, r
            assert "failed on rank 1" in msg and "ENOSPC" in msg
        assert r["listing"] == ["step_1", "step_4"]
    pm, opt = _trained()
    _assert_loads(pm, opt, f"{root}/step_4", 4, atol=1e-6)  # dp=2's summation order, as above


# --- partial and damaged checkpoints ---------------------------------------------------------------
@pytest.mark.parametrize("damage, verify, words", [
    ("no .metadata", "none", [".metadata is missing"]),
    ("no .metadata", "full", [".metadata: missing"]),
    ("no data file", "none", ["incomplete", "missing __0_0.distcp"]),
    ("no data file", "size", ["__0_0.distcp: missing"]),
    ("manifest files not an object", "none", ["'files' should be an object"]),
    ("manifest files not an object", "full", ["'files' should be an object"]),
    ("staging directory", "full", ["autopar_manifest.json is missing"]),
])
def test_loading_a_partial_or_damaged_checkpoint_names_what_is_missing(trained, tmp_path, damage, verify, words,
                                                                      unchanged):
    pm, opt = trained
    src = str(tmp_path / "step_1")
    api.save(pm, src, optimizer=opt, step=1)
    bad = str(tmp_path / (".step_2.tmp-0123456789ab" if damage == "staging directory" else "step_2"))
    shutil.copytree(src, bad)
    if damage == "no .metadata":
        os.remove(f"{bad}/.metadata")
    elif damage == "no data file":
        os.remove(f"{bad}/__0_0.distcp")
    elif damage == "manifest files not an object":
        m = json.load(open(f"{bad}/{files.MANIFEST}"))
        m["files"] = ["__0_0.distcp"]
        json.dump(m, open(f"{bad}/{files.MANIFEST}", "w"))
    else:
        os.remove(f"{bad}/{files.MANIFEST}")
    before = _params(pm)
    with unchanged(str(tmp_path)), pytest.raises(api.CheckpointError) as e:
        api.load(pm, bad, optimizer=opt, verify=verify)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), str(e.value)
    for k, v in _params(pm).items():  # a refused load leaves the model as it was
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("kwargs, words", [
    ({"extra": {"when": object()}}, ["extra must be JSON"]),
    ({"extra": {"loss": float("nan")}}, ["extra must be JSON"]),
    ({"step": "7"}, ["step must be an integer", "'7'"]),
    ({"path": ""}, ["path is empty"]),
    ({"path": "FILE"}, ["is a file", "a checkpoint is a directory"]),
    ({"path": "EXISTS"}, ["exists", "overwrite=True"]),
])
def test_save_arguments_are_refused_before_anything_is_written(trained, tmp_path, kwargs, words, unchanged):
    pm, opt = trained
    (tmp_path / "FILE").write_text("not a checkpoint")
    api.save(pm, str(tmp_path / "EXISTS"), optimizer=opt, step=0)
    path = kwargs.pop("path", "step_9")
    target = "" if path == "" else str(tmp_path / path)
    with unchanged(str(tmp_path)), pytest.raises(ValueError) as e:
        api.save(pm, target, optimizer=opt, **kwargs)
    for w in words:
        assert w in str(e.value), str(e.value)
