"""The talker's text work: normalization, and sentences out of text that arrives in pieces."""

from __future__ import annotations

import pytest

from cadence.speech.text import SentenceSplitter, normalize, split_sentences


def test_normalize_reads_markdown_links_and_symbols_as_words():
    assert normalize("**Bold** and `code` [here](http://x.y)") == "Bold and code here"
    assert normalize("Tom & Jerry: 50% off") == "Tom and Jerry: 50 percent off"
    assert normalize("# Title\n- item one\n- item two") == "Title\n item one\n item two"


def test_normalize_drops_emoji_and_control_characters():
    assert normalize("Great job \U0001f389\u200b!\x07") == "Great job !"


def test_whole_text_splits_at_sentence_ends_only():
    text = "Dr. Smith paid $3.50 for it. Really? Yes! Then e.g. that; and the rest"
    assert split_sentences(text) == [
        "Dr. Smith paid $3.50 for it.",
        "Really?",
        "Yes!",
        "Then e.g. that;",
        "and the rest",
    ]


def test_a_sentence_after_a_word_is_released_at_its_period():
    splitter = SentenceSplitter()
    assert splitter.feed("Hello there") == []
    assert splitter.feed(".") == ["Hello there."]  # no need to wait for the next token
    assert splitter.feed(" It costs 3") == []
    assert splitter.feed(".") == []  # "3." could still be "3.14"
    assert splitter.feed("14 dollars, Mr") == []
    assert splitter.feed(".") == []  # an abbreviation
    assert splitter.feed(" Smith! How") == ["It costs 3.14 dollars, Mr. Smith!"]
    assert splitter.feed(" are you?\n") == ["How are you?"]
    assert splitter.flush() == []


def test_token_by_token_gives_the_same_sentences_as_the_whole_text():
    text = "One. Two, three! Four is 4.5 units.\nFive... and six? Mr. Seven ends"
    splitter = SentenceSplitter()
    streamed = [s for ch in text for s in splitter.feed(ch)] + splitter.flush()
    # The same sentences; only "..." may end at its first period when it comes one at a time.
    assert [s.rstrip(".") for s in streamed] == [s.rstrip(".") for s in split_sentences(text)]
    assert streamed[0] == "One."


def test_a_run_without_an_end_is_cut_at_a_comma_or_space():
    splitter = SentenceSplitter(max_chars=40)
    out = splitter.feed("alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu")
    assert out and all(len(s) <= 40 for s in out)
    assert out[0] == "alpha beta gamma,"
    rest = splitter.flush()
    assert " ".join(out + rest).split() == (
        "alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu".split()
    )


def test_pieces_without_words_are_not_sentences():
    assert split_sentences("... !!! \n\n ?") == []
    assert split_sentences("") == []


def test_max_chars_is_checked():
    with pytest.raises(ValueError, match="max_chars"):
        SentenceSplitter(max_chars=3)
