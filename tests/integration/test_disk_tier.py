"""The prefix cache's disk tier on the real model: a prefix evicted from memory, or computed
before a restart, is read back from disk and gives exactly the answer a fresh prefill gives;
a file of another configuration, a truncated or a corrupt one is refused and never served;
an unwritable directory turns the tier off and the server serves on."""

from __future__ import annotations

import json
import logging
import os

import pytest

from tests.integration.conftest import engine_state, idle_state

PROMPT = "You are a careful assistant who answers briefly. " * 30 + "What is the capital of France?"
PARAMS = {"temperature": 0, "max_new_tokens": 12}


def tier_args(directory, **extra) -> dict:
    return {
        "model_path": None,
        "dtype": "float32",
        "max_total_tokens": 1024,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": json.dumps({"file_storage_path": str(directory)}),
        **extra,
    }


def stats(engine) -> dict:
    return engine.run_in_scheduler(lambda s: s.kv._cache.disk.stats())


def written(engine) -> None:
    engine.run_in_scheduler(lambda s: s.kv._cache.disk.flush())


@pytest.fixture(scope="module")
def fresh(engine):
    """The answer without any cache: the shared plain engine, its cache flushed."""
    engine.flush_cache()
    out = engine.generate(PROMPT, PARAMS)
    engine.flush_cache()
    return out


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_evicted_prefix_comes_back_from_disk_and_answers_the_same(tmp_path, fresh, policy):
    from cadence import Engine

    e = Engine(**tier_args(tmp_path, hicache_write_policy=policy))
    try:
        first = e.generate(PROMPT, PARAMS)
        assert first["output_ids"] == fresh["output_ids"]
        assert e.flush_cache().success  # memory lets every page go
        written(e)
        again = e.generate(PROMPT, PARAMS)
        assert again["output_ids"] == fresh["output_ids"]
        num_pages = len(e.tokenizer.encode(PROMPT)) // 16
        assert again["meta_info"]["cached_tokens"] == num_pages * 16  # read back, not computed
        assert stats(e)["loaded"] == num_pages
        state = engine_state(e)
        assert state == idle_state(state)
    finally:
        e.shutdown()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_restarted_server_reuses_the_files_and_another_configuration_does_not(
    tmp_path, fresh, policy
):
    from cadence import Engine

    e = Engine(**tier_args(tmp_path, hicache_write_policy=policy))
    try:
        e.generate(PROMPT, PARAMS)
    finally:
        e.shutdown()  # a clean stop finishes its writes (write_back: writes what it caches)
    e = Engine(**tier_args(tmp_path))
    try:
        out = e.generate(PROMPT, PARAMS)
        assert out["output_ids"] == fresh["output_ids"]
        assert out["meta_info"]["cached_tokens"] > 0 and stats(e)["written"] == 0
    finally:
        e.shutdown()
    # Another page size, weights served otherwise, another KV dtype (and, the same way,
    # another model or tokenizer file) compute other keys: nothing of the first server's
    # is found, let alone served.
    for other in ({"page_size": 32}, {"dequantize": True}, {"kv_cache_dtype": "bfloat16"}):
        e = Engine(**tier_args(tmp_path, **other))
        try:
            out = e.generate(PROMPT, PARAMS)
            assert out["meta_info"]["cached_tokens"] == 0, other
            if "page_size" in other:
                assert out["output_ids"] == fresh["output_ids"]
        finally:
            e.shutdown()


