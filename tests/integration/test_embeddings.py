"""Embedding models in process, against their references: all-MiniLM-L6-v2 against
sentence-transformers, small BERT classifiers saved here (random weights, fixed seed)
against transformers, the default SmolLM2 scoring and embedding (--is-embedding) against
transformers' forward pass; bad input refused naming the field; nothing left behind after
bursts, aborts and failures."""

from __future__ import annotations

import asyncio
import math
import os
import shutil

import pytest
import torch

from cadence.errors import InvalidParameter, RequestError
from cadence.model_loader.locate import default_model_path, embedding_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "How do I reset my password?",
    "Click 'Forgot password' on the sign-in page and follow the link we email you.",
    "Embeddings map text to vectors so that similar meanings land close together.",
    "I love pizza",
    "The stock market fell sharply on Monday after the central bank raised interest rates.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
    "Can you recommend a good book about the history of mathematics?",
    "It rained all weekend, so we stayed inside and played board games.",
    "Quantum computers use qubits, which can be in superpositions of states.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Our flight was delayed by three hours because of a storm over the Atlantic.",
    "Regular exercise improves both physical health and mental well-being.",
    "Dogs",
    "The committee will publish its final report at the end of the month.",
    "Rust's ownership model prevents data races at compile time.",
    "She finished the marathon in just under four hours, a personal best.",
    "Where can I buy fresh vegetables near the train station?",
    "The museum's new exhibition features paintings from the Dutch Golden Age.",
    "Lightning is a sudden electrostatic discharge during a thunderstorm.",
    "¿Dónde está la biblioteca? — Est-ce que tu viens ce soir?",
]
assert len(SENTENCES) == 32


@pytest.fixture(scope="module")
def minilm():
    from cadence import Engine

    e = Engine(embedding_model_path(), max_embedding_batch=64)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(embedding_model_path(), device="cpu")


def cosines(ours, theirs) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(
        torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    )


def embedding_state(engine) -> dict:
    """What embedding requests may hold, read on the scheduler thread and in the front."""

    def read(s) -> dict:
        usage = s.kv.check()  # the KV books balance, recounted from the holders' side
        return {
            "waiting": s.embeds.num_waiting,
            "free_pages": usage.num_free + usage.num_evictable,
            "num_pages": usage.num_pages,
            "cached_pages": usage.num_cached,
        }

    state = engine.run_in_scheduler(read)
    state["front"] = len(engine.client.embeds.states) + len(engine.client.tm.states)
    return state


def assert_idle(engine, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        state = embedding_state(engine)
        idle = {**state, "waiting": 0, "front": 0, "free_pages": state["num_pages"]}
        if state == idle or time.monotonic() > deadline:
            assert state == idle
            return
        time.sleep(0.05)


# -- all-MiniLM-L6-v2 ------------------------------------------------------------------------


def test_minilm_embeddings_equal_sentence_transformers(minilm, reference):
    ours = minilm.encode(SENTENCES)
    theirs = reference.encode(SENTENCES, convert_to_numpy=True)
    assert len(ours) == 32 and all(len(r["embedding"]) == 384 for r in ours)
    assert cosines([r["embedding"] for r in ours], theirs).min() >= 0.9999
    norms = [math.sqrt(sum(x * x for x in r["embedding"])) for r in ours]
    assert norms == pytest.approx([1.0] * 32, abs=1e-5)  # modules.json declares Normalize
    meta = ours[5]["meta_info"]
    assert meta["prompt_tokens"] == len(reference.tokenizer(SENTENCES[5])["input_ids"])


def test_text_token_ids_and_batch_position_give_the_same_embedding(minilm):
    tokenizer = minilm.tokenizer
    alone = minilm.encode(SENTENCES[3])["embedding"]
    ids = tokenizer(SENTENCES[3])["input_ids"]
    by_ids = minilm.encode(input_ids=ids)["embedding"]
    in_batch = minilm.encode(input_ids=[tokenizer(s)["input_ids"] for s in SENTENCES[:8]])[3]
    assert cosines([alone, alone], [by_ids, in_batch["embedding"]]).min() >= 0.99999


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt": ""}, "text"),
        ({"prompt": []}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"prompt": ["a"] * 65}, "text"),  # --max-embedding-batch 64
        ({"prompt": "word " * 600}, "text"),  # beyond the 512-token context
        ({"input_ids": [101, 40000, 102]}, "input_ids"),  # outside the vocabulary
        ({"prompt": "x", "dimensions": 128}, "dimensions"),  # not a Matryoshka model
        ({"prompt": ["q", "d"], "is_cross_encoder_request": True, "dimensions": 0}, "dimensions"),
    ],
)
def test_bad_input_is_refused_naming_the_field(minilm, kwargs, param):
    with pytest.raises(InvalidParameter) as e:
        minilm.encode(**kwargs)
    assert e.value.param == param
    assert_idle(minilm)


