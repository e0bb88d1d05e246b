"""Embedding servers through real clients: the openai SDK's embeddings.create (float and
base64) and generated gRPC stubs for all seven embedding RPCs (and the scheduler service's
Embed), against sentence-transformers and transformers; clear 400 / INVALID_ARGUMENT for
bad input and for the wrong kind of model; and every server idle again afterwards.

`embedding_server` serves all-MiniLM-L6-v2 (--max-embedding-batch 64), `classifier_server`
a small BertForSequenceClassification written by the harness, `server` the default
SmolLM2 (scoring, and refusing embeddings).
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import grpc
import httpx
import openai
import pytest
import torch
from e2e_server import is_idle
from embedding_models import CLASSIFIER_LABELS, CLASSIFIER_PATH, MINILM_PATH, save_classifier
from grpc_support import target

from cadence.grpc import sglang_pb2 as pb
from cadence.grpc import sglang_pb2_grpc, sglang_scheduler_pb2_grpc
from cadence.grpc import sglang_scheduler_pb2 as spb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "I love pasta.",
    "The new movie is awesome.",
    "The cat plays in the garden.",
    "A woman watches TV.",
    "The new movie is so great.",
    "Do you like pizza?",
    "How many people live in Berlin?",
    "Berlin has around 3.7 million inhabitants within its city limits.",
    "What is the boiling point of water at sea level?",
    "Water boils at 100 degrees Celsius under standard atmospheric pressure.",
    "Please send me the quarterly sales report by Friday afternoon.",
    "The train to Amsterdam leaves from platform nine in twenty minutes.",
    "Machine learning models need large amounts of labelled data to generalize well.",
    "He forgot his umbrella and got soaked on the way home.",
    "Our team won the championship after a dramatic penalty shootout.",
    "Tea",
    "The library opens at nine and closes at six on weekdays.",
    "Solar panels convert sunlight directly into electricity.",
    "Could you explain how vaccines train the immune system?",
    "The bakery on the corner sells the best croissants in town.",
    "Mount Everest is the highest mountain above sea level.",
    "Please keep your seatbelt fastened while the sign is on.",
    "A neural network is a stack of linear maps and non-linearities.",
    "The children built a sandcastle that was washed away by the tide.",
    "Interest rates are expected to stay unchanged this quarter.",
    "My laptop battery drains quickly when the screen is at full brightness.",
    "Hello!",
    "The orchestra rehearsed the symphony for weeks before the premiere.",
    "Which programming language should I learn first?",
    "Deep in the forest, an old cabin stood empty for decades.",
]
assert len(SENTENCES) == 32


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(MINILM_PATH, device="cpu").encode(SENTENCES))


def min_cosine(ours, reference) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(ours), reference).min().item()


def idle(server) -> None:
    """No request left: the scheduler's queues empty (/v1/loads), no rid state in the front
    (the scheduler service's GetServerInfo counts live requests)."""
    load = server.wait_idle()
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"]) == (
        0,
        0,
        0,
    )
    with grpc.insecure_channel(target(server)) as channel:
        info = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel).GetServerInfo(
            spb.GetServerInfoRequest()
        )
    assert info.active_requests == 0


@pytest.fixture
def sdk(embedding_server):
    with openai.OpenAI(
        base_url=embedding_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c
    idle(embedding_server)


@pytest.fixture
def stub(embedding_server):
    with grpc.insecure_channel(target(embedding_server)) as channel:
        yield sglang_pb2_grpc.SglangServiceStub(channel)
    idle(embedding_server)


@pytest.fixture(scope="module")
def classifier(classifier_server):
    model = save_classifier()
    yield classifier_server, model
    shutil.rmtree(CLASSIFIER_PATH, ignore_errors=True)  # the server has it loaded already


def openai_body(**fields) -> pb.OpenAIRequest:
    return pb.OpenAIRequest(json_body=json.dumps(fields).encode())


# -- the same embeddings over HTTP and gRPC -------------------------------------------------------


def test_the_openai_client_gets_sentence_transformers_embeddings(sdk, reference):
    as_floats = sdk.embeddings.create(
        model="all-MiniLM-L6-v2", input=SENTENCES, encoding_format="float"
    )
    by_default = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)  # base64
    for response in (as_floats, by_default):
        assert [d.index for d in response.data] == list(range(32))
        assert min_cosine([d.embedding for d in response.data], reference) >= 0.9999
        assert response.model == "all-MiniLM-L6-v2"
        assert response.usage.prompt_tokens == response.usage.total_tokens > 32
    raw = sdk.embeddings.create(model="m", input=SENTENCES[:2], encoding_format="base64")
    assert isinstance(raw.data[0].embedding, str)  # asked for explicitly: left encoded


