"""Capabilities read from the workers: GET /capabilities at registration and on every
successful probe decides which worker may take speech, audio output, embeddings; a worker's
capabilities declared in the router's config still win; a worker without the route can do
everything, as before."""

from __future__ import annotations

from router_fakes import wait_for

SPEECH = "/v1/audio/speech"
CHAT = "/v1/chat/completions"
AUDIO_CHAT = {"model": "m", "messages": [], "modalities": ["text", "audio"]}


async def test_speech_goes_only_to_the_worker_that_reports_it(make_worker, make_router, client):
    text = await make_worker(body=b'{"who": "text"}', capabilities=["chat", "streaming"])
    speech = await make_worker(
        body=b'{"who": "speech"}', capabilities=["chat", "speech", "audio_output"]
    )
    router = await make_router([text.url, speech.url])
    workers = {w.url: w for w in router.registry}
    assert workers[speech.url].capabilities == {"chat", "speech", "audio_output"}
    assert workers[speech.url].to_dict()["capabilities_source"] == "worker"
    for _ in range(4):
        async with client.post(router.url + SPEECH, json={"input": "hi"}) as resp:
            assert (await resp.read()) == b'{"who": "speech"}'
        async with client.post(router.url + CHAT, json=AUDIO_CHAT) as resp:
            assert (await resp.read()) == b'{"who": "speech"}'
    answers = set()
    for _ in range(4):
        async with client.post(router.url + CHAT, json={"model": "m", "messages": []}) as resp:
            answers.add(await resp.read())
    assert answers == {b'{"who": "text"}', b'{"who": "speech"}'}  # text chat reaches both
    assert text.num_requests == 2


async def test_a_changed_report_is_read_on_the_next_probe(make_worker, make_router, client):
    worker = await make_worker(capabilities=["chat"])
    router = await make_router([worker.url])
    async with client.post(router.url + SPEECH, json={"input": "hi"}) as resp:
        assert resp.status == 503 and "speech" in (await resp.json())["error"]["message"]
    worker.capabilities = ["chat", "speech"]
    (state,) = list(router.registry)
    await wait_for(lambda: state.capabilities == {"chat", "speech"}, what="the new report")
    async with client.post(router.url + SPEECH, json={"input": "hi"}) as resp:
        assert resp.status == 200


async def test_declared_capabilities_win_and_silent_workers_can_do_everything(
    make_worker, make_router, client, tmp_path
):
    declared = await make_worker(body=b'{"who": "declared"}', capabilities=["chat"])
    silent = await make_worker(body=b'{"who": "silent"}')  # no /capabilities route
    config = tmp_path / "workers.yaml"
    config.write_text(
        f"- url: {declared.url}\n  capabilities: [chat, speech]\n- url: {silent.url}\n"
    )
    router = await make_router([], wait_healthy=False, worker_config=str(config))
    await wait_for(lambda: len(router.registry.routable) == 2, what="workers healthy")
    states = {w.url: w for w in router.registry}
    assert states[declared.url].capabilities == {"chat", "speech"}
    assert states[declared.url].reported_capabilities == {"chat"}
    assert states[declared.url].to_dict()["capabilities_source"] == "config"
    assert states[silent.url].capabilities is None
    answers = set()
    for _ in range(4):
        async with client.post(router.url + SPEECH, json={"input": "hi"}) as resp:
            answers.add(await resp.read())
    assert answers == {b'{"who": "declared"}', b'{"who": "silent"}'}
