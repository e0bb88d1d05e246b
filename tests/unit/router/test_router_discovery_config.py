"""Service discovery's flags: selectors, which flags go with which mode, the CLI mapping."""

from __future__ import annotations

import pytest

from cadence.router.cli import main, parse_config
from cadence.router.config import RouterConfig, parse_selector


def test_selectors_are_key_value_pairs_given_apart_or_joined_by_commas():
    assert parse_selector(("app=cadence", "tier=gold,zone=a"), "selector") == (
        ("app", "cadence"),
        ("tier", "gold"),
        ("zone", "a"),
    )
    assert parse_selector(("example.com/role=prefill", "empty="), "selector") == (
        ("example.com/role", "prefill"),
        ("empty", ""),
    )
    assert parse_selector(("app=cadence", "app=cadence"), "selector") == (("app", "cadence"),)


@pytest.mark.parametrize(
    "bad",
    ["app", "=cadence", "app=ca dence", "app=" + "x" * 64, "-app=x", "Bad_Prefix/app=x", "a=b,"],
)
def test_a_malformed_selector_names_the_flag_and_the_label(bad):
    with pytest.raises(ValueError, match=r"^prefill_selector: .* is not a KEY=VALUE label"):
        parse_selector((bad,), "prefill_selector")


def test_a_label_given_twice_with_two_values_is_refused():
    with pytest.raises(ValueError, match="selector: label app is given twice"):
        RouterConfig(service_discovery=True, selector=("app=a", "app=b"))


def test_discovery_needs_a_selector_and_its_flags_need_discovery():
    with pytest.raises(ValueError, match=r"^selector: service discovery needs --selector"):
        RouterConfig(service_discovery=True)
    with pytest.raises(ValueError, match=r"^selector: --selector is a service discovery flag"):
        RouterConfig(selector=("app=cadence",))
    with pytest.raises(ValueError, match=r"^service_discovery_namespace: .* add --service-disc"):
        RouterConfig(service_discovery_namespace="serving")
    with pytest.raises(ValueError, match=r"^service_discovery_api_server: .* --service-discovery"):
        RouterConfig(service_discovery_api_server="http://127.0.0.1:8001")


def test_pd_discovery_takes_prefill_and_decode_selectors_only():
    config = RouterConfig(
        service_discovery=True,
        pd_disaggregation=True,
        prefill_selector=("app=cadence", "role=prefill"),
    )
    assert config.selectors() == {"prefill": (("app", "cadence"), ("role", "prefill"))}
    with pytest.raises(ValueError, match=r"^selector: PD mode discovers workers by --prefill"):
        RouterConfig(
            service_discovery=True,
            pd_disaggregation=True,
            selector=("app=cadence",),
            decode_selector=("role=decode",),
        )
    with pytest.raises(ValueError, match=r"^prefill_selector: service discovery in PD mode needs"):
        RouterConfig(service_discovery=True, pd_disaggregation=True)
    with pytest.raises(ValueError, match=r"^decode_selector: --decode-selector is a PD mode flag"):
        RouterConfig(service_discovery=True, selector=("a=b",), decode_selector=("role=d",))
    regular = RouterConfig(service_discovery=True, selector=("app=cadence",))
    assert regular.selectors() == {"regular": (("app", "cadence"),)}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("service_discovery_port", 0, "must be between 1 and 65535"),
        ("service_discovery_port", 65536, "must be between 1 and 65535"),
        ("service_discovery_namespace", "Serving", "is not a namespace name"),
        ("service_discovery_namespace", "a" * 64, "is not a namespace name"),
        ("service_discovery_api_server", "127.0.0.1:8001", "must be an http:// or https:// URL"),
        ("service_discovery_api_server", "ftp://h", "must be an http:// or https:// URL"),
    ],
)
def test_bad_discovery_values_name_their_field(field, value, message):
    with pytest.raises(ValueError, match=rf"^{field}: .*{message}"):
        RouterConfig(service_discovery=True, selector=("app=cadence",), **{field: value})


def test_cli_flags_map_onto_the_discovery_fields():
    config = parse_config(
        ["--service-discovery", "--selector", "app=cadence", "tier=gold",
         "--service-discovery-namespace", "serving", "--service-discovery-port", "30000",
         "--service-discovery-api-server", "http://127.0.0.1:8001"]
    )  # fmt: skip
    assert config.service_discovery is True
    assert config.selector == ("app=cadence", "tier=gold")
    assert config.service_discovery_namespace == "serving"
    assert config.service_discovery_port == 30000
    assert config.service_discovery_api_server == "http://127.0.0.1:8001"
    pd = parse_config(
        ["--pd-disaggregation", "--service-discovery",
         "--prefill-selector", "app=cadence", "role=prefill", "--decode-selector", "role=decode"]
    )  # fmt: skip
    assert pd.prefill_selector == ("app=cadence", "role=prefill")
    assert pd.decode_selector == ("role=decode",)
    assert RouterConfig().service_discovery_port == 80  # SGLang router's default


def test_the_cli_refuses_a_selector_without_discovery_with_status_2(capsys):
    assert main(["--selector", "app=cadence"]) == 2
    err = capsys.readouterr().err
    assert "selector: --selector is a service discovery flag: add --service-discovery" in err
