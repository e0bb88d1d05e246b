"""The control routes' bodies: typed, shape-checked, the field at fault named."""

import pytest

from cadence.errors import InvalidParameter
from cadence.serving import control


@pytest.mark.parametrize(
    "cls,body,param",
    [
        (control.AbortBody, [], None),
        (control.AbortBody, "rid", None),
        (control.AbortBody, None, None),
        (control.AbortBody, {"rid": 5}, "rid"),
        (control.AbortBody, {"abort_all": "true"}, "abort_all"),
        (control.AbortBody, {"abort_all": 1}, "abort_all"),
        (control.AbortBody, {}, "rid"),
        (control.AbortBody, {"rid": ""}, "rid"),
        (control.AbortBody, {"rid": "a", "abort_all": True}, "rid"),
        (control.PauseBody, {"mode": "later"}, "mode"),
        (control.PauseBody, {"mode": None}, "mode"),
        (control.ProfileBody, {"num_steps": 0}, "num_steps"),
        (control.ProfileBody, {"num_steps": True}, "num_steps"),
        (control.ProfileBody, {"num_steps": 10**23}, "num_steps"),
        (control.ProfileBody, {"num_steps": 2**63}, "num_steps"),
        (control.ProfileBody, {"start_step": -1}, "start_step"),
        (control.ProfileBody, {"start_step": 10**23}, "start_step"),
        (control.ProfileBody, {"start_step": 1.5}, "start_step"),
        (control.OpenSessionBody, {"capacity_of_str_len": 10**23}, "capacity_of_str_len"),
        (control.OpenSessionBody, {"capacity_of_str_len": -(10**23)}, "capacity_of_str_len"),
        (control.OpenSessionBody, {"capacity_of_str_len": -1}, "capacity_of_str_len"),
        (control.UpdateWeightsBody, {}, "model_path"),
        (control.UpdateWeightsBody, {"model_path": 3}, "model_path"),
        (control.UpdateWeightsBody, {"model_path": "m", "load_format": []}, "load_format"),
        (control.ConfigureLoggingBody, {"log_requests": "yes"}, "log_requests"),
        (control.ConfigureLoggingBody, {"log_requests_level": 4}, "log_requests_level"),
        (control.ConfigureLoggingBody, {"log_requests_level": -1}, "log_requests_level"),
        (control.ConfigureLoggingBody, {"log_requests_level": "2"}, "log_requests_level"),
        (control.ConfigureLoggingBody, {"dump_requests_folder": "/tmp/d"}, "dump_requests_folder"),
        (control.ConfigureLoggingBody, {"crash_dump_folder": "/tmp/c"}, "crash_dump_folder"),
        (control.ConfigureLoggingBody, {"dump_requests_threshold": 5}, "dump_requests_threshold"),
    ],
)
def test_bad_bodies_name_the_field(cls, body, param):
    with pytest.raises(InvalidParameter) as e:
        control.parse(cls, body)
    assert e.value.param == param


def test_good_bodies_parse_and_unknown_fields_are_ignored():
    assert control.parse(control.AbortBody, {"rid": "r1", "extra": 1}).rid == "r1"
    assert control.parse(control.AbortBody, {"abort_all": True}).abort_all is True
    assert control.parse(control.PauseBody, {}).mode == "abort"
    assert control.parse(control.PauseBody, {"mode": "in_place"}).mode == "in_place"
    body = control.parse(
        control.ProfileBody, {"output_dir": "run-1", "num_steps": 3, "activities": ["CPU"]}
    )
    assert (body.output_dir, body.num_steps) == ("run-1", 3)
    assert control.parse(control.UpdateWeightsBody, {"model_path": "/m.gguf"}).load_format is None


def test_integers_at_the_edge_of_their_range_are_accepted():
    top = 2**63 - 1
    assert control.parse(control.ProfileBody, {"num_steps": top, "start_step": 0}).num_steps == top
    body = control.parse(control.OpenSessionBody, {"capacity_of_str_len": top})
    assert body.capacity_of_str_len == top


def test_an_out_of_range_integer_is_named_not_printed_whole():
    with pytest.raises(InvalidParameter) as e:
        control.parse(control.OpenSessionBody, {"capacity_of_str_len": 10**5000})
    assert "capacity_of_str_len must be an integer in [0, 2^63-1]" in str(e.value)
    assert "about 5001 digits" in str(e.value) and len(str(e.value)) < 200


def test_a_logging_body_changes_only_what_it_gives():
    body = control.parse(control.ConfigureLoggingBody, {"log_requests": True})
    assert (body.log_requests, body.log_requests_level) == (True, None)
    body = control.parse(control.ConfigureLoggingBody, {"log_requests_level": 0, "x": 1})
    assert (body.log_requests, body.log_requests_level) == (None, 0)