def _page_files(directory) -> list[str]:
    return [
        os.path.join(root, f)
        for root, _, files in os.walk(directory)
        for f in files
        if f.endswith(".kv")
    ]


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_a_damaged_or_foreign_file_is_refused_and_the_answer_stays_exact(tmp_path, fresh, damage):
    from cadence import Engine
    from cadence.mem_cache.disk_tier import _HEADER

    e = Engine(**tier_args(tmp_path))
    try:
        e.generate(PROMPT, PARAMS)
        written(e)
        files = _page_files(tmp_path)
        assert files
        for path in files:
            with open(path, "r+b") as f:
                blob = bytearray(f.read())
                if damage == "truncate":
                    blob = blob[: len(blob) // 2]
                elif damage == "flip":
                    blob[-1] ^= 0xFF
                else:  # a header naming another server's identity
                    blob[8:40] = bytes(32)
                f.seek(0)
                f.truncate()
                f.write(blob)
        assert e.flush_cache().success
        out = e.generate(PROMPT, PARAMS)
        assert out["output_ids"] == fresh["output_ids"]
        assert out["meta_info"]["cached_tokens"] == 0  # recomputed, not read
        assert stats(e)["rejected"] >= 1
        assert len(_page_files(tmp_path)) >= 1  # the prefill wrote good pages again
        assert _HEADER.size == 52
    finally:
        e.shutdown()


def test_an_unwritable_directory_turns_the_tier_off_with_a_warning(tmp_path, fresh, caplog):
    from cadence import Engine

    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")  # a file where the directory should be: nothing can be written
    with caplog.at_level(logging.WARNING, logger="cadence.mem_cache.disk_tier"):
        e = Engine(**tier_args(blocked))
    try:
        assert not stats(e)["enabled"]
        assert any("disk tier off" in r.getMessage() for r in caplog.records)
        assert e.generate(PROMPT, PARAMS)["output_ids"] == fresh["output_ids"]
    finally:
        e.shutdown()


def test_the_size_cap_keeps_the_newest_pages(tmp_path):
    from cadence import Engine

    e = Engine(**tier_args(tmp_path, hicache_size=0.004))  # 4 MB: about five pages
    try:
        e.generate(PROMPT, PARAMS)
        written(e)
        s = stats(e)
        assert s["written"] > s["pages"] and s["bytes"] <= 4_000_000
        assert len(_page_files(tmp_path)) == s["pages"]
    finally:
        e.shutdown()


def test_two_servers_sharing_a_directory_never_read_each_others_half_files(tmp_path, fresh):
    """Both write the same pages at once (same model, same settings: the same keys), then
    each reads back what either wrote: every page read passes its checksum."""
    from concurrent.futures import ThreadPoolExecutor

    from cadence import Engine

    a, b = Engine(**tier_args(tmp_path)), Engine(**tier_args(tmp_path))
    try:
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda e: e.generate(PROMPT, PARAMS), (a, b)))
        for e in (a, b):
            written(e)
            assert e.flush_cache().success
        with ThreadPoolExecutor(2) as pool:
            again = list(pool.map(lambda e: e.generate(PROMPT, PARAMS), (b, a)))
        for out in outs + again:
            assert out["output_ids"] == fresh["output_ids"]
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        assert stats(a)["rejected"] == stats(b)["rejected"] == 0
        assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    finally:
        a.shutdown()
        b.shutdown()


def test_a_full_disk_turns_the_tier_off_and_requests_go_on(tmp_path, fresh, caplog):
    """A write that fails as a full disk fails (ENOSPC, raised by the file write itself)."""
    import errno

    from cadence import Engine

    e = Engine(**tier_args(tmp_path))

    def fill_the_disk(scheduler):
        disk = scheduler.kv._cache.disk

        def no_space(key, page):
            raise OSError(errno.ENOSPC, "No space left on device")

        disk._write = no_space

    try:
        e.run_in_scheduler(fill_the_disk)
        with caplog.at_level(logging.WARNING, logger="cadence.mem_cache.disk_tier"):
            assert e.generate(PROMPT, PARAMS)["output_ids"] == fresh["output_ids"]
            written(e)
        assert not stats(e)["enabled"]
        assert any("No space left" in r.getMessage() for r in caplog.records)
        assert e.flush_cache().success
        out = e.generate(PROMPT, PARAMS)
        assert out["output_ids"] == fresh["output_ids"] and out["meta_info"]["cached_tokens"] == 0
        state = engine_state(e)
        assert state == idle_state(state)
    finally:
        e.shutdown()
