"""Relay backends: the data plane between stage processes (see base.py for the contract)."""

from cadence.pipeline.relay.base import (
    RELAY_GROUP,
    Relay,
    RelayAborted,
    RelayContext,
    RelayError,
    RelayOperation,
    RelayTimeout,
    available_relays,
    create_relay,
    register_relay,
    relay_class,
)

__all__ = [
    "RELAY_GROUP",
    "Relay",
    "RelayAborted",
    "RelayContext",
    "RelayError",
    "RelayOperation",
    "RelayTimeout",
    "available_relays",
    "create_relay",
    "register_relay",
    "relay_class",
]
