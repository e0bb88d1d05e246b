"""The OpenAPI document declares every POST route's body, and its sampling ranges are the ones
`check_sampling_params` enforces (checked at each bound, just inside and just outside)."""

import math

import pytest

from cadence.entrypoints.http_server import build_app
from cadence.entrypoints.openapi import SAMPLING_RANGES
from cadence.errors import InvalidParameter
from cadence.front.sampling_checks import check_sampling_params, parse_sampling_params
from cadence.server_args import ServerArgs
from cadence.serving.state import ServerState


@pytest.fixture(scope="module")
def document():
    return build_app(ServerState(ServerArgs())).openapi()


def test_every_post_route_has_a_request_body(document):
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert len(posts) >= 14
    assert [path for path, op in posts.items() if "requestBody" not in op] == []
    generate = document["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert generate == {"$ref": "#/components/schemas/GenerateReqInput"}
    props = document["components"]["schemas"]["GenerateReqInput"]["properties"]
    assert "is_single" not in props and "type" not in props and "sampling_params" in props


def _valid(name, value) -> bool:
    params = {"max_new_tokens": 16} if name == "min_new_tokens" else {}
    try:
        check_sampling_params(parse_sampling_params({**params, name: value}), 100)
        return True
    except InvalidParameter:
        return False


@pytest.mark.parametrize("name", sorted(SAMPLING_RANGES))
def test_schema_ranges_match_verify(name, document):
    prop = document["components"]["schemas"]["SamplingParams"]["properties"][name]
    is_int = prop["type"] == "integer"
    step = 1 if is_int else 1e-9
    if "minimum" in prop:
        assert _valid(name, prop["minimum"]) and not _valid(name, prop["minimum"] - step)
    if "exclusiveMinimum" in prop:
        low = prop["exclusiveMinimum"]
        assert not _valid(name, low) and _valid(name, low + step)
    if "maximum" in prop:
        assert _valid(name, prop["maximum"]) and not _valid(name, prop["maximum"] + step)
    elif name != "min_new_tokens":  # bounded by max_new_tokens instead
        assert _valid(name, 10**6 if is_int else 1e6)
    if "not" in prop:
        assert not _valid(name, prop["not"]["const"])
    if not is_int:
        assert not _valid(name, math.inf) and not _valid(name, math.nan)