def test_an_embedding_model_refuses_generation_and_scoring(minilm):
    with pytest.raises(InvalidParameter) as e:
        minilm.generate("Hello")
    assert e.value.param == "model" and "embedding model" in str(e.value)
    with pytest.raises(InvalidParameter) as e:
        minilm.score("a", ["b"], [1])
    assert e.value.param == "model"


def test_rerank_with_an_embedding_model_orders_by_cosine_similarity(minilm, reference):
    docs = [SENTENCES[0], SENTENCES[16], SENTENCES[1], SENTENCES[4]]
    out = minilm.rerank("A man eats bread.", docs, top_n=3)
    vectors = reference.encode(["A man eats bread.", *docs], convert_to_tensor=True)
    expected = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    assert [r["index"] for r in out] == sorted(range(4), key=lambda i: -expected[i])[:3]
    assert [r["score"] for r in out] == pytest.approx(sorted(expected, reverse=True)[:3], abs=1e-4)
    assert out[0]["document"] == docs[out[0]["index"]]
    assert "document" not in minilm.rerank("q", ["a", "b"], return_documents=False)[0]


async def test_nothing_is_left_after_bursts_aborts_and_failures(minilm, monkeypatch):
    assert_idle(minilm)
    burst = await asyncio.gather(
        *(minilm.async_encode(SENTENCES[i : i + 8]) for i in range(0, 32, 2))
    )
    assert [len(r) for r in burst] == [min(8, 32 - i) for i in range(0, 32, 2)]
    # Aborted while waiting: paused, so they queue; cancelling a call aborts its requests.
    minilm.pause_generation(mode="in_place")
    calls = [asyncio.ensure_future(minilm.async_encode(SENTENCES)) for _ in range(3)]
    for _ in range(200):
        if minilm.run_in_scheduler(lambda s: s.embeds.num_waiting) == 96:
            break
        await asyncio.sleep(0.02)
    assert minilm.run_in_scheduler(lambda s: s.embeds.num_waiting) == 96
    calls[0].cancel()
    minilm.abort(abort_all=True)  # the other two: ended by the server
    for call in calls[1:]:
        with pytest.raises(RequestError) as e:
            await call
        assert e.value.status == 499
    minilm.continue_generation()
    # A request that makes the forward pass fail fails alone; the others get their vectors.
    runner = minilm.scheduler.runner
    real = runner.embed

    def embed(items):
        if any(666 in item.token_ids for item in items):
            raise RuntimeError("this input breaks the model")
        return real(items)

    monkeypatch.setattr(runner, "embed", embed)
    good, bad = await asyncio.gather(
        minilm.async_encode(SENTENCES[:4]),
        minilm.async_encode(input_ids=[101, 666, 102]),
        return_exceptions=True,
    )
    assert len(good) == 4
    assert isinstance(bad, RequestError) and bad.status == 500 and bad.is_request_fault
    assert_idle(minilm)


# -- BERT classifiers and a Matryoshka model saved here ------------------------------------------


