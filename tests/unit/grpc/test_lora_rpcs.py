"""LoRA over both gRPC services, through a real FrontClient whose scheduler is played by
the test (tests/unit/front/lora_scheduler.py): SGLang's scheduler service names an
adapter in GenerateRequest.lora_id (its server id, the id its loader minted, or its
name) and loads, unloads and lists adapters; our service names it in `lora_path`. An
unknown adapter is INVALID_ARGUMENT naming the field, and nothing reaches the scheduler."""

from __future__ import annotations

import grpc
import pytest

from cadence.grpc import sglang_pb2 as ours
from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc.scheduler_servicer import SglangSchedulerServicer
from cadence.grpc.servicer import SglangServicer
from cadence.server_args import ServerArgs
from cadence.serving.state import ServerState
from tests.unit.front.lora_scheduler import MODEL, adapter, make_client


class Aborted(Exception):
    pass


class Context:
    code = None

    async def abort(self, code, details="", trailing_metadata=()):
        self.code, self.details = code, details
        raise Aborted(code, details)


def services(enabled=True, known=None):
    client, scheduler = make_client(enabled=enabled, known=known)
    state = ServerState(args=ServerArgs(), client=client, is_ready=True)
    return SglangSchedulerServicer(state), SglangServicer(state), client, scheduler


def gen_request(lora_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="g1",
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=1),
        lora_id=lora_id,
    )


async def collect(agen):
    return [m async for m in agen]


# ---- SGLang's scheduler service ----------------------------------------------------------


@pytest.mark.parametrize("key", ["server id", "name"])
async def test_generate_names_the_adapter_by_its_id_or_name(key):
    svc, _, _, scheduler = services()
    lora_id = adapter("sql").lora_id if key == "server id" else "sql"
    msgs = await collect(svc.Generate(gen_request(lora_id), Context()))
    assert msgs[-1].WhichOneof("response") == "complete"
    assert [r.lora_path for r in scheduler.requests] == ["sql"]


async def test_generate_without_lora_id_runs_the_base_model():
    svc, _, _, scheduler = services()
    await collect(svc.Generate(gen_request(""), Context()))
    assert [r.lora_path for r in scheduler.requests] == [None]


@pytest.mark.parametrize(
    "enabled, message", [(True, "'nope' is not loaded"), (False, "LoRA is not enabled")]
)
async def test_an_unknown_lora_id_is_invalid_argument_naming_it(enabled, message):
    svc, _, _, scheduler = services(enabled=enabled)
    context = Context()
    with pytest.raises(Aborted):
        await collect(svc.Generate(gen_request("nope"), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("lora_id: ") and message in context.details
    assert scheduler.requests == []


async def test_load_with_a_minted_id_then_generate_list_and_unload_by_it():
    svc, _, client, scheduler = services()
    out = await svc.LoadLoRAAdapter(
        pb.LoadLoRAAdapterRequest(lora_name="new", lora_path="/adapters/new", lora_id="m-1"),
        Context(),
    )
    assert out.success and out.message == ""
    assert sorted(out.loaded_lora_ids) == sorted(
        [adapter("sql").lora_id, adapter("chat").lora_id, "m-1"]
    )
    await collect(svc.Generate(gen_request("m-1"), Context()))
    assert scheduler.requests[-1].lora_path == "new"
    listed = await svc.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), Context())
    new = [a for a in listed.loaded_adapters if a.lora_name == "new"]
    assert [(a.lora_id, a.lora_path, a.pinned) for a in new] == [("m-1", "/adapters/new", False)]
    gone = await svc.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_id="m-1"), Context())
    assert gone.success and "m-1" not in gone.loaded_lora_ids
    context = Context()
    with pytest.raises(Aborted):
        await collect(svc.Generate(gen_request("m-1"), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_failed_load_answers_success_false_with_why():
    svc, _, _, _ = services()
    out = await svc.LoadLoRAAdapter(
        pb.LoadLoRAAdapterRequest(lora_name="sql", lora_path="/adapters/sql"), Context()
    )
    assert not out.success and "already loaded" in out.message
    off, _, _, scheduler = services(enabled=False)
    out = await off.LoadLoRAAdapter(
        pb.LoadLoRAAdapterRequest(lora_name="x", lora_path="/a"), Context()
    )
    assert not out.success and "--enable-lora" in out.message and scheduler.sent == []
    listed = await off.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), Context())
    assert list(listed.loaded_adapters) == []


@pytest.mark.parametrize(
    "method, request_, field",
    [
        ("LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_path="/a"), "lora_name"),
        ("LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name="x"), "lora_path"),
        ("UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(), "lora_name"),
    ],
)
async def test_lora_rpcs_refuse_a_missing_field_naming_it(method, request_, field):
    svc, _, _, scheduler = services()
    context = Context()
    with pytest.raises(Aborted):
        await getattr(svc, method)(request_, context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and field in context.details
    assert scheduler.sent == []


# ---- our service ---------------------------------------------------------------------------


def text_request(**fields) -> ours.TextGenerateRequest:
    params = ours.SamplingParams(max_new_tokens=1)
    return ours.TextGenerateRequest(text="hi", sampling_params=params, **fields)


async def test_text_generate_passes_lora_path():
    _, svc, _, scheduler = services()
    msgs = await collect(svc.TextGenerate(text_request(lora_path="chat"), Context()))
    assert msgs[-1].finished and [r.lora_path for r in scheduler.requests] == ["chat"]


async def test_text_generate_refuses_an_unknown_lora_path():
    _, svc, _, scheduler = services()
    context = Context()
    with pytest.raises(Aborted):
        await collect(svc.TextGenerate(text_request(lora_path="nope"), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("lora_path: ") and scheduler.requests == []


async def test_list_models_has_the_adapter_cards():
    _, svc, _, _ = services()
    models = (await svc.ListModels(ours.ListModelsRequest(), Context())).models
    assert [(m.id, m.parent, m.root) for m in models[1:]] == [
        ("sql", MODEL, "/adapters/sql"),
        ("chat", MODEL, "/adapters/chat"),
    ]
