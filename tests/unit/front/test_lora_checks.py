"""The front's LoRA checks, over a scheduler played by the test (tests/unit/front/
lora_scheduler.py): how an OpenAI `model` string names an adapter, the copy of the loaded
set and its one lookup at the scheduler on a miss, /generate's per-item `lora_path`, and
the named control methods. No model, no process."""

from __future__ import annotations

import asyncio

import pytest

from cadence.errors import InvalidParameter
from cadence.front.lora import LoRARegistry, lora_not_enabled, split_model
from cadence.io_struct import (
    GenerateReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
)
from tests.unit.front.lora_scheduler import MODEL, adapter, make_client

SERVED = (MODEL, "alias:with-colon")


# ---- the model string ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, expected",
    [
        (None, (None, None)),
        ("", ("", None)),
        (MODEL, (MODEL, None)),
        ("gpt-4", ("gpt-4", None)),  # any other name: the base model (or an adapter's name)
        ("alias:with-colon", ("alias:with-colon", None)),  # a served name, colon and all
        (f"{MODEL}:sql", (MODEL, "sql")),
        ("alias:with-colon:sql", ("alias:with-colon", "sql")),  # the served name comes first
        ("other:sql", ("other", "sql")),  # split on the first colon
        ("other:a:b", ("other", "a:b")),
        (f"{MODEL}: sql ", (MODEL, "sql")),
        (f"{MODEL}:", (MODEL, None)),  # an empty adapter part names none
    ],
)
def test_split_model_follows_sglang(model, expected):
    assert split_model(model, SERVED) == expected


# ---- the registry ------------------------------------------------------------------------------


class Lookups:
    """The scheduler side of a registry: answers a lookup with `loaded`, after `delay`."""

    def __init__(self, registry_loaded: list, delay: float = 0.0):
        self.loaded = registry_loaded
        self.delay = delay
        self.num = 0
        self.registry: LoRARegistry | None = None

    async def __call__(self):
        self.num += 1
        snapshot = list(self.loaded)  # what the scheduler holds when it answers
        await asyncio.sleep(self.delay)
        self.registry.update(LoRAUpdateOutput(success=True, loaded_adapters=snapshot))


def registry(known=("sql",), loaded=("sql",), delay=0.0, enabled=True, max_loaded=None):
    lookups = Lookups([adapter(n) for n in loaded], delay)
    reg = LoRARegistry(enabled, [adapter(n) for n in known], lookups, max_loaded)
    lookups.registry = reg
    return reg, lookups


async def test_a_known_name_passes_without_asking_the_scheduler():
    reg, lookups = registry()
    await reg.check(["sql", None, "sql"], "lora_path")
    assert lookups.num == 0


async def test_a_name_loaded_elsewhere_is_found_by_one_lookup():
    reg, lookups = registry(known=(), loaded=("sql",))
    await reg.check(["sql"], "lora_path")
    assert lookups.num == 1 and "sql" in reg.adapters


async def test_an_unknown_name_is_refused_naming_the_field_and_the_loaded_adapters():
    reg, lookups = registry(known=(), loaded=("sql", "chat"))
    with pytest.raises(InvalidParameter) as e:
        await reg.check(["nope"], "lora_path")
    assert e.value.param == "lora_path" and lookups.num == 1
    assert "LoRA adapter 'nope' is not loaded; loaded adapters: ['chat', 'sql']" in str(e.value)


async def test_without_lora_a_named_adapter_gets_sglangs_message():
    reg, lookups = registry(enabled=False)
    with pytest.raises(InvalidParameter) as e:
        await reg.check([None, "sql"], "lora_path")
    assert str(e.value) == f"lora_path: {lora_not_enabled('sql')}" and lookups.num == 0
    await reg.check([None, None], "lora_path")  # the base model: nothing to check


async def test_misses_at_once_share_one_lookup():
    reg, lookups = registry(known=(), loaded=("sql",), delay=0.01)
    await asyncio.gather(*(reg.check(["sql"], "lora_path") for _ in range(10)))
    assert lookups.num == 1


async def test_a_miss_during_a_lookup_waits_for_one_sent_after_it():
    """A lookup sent before the miss may predate the load the client saw succeed."""
    reg, lookups = registry(known=(), loaded=(), delay=0.01)
    first = asyncio.ensure_future(reg.refresh())
    while lookups.num == 0:  # the first lookup is on its way: the scheduler has nothing yet
        await asyncio.sleep(0)
    lookups.loaded.append(adapter("late"))
    await reg.check(["late"], "lora_path")
    await first
    assert lookups.num == 2 and "late" in reg.adapters


