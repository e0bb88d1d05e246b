"""The graphs pipeline tests run: each shape once, with any relay configuration."""

from __future__ import annotations

import torch

from cadence.pipeline import PipelineConfig, RelayConfig, StageConfig

E = "pipeline_executors:"


def linear(relay: RelayConfig | None = None) -> PipelineConfig:
    """a (+1) -> b (*2) -> c (+3), each in its own process."""
    return PipelineConfig(
        name="linear",
        relay=relay or RelayConfig(),
        stages=[
            StageConfig(name="a", executor=E + "Step", args={"add": 1.0}, next="b"),
            StageConfig(name="b", executor=E + "Step", args={"scale": 2.0}, next="c"),
            StageConfig(name="c", executor=E + "Step", args={"add": 3.0}, terminal=True),
        ],
    )


def fan(relay: RelayConfig | None = None) -> PipelineConfig:
    """a -> (b, c) -> d, where d concatenates b's and c's x."""
    return PipelineConfig(
        name="fan",
        relay=relay or RelayConfig(),
        stages=[
            StageConfig(name="a", executor=E + "Step", args={"add": 1.0}, next=["b", "c"]),
            StageConfig(name="b", executor=E + "Step", args={"scale": 2.0}, next="d"),
            StageConfig(name="c", executor=E + "Step", args={"scale": -1.0}, next="d"),
            StageConfig(
                name="d", executor=E + "Step", args={"add": 0.5}, merge=E + "concat", terminal=True
            ),
        ],
    )


def stream(relay: RelayConfig | None = None) -> PipelineConfig:
    """a (+1) -> b streams 4 chunks to c and to the client; c sums them (terminal)."""
    return PipelineConfig(
        name="stream",
        relay=relay or RelayConfig(),
        stages=[
            StageConfig(name="a", executor=E + "Step", args={"add": 1.0}, next="b"),
            StageConfig(
                name="b",
                executor=E + "Producer",
                args={"num_chunks": 4},
                stream_to="c",
                stream_to_client=True,
            ),
            StageConfig(name="c", executor=E + "Collect", terminal=True),
        ],
    )


def colocated(relay: RelayConfig | None = None) -> PipelineConfig:
    """{a, b} in one process, {c, d} in another: a -> b by reference, b streams to c across
    processes, c -> d by reference."""
    return PipelineConfig(
        name="colocated",
        relay=relay or RelayConfig(),
        stages=[
            StageConfig(name="a", executor=E + "Step", args={"add": 1.0}, next="b"),
            StageConfig(
                name="b",
                executor=E + "Producer",
                args={"num_chunks": 3},
                colocate_with=["a"],
                stream_to="c",
            ),
            StageConfig(name="c", executor=E + "Collect", next="d"),
            StageConfig(
                name="d",
                executor=E + "Step",
                args={"scale": 3.0},
                colocate_with=["c"],
                terminal=True,
            ),
        ],
    )


def front(relay: RelayConfig | None = None) -> PipelineConfig:
    """a and d placed in the front (the coordinator's process), b and c in processes: the
    request enters at a, a -> b crosses from the front, b streams to c (and to the client)
    across processes, c -> d crosses back to the front, d's result goes to the client."""
    return PipelineConfig(
        name="front",
        relay=relay or RelayConfig(),
        stages=[
            StageConfig(
                name="a", executor=E + "Step", args={"add": 1.0}, next="b", placement="front"
            ),
            StageConfig(
                name="b",
                executor=E + "Producer",
                args={"num_chunks": 3},
                stream_to="c",
                stream_to_client=True,
            ),
            StageConfig(name="c", executor=E + "Collect", next="d"),
            StageConfig(
                name="d", executor=E + "Step", args={"scale": 3.0}, terminal=True, placement="front"
            ),
        ],
    )


GRAPHS = {
    "linear": linear,
    "fan": fan,
    "stream": stream,
    "colocated": colocated,
    "front": front,
}


def request(i: int, numel: int = 2048, **options) -> dict:
    """Request i: x is `numel` float32 values (8 KiB by default), distinct per request."""
    return {"x": torch.arange(numel, dtype=torch.float32) + i, "trace": [], **options}
