"""Request checks: voices (eSpeak's and OpenAI's names), formats, speed; each error names its
field."""

from __future__ import annotations

import pytest

from cadence.errors import InvalidParameter
from cadence.speech import voices


def test_openai_voice_names_map_to_espeak_voices_that_exist():
    for name, target in voices.OPENAI_VOICES.items():
        language, _, variant = target.partition("+")
        assert language in voices.espeak_languages(), name
        assert not variant or variant in voices.espeak_variants(), name
        assert voices.resolve_voice(name.upper()) == target
    assert voices.resolve_voice("en-gb") == "en"  # a declared language names its voice file


def test_espeak_languages_and_variants_are_voices():
    assert voices.resolve_voice("en-us") == "en-us"
    assert voices.resolve_voice("FR") == "fr"
    assert voices.resolve_voice("de+f3") == "de+f3"
    assert voices.resolve_voice(None) == voices.OPENAI_VOICES[voices.DEFAULT_VOICE]
    assert "alloy" in voices.voice_names() and "en-us" in voices.voice_names()


@pytest.mark.parametrize("bad", ["nobody", "en-us+nosuchvariant", "", "  ", 7])
def test_unknown_voice_is_a_400_naming_voice(bad):
    with pytest.raises(InvalidParameter, match="voice") as e:
        voices.resolve_voice(bad)
    assert e.value.param == "voice"


def test_formats_and_speeds():
    assert voices.check_format(None) == "mp3"
    for fmt in voices.FORMATS:
        assert voices.check_format(fmt) == fmt
    with pytest.raises(InvalidParameter, match="response_format must be one of") as e:
        voices.check_format("ogg-vorbis")
    assert e.value.param == "response_format"
    assert voices.check_speed(None) == 1.0
    assert voices.check_speed(4) == 4.0
    for bad in (0.2, 4.01, True, "fast"):
        with pytest.raises(InvalidParameter) as e:
            voices.check_speed(bad)
        assert e.value.param == "speed"


def test_opus_and_aac_without_pyav_are_a_400_naming_the_format(monkeypatch):
    monkeypatch.setattr(voices, "has_pyav", lambda: False)
    for fmt in ("opus", "aac"):
        with pytest.raises(InvalidParameter, match=f"'{fmt}' needs PyAV") as e:
            voices.check_format(fmt)
        assert e.value.param == "response_format"
    assert voices.check_format("mp3") == "mp3"
