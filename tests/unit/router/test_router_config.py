"""RouterConfig validation, worker URL normalization, worker files, CLI mapping."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cadence.config_docs import field_docs
from cadence.router.cli import build_parser, parse_config
from cadence.router.config import (
    MAX_MODEL_NAME_LENGTH,
    MAX_URL_LENGTH,
    RouterConfig,
    load_worker_specs,
    normalize_worker_url,
    worker_id,
    worker_spec_from_dict,
)


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("  HTTP://LocalHost:30000/ ", "http://localhost:30000"),
        ("http://example.com:80/", "http://example.com"),
        ("https://example.com:443/prefix/", "https://example.com/prefix"),
        ("https://example.com:8443", "https://example.com:8443"),
        ("http://[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_worker_urls_are_normalized(raw, normalized):
    assert normalize_worker_url(raw) == normalized


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("ftp://example.com", "http:// or https://"),
        ("127.0.0.1:30000", "http:// or https://"),
        ("http://", "no host"),
        ("http://user:pw@example.com", "credentials"),
        ("http://example.com/?x=1", "query"),
        ("http://example.com/#frag", "query or fragment"),
        ("http://example.com:99999", "invalid"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://169.254.1.1:8000", "link-local"),
        ("http://2852039166", "link-local"),  # 169.254.169.254 as one number
        ("http://0xa9.0xfe.0xa9.0xfe", "link-local"),
        ("http://[fe80::1]:80", "link-local"),
        ("http://[::ffff:169.254.169.254]", "link-local"),
        ("http://[fd00:ec2::254]", "link-local"),
        ("http://metadata.google.internal", "link-local"),
        ("http://METADATA.google.internal.", "link-local"),
        ("http://100.100.100.200/latest/meta-data", "metadata"),  # Alibaba Cloud
        ("http://1684301000", "metadata"),  # 100.100.100.200 as one number
        ("http://[::ffff:100.100.100.200]", "metadata"),
        ("http://[64:ff9b::100.100.100.200]", "metadata"),  # NAT64
        ("http://[64:ff9b::a9fe:a9fe]", "metadata"),  # 169.254.169.254 through NAT64
        ("http://192.0.0.192", "metadata"),  # Oracle Cloud
        ("http://168.63.129.16", "metadata"),  # Azure
        ("http://[fd20:ce::254]", "metadata"),  # Google Compute Engine over IPv6
        ("http://instance-data", "metadata"),
        ("http://metadata.tencentyun.com", "metadata"),
        ("", "non-empty"),
        ("http://example.com/" + "p" * MAX_URL_LENGTH, "the limit is 2048"),
    ],
)
def test_bad_worker_urls_are_refused_with_a_reason(raw, reason):
    with pytest.raises(ValueError, match=reason):
        normalize_worker_url(raw, field="worker_urls")


def test_duplicates_after_normalization_are_rejected_naming_the_field():
    with pytest.raises(ValueError, match="worker_urls: duplicate worker http://a:1"):
        RouterConfig(worker_urls=("http://a:1", "HTTP://A:1/"))


def test_worker_id_is_stable_and_url_encoded():
    assert worker_id("http://127.0.0.1:8000") == "http%3A%2F%2F127.0.0.1%3A8000"
    assert worker_id("http://127.0.0.1:8000") == worker_id(
        normalize_worker_url("http://127.0.0.1:8000/")
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", 70000),
        ("policy", "fastest"),
        ("request_timeout_secs", 0),
        ("max_payload_size", 0),
        ("max_concurrent_requests", -1),
        ("health_failure_threshold", 0),
        ("health_success_threshold", 0),
        ("health_check_timeout_secs", 0),
        ("health_check_interval_secs", -1),
        ("health_check_endpoint", "health"),
        ("retry_max_retries", -1),
        ("retry_backoff_multiplier", 0.5),
        ("retry_jitter_factor", 2.0),
        ("cache_threshold", 1.5),
        ("balance_rel_threshold", 0.5),
        ("max_tree_size", 0),
        ("api_key", ""),
        ("api_key", "cl\u00e9\u2713"),  # not Latin-1: no client could send it in a header
        ("api_key", "a\nb"),
        ("api_key", " padded"),
        ("admin_api_key", ""),
        ("admin_api_key", "\u20ac100"),
        ("admin_api_key", "tab\tinside"),
        ("enable_admin_api", "yes"),
        ("log_level", "loud"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        RouterConfig(**{field: value})


def test_admin_key_must_differ_from_the_client_key_and_is_never_echoed():
    with pytest.raises(ValueError, match="^admin_api_key: must differ from api_key") as info:
        RouterConfig(api_key="same-secret", admin_api_key="same-secret")
    assert "same-secret" not in str(info.value)
    with pytest.raises(ValueError) as info:
        RouterConfig(admin_api_key="s\u00e9cret\u2713")
    assert "cret" not in str(info.value)
    latin1 = RouterConfig(
        api_key="client", admin_api_key="cl\u00e9"
    )  # Latin-1 beyond ASCII is fine
    assert latin1.is_admin_api_enabled


def test_admin_api_is_off_unless_a_key_or_the_switch_turns_it_on():
    assert not RouterConfig().is_admin_api_enabled
    assert not RouterConfig(
        api_key="k"
    ).is_admin_api_enabled  # the client key alone does not open it
    assert RouterConfig(enable_admin_api=True).is_admin_api_enabled
    assert RouterConfig(admin_api_key="a").is_admin_api_enabled


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"url": "http://a:1", "model": "m" * (MAX_MODEL_NAME_LENGTH + 1)},
            "model: 257 characters long",
        ),
        (
            {"url": "http://a:1", "capabilities": ["chat"] * 10},
            "capabilities: 10 entries; at most 9",
        ),
        ({"url": "http://a:1", "capabilities": "chat" * 1000}, "got 'chatchat"),
        ({"url": "http://a:1", 1: 2, "gpu": 3}, r"unknown worker keys \['1', 'gpu'\]"),
    ],
)
def test_worker_entries_are_bounded(entry, message):
    with pytest.raises(ValueError, match=message) as info:
        worker_spec_from_dict(entry)
    assert len(str(info.value)) < 300  # long input is cut, not echoed whole


def test_config_is_frozen_and_spec_defaults_hold():
    config = RouterConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    assert config.max_payload_size == 512 * 1024 * 1024
    assert (config.health_failure_threshold, config.health_success_threshold) == (3, 2)
    assert (config.health_check_timeout_secs, config.health_check_interval_secs) == (5.0, 10.0)
    assert config.health_check_endpoint == "/health"
    assert config.policy == "round_robin"
    assert config.retry_initial_backoff_secs == 0.05


def test_every_field_has_a_docstring_used_as_help():
    docs = field_docs(RouterConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(RouterConfig)}
    help_text = " ".join(build_parser().format_help().split())
    assert docs["max_payload_size"] in help_text


def test_worker_file_json_and_yaml_merge_with_flags(tmp_path):
    json_file = tmp_path / "workers.json"
    json_file.write_text(json.dumps({"workers": [
        {"url": "http://a:1", "model": "m", "capabilities": ["chat", "streaming"]}, "http://b:2"]}))  # fmt: skip
    specs = load_worker_specs(
        RouterConfig(worker_urls=("http://c:3",), worker_config=str(json_file))
    )
    assert [s.url for s in specs] == ["http://c:3", "http://a:1", "http://b:2"]
    assert specs[1].model == "m" and specs[1].capabilities == frozenset({"chat", "streaming"})
    assert specs[2].model is None and specs[2].capabilities is None
    yaml_file = tmp_path / "workers.yaml"
    yaml_file.write_text("- url: http://a:1\n  capabilities: [embedding]\n")
    assert load_worker_specs(RouterConfig(worker_config=str(yaml_file)))[0].capabilities == {
        "embedding"
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("- url: http://a:1\n- url: http://A:1/\n", "duplicate worker"),
        ("- url: http://a:1\n  gpu: 1\n", "unknown worker keys"),
        ("- model: m\n", "has no url"),
        ("- url: http://a:1\n  capabilities: [flying]\n", "unknown capabilities"),
        ("- url: http://a:1\n  model: 3\n", "model"),
        ("url: http://a:1\n", "must hold a list"),
        ("- [unclosed\n", "not valid JSON/YAML"),
    ],
)
def test_bad_worker_files_are_refused(tmp_path, content, message):
    path = tmp_path / "workers.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_worker_specs(RouterConfig(worker_config=str(path)))


def test_cli_flags_map_onto_the_config():
    config = parse_config(["--port", "0", "--worker-urls", "http://a:1", "http://b:2", "--policy",
                           "cache_aware", "--cache-threshold", "0.25", "--api-key", "k"])  # fmt: skip
    assert config.worker_urls == ("http://a:1", "http://b:2")
    assert (config.port, config.policy, config.cache_threshold, config.api_key) == (
        0,
        "cache_aware",
        0.25,
        "k",
    )
    assert parse_config([]) == RouterConfig()
    admin = parse_config(["--admin-api-key", "a", "--enable-admin-api"])
    assert admin.admin_api_key == "a" and admin.enable_admin_api is True
    assert parse_config([]).enable_admin_api is False
