"""Stage pipelines: several executors (models, processing steps) chained as a graph of stages,
each in its own process or colocated with others, with a ZMQ control plane and a pluggable
data plane (the relay). The contract is specs/pipeline.md; docs/pipeline.md is the guide.

    from cadence.pipeline import Pipeline
    pipeline = await Pipeline.start("speech.yaml")
    result = await pipeline.coordinator.submit({"text": "hello"})

Importing this package is light (no torch, no zmq): the declaration and the executor
interface are here at once; the runtime is imported on first use of its names.
"""

from __future__ import annotations

import importlib

from cadence.pipeline.config import (
    PipelineConfig,
    PipelineGraph,
    RelayConfig,
    StageConfig,
    load_pipeline_config,
    packaged_pipelines,
    resolve_pipeline_path,
)
from cadence.pipeline.executor import (
    ChunkStream,
    Executor,
    StageContext,
    StageRequest,
    StreamError,
)

_LAZY = {
    "Pipeline": "cadence.pipeline.launcher",
    "Coordinator": "cadence.pipeline.coordinator",
    "LocalPipeline": "cadence.pipeline.local",
    "StreamItem": "cadence.pipeline.client",
    "PipelineClient": "cadence.pipeline.client",
    "StageFailed": "cadence.pipeline.errors",
    "PipelineUnavailable": "cadence.pipeline.errors",
    "RequestAborted": "cadence.pipeline.errors",
    "PipelineStartError": "cadence.pipeline.errors",
    "Relay": "cadence.pipeline.relay.base",
    "RelayOperation": "cadence.pipeline.relay.base",
    "register_relay": "cadence.pipeline.relay.base",
}

__all__ = [
    "ChunkStream",
    "Executor",
    "PipelineConfig",
    "PipelineGraph",
    "RelayConfig",
    "StageConfig",
    "StageContext",
    "StageRequest",
    "StreamError",
    "load_pipeline_config",
    "packaged_pipelines",
    "resolve_pipeline_path",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