async def test_a_failed_lookup_fails_every_waiter_and_the_next_one_asks_again():
    calls = []

    async def failing():
        calls.append(1)
        await asyncio.sleep(0.01)
        raise RuntimeError("no answer")

    reg = LoRARegistry(True, [], failing)
    results = await asyncio.gather(
        *(reg.check(["x"], "lora_path") for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results) and len(calls) == 1
    with pytest.raises(RuntimeError):
        await reg.check(["x"], "lora_path")
    assert len(calls) == 2


async def test_a_waiter_that_goes_away_does_not_cancel_the_others_lookup():
    reg, lookups = registry(known=(), loaded=("sql",), delay=0.02)
    leaving = asyncio.ensure_future(reg.check(["sql"], "lora_path"))
    staying = asyncio.ensure_future(reg.check(["sql"], "lora_path"))
    await asyncio.sleep(0.005)
    leaving.cancel()
    await staying
    assert lookups.num == 1 and leaving.cancelled()


async def test_more_distinct_adapters_than_may_be_loaded_is_refused():
    reg, _ = registry(known=("a", "b", "c"), max_loaded=2)
    await reg.check(["a", "b", "a", None], "lora_path")
    with pytest.raises(InvalidParameter, match="3 different LoRA adapters.*--max-loaded-loras"):
        await reg.check(["a", "b", "c"], "lora_path")


async def test_an_adapter_is_found_by_name_server_id_or_minted_id():
    reg, _ = registry(known=("sql",))
    sql = adapter("sql")
    assert (await reg.resolve(sql.lora_id, "lora_id", by_id=True)).name == "sql"
    reg.aliases["minted-1"] = "sql"
    assert (await reg.resolve("minted-1", "lora_id", by_id=True)).name == "sql"
    assert reg.id_of(sql) == "minted-1"
    reg.update(LoRAUpdateOutput(success=True, loaded_adapters=[]))  # unloaded
    assert reg.get("minted-1") is None and reg.aliases == {}


async def test_lora_path_names_an_adapter_by_name_only():
    """The scheduler is given the name: an id there would pass here and fail there."""
    reg, _ = registry(known=("sql",))
    with pytest.raises(InvalidParameter, match="is not loaded"):
        await reg.check([adapter("sql").lora_id], "lora_path")


async def test_several_unknown_names_of_one_request_share_one_lookup():
    reg, lookups = registry(known=(), loaded=("a", "b"))
    await reg.check(["a", "b", None], "lora_path")
    assert lookups.num == 1
    with pytest.raises(InvalidParameter, match="'x' is not loaded"):
        await reg.check(["x", "y"], "lora_path")
    assert lookups.num == 2


def test_a_failed_answer_without_the_set_leaves_the_copy():
    reg, _ = registry(known=("sql",))
    reg.update(LoRAUpdateOutput(success=False, error_message="bad adapter"))
    assert list(reg.adapters) == ["sql"]
    reg.update(LoRAUpdateOutput(success=False, loaded_adapters=[adapter("chat")]))
    assert list(reg.adapters) == ["chat"]


async def test_a_plain_model_name_selects_a_loaded_adapter_and_is_looked_up_sparingly():
    reg, lookups = registry(known=("sql",), loaded=("sql",))
    assert await reg.model_adapter("sql", SERVED) == "sql"
    assert await reg.model_adapter(MODEL, SERVED) is None
    assert lookups.num == 0
    assert await reg.model_adapter("gpt-4", SERVED) is None  # a client's name for the model
    assert await reg.model_adapter("gpt-4", SERVED) is None
    assert lookups.num == 1  # looked up once a second at most
    with pytest.raises(InvalidParameter) as e:
        await reg.model_adapter(f"{MODEL}:nope", SERVED)
    assert e.value.param == "model" and "'nope' is not loaded" in str(e.value)


async def test_without_lora_base_colon_adapter_is_refused_and_plain_names_are_served():
    reg, lookups = registry(enabled=False)
    assert await reg.model_adapter("gpt-4", SERVED) is None
    with pytest.raises(InvalidParameter, match="LoRA is not enabled") as e:
        await reg.model_adapter("gpt-4:sql", SERVED)
    assert e.value.param == "model" and lookups.num == 0


# ---- /generate through the front client ----------------------------------------------------


async def run(client, **fields):
    results = [r async for r in client.generate(GenerateReqInput(**fields))]
    return results[-1]


async def test_lora_path_reaches_the_scheduler_per_item_and_per_sample():
    client, scheduler = make_client()
    await run(client, text=["a", "b", "c"], lora_path=["sql", None, "chat"])
    assert [r.lora_path for r in scheduler.requests] == ["sql", None, "chat"]
    scheduler.sent.clear()
    await run(client, text=["a", "b"], lora_path="sql", sampling_params={"n": 2})
    assert [r.lora_path for r in scheduler.requests] == ["sql"] * 4  # samples inherit it
    scheduler.sent.clear()
    await run(client, text="a", lora_path=["chat"], sampling_params={"n": 3})
    assert [r.lora_path for r in scheduler.requests] == ["chat"] * 3
    assert scheduler.lookups == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"text": "a", "lora_path": "nope"}, "LoRA adapter 'nope' is not loaded"),
        ({"text": ["a", "b"], "lora_path": ["sql", "nope"]}, "'nope' is not loaded"),
        ({"text": ["a", "b"], "lora_path": ["sql"]}, "lora_path has 1 entries"),
        ({"text": "a", "lora_path": 7}, "lora_path must be a string"),
    ],
)
async def test_a_bad_lora_path_is_refused_before_anything_is_sent(fields, message):
    client, scheduler = make_client()
    with pytest.raises(InvalidParameter, match=message) as e:
        await run(client, **fields)
    assert e.value.param == "lora_path" and scheduler.requests == []


