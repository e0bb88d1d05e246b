"""What outlives a process unless someone removes it: pid liveness, the private socket
directory (named after its owner's pid, so a later pipeline sweeps a killed one's), and
children that die with their parent. Linux-first, like the rest of the runtime."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile

SOCKET_DIR_PREFIX = "cadence-pipe-"


def is_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def make_socket_dir() -> str:
    """A fresh private (0700) directory for a pipeline's ipc:// sockets, after sweeping those
    whose owner died."""
    sweep_socket_dirs()
    path = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    os.chmod(path, 0o700)
    return path


def sweep_socket_dirs(root: str | None = None) -> list[str]:
    """Removes our user's pipeline socket directories whose owner pid is dead."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid = name[len(SOCKET_DIR_PREFIX) :].split("-", 1)[0]
        if not name.startswith(SOCKET_DIR_PREFIX) or not pid.isdigit():
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
    """Ask the kernel to SIGTERM this process when its parent dies (Linux; elsewhere the
    parent-pid check at start is all there is)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass
