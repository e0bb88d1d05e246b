"""The serving objects of a front process are built once: the HTTP app and both gRPC
servicers answer through the same ones, and the chat template is read once."""

from __future__ import annotations

import pytest

from cadence.entrypoints.http_server import build_app
from cadence.grpc.servicer import SglangServicer
from cadence.server_args import ServerArgs
from cadence.serving.bundle import serving_of
from cadence.serving.state import ServerState


def test_http_and_grpc_share_one_set_of_serving_objects(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    state = ServerState(ServerArgs(chat_template=str(template)))
    build_app(state)
    bundle = state.serving
    assert bundle is not None and serving_of(state) is bundle
    servicer = SglangServicer(state)
    assert servicer.openai is bundle.openai
    assert servicer.embedding is bundle.embeddings and servicer.speech is bundle.speech
    assert bundle.invocations.openai is bundle.openai and bundle.responses.openai is bundle.openai
    assert state.chat_template == template.read_text() == bundle.openai.chat_template
    # A second adapter does not read the template again: a file changed meanwhile is not seen.
    template.write_text("changed")
    SglangServicer(state)
    assert state.chat_template != "changed"


def test_a_bad_chat_template_stops_whichever_adapter_is_built_first(tmp_path):
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        SglangServicer(ServerState(ServerArgs(chat_template=str(template))))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        build_app(ServerState(ServerArgs(chat_template=str(template))))