async def test_lora_path_without_lora_is_refused_no_longer_ignored():
    client, scheduler = make_client(enabled=False)
    with pytest.raises(InvalidParameter, match="was requested, but LoRA is not enabled"):
        await run(client, text="a", lora_path="sql")
    assert scheduler.sent == []
    await run(client, text="a", lora_path=[None])
    assert [r.lora_path for r in scheduler.requests] == [None]


async def test_an_adapter_loaded_through_another_front_is_found_at_the_scheduler():
    client, scheduler = make_client(known=())
    await run(client, text="a", lora_path="sql")
    assert scheduler.lookups == 1 and scheduler.requests[0].lora_path == "sql"
    await run(client, text="a", lora_path="sql")
    assert scheduler.lookups == 1  # in the copy from then on


async def test_max_loaded_loras_bounds_the_adapters_of_one_request():
    client, scheduler = make_client(max_loaded_loras=1)
    with pytest.raises(InvalidParameter, match="2 different LoRA adapters"):
        await run(client, text=["a", "b"], lora_path=["sql", "chat"])
    assert scheduler.requests == []


# ---- the named control methods ---------------------------------------------------------------


async def test_load_and_unload_keep_the_copy_and_requests_follow():
    client, scheduler = make_client()
    out = await client.load_lora_adapter("new", "/adapters/new", pinned=True)
    assert out.success and "new" in client.lora.adapters
    [load] = [m for m in scheduler.sent if isinstance(m, LoadLoRAAdapterReqInput)]
    assert (load.lora_name, load.lora_path, load.pinned) == ("new", "/adapters/new", True)
    await run(client, text="a", lora_path="new")
    again = await client.load_lora_adapter("new", "/adapters/new")
    assert not again.success and "already loaded" in again.error_message
    out = await client.unload_lora_adapter("new")
    assert out.success and "new" not in client.lora.adapters
    with pytest.raises(InvalidParameter, match="'new' is not loaded"):
        await run(client, text="a", lora_path="new")
    listed = await client.list_lora_adapters()
    assert sorted(a.name for a in listed) == ["chat", "sql"]


@pytest.mark.parametrize(
    "name, path, param",
    [("", "/a", "lora_name"), (MODEL, "/a", "lora_name"), ("x", "", "lora_path")],
)
async def test_a_load_is_checked_before_it_is_sent(name, path, param):
    client, scheduler = make_client()
    with pytest.raises(InvalidParameter) as e:
        await client.load_lora_adapter(name, path)
    assert e.value.param == param and scheduler.sent == []


async def test_without_lora_the_control_methods_answer_sglangs_refusal_themselves():
    client, scheduler = make_client(enabled=False)
    for out in (
        await client.load_lora_adapter("x", "/a"),
        await client.unload_lora_adapter("x"),
    ):
        assert not out.success
        assert (
            out.error_message == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        )
    assert await client.list_lora_adapters() == []
    assert scheduler.sent == []


async def test_an_answer_no_one_waits_for_still_updates_the_copy():
    client, _ = make_client()
    client.on_message(LoRAUpdateOutput(success=True, loaded_adapters=[adapter("x")], cid="gone"))
    assert list(client.lora.adapters) == ["x"]


def test_model_info_reads_the_schedulers_lora_facts():
    from cadence.front.engine_client import ModelInfo

    facts = {
        "context_len": 8,
        "vocab_size": 8,
        "max_total_tokens": 8,
        "lora_enabled": True,
        "lora_adapters": [
            {"name": "sql", "path": "/a/sql", "lora_id": "abc", "rank": 16, "pinned": True}
        ],
    }
    info = ModelInfo.from_facts("/m", None, ["m"], None, facts)
    assert info.lora_enabled and info.lora_adapters[0].name == "sql"
    assert info.lora_adapters[0].rank == 16 and info.lora_adapters[0].pinned
    plain = ModelInfo.from_facts("/m", None, ["m"], None, {**facts, "lora_adapters": None})
    assert plain.lora_adapters == ()
    assert not ModelInfo.from_facts(
        "/m", None, ["m"], None, {"context_len": 8, "vocab_size": 8, "max_total_tokens": 8}
    ).lora_enabled
