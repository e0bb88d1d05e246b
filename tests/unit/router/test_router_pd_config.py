"""PD mode configuration: SGLang router's flags, validation, worker files with roles."""

from __future__ import annotations

import json

import pytest

from cadence.router.cli import build_parser, main, parse_config
from cadence.router.config import RouterConfig, load_worker_specs


def test_prefill_and_decode_flags_repeat_with_an_optional_bootstrap_port():
    config = parse_config(["--pd-disaggregation",
                           "--prefill", "http://p1:30000", "8998",
                           "--prefill", "http://p2:30000",
                           "--prefill", "http://p3:30000", "none",
                           "--decode", "http://d1:30001", "--decode", "http://d2:30001",
                           "--prefill-policy", "cache_aware", "--policy", "least_request"])  # fmt: skip
    assert config.pd_disaggregation is True
    assert config.prefill_urls == (
        ("http://p1:30000", 8998),
        ("http://p2:30000", None),
        ("http://p3:30000", None),
    )
    assert config.decode_urls == ("http://d1:30001", "http://d2:30001")
    assert config.policy_for("prefill") == "cache_aware"
    assert config.policy_for("decode") == "least_request"  # falls back to --policy
    specs = load_worker_specs(config)
    assert [(s.url, s.role, s.bootstrap_port) for s in specs] == [
        ("http://p1:30000", "prefill", 8998),
        ("http://p2:30000", "prefill", None),
        ("http://p3:30000", "prefill", None),
        ("http://d1:30001", "decode", None),
        ("http://d2:30001", "decode", None),
    ]
    help_text = " ".join(build_parser().format_help().split())
    assert "--prefill URL" in help_text and "--decode URL" in help_text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pd-disaggregation", "--prefill", "http://p:1", "x"], "must be a number or 'none'"),
        (
            ["--pd-disaggregation", "--prefill", "http://p:1", "1", "2"],
            "at most one bootstrap port",
        ),
        (["--pd-disaggregation", "--prefill", "http://p:1", "70000"], "1 to 65535"),
        (["--prefill", "http://p:1"], "add --pd-disaggregation"),
        (["--decode", "http://d:1"], "add --pd-disaggregation"),
        (["--decode-policy", "random"], "add --pd-disaggregation"),
        (["--pd-disaggregation", "--worker-urls", "http://w:1"], "drop --worker-urls"),
        (
            ["--pd-disaggregation", "--prefill", "http://a:1", "--decode", "HTTP://A:1/"],
            "listed twice",
        ),
        (["--pd-disaggregation", "--prefill", "http://169.254.169.254"], "link-local"),
        (["--pd-disaggregation", "--prefill-policy", "fastest"], "prefill_policy: must be one of"),
        (["--pd-local-prefill-max-tokens", "64"], "add --pd-disaggregation"),
        (["--pd-disaggregation", "--pd-local-prefill-max-tokens", "-1"], ">= 0"),
    ],
)
def test_bad_pd_configurations_are_refused_naming_what_to_change(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_config(argv)


def test_the_command_exits_2_with_the_message(capsys):
    assert main(["--pd-disaggregation", "--worker-urls", "http://w:1"]) == 2
    assert "drop --worker-urls" in capsys.readouterr().err


def test_worker_files_carry_roles_in_pd_mode_and_only_there(tmp_path):
    path = tmp_path / "workers.json"
    path.write_text(json.dumps([
        {"url": "http://p:1", "role": "prefill", "bootstrap_port": 9000},
        {"url": "http://d:1", "role": "decode", "model": "m"}]))  # fmt: skip
    specs = load_worker_specs(RouterConfig(pd_disaggregation=True, worker_config=str(path)))
    assert [(s.role, s.bootstrap_port, s.model) for s in specs] == [
        ("prefill", 9000, None),
        ("decode", None, "m"),
    ]
    with pytest.raises(ValueError, match="start the router with --pd-disaggregation"):
        load_worker_specs(RouterConfig(worker_config=str(path)))
    path.write_text(json.dumps(["http://w:1"]))
    with pytest.raises(ValueError, match="needs a role, prefill or decode"):
        load_worker_specs(RouterConfig(pd_disaggregation=True, worker_config=str(path)))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"url": "http://d:1", "role": "decode", "bootstrap_port": 1}, "only a prefill worker"),
        ({"url": "http://p:1", "role": "prefill", "bootstrap_port": "9000"}, "1 to 65535"),
        ({"url": "http://p:1", "role": "both"}, "role: must be one of"),
    ],
)
def test_bad_worker_roles_are_refused(tmp_path, entry, message):
    path = tmp_path / "workers.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(ValueError, match=message):
        load_worker_specs(RouterConfig(pd_disaggregation=True, worker_config=str(path)))


def test_existing_flags_are_unchanged_outside_pd_mode():
    config = parse_config(["--worker-urls", "http://a:1"])
    assert config.pd_disaggregation is False and config.prefill_urls == config.decode_urls == ()
    assert [s.role for s in load_worker_specs(config)] == ["regular"]
