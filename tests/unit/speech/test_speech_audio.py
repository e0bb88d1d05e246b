"""eSpeak NG synthesis and every encoder, decoded back with soundfile / miniaudio / PyAV."""

from __future__ import annotations

import numpy as np
import pytest
from speech_checks import assert_speech, decode

from cadence.speech.audio import make_encoder
from cadence.speech.espeak import ESpeak, ESpeakError, resample
from cadence.speech.voices import FORMATS, SAMPLE_RATE

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park."


@pytest.fixture(scope="module")
def espeak():
    return ESpeak.get()


def test_synthesis_is_speech_of_a_plausible_length(espeak):
    pcm = espeak.synthesize(TEXT, "en-us")
    assert pcm.dtype == np.float32 and pcm.ndim == 1
    assert np.abs(pcm).max() <= 1.0
    seconds = len(pcm) / SAMPLE_RATE
    assert 9 <= len(TEXT) / seconds <= 24
    assert float(np.sqrt(np.mean(pcm**2))) > 0.01


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed_scales_the_duration(espeak, speed):
    normal = len(espeak.synthesize(TEXT, "en-us"))
    scaled = len(espeak.synthesize(TEXT, "en-us", speed))
    # eSpeak's pauses do not all scale with its rate: within 35% of the ideal ratio.
    assert normal / scaled == pytest.approx(speed, rel=0.35)


def test_voices_differ_and_unknown_ones_fail(espeak):
    male = espeak.synthesize("Hello there.", "en-us")
    female = espeak.synthesize("Hello there.", "en-us+f3")
    assert not np.array_equal(male[: len(female)], female[: len(male)])
    assert len(espeak.synthesize("Bonjour à tous.", "fr")) > 0
    with pytest.raises(ESpeakError, match="no voice"):
        espeak.synthesize("x", "xx-nonexistent")
    assert len(espeak.synthesize("Hello again.", "en-us")) > 0  # still usable


def test_resample_keeps_duration_and_tone():
    tone = np.sin(2 * np.pi * 440 * np.arange(22050) / 22050).astype(np.float32)
    out = resample(tone, 22050, 24000)
    assert len(out) == 24000
    crossings = np.count_nonzero(np.diff(np.signbit(out)))
    assert crossings == pytest.approx(880, abs=4)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_decodes_back_to_the_speech(espeak, fmt, streaming):
    sentences = ["The quick brown fox jumps over the lazy dog.", "It was a sunny day in the park."]
    encoder = make_encoder(fmt, streaming)
    parts = [encoder.encode(espeak.synthesize(s, "en-us")) for s in sentences]
    parts.append(encoder.finish())
    data = b"".join(parts)
    seconds = assert_speech(data, fmt, " ".join(sentences))
    expected = sum(len(espeak.synthesize(s, "en-us")) for s in sentences) / SAMPLE_RATE
    assert seconds == pytest.approx(expected, abs=0.15)  # codec padding at most
    if streaming and FORMATS[fmt][1]:
        assert parts[0], f"{fmt}: nothing after the first sentence"
    samples, rate = decode(data, fmt)
    assert rate in (SAMPLE_RATE, 48_000)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_empty_stream_is_a_valid_file_of_every_format(fmt, streaming):
    """Nothing to say (lame used to refuse to flush an encoder that never encoded: mp3 was
    a 500): a file that decodes, holding nothing or a moment of silence."""
    encoder = make_encoder(fmt, streaming)
    data = encoder.encode(np.zeros(0, np.float32)) + encoder.finish()
    samples, rate = decode(data, fmt)
    assert len(samples) <= 0.1 * rate, fmt
    assert np.abs(samples).max(initial=0.0) < 0.01, (
        f"{fmt}: the silence is silent (lossy codecs: near 0)"
    )
