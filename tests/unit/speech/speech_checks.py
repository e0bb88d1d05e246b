"""Decoding a speech response back to samples, and what a plausible one looks like; shared by
the unit, integration and end-to-end speech tests (a helper, not a test module)."""

from __future__ import annotations

import io

import numpy as np

SAMPLE_RATE = 24_000
# eSpeak NG at speed 1 speaks English at about 12 to 20 characters a second.
CHARS_PER_S = (9.0, 24.0)


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Mono float samples and their rate: soundfile for wav/flac/mp3/opus, miniaudio where
    soundfile reads no such file, PyAV for aac (ADTS), and pcm as raw 16-bit samples."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768, SAMPLE_RATE
    if fmt == "aac":
        import av

        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
            rate = container.streams.audio[0].rate
        return np.concatenate(frames).astype(np.float32), rate
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    except soundfile.LibsndfileError:
        import miniaudio

        decoded = miniaudio.decode(data, nchannels=1, sample_rate=SAMPLE_RATE)
        samples = np.asarray(decoded.samples, dtype=np.float32) / 32768
        rate = decoded.sample_rate
    if samples.ndim > 1:
        samples = samples.mean(axis=1)
    return samples, rate


def duration_s(data: bytes, fmt: str) -> float:
    samples, rate = decode(data, fmt)
    return len(samples) / rate


def assert_speech(data: bytes, fmt: str, text: str, speed: float = 1.0) -> float:
    """`data` decodes to a non-silent waveform whose length fits `text` at `speed`; returns
    its duration."""
    samples, rate = decode(data, fmt)
    seconds = len(samples) / rate
    assert seconds > 0, f"{fmt}: no samples"
    rms = float(np.sqrt(np.mean(samples**2)))
    assert rms > 0.01, f"{fmt}: silent (rms {rms:.4f})"
    low, high = CHARS_PER_S
    rate_cps = len(text) / seconds / speed
    assert low <= rate_cps <= high, (
        f"{fmt}: {len(text)} chars in {seconds:.2f} s at speed {speed} is {rate_cps:.1f} chars/s "
        f"(eSpeak: {low}-{high})"
    )
    return seconds


STANDALONE_THINKER = "cadence.engine_stage:EngineStage"


def standalone_speech(name: str = "speech", llm: bool = False, engine_args: dict | None = None):
    """A shipped speech declaration as a pipeline run without a Cadence server: its thinker
    (the server's engine, placed in the front) becomes `EngineStage`, an Engine of its own in
    a stage process (`llm`: whether it loads the model; `engine_args`: its ServerArgs)."""
    import dataclasses
    from pathlib import Path

    import cadence
    from cadence.pipeline import load_pipeline_config

    path = Path(cadence.__file__).parent / "pipeline" / "pipelines" / f"{name}.yaml"
    config = load_pipeline_config(str(path))
    args = {"llm": llm, "engine_args": dict(engine_args or {"max_total_tokens": 2048})}
    stages = tuple(
        dataclasses.replace(s, executor=STANDALONE_THINKER, placement="process", args=args)
        if s.name == "thinker"
        else s
        for s in config.stages
    )
    return dataclasses.replace(config, stages=stages)
