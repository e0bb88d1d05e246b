"""Which processes are alive, and what dead ones leave behind: private directories named
after their owner's pid (`<prefix><pid>-...`), swept by the next process that makes one,
and children that die with their parent. Standard library only: the engine's IPC and the
stage pipeline both build on it. Linux-first."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile


def is_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process with that pid: not ours to judge
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def make_owned_dir(prefix: str) -> str:
    """A fresh private (0700) directory named after this process, once the directories of
    dead owners with the same prefix are gone."""
    sweep_owned_dirs(prefix)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    os.chmod(path, 0o700)
    return path


def sweep_owned_dirs(prefix: str, root: str | None = None) -> list[str]:
    """Removes our user's `<prefix><pid>-...` directories in `root` (the temp directory)
    whose owner pid is dead, e.g. after a SIGKILL; returns what it removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0]
        if not name.startswith(prefix) or not pid.isdigit():
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or is_alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies: no orphans, even after a
    SIGKILL of the parent (Linux only; elsewhere the parent-pid checks in the loops cover it)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass
