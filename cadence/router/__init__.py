"""The router: one HTTP endpoint in front of many complete Cadence replicas.

It routes whole requests to opaque worker base URLs and never inspects the engine.
The contract is `specs/router.md`; `docs/router.md` is the user's guide. Nothing here
imports torch: the router runs on machines that have no model.
"""

from cadence.router.config import RouterConfig, WorkerSpec

__all__ = ["RouterConfig", "WorkerSpec"]
