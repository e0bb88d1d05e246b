"""`cadence serve --pipeline`: the flag's checks, shipped names, and the accessor the serving
layer reaches the coordinator through (ServerState.pipeline_client / pipeline_problem)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from cadence.errors import RequestError
from cadence.pipeline import config as pipeline_config
from cadence.pipeline import resolve_pipeline_path
from cadence.server_args import ServerArgs
from cadence.serving.state import ServerState

YAML = """
stages:
  - {name: a, executor: "pipeline_executors:Step", terminal: true}
"""


@pytest.fixture
def declaration(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text(YAML)
    return str(path)


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A package directory of shipped pipelines holding `demo.yaml`."""
    (tmp_path / "demo.yaml").write_text(YAML)
    monkeypatch.setattr(pipeline_config, "PACKAGED_DIR", str(tmp_path))
    return str(tmp_path / "demo.yaml")


def test_a_path_or_a_shipped_name(declaration, shipped):
    assert resolve_pipeline_path(declaration) == declaration
    assert resolve_pipeline_path("demo") == shipped
    assert ServerArgs(pipeline="demo").pipeline_path == shipped
    assert ServerArgs().pipeline_path is None


def test_an_unknown_pipeline_lists_the_shipped_ones(shipped):
    with pytest.raises(ValueError, match=r"no such file 'speach'.*\(shipped: demo\)"):
        ServerArgs(pipeline="speach")


def test_the_flags_that_do_not_go_together(declaration):
    with pytest.raises(ValueError, match="pipeline_restart_stages needs --pipeline"):
        ServerArgs(pipeline_restart_stages=True)
    with pytest.raises(ValueError, match="give --api-workers 1 with --pipeline"):
        ServerArgs(pipeline=declaration, api_workers=2)
    assert ServerArgs(pipeline=declaration, pipeline_restart_stages=True).pipeline_restart_stages


def test_the_shipped_pipelines_directory_exists():
    assert os.path.isdir(pipeline_config.PACKAGED_DIR)
    assert all(isinstance(n, str) for n in pipeline_config.packaged_pipelines())


def test_the_accessor_without_a_pipeline():
    state = ServerState(ServerArgs())
    assert state.pipeline_problem is None
    with pytest.raises(RequestError, match="start it with --pipeline") as e:
        state.pipeline_client()
    assert e.value.status == 400


def test_the_accessor_while_starting_then_ready_then_down(declaration):
    state = ServerState(ServerArgs(pipeline=declaration))
    assert state.pipeline_problem == "the pipeline is starting"
    with pytest.raises(RequestError) as e:
        state.pipeline_client()
    assert e.value.status == 503
    coordinator = SimpleNamespace(unhealthy_reason=None)  # what the launcher's Pipeline holds
    state.pipeline = SimpleNamespace(coordinator=coordinator)
    assert state.pipeline_problem is None
    assert state.pipeline_client() is coordinator
    coordinator.unhealthy_reason = "stage process b was killed by SIGKILL"
    assert state.pipeline_problem == "stage process b was killed by SIGKILL"
