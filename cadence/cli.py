"""`cadence` command line: `cadence serve`, `cadence generate`, `cadence router`,
`cadence launch`.

Imports nothing heavy: each subcommand imports its own module only when chosen.
"""

from __future__ import annotations

import sys

USAGE = """usage: cadence <command> [options]

commands:
  serve      serve a model over HTTP (OpenAI-compatible and native routes) and gRPC
  generate   generate text once from a prompt, in this process
  router     route requests over many Cadence replicas
  launch     serve from N data-parallel replicas behind the router (--dp-size N)

Run `cadence <command> --help` for the options of a command."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from cadence.launch_server import main as serve_main

        return serve_main(rest)
    if command == "generate":
        from cadence.generate_cli import main as generate_main

        return generate_main(rest)
    if command == "router":
        from cadence.router.cli import main as router_main

        return router_main(rest)
    if command == "launch":
        from cadence.launch_dp import main as launch_main

        return launch_main(rest)
    print(f"cadence: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
