"""PD mode end to end over real sockets: fake prefill and decode servers behind a router.

What the servers receive (the same body, bootstrap fields included), what the client gets
back (the decode side's answer, logprobs merged), and the roles in the admin listing.
Failures and cancellation are in test_router_pd_faults.py.
"""

from __future__ import annotations

import json

import pytest
from router_fakes import assert_idle, wait_for

GENERATE = "/generate"
CHAT = "/v1/chat/completions"


def bootstrap(body: dict) -> tuple:
    return body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]


async def test_both_sides_get_the_same_body_with_bootstrap_fields_and_decode_answers(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill", answer={"text": "from prefill"})
    decode = await make_server("decode", answer={"text": "from decode", "meta_info": {"id": 1}})
    router = await make_pd_router([(prefill, 8998)], [decode])
    sent = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}, "rid": "r1"}
    rooms = []
    for _ in range(3):
        async with client.post(router.url + GENERATE, json=sent) as resp:
            assert resp.status == 200
            assert await resp.json() == {"text": "from decode", "meta_info": {"id": 1}}
            assert resp.headers["X-Side"] == "decode"  # the decode side's headers
            assert resp.headers["x-cadence-worker"] == decode.url
            assert resp.headers["x-cadence-prefill-worker"] == prefill.url
            assert resp.headers["x-cadence-request-id"]
        p_body, d_body = prefill.bodies[-1], decode.bodies[-1]
        assert p_body == d_body  # identical bytes to both sides
        host, port, room = bootstrap(d_body)
        assert (host, port) == ("127.0.0.1", 8998)
        assert isinstance(room, int) and 0 <= room < 2**63
        assert {k: v for k, v in d_body.items() if not k.startswith("bootstrap_")} == sent
        rooms.append(room)
    assert len(set(rooms)) == 3  # a fresh room per request
    # The client's request id reaches both sides.
    assert prefill.headers[-1]["x-cadence-request-id"] == decode.headers[-1]["x-cadence-request-id"]
    await wait_for(lambda: all(w.active == 0 for w in router.registry), what="counts released")
    await assert_idle(router)


async def test_client_sent_bootstrap_fields_are_replaced(make_server, make_pd_router, client):
    prefill = await make_server("prefill")
    decode = await make_server("decode")
    router = await make_pd_router([(prefill, 9000)], [decode])
    body = {"text": "x", "bootstrap_host": "evil", "bootstrap_port": 1, "bootstrap_room": 5}
    async with client.post(router.url + GENERATE, json=body) as resp:
        assert resp.status == 200
    assert bootstrap(decode.bodies[0])[:2] == ("127.0.0.1", 9000)


async def test_short_prompts_go_to_a_decode_worker_alone_and_a_failed_one_is_retried(
    make_server, make_pd_router, client
):
    """--pd-local-prefill-max-tokens: a prompt within the limit reaches a decode worker
    alone, without the bootstrap fields the client sent; a decode worker that fails (502)
    is retried on the other one; a longer prompt is disaggregated as usual."""
    prefill = await make_server("prefill")
    broken = await make_server("decode", status=500, answer={"error": "down"})
    decode = await make_server("decode", answer={"text": "local"})
    router = await make_pd_router(
        [(prefill, 8998)],
        [broken, decode],
        pd_local_prefill_max_tokens=8,
        retry_max_retries=2,
        decode_policy="round_robin",
    )
    short = {"input_ids": list(range(8)), "bootstrap_host": "h", "bootstrap_room": 3}
    for _ in range(2):  # round robin: one of the two meets the broken worker first
        async with client.post(router.url + GENERATE, json=short) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.json() == {"text": "local"}
            assert resp.headers["x-cadence-worker"] == decode.url
            assert "x-cadence-prefill-worker" not in resp.headers
    assert prefill.bodies == []
    assert decode.bodies == [{"input_ids": list(range(8))}] * 2
    assert len(broken.bodies) >= 1
    long = {"input_ids": list(range(9))}
    async with client.post(router.url + GENERATE, json=long) as resp:
        assert resp.status == 200
        assert resp.headers["x-cadence-prefill-worker"] == prefill.url
    # (on a new pair, a new room, when the broken decode worker met it first)
    assert prefill.bodies and all(bootstrap(b)[2] is not None for b in prefill.bodies)
    await wait_for(lambda: all(w.active == 0 for w in router.registry), what="counts released")
    await assert_idle(router)


