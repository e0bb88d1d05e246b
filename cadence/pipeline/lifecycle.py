"""What outlives a stage process unless someone removes it: the pipeline's private socket
directory, named after its owner's pid so that a later pipeline sweeps a killed one's (the
mechanism, shared with the engine's IPC, is `cadence.liveness`)."""

from __future__ import annotations

from cadence.liveness import make_owned_dir, sweep_owned_dirs

SOCKET_DIR_PREFIX = "cadence-pipe-"


def make_socket_dir() -> str:
    """A fresh private (0700) directory for a pipeline's ipc:// sockets, after sweeping those
    whose owner died."""
    return make_owned_dir(SOCKET_DIR_PREFIX)


def sweep_socket_dirs(root: str | None = None) -> list[str]:
    """Removes our user's pipeline socket directories whose owner pid is dead."""
    return sweep_owned_dirs(SOCKET_DIR_PREFIX, root)
