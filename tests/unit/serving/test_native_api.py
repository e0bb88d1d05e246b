"""The native API's own checks: the `dp_rank` filter of /v1/loads and the GetLoad RPCs."""

import pytest

from cadence.errors import InvalidParameter
from cadence.serving import native_api


@pytest.mark.parametrize("value", ["--1", "-1", "", " ", "1.5", "0x1", "²", "1e3", "9" * 5000, -1])
def test_a_bad_dp_rank_is_refused_naming_it(value):
    with pytest.raises(InvalidParameter) as e:
        native_api.check_dp_rank(value)
    assert e.value.param == "dp_rank" and len(str(e.value)) < 200


@pytest.mark.parametrize("value,rank", [(None, None), ("0", 0), (" 7 ", 7), (3, 3)])
def test_a_good_dp_rank_is_a_rank(value, rank):
    assert native_api.check_dp_rank(value) == rank
