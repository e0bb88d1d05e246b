"""The one readiness gate both protocols use: 503 while stopping, 503 while loading (unless
the route is open while loading), the protocol's own retry hint, and the gRPC services'
UNAVAILABLE from the same check."""

from __future__ import annotations

import grpc
import pytest

from cadence.errors import RequestError
from cadence.grpc.errors import code_for_http_status
from cadence.grpc.scheduler_servicer import SglangSchedulerServicer
from cadence.server_args import ServerArgs
from cadence.serving.state import ServerState


def state(ready: bool, stopping: bool = False) -> ServerState:
    s = ServerState(ServerArgs())
    s.is_ready, s.is_shutting_down = ready, stopping
    return s


def test_loading_is_503_unless_the_route_is_open_while_loading():
    with pytest.raises(RequestError, match="^the server is starting: the model is loading$") as e:
        state(ready=False).check_ready()
    assert e.value.status == 503
    state(ready=False).check_ready(while_loading=True)  # /health, /metrics, /server_info
    state(ready=True).check_ready()


def test_stopping_is_503_even_where_loading_is_open():
    for while_loading in (False, True):
        with pytest.raises(RequestError, match="^the server is shutting down$") as e:
            state(ready=True, stopping=True).check_ready(while_loading=while_loading)
        assert e.value.status == 503


def test_each_protocol_adds_its_retry_hint():
    with pytest.raises(RequestError) as e:
        state(ready=False).check_ready(hint="; retry once HealthCheck passes")
    assert (
        str(e.value)
        == "the server is starting: the model is loading; retry once HealthCheck passes"
    )


def test_the_grpc_services_answer_unavailable_from_the_same_gate():
    servicer = SglangSchedulerServicer(state(ready=False))
    with pytest.raises(RequestError) as e:
        servicer._client()
    assert code_for_http_status(e.value.status) == grpc.StatusCode.UNAVAILABLE
    assert "retry once HealthCheck passes" in str(e.value)


def test_health_says_why_it_fails():
    assert state(ready=False).health_problem() == "starting"
    assert state(ready=True, stopping=True).health_problem() == "shutting down"
    assert state(ready=True).health_problem() is None
