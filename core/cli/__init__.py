"""The ``slipstream`` command: ``slipstream launch ...`` and the other subcommands.

Each subcommand lives in its own module with ``register(subparsers)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import sys

from ..options.errors import ConfigError
from . import check, configure, environment, estimate_memory, merge_weights, migrate, plan
from . import launch as launch_command
from .suggest import refuse_unknown

_COMMANDS = [
    configure,
    launch_command,
    environment,
    check,
    merge_weights,
    estimate_memory,
    plan,
    migrate,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Configure and launch PyTorch training on CPUs, GPUs and machines.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slipstream`` console script."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse alone would say "unrecognized arguments" and nothing more
        refuse_unknown(parser, [args.command, getattr(args, "action", None)], unknown)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args) or 0)
    except ConfigError as error:
        print(f"slipstream {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
