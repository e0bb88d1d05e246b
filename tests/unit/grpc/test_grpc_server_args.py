"""The gRPC flags of ServerArgs: defaults, derived values and the errors a user can cause."""

from __future__ import annotations

import pytest

from cadence.server_args import ServerArgs


def test_grpc_port_defaults_to_http_port_plus_10000():
    assert ServerArgs(port=30000).effective_grpc_port == 40000
    assert ServerArgs(port=30000, grpc_port=50051).effective_grpc_port == 50051


def test_admission_limit_defaults_to_what_the_engine_can_hold():
    args = ServerArgs(max_running_requests=8, max_queued_requests=100)
    assert args.effective_grpc_max_concurrent_requests == 108
    assert ServerArgs(grpc_max_concurrent_requests=3).effective_grpc_max_concurrent_requests == 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"port": 60000}, "--grpc-port or --disable-grpc"),
        ({"grpc_port": 70000}, "grpc_port must be in"),
        ({"port": 30000, "grpc_port": 30000}, "must differ"),
        ({"grpc_tls_cert": "c.pem"}, "give both or neither"),
        ({"grpc_tls_key": "k.pem"}, "give both or neither"),
        ({"grpc_tls_client_ca": "ca.pem"}, "mutual TLS"),
        ({"grpc_keepalive_time_s": 0}, "grpc_keepalive_time_s"),
        ({"grpc_min_ping_interval_s": -1}, "grpc_min_ping_interval_s"),
        ({"grpc_max_message_mb": 0}, "grpc_max_message_mb"),
        ({"grpc_max_message_mb": 4096}, "2 GiB"),
        ({"grpc_max_concurrent_requests": 0}, "grpc_max_concurrent_requests"),
        ({"grpc_stream_buffer": 0}, "grpc_stream_buffer"),
    ],
)
def test_bad_grpc_flags_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        ServerArgs(**kwargs)


def test_a_disabled_grpc_needs_no_valid_port():
    assert ServerArgs(port=60000, disable_grpc=True).disable_grpc


def test_server_options_carry_the_flags():
    from cadence.grpc.server import server_options

    opts = dict(
        server_options(
            ServerArgs(
                grpc_max_message_mb=8,
                grpc_min_ping_interval_s=2.5,
                grpc_keepalive_time_s=30,
                grpc_keepalive_timeout_s=5,
            )
        )
    )
    assert opts["grpc.max_receive_message_length"] == 8 * 1024 * 1024
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] == 2500
    assert opts["grpc.keepalive_permit_without_calls"] == 1
    assert (opts["grpc.keepalive_time_ms"], opts["grpc.keepalive_timeout_ms"]) == (30000, 5000)
    assert opts["grpc.so_reuseport"] == 0


def test_the_default_receive_limit_is_far_below_the_send_limit():
    """A client's message is refused past 16 MiB (a 1M-token input_ids is ~3 MiB); answers,
    bounded by what a request may ask for, may be larger than the request."""
    from cadence.grpc.server import server_options

    opts = dict(server_options(ServerArgs()))
    assert opts["grpc.max_receive_message_length"] == 16 * 1024 * 1024
    assert opts["grpc.max_send_message_length"] == 256 * 1024 * 1024
    large = dict(server_options(ServerArgs(grpc_max_message_mb=512)))
    assert large["grpc.max_send_message_length"] == large["grpc.max_receive_message_length"]
