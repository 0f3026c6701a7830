"""Fixtures for the bad-input tests: a snapshot of a directory (to assert that a refused call
wrote or changed nothing), and the disks that fail: read-only, full, forbidden.

`failing_dir(kind, err)` gives a directory that fails with `err` in one of two ways:
  * "mount" (only where this process may mount, e.g. root in CI's container; skipped
    elsewhere): a read-only bind mount (`mount --bind` + `remount,ro`; chmod does not stop
    root) for EROFS, a 256 KiB tmpfs for ENOSPC;
  * "injected" (everywhere): a fault-injecting wrapper in this process: DCP's FileSystem and
    `os.open` / `os.makedirs` under the directory raise OSError(err) (EROFS, EACCES) when they
    create something, or (ENOSPC) DCP's streams raise on the first write.
The directory is prepared writable first (`setup(fn)` runs `fn(path)` before the fault is
armed), so a previous checkpoint can be put there.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import uuid

import pytest


def snapshot(root: str) -> dict[str, tuple]:
    """Every file and directory under `root`: path -> (kind, size, sha256, mtime_ns)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root)] = ("dir",)
        for name in files:
            p = os.path.join(d, name)
            st = os.stat(p)
            with open(p, "rb") as f:
                h = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = ("file", st.st_size, h, st.st_mtime_ns)
    return out


@pytest.fixture
def unchanged():
    """`with unchanged(dir): ...` fails when anything under dir was created, removed or changed."""
    @contextlib.contextmanager
    def check(root):
        before = snapshot(str(root))
        yield
        after = snapshot(str(root))
        assert after == before, {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
                                 "changed": sorted(k for k in before if k in after and before[k] != after[k])}
    return check


def _can_mount() -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = f"/tmp/autopar-mount-probe-{uuid.uuid4().hex[:8]}"
    os.makedirs(probe)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", probe], check=True)
        return ok
    finally:
        os.rmdir(probe)


MOUNT = _can_mount()


def inject(monkeypatch, prefix: str, err: int) -> None:
    """Arm the fault-injecting wrapper for everything under `prefix` (see the module docstring)."""
    from torch.distributed.checkpoint import filesystem as dfs

    prefix = os.path.abspath(prefix)

    def under(p) -> bool:
        try:
            return os.path.abspath(os.fspath(p)).startswith(prefix)
        except TypeError:
            return False

    real_os_open, real_makedirs = os.open, os.makedirs
    real_stream, real_mkdir = dfs.FileSystem.create_stream, dfs.FileSystem.mkdir

    def fail(p):
        raise OSError(err, os.strerror(err), os.fspath(p))

    if err == errno.ENOSPC:
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with real_stream(self, path, mode) as s:
                if under(path) and any(c in mode for c in "wa+"):
                    def write(b, _s=s):
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    s.write = write
                yield s
        monkeypatch.setattr(dfs.FileSystem, "create_stream", create_stream)
        return

    def os_open(p, flags, *a, **k):
        if under(p) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            fail(p)
        return real_os_open(p, flags, *a, **k)

    def makedirs(p, *a, **k):
        if under(p) and not os.path.isdir(p):
            fail(p)
        return real_makedirs(p, *a, **k)

    def mkdir(self, path):
        if under(path):
            fail(path)
        return real_mkdir(self, path)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "makedirs", makedirs)
    monkeypatch.setattr(dfs.FileSystem, "mkdir", mkdir)


@pytest.fixture
def failing_dir(tmp_path, monkeypatch):
    """failing_dir(kind, err, setup=None) -> the path (see the module docstring)."""
    cleanup = []

    def make(kind: str, err: int, setup=None, size: str = "160k") -> str:
        if kind == "mount" and not MOUNT:
            pytest.skip("this process may not mount (not root, or no mount permission); the 'injected' variant "
                        "of this test runs instead")
        rw = tmp_path / f"rw_{len(cleanup)}"
        rw.mkdir()
        if kind == "injected":
            if setup:
                setup(str(rw))
            inject(monkeypatch, str(rw), err)
            return str(rw)
        if err == errno.ENOSPC:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(rw)], check=True)
            cleanup.append(str(rw))
            if setup:
                setup(str(rw))
            return str(rw)
        if setup:
            setup(str(rw))
        ro = tmp_path / f"ro_{len(cleanup)}"
        ro.mkdir()
        subprocess.run(["mount", "--bind", str(rw), str(ro)], check=True)
        cleanup.append(str(ro))
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        return str(ro)

    yield make
    for p in reversed(cleanup):
        subprocess.run(["umount", p], check=False)
