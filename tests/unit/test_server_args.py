"""ServerArgs: per-concern groups behind the same flat arguments, flags and class defaults."""

from __future__ import annotations

import argparse
import dataclasses
import pickle

import pytest

from cadence.server_args import GROUPS, ServerArgs, add_cli_args, from_cli_args


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return from_cli_args(parser.parse_args(["--model-path", "m.gguf", *argv]))


def test_flat_arguments_land_in_their_group():
    args = ServerArgs(model_path="m.gguf", page_size=32, port=31000, disable_grpc=True)
    assert args.page_size == args.scheduler.page_size == 32
    assert args.port == args.http.port == 31000
    assert args.model_path == args.model.model_path == "m.gguf"
    assert set(args.to_dict()) == set(ServerArgs.field_names())
    # every flat name belongs to exactly one group
    names = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))


def test_class_attributes_are_the_defaults_a_platform_compares_with():
    default = ServerArgs(model_path="m.gguf")
    assert ServerArgs.page_size == default.page_size
    assert ServerArgs.port == default.port
    assert ServerArgs.max_total_tokens is None
    with pytest.raises(AttributeError, match="no argument 'not_an_argument'"):
        _ = ServerArgs.not_an_argument


def test_frozen_equal_by_value_and_picklable():
    args = ServerArgs(model_path="m.gguf", max_running_requests=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.port = 1  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(args))
    assert again == args and hash(again) == hash(args)
    changed = args.replace(max_running_requests=4)
    assert changed.max_running_requests == 4 and args.max_running_requests == 8
    assert changed != args


def test_unknown_and_invalid_arguments_are_named():
    with pytest.raises(TypeError, match="nonsense"):
        ServerArgs(model_path="m.gguf", nonsense=1)
    with pytest.raises(ValueError, match="grpc_port"):
        ServerArgs(model_path="m.gguf", port=31000, grpc_port=31000)


def test_the_flat_cli_flags_fill_the_groups():
    args = parse("--page-size", "32", "--port", "31001", "--disable-grpc", "--api-workers", "2")
    assert args.scheduler.page_size == 32
    assert args.http.port == 31001 and args.api_workers == 2
    assert args.disable_grpc is True
    assert parse() == ServerArgs(model_path="m.gguf")


def test_disaggregation_flags_are_checked_by_name():
    """SGLang's --disaggregation-* flags: a bad value names the flag and what exists."""
    args = ServerArgs(disaggregation_mode="prefill", disaggregation_bootstrap_port=9100)
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port) == ("prefill", 9100)
    assert ServerArgs().disaggregation_mode == "null"
    for kwargs, words in [
        ({"disaggregation_mode": "both"}, "null, prefill or decode"),
        ({"disaggregation_transfer_backend": "mooncake"}, "shm or torch"),
        ({"disaggregation_bootstrap_port": 0}, "must be a port"),
        ({"disaggregation_waiting_timeout": 0}, "> 0 seconds"),
        ({"disaggregation_mode": "decode", "speculative_algorithm": "NGRAM"}, "speculative"),
        ({"disaggregation_decode_local_prefill": True}, "only a decode server"),
        (
            {"disaggregation_mode": "prefill", "disaggregation_decode_local_prefill": True},
            "only a decode server",
        ),
    ]:
        with pytest.raises(ValueError, match=words):
            ServerArgs(**kwargs)


def test_disaggregation_timeouts_default_to_sglangs_variables(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "12")
    args = ServerArgs(disaggregation_mode="decode")
    assert args.effective_bootstrap_timeout == 12.0
    assert args.effective_waiting_timeout == 300.0
    assert ServerArgs(disaggregation_waiting_timeout=5).effective_waiting_timeout == 5


def test_sglang_flags_that_change_nothing_here_are_accepted_and_say_why():
    """An SGLang launch line's --trust-remote-code, --enable-metrics and --enable-cache-report
    start a server: no model code runs, /metrics and cached-token counts are always on."""
    args = parse("--trust-remote-code", "--enable-metrics", "--enable-cache-report")
    assert args.trust_remote_code and args.enable_metrics and args.enable_cache_report
    help_text = argparse.ArgumentParser()
    add_cli_args(help_text)
    text = " ".join(help_text.format_help().split())
    assert "no model's own code is ever run" in text
    assert "always report their prompt's cached tokens" in text


def test_sglang_sizing_and_truncation_flags_parse_as_sglang_spells_them():
    args = parse(
        *("--mem-fraction-static", "0.85", "--max-prefill-tokens", "8192"),
        *("--chunked-prefill-size", "-1", "--allow-auto-truncate"),
        *("--preferred-sampling-params", '{"temperature": 0.7}'),
    )
    assert (args.mem_fraction_static, args.max_prefill_tokens) == (0.85, 8192)
    assert args.allow_auto_truncate and args.preferred_sampling_params == '{"temperature": 0.7}'
    assert args.prefill_token_budget(4096) == 8192  # no chunking: whatever holds a prompt
    assert args.prefill_token_budget(32768) == 32768
    assert parse("--max-prefill-tokens", "512").prefill_token_budget(4096) == 512
    assert ServerArgs().prefill_token_budget(4096) == 2048  # the chunk size
    for bad in (("--chunked-prefill-size", "0"), ("--max-prefill-tokens", "0")):
        with pytest.raises(ValueError):
            parse(*bad)
    with pytest.raises(ValueError, match="JSON object"):
        parse("--preferred-sampling-params", "[1, 2]")


def test_sglang_logging_and_version_flags():
    args = parse("--log-level-http", "info", "--weight-version", "step-0", "--dp-size", "1")
    assert (args.log_level_http, args.weight_version, args.dp_size) == ("info", "step-0", 1)
    assert ServerArgs().log_level_http is None and ServerArgs().weight_version == "default"
    with pytest.raises(ValueError, match="log_level_http"):
        parse("--log-level-http", "loud")


def test_load_format_must_name_what_the_model_path_holds(tmp_path):
    from cadence.model_loader.locate import check_load_format, default_model_path

    gguf = default_model_path()
    for fmt in (None, "auto", "gguf"):
        check_load_format(gguf, fmt)
    check_load_format(str(tmp_path), "safetensors")  # a directory: a Hugging Face model
    with pytest.raises(ValueError, match="holds gguf weights"):
        check_load_format(gguf, "safetensors")
    with pytest.raises(ValueError, match="holds safetensors weights"):
        check_load_format(str(tmp_path), "gguf")
    with pytest.raises(ValueError, match="'dummy' is not served"):
        check_load_format(gguf, "dummy")
    assert parse("--load-format", "gguf").load_format == "gguf"


def test_tokenizer_mode_auto_is_served_and_slow_refused():
    assert parse("--tokenizer-mode", "auto").tokenizer_mode == "auto"
    with pytest.raises(ValueError, match="tokenizer_mode 'slow' is not served"):
        parse("--tokenizer-mode", "slow")
    prefixes = parse("--uvicorn-access-log-exclude-prefixes", "/health", "/metrics")
    assert prefixes.uvicorn_access_log_exclude_prefixes == ("/health", "/metrics")
