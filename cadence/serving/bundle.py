"""The serving objects of one front process, built once and handed to both adapters.

The HTTP app's routes and the gRPC servicers answer through the same `OpenAIServing`,
`ResponsesServing`, `EmbeddingServing`, `SpeechServing` and `Invocations`: one chat
template read (a bad --chat-template stops the server at start-up, whichever adapter is
built first), one store of responses, one set of capabilities.
"""

from __future__ import annotations

import dataclasses

from cadence.serving.embedding_serving import EmbeddingServing
from cadence.serving.invocations import Invocations
from cadence.serving.openai_serving import OpenAIServing
from cadence.serving.responses import ResponsesServing
from cadence.serving.speech_serving import SpeechServing
from cadence.serving.state import ServerState


@dataclasses.dataclass(frozen=True)
class Serving:
    openai: OpenAIServing
    responses: ResponsesServing
    embeddings: EmbeddingServing
    speech: SpeechServing
    invocations: Invocations

    @classmethod
    def build(cls, state: ServerState) -> Serving:
        openai = OpenAIServing(state)  # reads --chat-template
        embeddings = EmbeddingServing(state, openai)
        return cls(
            openai=openai,
            responses=ResponsesServing(openai),
            embeddings=embeddings,
            speech=SpeechServing(state),
            invocations=Invocations(openai, embeddings),
        )


def serving_of(state: ServerState) -> Serving:
    """`state`'s serving objects: built by the first adapter that asks, then shared."""
    if state.serving is None:
        serving = state.serving = Serving.build(state)
        state.chat_template = serving.openai.chat_template
        return serving
    assert isinstance(state.serving, Serving)
    return state.serving
