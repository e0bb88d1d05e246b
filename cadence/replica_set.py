"""The life of `cadence launch` (its plan: `launch_dp.py`): replicas started together and
waited for, the router started over them, deaths watched, everything stopped in order.

A replica is a whole `cadence serve` in a child process and the router a `cadence router`,
both owned by one `Supervisor`. Nothing is restarted: a replica's death is logged as an
error naming it, its address and how it ended, and the router, whose probes see it gone,
serves on the others. A death during start-up, the router's death, or the last replica's
ends the launcher with exit code 1; a stop asked for by SIGINT/SIGTERM ends it with 0.
Standard library only, so that each child imports no more than what it runs.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request

logger = logging.getLogger("cadence.launch")

ROUTER = "router"
START_TIMEOUT_S = 1800.0  # a replica loading a large model from a slow disk
ROUTER_START_TIMEOUT_S = 300.0  # the router's probes finding every replica healthy
POLL_S = 0.5


def run_replica_process(argv: list[str], cpus, cuda_devices: str | None) -> None:
    """A replica: `cadence serve argv` on its share of the machine."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher alone, which stops in order
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before OpenMP and torch count the cores
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    from cadence.launch_server import main

    raise SystemExit(main(argv))


def run_router_process(argv: list[str]) -> None:
    """The router: `cadence router argv`."""
    os.setpgrp()
    from cadence.router.cli import main

    raise SystemExit(main(argv))


class ReplicaSet:
    """The replicas and the router of one launcher, and what has become of them."""

    def __init__(self, replicas: list, specs: list, router_spec, router_url: str):
        from cadence.supervisor import Supervisor

        self.replicas = {r.name: r for r in replicas}
        self.specs = specs  # one ProcessSpec per replica, in order
        self.router_spec = router_spec
        self.router_url = router_url
        self.supervisor = Supervisor()
        self.lost: queue.Queue = queue.Queue()  # Failures, from the supervisor's watch thread

    def run(self, stopping: threading.Event) -> int:
        """Serves until `stopping` is set (0) or it cannot go on (1); stops everything."""
        try:
            if not self._start_replicas(stopping) or not self._start_router(stopping):
                return 0 if stopping.is_set() else 1
            return self._watch(stopping)
        finally:
            logger.info("stopping the router, then the replicas")
            self.supervisor.stop()  # stop_rank: the router (0) before the replicas (1)
            logger.info("cadence launch stopped")

    def _start_replicas(self, stopping: threading.Event) -> bool:
        t0 = time.monotonic()
        for spec in self.specs:
            proc = self.supervisor.start(spec)
            replica = self.replicas[spec.name]
            logger.info("%s starting: %s, pid %d%s", spec.name, replica.url, proc.pid,
                        _share_text(replica))  # fmt: skip
        self.supervisor.watch(self.lost.put)
        pending = list(self.replicas.values())
        while pending:
            if not self._still_starting(stopping, t0, START_TIMEOUT_S, "the replicas"):
                return False
            for replica in [r for r in pending if _get(r.url + "/health")[0] == 200]:
                logger.info("%s ready: %s (%.1f s)", replica.name, replica.url,
                            time.monotonic() - t0)  # fmt: skip
                pending.remove(replica)
        return True

    def _start_router(self, stopping: threading.Event) -> bool:
        t0 = time.monotonic()
        proc = self.supervisor.start(self.router_spec)
        logger.info("router starting: %s, pid %d, over %s", self.router_url, proc.pid,
                    " ".join(r.url for r in self.replicas.values()))  # fmt: skip
        while True:
            if not self._still_starting(stopping, t0, ROUTER_START_TIMEOUT_S, "the router"):
                return False
            status, body = _get(self.router_url + "/health")
            healthy = body.get("workers_by_health", {}).get("healthy", 0) if status == 200 else 0
            if healthy == len(self.replicas):
                break
        logger.info(
            "ready: send requests to %s (the router, policy %s, over %d replicas)",
            self.router_url, body.get("policy"), len(self.replicas),
        )  # fmt: skip
        return True

    def _still_starting(self, stopping: threading.Event, t0: float, limit: float, what: str):
        """False once a stop is asked, a child died or `limit` passed (logged); else waits."""
        try:
            failure = self.lost.get(timeout=POLL_S)
        except queue.Empty:
            failure = None
        if stopping.is_set():
            return False
        if failure is not None:
            logger.error("%s during start-up; stopping everything", failure.reason)
            return False
        if time.monotonic() - t0 > limit:
            logger.error("%s did not become ready in %.0f s; stopping everything", what, limit)
            return False
        return True

    def _watch(self, stopping: threading.Event) -> int:
        alive = dict(self.replicas)
        while not stopping.is_set():
            try:
                failure = self.lost.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if stopping.is_set():
                break
            if failure.name == ROUTER:
                logger.error("%s: clients cannot reach the replicas; stopping them", failure.reason)
                return 1
            replica = alive.pop(failure.name)
            if not alive:
                logger.error("%s (%s, pid %s); no replica is left: stopping", failure.reason,
                             replica.url, failure.pid)  # fmt: skip
                return 1
            logger.error(
                "%s (%s, pid %s); it is not restarted: the router takes it out of rotation "
                "and serves on the %d left (%s)",
                failure.reason, replica.url, failure.pid, len(alive),
                " ".join(r.name for r in alive.values()),
            )  # fmt: skip
        return 0


def _share_text(replica) -> str:
    text = "" if replica.grpc_port is None else f", gRPC port {replica.grpc_port}"
    if replica.cpus is not None:
        text += f", CPU cores {_ranges(replica.cpus)}"
    if replica.cuda_devices is not None:
        text += f", CUDA devices {replica.cuda_devices}"
    return text


def _ranges(cores) -> str:
    """CPU cores as taskset writes them: 0-3,8."""
    parts: list[str] = []
    for core in cores:
        if parts and parts[-1].split("-")[-1] == str(core - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{core}"
        else:
            parts.append(str(core))
    return ",".join(parts)


# Straight to the address: a proxy from the environment has no business between the launcher
# and its own children.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> tuple[int | None, dict]:
    """Status and JSON body (empty when not JSON) of GET `url`; (None, {}) when unreachable."""
    try:
        with _OPENER.open(url, timeout=2.0) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (OSError, ValueError):
        return None, {}
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    return status, body if isinstance(body, dict) else {}
