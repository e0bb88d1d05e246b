"""Control messages: msgspec structs tagged by type, msgpack on the wire, nothing else
accepted (no pickle: bytes that are not one of our messages are a decode error)."""

from __future__ import annotations

import pickle

import msgspec
import pytest
import torch

from cadence.pipeline import messages as m
from cadence.pipeline.payload import extract

HEADER = extract({"x": torch.ones(3), "note": "hi"}).header

SAMPLES = [
    m.Submit(rid="r", stage="a", payload=HEADER),
    m.DataReady(
        rid="r",
        stage="b",
        src_stage="a",
        payload=HEADER,
        relay={"segment": "s", "offset": 0, "size": 12, "seq": 1, "pid": 7},
    ),
    m.DataReady(rid="r", stage="b", src_stage="a", chunk_id=3, is_done=True, error="boom"),
    m.DataAck(rid="r", relay={"seq": 1, "pid": 7}),
    m.Complete(rid="r", stage="d", payload=HEADER),
    m.Complete(rid="r", stage="d", error="stage 'd' failed"),
    m.Stream(rid="r", stage="b", chunk_id=0, payload=HEADER),
    m.Stream(rid="r", stage="b", chunk_id=4, is_done=True),
    m.Abort(rids=["r", "s"], reason="client left"),
    m.Shutdown(),
    m.ProfilerStart(output_dir="/tmp/p"),
    m.ProfilerStop(),
    m.StageReady(process="a+b", pid=12),
    m.StatsQuery(token=3),
    m.StageStats(token=3, process="a", pid=1, live={"a": []}, relay={"free": 8}),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips_with_its_type(msg):
    data = m.encode(msg)
    back = m.decode(data)
    assert type(back) is type(msg)
    assert m.encode(back) == data


def test_the_wire_names_of_the_spec():
    names = {cls.__name__ for cls in m.Message.__args__}
    assert {
        "Submit",
        "DataReady",
        "Complete",
        "Stream",
        "Abort",
        "Shutdown",
        "ProfilerStart",
        "ProfilerStop",
    } <= names
    assert msgspec.msgpack.decode(m.encode(m.Shutdown())) == ["Shutdown"]


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(m.Shutdown()),
        pickle.dumps({"rid": "r"}),
        msgspec.msgpack.encode(["Exec", "import os"]),
        msgspec.msgpack.encode(["Submit", "r"]),
        b"",
    ],
)
def test_anything_else_is_a_decode_error(data):
    with pytest.raises(msgspec.DecodeError):
        m.decode(data)


def test_the_stage_process_spec_round_trips():
    spec = m.StageProcessSpec(
        config={"stages": []},
        process="a",
        pipeline_id="p",
        coordinator_address="ipc:///x/c",
        broadcast_address="ipc:///x/b",
        process_addresses={"a": "ipc:///x/p0"},
        parent_pid=1,
    )
    assert m.decode_spec(m.encode_spec(spec)) == spec
