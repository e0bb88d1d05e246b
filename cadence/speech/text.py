"""The talker's text work: normalization for a synthesizer, and sentences out of streamed text.

An LLM's answer arrives a few characters at a time; speech should start as soon as its first
sentence is complete, not when the answer is. `SentenceSplitter.feed` takes each delta and
returns the sentences it completed; `flush` returns the rest at the end. A sentence ends at
`.`, `!`, `?`, `;` or `…` followed by white space (so "3.14" and "e.g." never split), or at
a line break; after a word (not a number, abbreviation or initial) a `.`, `!` or `?` ends it at
once, without waiting for the next character; a run
longer than `max_chars` with no end in sight is cut at its last comma or space, so that a
list or run-on answer does not hold speech back.
"""

from __future__ import annotations

import re
import unicodedata

# Abbreviations whose period does not end a sentence (lower case, without the period).
ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e cf fig no approx dept est inc ltd co".split()
)
MAX_SENTENCE_CHARS = 240

_SYMBOLS = {
    "&": " and ",
    "%": " percent",
    "+": " plus ",
    "=": " equals ",
    "@": " at ",
    "°": " degrees",
}
_MARKDOWN = re.compile(r"(\*\*|__|`+|^#{1,6}\s+|^\s*[-*•]\s+|^\s*>\s*)", re.MULTILINE)
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_SPACES = re.compile(r"[ \t\f\v]+")
_TAIL_END = re.compile(r"([.!?…]+)[\"')\]]*$")
_END = re.compile(r"([.!?;…]+)[\"')\]]*(\s)|(\n)")


def normalize(text: str) -> str:
    """Text as a synthesizer should read it: Unicode NFKC, markdown markup and links reduced
    to their words, symbols eSpeak reads badly spelled out, control characters and emoji
    dropped, runs of blanks collapsed. Numbers, dates and abbreviations stay: eSpeak's own
    rules read them."""
    text = unicodedata.normalize("NFKC", text)
    text = _LINK.sub(r"\1", text)
    text = _MARKDOWN.sub(" ", text)
    text = "".join(_SYMBOLS.get(c, c) for c in text if _is_speakable(c))
    return _SPACES.sub(" ", text).strip()


def _is_speakable(c: str) -> bool:
    if c in "\n\t ":
        return True
    category = unicodedata.category(c)
    # Cc/Cf: control and format characters; So: symbols (emoji, dingbats); Cs/Co: surrogates.
    return category not in ("Cc", "Cf", "Cs", "Co", "So")


class SentenceSplitter:
    """Complete sentences out of text that arrives in pieces; see the module docstring."""

    def __init__(self, max_chars: int = MAX_SENTENCE_CHARS):
        if max_chars < 16:
            raise ValueError(f"max_chars must be >= 16, got {max_chars}")
        self.max_chars = max_chars
        self._buffer = ""

    def feed(self, delta: str) -> list[str]:
        """The sentences `delta` completed (normalized, non-empty), in order."""
        self._buffer += delta
        sentences = []
        start = 0
        for match in _END.finditer(self._buffer):
            end = match.end(1) if match.group(1) else match.start(3)
            candidate = self._buffer[start:end]
            if match.group(1) and match.group(1) == "." and _ends_with_abbreviation(candidate):
                continue
            sentences.append(candidate)
            start = match.end()
        self._buffer = self._buffer[start:]
        if _ends_a_sentence_now(self._buffer):
            sentences.append(self._buffer)
            self._buffer = ""
        while len(self._buffer) > self.max_chars:
            cut = _cut_point(self._buffer, self.max_chars)
            sentences.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
        return [s for s in map(normalize, sentences) if _has_words(s)]

    def flush(self) -> list[str]:
        """What is left at the end of the text, as a last sentence (or none)."""
        rest, self._buffer = normalize(self._buffer), ""
        return [rest] if _has_words(rest) else []


def split_sentences(text: str, max_chars: int = MAX_SENTENCE_CHARS) -> list[str]:
    """A whole text's sentences, as the splitter would give them."""
    splitter = SentenceSplitter(max_chars)
    return splitter.feed(text) + splitter.flush()


def _ends_with_abbreviation(candidate: str) -> bool:
    words = candidate.rstrip(".").rsplit(None, 1)
    if not words:
        return False
    word = words[-1].lower().lstrip("(\"'")
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def _ends_a_sentence_now(text: str) -> bool:
    """`text` ends with a sentence end that no next character can undo: `.`, `!`, `?` after
    a word (not a number: "3." may be "3.14"; not an abbreviation or an initial). Releasing it
    at once saves waiting one more token of an LLM's stream."""
    match = _TAIL_END.search(text)
    if match is None or not text[match.start() - 1 : match.start()].isalpha():
        return False
    return not (match.group(1) == "." and _ends_with_abbreviation(text[: match.end(1)]))


def _cut_point(text: str, limit: int) -> int:
    # A comma anywhere past the first quarter beats a space: it is where a speaker pauses.
    for sep, start in ((", ", limit // 4), (" ", limit // 2)):
        cut = text.rfind(sep, start, limit)
        if cut > 0:
            return cut + len(sep)
    return limit


def _has_words(text: str) -> bool:
    return any(c.isalnum() for c in text)
