"""Audio encoders: float PCM chunks in, a format's bytes out, as early as the format allows.

    encoder = make_encoder("mp3", streaming=True)
    for pcm in chunks:             # float32, mono, SAMPLE_RATE
        send(encoder.encode(pcm))  # may be b"" while the codec fills a frame
    send(encoder.finish())

pcm: 16-bit little-endian samples, nothing else. wav: streamed, its header comes first with
the sizes unknown (0xFFFFFFFF, as streaming servers write it); whole, the header is exact.
mp3 through lameenc; opus (in Ogg) and aac (ADTS) through PyAV; flac through soundfile, whole
at `finish` (its header is written last). Codec libraries are imported when an encoder of
theirs is made.

A text with nothing to say (".", an emoji) still ends in a valid file of every format: wav
and pcm hold no samples; flac, mp3, opus and aac, whose codecs write no stream (or fail) for
zero samples, hold `SILENCE_SAMPLES` of silence.
"""

from __future__ import annotations

import io
import struct
from abc import ABC, abstractmethod

import numpy as np

from cadence.speech.voices import SAMPLE_RATE

SILENCE_SAMPLES = SAMPLE_RATE // 100  # 10 ms: the audio of nothing to say, where one is needed


class AudioEncoder(ABC):
    """One response's encoder. `encode` and `finish` return the bytes ready to send; after
    `finish` the encoder is spent."""

    @abstractmethod
    def encode(self, pcm: np.ndarray) -> bytes:
        """Bytes for `pcm` (float32 [num_samples], in [-1, 1]); may hold some back."""

    @abstractmethod
    def finish(self) -> bytes:
        """The bytes still held back, and the format's trailer."""


def to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")


class PcmEncoder(AudioEncoder):
    def encode(self, pcm: np.ndarray) -> bytes:
        return to_int16(pcm).tobytes()

    def finish(self) -> bytes:
        return b""


def wav_header(num_data_bytes: int | None) -> bytes:
    """A 44-byte PCM WAV header (mono, 16-bit, SAMPLE_RATE); None: sizes unknown."""
    data = 0xFFFFFFFF if num_data_bytes is None else num_data_bytes
    riff = 0xFFFFFFFF if num_data_bytes is None else 36 + num_data_bytes
    return b"".join(
        (
            b"RIFF",
            struct.pack("<I", riff),
            b"WAVEfmt ",
            struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, SAMPLE_RATE * 2, 2, 16),
            b"data",
            struct.pack("<I", data),
        )
    )


class WavEncoder(AudioEncoder):
    def __init__(self, streaming: bool):
        self.streaming = streaming
        self._parts: list[bytes] = []
        self._started = False

    def encode(self, pcm: np.ndarray) -> bytes:
        data = to_int16(pcm).tobytes()
        if not self.streaming:
            self._parts.append(data)
            return b""
        if not self._started:
            self._started = True
            return wav_header(None) + data
        return data

    def finish(self) -> bytes:
        if self.streaming:
            return b"" if self._started else wav_header(None)
        data = b"".join(self._parts)
        return wav_header(len(data)) + data


class FlacEncoder(AudioEncoder):
    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []

    def encode(self, pcm: np.ndarray) -> bytes:
        self._parts.append(to_int16(pcm))
        return b""

    def finish(self) -> bytes:
        import soundfile

        # libsndfile writes no FLAC stream at all for zero samples
        samples = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype="<i2")
        if len(samples) == 0:
            samples = np.zeros(SILENCE_SAMPLES, dtype="<i2")
        out = io.BytesIO()
        soundfile.write(out, samples, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
        return out.getvalue()


class Mp3Encoder(AudioEncoder):
    def __init__(self, bitrate_kbps: int = 64):
        import lameenc

        self._lame = lameenc.Encoder()
        self._lame.set_bit_rate(bitrate_kbps)
        self._lame.set_in_sample_rate(SAMPLE_RATE)
        self._lame.set_channels(1)
        self._lame.set_quality(5)
        self._num_samples = 0

    def encode(self, pcm: np.ndarray) -> bytes:
        if len(pcm) == 0:
            return b""
        self._num_samples += len(pcm)
        return bytes(self._lame.encode(to_int16(pcm).tobytes()))

    def finish(self) -> bytes:
        # lame refuses to flush what it never started ("Not currently encoding")
        head = b"" if self._num_samples else self.encode(np.zeros(SILENCE_SAMPLES, np.float32))
        return head + bytes(self._lame.flush())


class _Sink:
    """A write-only file for PyAV's muxer: collects what it writes until taken."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._pos = 0

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return False

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class PyAVEncoder(AudioEncoder):
    """opus in Ogg, aac in ADTS: containers a muxer writes front to back."""

    CODECS = {"opus": ("ogg", "libopus"), "aac": ("adts", "aac")}

    def __init__(self, fmt: str):
        import av

        container, codec = self.CODECS[fmt]
        self._av = av
        self._sink = _Sink()
        self._container = av.open(self._sink, "w", format=container)
        self._stream = self._container.add_stream(codec, rate=SAMPLE_RATE, layout="mono")
        self._pts = 0

    def encode(self, pcm: np.ndarray) -> bytes:
        if len(pcm) == 0:
            return b""
        frame = self._av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm, dtype=np.float32)[None, :], format="flt", layout="mono"
        )
        frame.sample_rate = SAMPLE_RATE
        frame.pts = self._pts
        self._pts += len(pcm)
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        # With no frame at all the muxer writes nothing, not even its header
        head = b"" if self._pts else self.encode(np.zeros(SILENCE_SAMPLES, np.float32))
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return head + self._sink.take()


def make_encoder(fmt: str, streaming: bool = True) -> AudioEncoder:
    """The encoder of `fmt` (one of voices.FORMATS, already checked)."""
    if fmt == "pcm":
        return PcmEncoder()
    if fmt == "wav":
        return WavEncoder(streaming)
    if fmt == "flac":
        return FlacEncoder()
    if fmt == "mp3":
        return Mp3Encoder()
    if fmt in PyAVEncoder.CODECS:
        return PyAVEncoder(fmt)
    raise ValueError(f"no encoder for format {fmt!r}")