async def test_bootstrap_port_comes_from_server_info_when_not_configured(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill", bootstrap_port=7777)
    decode = await make_server("decode")
    router = await make_pd_router([(prefill, None)], [decode])
    async with client.post(router.url + CHAT, json={"messages": []}) as resp:
        assert resp.status == 200
    assert bootstrap(prefill.bodies[0])[1] == bootstrap(decode.bodies[0])[1] == 7777
    async with client.get(router.url + "/workers") as resp:
        workers = {w["url"]: w for w in (await resp.json())["workers"]}
    assert workers[prefill.url]["role"] == "prefill"
    assert workers[prefill.url]["bootstrap_port"] == 7777
    assert workers[prefill.url]["bootstrap_port_source"] == "worker"
    assert workers[decode.url]["role"] == "decode"
    assert workers[decode.url]["bootstrap_port"] is None


async def test_a_configured_port_wins_over_server_info(make_server, make_pd_router, client):
    prefill = await make_server("prefill", bootstrap_port=7777)
    decode = await make_server("decode")
    router = await make_pd_router([(prefill, 8123)], [decode])
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 200
    assert bootstrap(decode.bodies[0])[1] == 8123
    worker = router.registry.get(prefill.url)
    assert worker.to_dict()["bootstrap_port_source"] == "config"


async def test_a_prefill_worker_without_a_known_port_never_becomes_routable(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill")  # /server_info has no bootstrap port
    decode = await make_server("decode")
    router = await make_pd_router([(prefill, None)], [decode], wait_healthy=False)
    state = router.registry.get(prefill.url)
    await wait_for(lambda: state.num_failures >= 3, what="failed probes")
    assert not state.is_routable
    assert f"--prefill {prefill.url} PORT" in state.last_error
    async with client.get(router.url + "/ready") as resp:
        assert resp.status == 503
        assert (await resp.json())["num_routable_by_role"] == {"prefill": 0, "decode": 1}
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 503
        assert "no healthy prefill worker" in (await resp.json())["error"]["message"]
    assert decode.bodies == []


async def test_a_worker_started_in_another_mode_is_not_routable(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill", bootstrap_port=7000)
    wrong = await make_server("prefill", bootstrap_port=7001)  # listed as decode below
    router = await make_pd_router([(prefill, None)], [wrong], wait_healthy=False)
    state = router.registry.get(wrong.url)
    await wait_for(lambda: state.num_failures >= 2, what="failed probes")
    assert not state.is_routable
    assert "--disaggregation-mode prefill" in state.last_error
    assert "decode worker" in state.last_error


async def test_streamed_decode_answer_is_relayed_byte_for_byte(make_server, make_pd_router, client):
    events = [b'data: {"choices": [{"delta": {"content": "%d"}}]}\n\n' % i for i in range(5)]
    events.append(b"data: [DONE]\n\n")
    prefill = await make_server("prefill", mode="sse", events=[b"data: [DONE]\n\n"])
    decode = await make_server("decode", mode="sse", events=events, event_gap_secs=0.01)
    router = await make_pd_router([(prefill, 8998)], [decode])
    async with client.post(router.url + CHAT, json={"messages": [], "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-cadence-worker"] == decode.url
        assert await resp.read() == b"".join(events)
    assert prefill.bodies[0] == decode.bodies[0] and decode.bodies[0]["stream"] is True
    await assert_idle(router)


@pytest.mark.parametrize(
    ("route", "body", "size"),
    [
        (GENERATE, {"text": ["a", "b", "c"]}, 3),
        (GENERATE, {"input_ids": [[1, 2], [3]]}, 2),
        (GENERATE, {"input_ids": [1, 2, 3]}, None),
        ("/v1/completions", {"prompt": ["a", "b"]}, 2),
        ("/v1/completions", {"prompt": [1, 2, 3]}, None),
        (CHAT, {"messages": [], "n": 3}, 3),
        (CHAT, {"messages": [], "n": 1}, None),
    ],
)
async def test_a_batch_gets_lists_of_bootstrap_fields(
    make_server, make_pd_router, client, route, body, size
):
    prefill = await make_server("prefill")
    decode = await make_server("decode")
    router = await make_pd_router([(prefill, 8998)], [decode])
    async with client.post(router.url + route, json=body) as resp:
        assert resp.status == 200
    host, port, room = bootstrap(decode.bodies[0])
    assert prefill.bodies[0] == decode.bodies[0]
    if size is None:
        assert (host, port) == ("127.0.0.1", 8998) and isinstance(room, int)
    else:
        assert host == ["127.0.0.1"] * size and port == [8998] * size
        assert len(room) == size and len(set(room)) == size


async def test_input_logprobs_of_the_prefill_side_are_merged(make_server, make_pd_router, client):
    prefill = await make_server(
        "prefill",
        answer={"text": "", "meta_info": {"input_token_logprobs": [[None, 1], [-1.5, 2]]}},
    )
    answer = {"text": "hi", "meta_info": {"input_token_logprobs": [[-0.5, 3]], "id": "x"}}
    decode = await make_server("decode", answer=answer)
    router = await make_pd_router([(prefill, 8998)], [decode])
    async with client.post(
        router.url + GENERATE, json={"text": "a", "return_logprob": True}
    ) as resp:
        assert resp.status == 200
        merged = await resp.json()
    assert merged["meta_info"]["input_token_logprobs"] == [[None, 1], [-1.5, 2], [-0.5, 3]]
    assert merged["text"] == "hi" and merged["meta_info"]["id"] == "x"
    # Without return_logprob the decode answer passes as it is.
    async with client.post(router.url + GENERATE, json={"text": "a"}) as resp:
        assert (await resp.json())["meta_info"]["input_token_logprobs"] == [[-0.5, 3]]


async def test_a_batch_merges_logprobs_item_by_item(make_server, make_pd_router, client):
    def item(lps):
        return {"text": "", "meta_info": {"input_token_logprobs": lps}}

    prefill = await make_server("prefill", answer=[item([[-1, 1]]), item([[-2, 2]])])
    decode = await make_server("decode", answer=[item([[-3, 3]]), item([])])
    router = await make_pd_router([(prefill, 8998)], [decode])
    body = {"text": ["a", "b"], "return_logprob": True}
    async with client.post(router.url + GENERATE, json=body) as resp:
        merged = await resp.json()
    assert [m["meta_info"]["input_token_logprobs"] for m in merged] == [
        [[-1, 1], [-3, 3]],
        [[-2, 2]],
    ]


async def test_streamed_logprobs_are_merged_into_the_events_that_carry_them(
    make_server, make_pd_router, client
):
    def event(text, lps):
        meta = {} if lps is None else {"input_token_logprobs": lps}
        return b"data: " + json.dumps({"text": text, "meta_info": meta}).encode() + b"\n\n"

    prefill_events = [event("", [[None, 1], [-1.0, 2]]), event("", [[None, 1], [-1.0, 2]])]
    prefill_events.append(b"data: [DONE]\n\n")
    decode_events = [event("a", []), event("ab", []), event("abc", None), b"data: [DONE]\n\n"]
    # Cut the decode stream mid-event: the router reassembles events before rewriting.
    raw = b"".join(decode_events)
    chunks = [raw[i : i + 7] for i in range(0, len(raw), 7)]
    prefill = await make_server("prefill", mode="sse", events=prefill_events)
    decode = await make_server("decode", mode="sse", events=chunks)
    router = await make_pd_router([(prefill, 8998)], [decode])
    body = {"text": "x", "stream": True, "return_logprob": True}
    async with client.post(router.url + GENERATE, json=body) as resp:
        assert resp.status == 200
        received = await resp.read()
    events = [e for e in received.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    parsed = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert [p["text"] for p in parsed] == ["a", "ab", "abc"]
    assert parsed[0]["meta_info"]["input_token_logprobs"] == [[None, 1], [-1.0, 2]]
    assert parsed[1]["meta_info"]["input_token_logprobs"] == [[None, 1], [-1.0, 2]]
    assert "input_token_logprobs" not in parsed[2]["meta_info"]  # left as the decode sent it
    await assert_idle(router)


async def test_each_side_has_its_own_policy(make_server, make_pd_router, client):
    prefills = [await make_server("prefill") for _ in range(2)]
    decodes = [await make_server("decode") for _ in range(3)]
    router = await make_pd_router(
        [(p, 9000 + i) for i, p in enumerate(prefills)], decodes, prefill_policy="round_robin"
    )
    for _ in range(6):
        async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
            assert resp.status == 200
    assert [len(p.bodies) for p in prefills] == [3, 3]
    assert [len(d.bodies) for d in decodes] == [2, 2, 2]
    for p, port in zip(prefills, (9000, 9001)):
        assert {b["bootstrap_port"] for b in p.bodies} == {port}  # the port of the chosen one
    async with client.get(router.url + "/metrics") as resp:
        text = await resp.text()
    assert (
        f'cadence_router_pd_requests_total{{role="prefill",worker="{prefills[0].url}"}} 3.0' in text
    )
    assert (
        f'cadence_router_pd_requests_total{{role="decode",worker="{decodes[2].url}"}} 2.0' in text
    )


async def test_an_unhealthy_decode_worker_is_skipped_until_it_recovers(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill")
    sick = await make_server("decode")
    well = await make_server("decode")
    router = await make_pd_router([(prefill, 8998)], [sick, well], health_failure_threshold=1)
    sick.health_status = 500
    state = router.registry.get(sick.url)
    await wait_for(lambda: not state.is_routable, what="the sick decode worker unhealthy")
    for _ in range(4):
        async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-cadence-worker"] == well.url
    assert sick.bodies == []
    well.health_status = 500
    await wait_for(lambda: not router.registry.get(well.url).is_routable, what="both unhealthy")
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 503
        assert "no healthy decode worker" in (await resp.json())["error"]["message"]
    async with client.get(router.url + "/health") as resp:
        assert resp.status == 503
        assert "prefill and a routable decode" in (await resp.json())["status"]
    sick.health_status = 200
    await wait_for(lambda: state.is_routable, what="recovered")
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 200 and resp.headers["x-cadence-worker"] == sick.url
    assert len(prefill.bodies) == 5


async def test_non_generate_routes_answer_501_and_bad_bodies_400(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill")
    decode = await make_server("decode")
    router = await make_pd_router([(prefill, 8998)], [decode])
    for path in ("/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/audio/speech"):
        async with client.post(router.url + path, json={"input": "x"}) as resp:
            assert resp.status == 501
            error = (await resp.json())["error"]
            assert (
                "not served in PD mode" in error["message"] and error["type"] == "not_implemented"
            )
    for body, message in ((b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object")):
        async with client.post(router.url + GENERATE, data=body) as resp:
            assert resp.status == 400
            assert message in (await resp.json())["error"]["message"]
    assert prefill.bodies == decode.bodies == []


async def test_admin_api_adds_workers_with_a_role(make_server, make_pd_router, client):
    prefill = await make_server("prefill")
    decode = await make_server("decode")
    router = await make_pd_router([], [], wait_healthy=False)
    async with client.post(router.url + "/workers", json={"url": decode.url}) as resp:
        assert resp.status == 400
        assert "prefill or decode" in (await resp.json())["error"]["message"]
    entry = {"url": prefill.url, "role": "prefill", "bootstrap_port": 8999}
    async with client.post(router.url + "/workers", json=entry) as resp:
        assert resp.status == 201
        assert (await resp.json())["bootstrap_port"] == 8999
    async with client.post(
        router.url + "/workers", json={"url": decode.url, "role": "decode"}
    ) as resp:
        assert resp.status == 201
    await wait_for(lambda: len(router.registry.routable) == 2, what="added workers healthy")
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 200
    assert bootstrap(decode.bodies[0])[1] == 8999
