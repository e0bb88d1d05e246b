"""--log-requests: what each of SGLang's levels writes when a request arrives and ends, and
/configure_logging's changes, seen by every front process through the shared value."""

from __future__ import annotations

import logging
import multiprocessing

import pytest

from cadence.front.request_log import PARTIAL_CHARS, RequestLog
from cadence.io_struct import SamplingParams, TokenizedGenerateReqInput
from cadence.server_args import ServerArgs


def _tok(text: str | None = "hello there", ids=(1, 2, 3)) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid="r1",
        input_text=text,
        input_ids=list(ids),
        sampling_params=SamplingParams(max_new_tokens=7, temperature=0.5),
        stream=True,
        lora_path="french",
    )


META = {
    "finish_reason": {"type": "length", "length": 7},
    "prompt_tokens": 3,
    "completion_tokens": 7,
    "cached_tokens": 0,
}


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cadence.requests"]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_each_level_adds_its_detail(caplog, level):
    caplog.set_level(logging.INFO, logger="cadence.requests")
    log = RequestLog(True, level)
    log.received(_tok())
    log.finished("r1", META, " a b c", [5, 6, 7], 0.25)
    received, finished = _lines(caplog)
    assert received.startswith("Receive: rid=r1 prompt_tokens=3 stream=True lora=french")
    assert finished.startswith("Finish: rid=r1 finish_reason={'type': 'length', 'length': 7}")
    assert "completion_tokens=7" in finished and "e2e_latency=0.250s" in finished
    assert ("'temperature': 0.5" in received) == (level >= 1)
    assert ("text='hello there'" in received) == (level >= 2)
    assert ("text=' a b c'" in finished and "output_ids=[5, 6, 7]" in finished) == (level >= 2)


def test_a_prompt_of_ids_is_logged_as_ids(caplog):
    caplog.set_level(logging.INFO, logger="cadence.requests")
    RequestLog(True, 2).received(_tok(text=None, ids=(9, 8)))
    (received,) = _lines(caplog)
    assert "input_ids=[9, 8]" in received and "text=" not in received


def test_level_2_cuts_long_values_and_level_3_keeps_them(caplog):
    caplog.set_level(logging.INFO, logger="cadence.requests")
    long = "x" * (PARTIAL_CHARS * 2)
    RequestLog(True, 2).finished("r1", META, long, [], 1.0)
    RequestLog(True, 3).finished("r1", META, long, [], 1.0)
    cut, whole = _lines(caplog)
    assert f"({len(repr(long)) - PARTIAL_CHARS} more characters)" in cut
    assert long not in cut and repr(long) in whole


def test_off_writes_nothing_and_a_bad_level_is_refused(caplog):
    caplog.set_level(logging.INFO, logger="cadence.requests")
    RequestLog(False, 3).received(_tok())
    RequestLog().finished("r1", META, "", [], 0.0)
    assert _lines(caplog) == []
    with pytest.raises(ValueError, match="log_requests_level"):
        RequestLog(True, 4)
    with pytest.raises(ValueError, match="log_requests_level"):
        RequestLog().configure(level=-1)
    with pytest.raises(ValueError, match="log_requests_level must be 0, 1, 2 or 3"):
        ServerArgs(log_requests=True, log_requests_level=5)
    args = ServerArgs(log_requests=True)
    assert (args.log_requests, args.log_requests_level) == (True, 2)  # SGLang's default level


def test_configure_changes_what_is_given_for_every_front_sharing_the_value(caplog):
    caplog.set_level(logging.INFO, logger="cadence.requests")
    shared = multiprocessing.get_context("spawn").RawValue("b", RequestLog.encode(False, 1))
    a, b = RequestLog(shared=shared), RequestLog(shared=shared)
    assert a.state() == b.state() == (False, 1)  # the shared value wins over the fields
    a.configure(on=True)  # the level stays as it was
    assert b.state() == (True, 1)
    b.received(_tok())
    (line,) = _lines(caplog)
    assert "'temperature': 0.5" in line and "text=" not in line  # level 1
    b.configure(level=3)
    assert a.state() == (True, 3)
    a.configure(on=False)
    assert b.state() == (False, 3)
    b.received(_tok())
    assert len(_lines(caplog)) == 1  # off: nothing more
    for on in (True, False):
        for level in (0, 1, 2, 3):
            shared.value = RequestLog.encode(on, level)
            assert a.state() == (on, level)
