"""`cadence router` / `python -m cadence.router`: flags are RouterConfig's fields."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import MISSING, fields

from cadence.config_docs import field_docs
from cadence.router.config import RouterConfig, load_worker_specs

_TYPES = {"str": str, "str | None": str, "int": int, "float": float}
# SGLang router's names for the PD worker lists: one flag per worker, repeated.
_PD_FLAGS = {"prefill_urls": "--prefill", "decode_urls": "--decode"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence router",
        description="Route OpenAI-compatible and native requests over many Cadence replicas.",
    )
    docs = field_docs(RouterConfig)
    for f in fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        help_text = docs[f.name] + ("" if default in (None, ()) else f" (default: {default})")
        if f.name == "prefill_urls":
            # --prefill URL [BOOTSTRAP_PORT]: nargs="+" and checked in parse_config, since
            # argparse has no "one or two" count.
            parser.add_argument(_PD_FLAGS[f.name], dest=f.name, nargs="+", action="append",
                                default=None, metavar=("URL", "BOOTSTRAP_PORT"),
                                help=docs[f.name])  # fmt: skip
        elif f.name == "decode_urls":
            parser.add_argument(_PD_FLAGS[f.name], dest=f.name, action="append", metavar="URL",
                                default=None, help=docs[f.name])  # fmt: skip
        elif f.type == "tuple[str, ...]":
            metavar = "KEY=VALUE" if f.name.endswith("selector") else "URL"
            parser.add_argument(flag, nargs="+", metavar=metavar, default=None, help=help_text)
        elif f.type == "bool":
            # A switch that only turns things on; absent, the field keeps its default.
            parser.add_argument(flag, action="store_true", default=None, help=docs[f.name])
        elif f.type in _TYPES:
            parser.add_argument(flag, type=_TYPES[f.type], default=None, help=help_text)
        else:
            raise TypeError(f"RouterConfig.{f.name}: no CLI mapping for type {f.type}")
    return parser


def parse_config(argv: list[str] | None) -> RouterConfig:
    """RouterConfig from command-line arguments; ValueError names a bad field."""
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    for name in ("worker_urls", "selector", "prefill_selector", "decode_selector"):
        if name in given:
            given[name] = tuple(given[name])
    if "prefill_urls" in given:
        given["prefill_urls"] = tuple(parse_prefill_arg(v) for v in given["prefill_urls"])
    if "decode_urls" in given:
        given["decode_urls"] = tuple(given["decode_urls"])
    return RouterConfig(**given)


def parse_prefill_arg(values: list[str]) -> tuple[str, int | None]:
    """One `--prefill URL [BOOTSTRAP_PORT]`: the port is a number, 'none' or left out (None:
    the router reads it from the worker's /server_info)."""
    if len(values) > 2:
        raise ValueError(
            f"prefill_urls: --prefill takes a URL and at most one bootstrap port, got {values}; "
            "repeat --prefill for each prefill worker"
        )
    if len(values) == 1 or values[1].lower() == "none":
        return values[0], None
    try:
        return values[0], int(values[1])
    except ValueError:
        raise ValueError(
            f"prefill_urls: bootstrap port of {values[0]} must be a number or 'none', got {values[1]!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    from cadence.plugins import PluginError, load_plugins

    try:
        load_plugins()  # before the configuration exists, so that plugins can shape it
    except PluginError as exc:
        print(f"cadence router: error: {exc}", file=sys.stderr)
        return 1
    try:
        config = parse_config(argv)
        specs = load_worker_specs(config)
    except SystemExit as exc:  # argparse: --help or a usage error
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"cadence router: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from cadence.router.server import run_router

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(run_router, config, specs))
    except ValueError as exc:
        print(f"cadence router: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"cadence router: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr
        )
        return 1
    return 0


async def _serve(run_router, config: RouterConfig, specs) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_router(config, specs, stop)


def _loop_factory():
    try:
        import uvloop
    except ImportError:  # uvloop is pinned, but the router also runs without it
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
