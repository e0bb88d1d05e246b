"""Voices, formats and speeds a speech request may ask for, and the checks that say why not.

The voice list comes from eSpeak NG's data directory as shipped in the `espeakng-loader`
wheel (a file per language under `lang/`, a file per variant under `voices/!v/`): reading
file names needs neither the library nor a synthesizer, so the HTTP and gRPC adapters check
a request here before any stage sees it. A voice is a language (`en-us`, `fr`), optionally
with a variant (`en-us+f3`), or one of OpenAI's voice names, each mapped to an English
language and variant.
"""

from __future__ import annotations

import functools
import os

from cadence.errors import InvalidParameter

SAMPLE_RATE = 24_000  # what every format carries (OpenAI's pcm is 24 kHz, 16-bit, mono)
MIN_SPEED, MAX_SPEED = 0.25, 4.0
DEFAULT_VOICE = "alloy"

# OpenAI's voice names -> eSpeak NG voices (language + variant), spread over male/female.
OPENAI_VOICES = {
    "alloy": "en-us",
    "ash": "en-us+m3",
    "ballad": "en+m2",
    "coral": "en-us+f2",
    "echo": "en",
    "fable": "en-gb-x-rp+m1",
    "nova": "en-us+f3",
    "onyx": "en-us+m7",
    "sage": "en+f4",
    "shimmer": "en-us+f4",
    "verse": "en-us+m2",
    "marin": "en-us+f1",
    "cedar": "en+m4",
}

# response_format -> (MIME type, whether its bytes can be sent as they are made)
FORMATS = {
    "mp3": ("audio/mpeg", True),
    "opus": ("audio/ogg", True),
    "aac": ("audio/aac", True),
    "flac": ("audio/flac", False),  # STREAMINFO is written last: sent whole at the end
    "wav": ("audio/wav", True),
    "pcm": ("audio/pcm", True),
}
STREAM_FORMATS = ("audio", "sse")


def data_path() -> str:
    """eSpeak NG's data directory, from the espeakng-loader package."""
    import espeakng_loader

    return espeakng_loader.get_data_path()


@functools.cache
def espeak_languages() -> dict[str, str]:
    """Every eSpeak NG language (lower case) -> the voice file that speaks it: each file under
    `lang/` by its own name and by the languages it declares (`en-gb` is the file `en`).
    Languages whose dictionary the wheel lacks are left out."""
    root = data_path()
    names: dict[str, str] = {}
    aliases: dict[str, tuple[int, int, str]] = {}  # language -> (priority, len, file)
    for folder, _, files in os.walk(os.path.join(root, "lang")):
        for file in sorted(files):
            name = file.lower()
            dictionary = name.split("-")[0]
            declared = []
            with open(os.path.join(folder, file), encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "language" and value.split():
                        words = value.split()
                        priority = int(words[1]) if len(words) > 1 and words[1].isdigit() else 5
                        declared.append((words[0].lower(), priority))
                    elif key == "dictionary" and value.strip():
                        dictionary = value.strip().lower()
            if not os.path.exists(os.path.join(root, f"{dictionary}_dict")):
                continue
            names[name] = name
            for language, priority in declared:  # the best-placed file speaks it
                aliases[language] = min(
                    aliases.get(language, (99, 0, "")), (priority, len(name), name)
                )
    return {**{language: best[2] for language, best in aliases.items()}, **names}


@functools.cache
def espeak_variants() -> frozenset[str]:
    """Every voice variant name (`m1`, `f3`, `klatt`, ...), from `voices/!v/`."""
    root = os.path.join(data_path(), "voices", "!v")
    return frozenset(f.lower() for f in os.listdir(root)) if os.path.isdir(root) else frozenset()


def voice_names() -> list[str]:
    """What `voice` may be: OpenAI's names first, then eSpeak's languages."""
    return [*OPENAI_VOICES, *sorted(espeak_languages())]


def resolve_voice(voice: str | None) -> str:
    """The eSpeak voice (`language` or `language+variant`) for a request's `voice`; an
    InvalidParameter naming `voice` when there is none such."""
    voice = DEFAULT_VOICE if voice is None else voice
    if not isinstance(voice, str) or not voice.strip():
        raise InvalidParameter("voice", f"voice must be a voice name, got {voice!r}")
    name = voice.strip().lower()
    if name in OPENAI_VOICES:
        return OPENAI_VOICES[name]
    language, _, variant = name.partition("+")
    if language in espeak_languages() and (not variant or variant in espeak_variants()):
        return espeak_languages()[language] + (f"+{variant}" if variant else "")
    raise InvalidParameter(
        "voice",
        f"unknown voice {voice!r}: use one of OpenAI's ({', '.join(OPENAI_VOICES)}) or an eSpeak "
        f"NG language such as en-us, fr or de, optionally with a variant such as en-us+f3 "
        f"(GET /v1/audio/voices lists them)",
    )


def check_format(fmt: str | None, field: str = "response_format") -> str:
    fmt = "mp3" if fmt is None else fmt
    if fmt not in FORMATS:
        raise InvalidParameter(field, f"{field} must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt in ("opus", "aac") and not has_pyav():
        raise InvalidParameter(
            field,
            f"{field} {fmt!r} needs PyAV (the `av` package), which this server lacks; "
            f"ask for mp3, wav, flac or pcm, or install av",
        )
    return fmt


def check_speed(speed) -> float:
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise InvalidParameter("speed", f"speed must be a number, got {speed!r}")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidParameter(
            "speed", f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed}"
        )
    return float(speed)


@functools.cache
def has_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True