def save_bert(path, cls_name: str, **config_fields):
    """A small BERT with random weights (seed 0) and MiniLM's tokenizer files, saved by
    transformers itself."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        **config_fields,
    )
    model = getattr(transformers, cls_name)(config).eval()
    model.save_pretrained(path)
    source = embedding_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(os.path.join(source, name), path)
    return model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    from cadence import Engine

    path = str(tmp_path_factory.mktemp("classifier"))
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model = save_bert(
        path,
        "BertForSequenceClassification",
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    e = Engine(path)
    yield e, model
    e.shutdown()


def test_classifier_logits_equal_transformers(classifier):
    engine, model = classifier
    texts = SENTENCES[:6]
    ours = engine.encode(texts)
    with torch.inference_mode():
        enc = engine.tokenizer(texts, padding=True, return_tensors="pt")
        theirs = model(**enc).logits
    assert torch.tensor([r["embedding"] for r in ours]) == pytest.approx(theirs, abs=1e-4)
    assert engine.info.id2label == ("negative", "neutral", "positive")


def test_classify_adds_the_label_and_probabilities(classifier):
    from cadence.io_struct import EmbeddingReqInput
    from cadence.serving import embedding_serving

    engine, model = classifier
    out = engine._call(embedding_serving.classify(engine.client, EmbeddingReqInput(text="great")))
    probs = torch.softmax(torch.tensor(out["embedding"]), dim=0)
    assert out["probs"] == pytest.approx(probs.tolist(), abs=1e-6)
    assert out["label"] == engine.info.id2label[int(probs.argmax())]
    with pytest.raises(InvalidParameter) as e:  # three classes: no single relevance score
        engine.rerank("q", ["d"])
    assert e.value.param == "model"


def test_cross_encoder_rerank_is_the_sigmoid_of_transformers_pair_logits(tmp_path):
    from cadence import Engine

    model = save_bert(str(tmp_path), "BertForSequenceClassification", num_labels=1)
    query, docs = "Where is Paris?", [SENTENCES[10], SENTENCES[7], SENTENCES[17]]
    with Engine(str(tmp_path)) as engine:
        out = engine.rerank(query, docs)
        pairs = engine.encode(
            [[query, d] for d in docs], is_cross_encoder_request=True
        )  # the same pairs, their raw logits
        enc = engine.tokenizer([query] * 3, docs, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**enc).logits[:, 0]
    assert [p["embedding"][0] for p in pairs] == pytest.approx(logits.tolist(), abs=1e-4)
    expected = torch.sigmoid(logits).tolist()
    assert [r["index"] for r in out] == sorted(range(3), key=lambda i: -expected[i])
    assert [r["score"] for r in out] == pytest.approx(sorted(expected, reverse=True), abs=1e-5)


def test_matryoshka_dimensions_keep_a_renormalized_prefix(tmp_path):
    from cadence import Engine

    save_bert(str(tmp_path), "BertModel", is_matryoshka=True)
    with Engine(str(tmp_path)) as engine:
        full = torch.tensor(engine.encode("a short text")["embedding"])
        short = engine.encode("a short text", dimensions=16)["embedding"]
        with pytest.raises(InvalidParameter) as e:
            engine.encode("x", dimensions=65)
    assert e.value.param == "dimensions"
    assert full.norm() == pytest.approx(1.0, abs=1e-5)  # no modules.json: CLS, normalized
    expected = torch.nn.functional.normalize(full[:16], dim=0)
    assert short == pytest.approx(expected.tolist(), abs=1e-6)


# -- a generation model: scoring, yes/no reranking, --is-embedding ------------------------------


@pytest.fixture(scope="module")
def hf_smollm():
    from transformers import AutoModelForCausalLM

    from cadence.model_loader.hf_export import exported_checkpoint_dir

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(exported_checkpoint_dir(path), dtype=torch.float32)
    return model.eval()


def test_score_probabilities_equal_a_transformers_forward_pass(engine, hf_smollm):
    tok = engine.tokenizer
    query, items = "The capital of France is", [" Paris.", " Berlin.", " a city"]
    labels = [tok.encode(w, add_special_tokens=False)[0] for w in (" The", " It", " and")]
    probs = engine.score(query, items, labels)
    softmaxed = engine.score(query, items, labels, apply_softmax=True)
    item_first = engine.score(query, items, labels, item_first=True)
    for i, item in enumerate(items):
        for text, got in ((query + item, probs[i]), (item + query, item_first[i])):
            with torch.inference_mode():
                logits = hf_smollm(torch.tensor([tok.encode(text)])).logits[0, -1]
            expected = torch.softmax(logits.float(), dim=-1)[labels]
            assert got == pytest.approx(expected.tolist(), rel=1e-2, abs=1e-6)
        expected = torch.tensor(probs[i]) / sum(probs[i])
        assert softmaxed[i] == pytest.approx(expected.tolist(), abs=1e-6)
    ids = engine.score(tok.encode(query), [tok.encode(i) for i in items], labels)
    for by_ids, by_text in zip(ids, probs):
        assert by_ids == pytest.approx(by_text, rel=1e-4)


def test_score_refuses_an_unknown_label_token_and_empty_items(engine):
    with pytest.raises(InvalidParameter) as e:
        engine.score("q", ["a"], [engine.info.vocab_size])
    assert e.value.param == "label_token_ids"
    with pytest.raises(InvalidParameter) as e:
        engine.score("q", [], [1])
    assert e.value.param == "items"
    with pytest.raises(InvalidParameter) as e:
        engine.encode("an embedding of a generation model")
    assert e.value.param == "model"


def test_a_generation_model_reranks_by_its_yes_probability(engine):
    docs = ["The giant panda is a bear species endemic to China.", "I had pasta for lunch."]
    out = engine.rerank("What is a panda?", docs, top_n=1)
    assert len(out) == 1 and 0.0 < out[0]["score"] < 1.0
    both = engine.rerank("What is a panda?", docs)
    assert out[0] == {**both[0], "meta_info": out[0]["meta_info"]}
    assert both[0]["score"] >= both[1]["score"]


@pytest.fixture(scope="module")
def decoder_embedder():
    from cadence import Engine

    e = Engine(None, is_embedding=True, dtype="float32", max_total_tokens=1024)
    yield e
    e.shutdown()


def test_is_embedding_serves_the_last_token_s_normalized_hidden_state(decoder_embedder, hf_smollm):
    engine = decoder_embedder
    texts = SENTENCES[:4]
    ours = engine.encode(texts)
    for text, result in zip(texts, ours):
        ids = engine.tokenizer.encode(text)
        with torch.inference_mode():
            hidden = hf_smollm(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        expected = torch.nn.functional.normalize(hidden[0, -1], dim=0)
        assert cosines([result["embedding"]], [expected.tolist()]).item() >= 0.999
        assert len(result["embedding"]) == engine.info.embedding_dim == 576
    with pytest.raises(InvalidParameter):
        engine.generate("Hello")
    assert_idle(engine)  # its KV pages went back right after the step
