"""eSpeak NG through ctypes: text in, 24 kHz float PCM out.

The library and its data come from the `espeakng-loader` wheel (no system package). eSpeak
keeps one synthesizer per process, with global state (voice, rate, the output callback), so
`ESpeak` is one object per process whose `synthesize` holds a lock: calls from several
threads run one after another. It is fast (a few hundred times real time on one core), so a
vocoder stage serializing its requests' sentences is not its bottleneck.

Speed: eSpeak's rate is words per minute, 175 at speed 1, up to 4x through its sonic
speed-up. Below its floor (80 wpm) it also lengthens the gaps between words, so that speed
0.25 still takes about four times as long as speed 1.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from cadence.speech.voices import SAMPLE_RATE, data_path

AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
ESPEAK_CHARS_UTF8 = 1
ESPEAK_RATE = 1
ESPEAK_WORDGAP = 7  # units of 10 ms
NORMAL_RATE = 175  # words per minute at speed 1.0
MIN_RATE = 80
# eSpeak stretches its word-gap unit (10 ms at the normal rate) as the rate slows, and adds
# a gap at some punctuation too: measured, a unit costs about 3.6x what 10 ms would.
GAP_SCALE = 0.28

# eSpeak hands over audio each time its buffer fills: with its default (60 ms) a sentence
# took ~80 callbacks, each needing the GIL, which the vocoder's event loop often held. A 1 s
# buffer makes it a handful; served speech at c8 rose ~15%.
BUFFER_MS = 1000
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class ESpeakError(RuntimeError):
    pass


class ESpeak:
    """The process's eSpeak NG synthesizer; see the module docstring. Use `ESpeak.get()`."""

    _instance: ESpeak | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> ESpeak:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        import espeakng_loader

        self._lock = threading.Lock()
        lib = self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, BUFFER_MS, data_path().encode(), 0)
        if rate <= 0:
            raise ESpeakError(f"eSpeak NG did not initialize (data at {data_path()})")
        self.native_rate = rate  # 22050 Hz
        self._chunks: list[np.ndarray] = []
        self._callback = _CALLBACK(self._on_audio)  # kept alive: eSpeak holds its address
        lib.espeak_SetSynthCallback(self._callback)
        self._voice: str | None = None

    def _on_audio(self, wav, num_samples: int, events) -> int:
        if num_samples > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
        return 0  # go on

    def synthesize(self, text: str, voice: str, speed: float = 1.0) -> np.ndarray:
        """`text` spoken by `voice` at `speed`: float32 PCM in [-1, 1] at SAMPLE_RATE, mono
        (shape [num_samples])."""
        with self._lock:
            self._set_voice(voice)
            wpm = NORMAL_RATE * speed
            rate = max(MIN_RATE, round(wpm))
            # Below eSpeak's floor: the missing time goes into the gaps between words.
            gap = round((60 / wpm - 60 / rate) * 100 * GAP_SCALE) if wpm < MIN_RATE else 0
            self._lib.espeak_SetParameter(ESPEAK_RATE, rate, 0)
            self._lib.espeak_SetParameter(ESPEAK_WORDGAP, gap, 0)
            data = text.encode("utf-8") + b"\0"
            self._chunks = []
            status = self._lib.espeak_Synth(
                data, len(data), 0, POS_CHARACTER, 0, ESPEAK_CHARS_UTF8, None, None
            )
            self._lib.espeak_Synchronize()
            chunks, self._chunks = self._chunks, []
        if status != 0:
            raise ESpeakError(f"eSpeak NG failed to synthesize (status {status})")
        if not chunks:
            return np.zeros(0, dtype=np.float32)
        pcm = np.concatenate(chunks).astype(np.float32) / 32768.0
        return resample(pcm, self.native_rate, SAMPLE_RATE)

    def _set_voice(self, voice: str) -> None:
        if voice != self._voice:
            if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ESpeakError(f"eSpeak NG has no voice {voice!r}")
            self._voice = voice


def resample(pcm: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Linear-interpolation resampling of mono float PCM (enough for eSpeak's band-limited
    formant speech; a polyphase filter would buy nothing audible here)."""
    if src_rate == dst_rate or len(pcm) == 0:
        return pcm.astype(np.float32, copy=False)
    num = int(round(len(pcm) * dst_rate / src_rate))
    positions = np.arange(num, dtype=np.float64) * (src_rate / dst_rate)
    return np.interp(positions, np.arange(len(pcm)), pcm).astype(np.float32)
