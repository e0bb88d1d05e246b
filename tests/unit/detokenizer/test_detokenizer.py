"""Incremental detokenization with the default model's real tokenizer (no weights loaded)."""

import pytest

from cadence.detokenizer.detokenizer import Detokenizer
from cadence.io_struct import BatchTokenIDOutput
from cadence.model_loader.locate import default_model_path
from cadence.model_loader.tokenizer_files import load_tokenizer

EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def batch(rids, ids, reasons=None, stops=None, skip=True, no_trim=False) -> BatchTokenIDOutput:
    n = len(rids)
    return BatchTokenIDOutput(
        rids=list(rids),
        http_worker_ipcs=[None] * n,
        finished_reasons=reasons or [None] * n,
        output_ids=ids,
        skip_special_tokens=[skip] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[no_trim] * n,
        stop_strs=stops or [None] * n,
        prompt_tokens=[1] * n,
        completion_tokens=[len(i) for i in ids],
        cached_tokens=[0] * n,
    )


def stream(detok, ids, reason, stop=None, skip=True, no_trim=False, rid="r") -> list[str]:
    """Feeds ids one token per output, the last one with `reason`; returns the text deltas."""
    deltas = []
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        out = detok.process(
            batch([rid], [[token]], [reason if last else None], [stop], skip, no_trim)
        )
        assert out.rids == [rid] and out.output_ids == [[token]]
        deltas.append(out.output_strs[0])
    return deltas


MULTIBYTE = [
    "café au lait, naïve façade",
    "Emoji: 😀🎉 and 👍🏽 mixed 🤖 in text",
    "日本語のテキストと中文字符",
    "Ça coûte 5€ — 🤖👍🏽 中文字符 ok",
]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_stream_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The fixture is only meaningful if some characters do span several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.startswith("café")
    detok = Detokenizer(tokenizer)
    deltas = stream(detok, ids, {"type": "length", "length": len(ids)})
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.states == {}  # state dropped with the final output


def test_interleaved_requests_keep_separate_state(tokenizer):
    a = tokenizer.encode(MULTIBYTE[1], add_special_tokens=False)
    b = tokenizer.encode(MULTIBYTE[2], add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    texts = {"a": "", "b": ""}
    for k in range(max(len(a), len(b))):
        rids, ids, reasons = [], [], []
        for rid, seq in (("a", a), ("b", b)):
            if k < len(seq):
                rids.append(rid), ids.append([seq[k]])
                reasons.append({"type": "length"} if k == len(seq) - 1 else None)
        out = detok.process(batch(rids, ids, reasons))
        for rid, s in zip(out.rids, out.output_strs):
            assert "\ufffd" not in s
            texts[rid] += s
    assert texts == {"a": MULTIBYTE[1], "b": MULTIBYTE[2]}
    assert detok.states == {}


def test_whole_output_at_once_decodes_fully(tokenizer):
    ids = tokenizer.encode(MULTIBYTE[3], add_special_tokens=False)
    out = Detokenizer(tokenizer).process(batch(["r"], [ids], [{"type": "length"}]))
    assert out.output_strs == [MULTIBYTE[3]]


def test_stop_string_is_trimmed_and_held_back_while_partial(tokenizer):
    ids = tokenizer.encode("going to the park. the end of it", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[:7] == ["going", " to", " the", " park", ".", " the", " end"]
    detok = Detokenizer(tokenizer)
    stop = ["the end"]
    sent = ""
    for k in range(6):
        sent += detok.process(batch(["r"], [[ids[k]]], stops=[stop])).output_strs[0]
        if k == 2:  # "going to the": "the" may start "the end", so it is held back
            assert sent == "going to "
        if k == 3:  # " park" decides it: not a stop, released
            assert sent == "going to the park"
    assert sent == "going to the park. "
    # The scheduler matches "the end" at the " end" token and finishes the request.
    last = detok.process(batch(["r"], [[ids[6]]], [{"type": "stop", "matched": "the end"}], [stop]))
    assert sent + last.output_strs[0] == "going to the park. "
    assert detok.states == {}


def test_stop_string_trimmed_without_streaming(tokenizer):
    ids = tokenizer.encode("The answer is 42. Done", add_special_tokens=False)
    ids = ids[: next(k for k in range(len(ids)) if "42" in tokenizer.decode(ids[: k + 1])) + 1]
    out = Detokenizer(tokenizer).process(
        batch(["r"], [ids], [{"type": "stop", "matched": "42"}], [["42"]])
    )
    assert out.output_strs == ["The answer is "]


def test_stop_string_kept_with_no_stop_trim(tokenizer):
    ids = tokenizer.encode("x. y", add_special_tokens=False)[:2]
    out = Detokenizer(tokenizer).process(
        batch(["r"], [ids], [{"type": "stop", "matched": "."}], [["."]], no_trim=True)
    )
    assert out.output_strs == ["x."]


def test_stop_string_cut_at_the_matched_occurrence(tokenizer):
    # Under min_new_tokens the scheduler ignores an early "." and matches the later one;
    # the text must end before the occurrence that ended the request, not the first one.
    ids = tokenizer.encode("x. y. z", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["x", ".", " y", ".", " z"]
    out = Detokenizer(tokenizer).process(
        batch(["r"], [ids[:4]], [{"type": "stop", "matched": "."}], [["."]])
    )
    assert out.output_strs == ["x. y"]
    deltas = stream(Detokenizer(tokenizer), ids[:4], {"type": "stop", "matched": "."}, stop=["."])
    assert "".join(deltas) == "x. y"


def test_stop_string_inside_the_last_token(tokenizer):
    ids = tokenizer.encode("A\n\nB", add_special_tokens=False)
    text = tokenizer.decode(ids)
    out = Detokenizer(tokenizer).process(
        batch(["r"], [ids], [{"type": "stop", "matched": "\n"}], [["\n"]])
    )
    assert out.output_strs == [text[: text.index("\n")]]


def test_held_back_text_released_when_request_ends_otherwise(tokenizer):
    ids = tokenizer.encode("going to the", add_special_tokens=False)
    deltas = stream(
        Detokenizer(tokenizer), ids, {"type": "length", "length": len(ids)}, stop=["the end"]
    )
    assert deltas[-1].endswith("the")  # held back until the end, then delivered
    assert "".join(deltas) == "going to the"


def test_stop_token_id_left_out_of_text(tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False) + [EOS]
    reason = {"type": "stop", "matched": EOS}
    kept = stream(Detokenizer(tokenizer), ids, reason, skip=False, no_trim=True)
    assert "".join(kept) == "Hello there<|im_end|>"
    trimmed = stream(Detokenizer(tokenizer), ids, reason, skip=False)
    assert "".join(trimmed) == "Hello there"
    out = Detokenizer(tokenizer).process(batch(["r"], [ids], [reason], skip=False))
    assert out.output_strs == ["Hello there"]
    assert out.output_ids == [ids]  # the token itself is still reported


def test_abort_drops_state(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("partial output", add_special_tokens=False)
    detok.process(batch(["r"], [ids[:1]]))
    assert "r" in detok.states
    detok.process(batch(["r"], [[]], [{"type": "abort", "message": "aborted"}]))
    assert detok.states == {}
