"""`cadence generate`: one generation from the command line, in this process, streamed to stdout."""

from __future__ import annotations

import argparse
import asyncio
import sys

from cadence.server_args import add_cli_args, from_cli_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence generate", description="Generate text once from a prompt."
    )
    parser.add_argument("prompt", help="the prompt (with --chat: the user message)")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    server = parser.add_argument_group("engine options")
    add_cli_args(server)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from cadence.engine import Engine

    args = from_cli_args(ns)
    engine = Engine(**{k: v for k, v in vars(args).items()})
    try:
        prompt = ns.prompt
        if ns.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        params = {
            "max_new_tokens": ns.max_new_tokens,
            "temperature": ns.temperature,
            "top_p": ns.top_p,
            "seed": ns.seed,
        }

        async def run():
            async for chunk in engine.async_generate(prompt, params, stream=True):
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
            sys.stdout.write("\n")

        asyncio.run(run())
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
