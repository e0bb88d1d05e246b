"""Speech: the stages of the `speech` pipeline and what the adapters check a request with.

    thinker (LLM) → talker (text → sentences) → vocoder (eSpeak NG) → encoder (audio bytes)

`cadence/pipeline/pipelines/speech.yaml` declares the pipeline (`cadence serve --pipeline
speech`); docs/speech.md is the guide. This package's top is light: `voices` (request checks)
imports nothing heavy; `executors`, `espeak` and `audio` load torch, the eSpeak library and
the codecs, and run in the stage processes.
"""
