"""The worker health state machine, driven directly (no sockets)."""

from __future__ import annotations

import pytest

from cadence.router.config import WorkerSpec
from cadence.router.workers import HealthState, WorkerRegistry, is_failure_status


def make(success: int = 2, failure: int = 3):
    registry = WorkerRegistry(success_threshold=success, failure_threshold=failure)
    worker = registry.add(WorkerSpec(url="http://w:1"))
    return registry, worker


def test_new_worker_is_unknown_and_becomes_healthy_after_success_threshold():
    registry, worker = make(success=2)
    assert worker.health is HealthState.UNKNOWN and registry.routable == ()
    registry.record_probe(worker, 200, None)
    assert worker.health is HealthState.UNKNOWN
    registry.record_probe(worker, 200, None)
    assert worker.health is HealthState.HEALTHY and registry.routable == (worker,)
    assert worker.last_status == 200 and worker.last_check_time is not None


def test_failure_threshold_counts_probes_and_requests_together():
    registry, worker = make(success=1, failure=3)
    registry.record_probe(worker, 200, None)
    registry.record_probe(worker, 503, None)
    registry.record_request(worker, None, "connection refused")
    assert worker.health is HealthState.HEALTHY and worker.consecutive_failures == 2
    registry.record_request(worker, 502)
    assert worker.health is HealthState.UNHEALTHY and registry.routable == ()
    assert worker.last_error == "request answered 502" and worker.num_failures == 3


def test_a_success_breaks_the_failure_streak():
    registry, worker = make(success=1, failure=2)
    registry.record_probe(worker, 200, None)
    registry.record_request(worker, 500)
    registry.record_request(worker, 200)
    registry.record_request(worker, 500)
    assert worker.health is HealthState.HEALTHY and worker.consecutive_failures == 1


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_4xx_never_counts_as_failure(status):
    registry, worker = make(success=1, failure=1)
    registry.record_probe(worker, 200, None)
    for _ in range(5):
        registry.record_request(worker, status)
    assert worker.health is HealthState.HEALTHY and worker.num_failures == 0


def test_a_5xx_blamed_on_the_request_is_not_a_failure_and_breaks_the_streak():
    registry, worker = make(success=1, failure=2)
    registry.record_probe(worker, 200, None)
    registry.record_request(worker, 503)
    for _ in range(5):
        registry.record_request(worker, 500, is_request_fault=True)
    assert (
        worker.health is HealthState.HEALTHY
        and worker.consecutive_failures == 0
        and worker.num_failures == 1
    )


@pytest.mark.parametrize(("status", "is_failure"), [(408, True), (429, True), (500, True), (503, True),
                                                     (599, True), (200, False), (404, False), (302, False)])  # fmt: skip
def test_failure_statuses(status, is_failure):
    assert is_failure_status(status) is is_failure


def test_unhealthy_recovers_after_success_threshold_of_probes():
    registry, worker = make(success=2, failure=1)
    registry.record_probe(worker, None, "refused")
    assert worker.health is HealthState.UNHEALTHY and worker.last_error == "refused"
    registry.record_probe(worker, 200, None)
    assert worker.health is HealthState.UNHEALTHY
    registry.record_probe(worker, 200, None)
    assert worker.health is HealthState.HEALTHY and worker.last_error is None


def test_dead_ignores_probes_and_requests_until_recovered():
    registry, worker = make(success=1, failure=1)
    registry.record_probe(worker, 200, None)
    registry.update(worker, {"dead": True})
    assert worker.health is HealthState.DEAD and registry.routable == ()
    registry.record_probe(worker, 200, None)
    registry.record_request(worker, 500)
    assert worker.health is HealthState.DEAD
    registry.update(worker, {"dead": False})
    assert worker.health is HealthState.UNKNOWN and worker.consecutive_failures == 0
    registry.record_probe(worker, 200, None)
    assert worker.is_routable


def test_disabled_is_independent_of_health():
    registry, worker = make(success=1)
    registry.record_probe(worker, 200, None)
    registry.update(worker, {"disabled": True})
    assert (
        worker.health is HealthState.HEALTHY and not worker.is_routable and registry.routable == ()
    )
    registry.update(worker, {"disabled": False})
    assert registry.routable == (worker,)


def test_update_validates_fields_and_values():
    registry, worker = make()
    with pytest.raises(ValueError, match="unknown fields"):
        registry.update(worker, {"weight": 2})
    with pytest.raises(ValueError, match="disabled"):
        registry.update(worker, {"disabled": "yes"})
    with pytest.raises(ValueError, match="capabilities"):
        registry.update(worker, {"capabilities": ["flying"]})
    registry.update(worker, {"capabilities": ["chat"], "model": "m"})
    assert worker.capabilities == {"chat"} and worker.model == "m"
    assert worker.can_serve("m", frozenset({"chat"})) and not worker.can_serve(
        "m", frozenset({"embedding"})
    )
    assert not worker.can_serve("other", frozenset()) and worker.can_serve(None, frozenset())


def test_lookup_by_id_or_url_and_removal():
    registry, worker = make()
    assert registry.get(worker.id) is worker and registry.get("http://w:1") is worker
    for spelling in ("http://w:1/", "HTTP://W:1", " http://w:1 "):
        assert registry.get(spelling) is worker, spelling
    for other in ("http://w:2", "http://169.254.169.254", "not a url", ""):
        assert registry.get(other) is None, other
    with pytest.raises(KeyError):
        registry.add(WorkerSpec(url="http://w:1"))
    assert registry.remove(worker.id) is worker
    assert registry.get(worker.id) is None and len(registry) == 0
    registry.record_probe(worker, 200, None)  # a probe that lands after removal is ignored
    assert worker.consecutive_successes == 0
