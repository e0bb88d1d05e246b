"""The prefill/decode pair the e2e fleet launches (`prefill_server`, `decode_server`): one
bootstrap port for the session and short timeouts. A module of its own, so that tests import
it by name (a function that imports `conftest` at run time may get another directory's)."""

from __future__ import annotations

from e2e_server import free_port

PD_BOOTSTRAP_PORT = free_port()
PD_TIMEOUTS = ["--disaggregation-bootstrap-timeout", "4", "--disaggregation-waiting-timeout", "15"]
PD_ARGS = [
    *("--max-total-tokens", "8192", "--skip-warmup", "--chunked-prefill-size", "512"),
    *("--disaggregation-bootstrap-port", str(PD_BOOTSTRAP_PORT), *PD_TIMEOUTS),
]