def test_token_id_inputs_embed_like_their_text(sdk, embedding_server):
    ids = httpx.post(embedding_server.url + "/tokenize", json={"prompt": SENTENCES[:3]}).json()
    by_ids = sdk.embeddings.create(model="m", input=ids["tokens"], encoding_format="float")
    by_text = sdk.embeddings.create(model="m", input=SENTENCES[:3], encoding_format="float")
    ours = torch.tensor([d.embedding for d in by_ids.data])
    assert min_cosine([d.embedding for d in by_text.data], ours) >= 0.99999


def test_grpc_embeddings_equal_sentence_transformers(stub, reference):
    one_by_one = [stub.TextEmbed(pb.TextEmbedRequest(text=s)).embedding for s in SENTENCES]
    assert min_cosine([list(e) for e in one_by_one], reference) >= 0.9999
    out = stub.OpenAIEmbed(openai_body(input=SENTENCES, encoding_format="float"))
    assert out.status_code == 200
    data = json.loads(out.json_body)["data"]
    assert min_cosine([d["embedding"] for d in data], reference) >= 0.9999


def test_all_seven_embedding_rpcs_through_generated_stubs(
    stub, embedding_server, classifier, server
):
    ids = httpx.post(embedding_server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    text = stub.TextEmbed(pb.TextEmbedRequest(text="Hello world", rid="te-1"))
    by_ids = stub.Embed(pb.EmbedRequest(input_ids=ids["tokens"]))
    assert list(text.embedding) == pytest.approx(list(by_ids.embedding), abs=1e-5)
    assert json.loads(text.meta_info["id"]) == "te-1"
    assert json.loads(text.meta_info["prompt_tokens"]) == ids["count"]
    docs = [SENTENCES[1], SENTENCES[9]]  # guitar, Berlin
    ranked = stub.Rerank(
        openai_body(query="How many inhabitants does Berlin have?", documents=docs)
    )
    assert [r["index"] for r in json.loads(ranked.json_body)] == [1, 0]
    classifier_server, model = classifier
    with grpc.insecure_channel(target(classifier_server)) as channel:
        cstub = sglang_pb2_grpc.SglangServiceStub(channel)
        classified = cstub.Classify(pb.ClassifyRequest(text="What a lovely day"))
        assert len(classified.embedding) == 3
        assert json.loads(classified.meta_info["label"]) in CLASSIFIER_LABELS.values()
        assert sum(json.loads(classified.meta_info["probs"])) == pytest.approx(1.0)
        listed = cstub.OpenAIClassify(openai_body(input=["great", "awful"]))
        data = json.loads(listed.json_body)["data"]
        assert [d["num_classes"] for d in data] == [3, 3]
    with grpc.insecure_channel(target(server)) as channel:
        scored = sglang_pb2_grpc.SglangServiceStub(channel).Score(
            openai_body(query="The sky is", items=[" blue", " green"], label_token_ids=[13, 28])
        )
    scores = json.loads(scored.json_body)["scores"]
    assert len(scores) == 2 and all(0 <= p <= 1 for row in scores for p in row)


def test_the_scheduler_service_embeds_on_an_embedding_model_only(
    embedding_server, server, reference
):
    ids = httpx.post(embedding_server.url + "/tokenize", json={"prompt": SENTENCES}).json()
    with grpc.insecure_channel(target(embedding_server)) as channel:
        smg = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        outs = [
            smg.Embed(
                spb.EmbedRequest(
                    request_id=f"smg-{i}", tokenized=spb.TokenizedInput(input_ids=tokens)
                )
            )
            for i, tokens in enumerate(ids["tokens"])
        ]
        with pytest.raises(grpc.RpcError) as empty:
            smg.Embed(spb.EmbedRequest(request_id="smg-empty"))
    assert [(o.embedding_dim, o.prompt_tokens) for o in outs] == [
        (384, len(t)) for t in ids["tokens"]
    ]
    assert min_cosine([list(o.embedding) for o in outs], reference) >= 0.9999
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokenized.input_ids" in empty.value.details()
    request = spb.EmbedRequest(
        request_id="smg-gen", tokenized=spb.TokenizedInput(input_ids=ids["tokens"][0])
    )
    with grpc.insecure_channel(target(server)) as channel:
        with pytest.raises(grpc.RpcError) as e:
            sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel).Embed(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generation model" in e.value.details()


# -- classification and reranking over HTTP ---------------------------------------------------


def test_classify_matches_transformers_over_http(classifier):
    classifier_server, model = classifier
    texts = ["great", "terrible service", "it was fine"]
    native = httpx.post(classifier_server.url + "/classify", json={"text": texts}).json()
    listed = httpx.post(classifier_server.url + "/v1/classify", json={"input": texts}).json()
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(MINILM_PATH)(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**enc).logits
    probs = torch.softmax(logits, dim=-1)
    for i, row in enumerate(native):
        assert row["embedding"] == pytest.approx(logits[i].tolist(), abs=1e-4)
        assert row["probs"] == pytest.approx(probs[i].tolist(), abs=1e-4)
        assert row["label"] == CLASSIFIER_LABELS[int(probs[i].argmax())]
        assert listed["data"][i]["label"] == row["label"]
    assert listed["object"] == "list" and listed["usage"]["prompt_tokens"] > 0


def test_rerank_over_http_sorts_truncates_and_echoes(embedding_server):
    docs = [SENTENCES[1], SENTENCES[9], SENTENCES[17]]
    body = {"query": "How big is Berlin?", "documents": docs, "top_n": 2}
    out = httpx.post(embedding_server.url + "/v1/rerank", json=body).json()
    assert len(out) == 2 and out[0]["index"] == 1 and out[0]["document"] == docs[1]
    assert out[0]["score"] >= out[1]["score"]
    bare = httpx.post(
        embedding_server.url + "/v1/rerank", json={**body, "return_documents": False}
    ).json()
    assert [r["index"] for r in bare] == [r["index"] for r in out] and "document" not in bare[0]


def test_rerank_takes_exactly_max_embedding_batch_documents_and_refuses_one_more(
    embedding_server,
):
    """The query is not one of the documents: 64 documents fit --max-embedding-batch 64
    (it was refused as "65 inputs"), 65 are a 400 naming documents."""
    docs = [f"{SENTENCES[i % len(SENTENCES)]} ({i})" for i in range(65)]
    url = embedding_server.url + "/v1/rerank"
    r = httpx.post(url, json={"query": "Berlin", "documents": docs[:64]}, timeout=120)
    assert r.status_code == 200, r.text
    assert sorted(e["index"] for e in r.json()) == list(range(64))
    r = httpx.post(url, json={"query": "Berlin", "documents": docs}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    assert "65" in r.json()["error"]["message"]


def test_invocations_answers_embedding_rerank_and_classify_bodies_as_their_routes(
    embedding_server, classifier_server
):
    """vLLM's /invocations: `input` is embeddings (classification on a classification
    model), `query` + `documents` a rerank; each answer is the route's own."""
    cases = [
        (embedding_server, "/v1/embeddings", {"input": SENTENCES[:2]}),
        (embedding_server, "/v1/rerank", {"query": "How big is Berlin?", "documents": SENTENCES[8:11]}),
        (classifier_server, "/v1/classify", {"input": ["great", "terrible service"]}),
    ]  # fmt: skip
    for srv, route, body in cases:
        routed = httpx.post(srv.url + route, json=body, timeout=120).json()
        invoked = httpx.post(srv.url + "/invocations", json=body, timeout=120).json()
        if route == "/v1/rerank":  # a list of results, best first
            assert [r["index"] for r in invoked] == [r["index"] for r in routed]
            assert [r["score"] for r in invoked] == pytest.approx([r["score"] for r in routed])
            continue
        assert invoked.keys() == routed.keys() and invoked["object"] == routed["object"]
        for got, expected in zip(invoked["data"], routed["data"], strict=True):
            assert got.keys() == expected.keys()
            values = "embedding" if "embedding" in got else "probs"
            assert got[values] == pytest.approx(expected[values], abs=1e-5)
    idle(embedding_server)
    idle(classifier_server)


def test_score_over_http_equals_a_transformers_forward_pass(server):
    from transformers import AutoModelForCausalLM

    from cadence.model_loader.hf_export import exported_checkpoint_dir
    from cadence.model_loader.locate import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        exported_checkpoint_dir(path), dtype=torch.float32
    ).eval()
    query, items = "The sky is", [" blue", " green and", " very"]

    def tokens(text: str, **fields) -> list[int]:
        body = {"prompt": text, **fields}
        return httpx.post(server.url + "/tokenize", json=body).json()["tokens"]

    labels = [tokens(w, add_special_tokens=False)[0] for w in (" and", ".", " the")]
    r = httpx.post(
        server.url + "/v1/score", json={"query": query, "items": items, "label_token_ids": labels}
    )
    assert r.status_code == 200, r.text
    scores = r.json()["scores"]
    for item, got in zip(items, scores, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([tokens(query + item)])).logits[0, -1]
        expected = torch.softmax(logits.float(), dim=-1)[labels]
        assert got == pytest.approx(expected.tolist(), rel=1e-2, abs=1e-6)
    assert is_idle(server.wait_idle())


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", "  "]}, "input"),
        ({"input": ["x"] * 65}, "input"),  # --max-embedding-batch 64
        ({"input": "word " * 600}, "input"),  # beyond the 512-token context
        ({"input": [[101, 99999, 102]]}, "input"),  # outside the vocabulary
        ({"input": "x", "dimensions": 64}, "dimensions"),  # MiniLM is not Matryoshka-trained
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({}, "input"),
    ],
)
def test_bad_embedding_requests_get_a_400_naming_the_field(embedding_server, body, param):
    r = httpx.post(embedding_server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_grpc_embedding_requests_are_invalid_argument_naming_the_field(stub, server):
    for call, request, field in (
        (stub.TextEmbed, pb.TextEmbedRequest(text=""), "text"),
        (stub.TextEmbed, pb.TextEmbedRequest(text="word " * 600), "text"),
        (stub.Embed, pb.EmbedRequest(input_ids=[-1]), "input_ids"),
        (stub.OpenAIEmbed, openai_body(input=["x"] * 65), "input"),
        (stub.Score, openai_body(query="a", items=["b"], label_token_ids=[1]), "model"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert field in e.value.details()
    with grpc.insecure_channel(target(server)) as channel:
        with pytest.raises(grpc.RpcError) as e:
            sglang_pb2_grpc.SglangServiceStub(channel).Score(
                openai_body(query="a", items=["b"], label_token_ids=[10**6])
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "label_token_ids" in e.value.details()


def test_each_kind_of_model_refuses_the_other_kind_of_request(embedding_server, server, client):
    chat = httpx.post(
        embedding_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    assert httpx.post(embedding_server.url + "/generate", json={"text": "hi"}).status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="m", input="hi")
    assert "generation model" in e.value.message
    labels = {"query": "a", "items": ["b"], "label_token_ids": [10**6]}
    r = httpx.post(server.url + "/v1/score", json=labels)
    assert r.status_code == 400 and r.json()["error"]["param"] == "label_token_ids"
    with grpc.insecure_channel(target(server)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            sglang_pb2_grpc.SglangServiceStub(channel).TextEmbed(pb.TextEmbedRequest(text="hi"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(target(embedding_server)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            next(
                sglang_pb2_grpc.SglangServiceStub(channel).TextGenerate(
                    pb.TextGenerateRequest(text="hi")
                )
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    idle(embedding_server)


# -- nothing left behind ---------------------------------------------------------------------------


def test_bursts_and_clients_that_leave_leave_nothing_behind(embedding_server):
    url = embedding_server.url + "/v1/embeddings"
    results: list[int] = []

    def burst():
        with httpx.Client(timeout=120) as c:
            for _ in range(3):
                r = c.post(url, json={"input": SENTENCES, "encoding_format": "base64"})
                results.append(r.status_code)

    threads = [threading.Thread(target=burst) for _ in range(8)]
    for t in threads:
        t.start()
    for _ in range(6):  # clients that give up before their answer: their requests are aborted
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json={"input": SENTENCES * 2}, timeout=0.005)
    with grpc.insecure_channel(target(embedding_server)) as channel:
        stub = sglang_pb2_grpc.SglangServiceStub(channel)
        calls = [stub.OpenAIEmbed.future(openai_body(input=SENTENCES * 2)) for _ in range(6)]
        for call in calls:  # gRPC clients that cancel: their requests are aborted too
            call.cancel()
        assert all(call.cancelled() or call.done() for call in calls)
    for t in threads:
        t.join()
    assert results == [200] * 24
    idle(embedding_server)
    after = httpx.post(url, json={"input": SENTENCES[:2]})
    assert after.status_code == 200 and len(after.json()["data"]) == 2
    assert os.path.isdir(MINILM_PATH)
