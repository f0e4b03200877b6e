"""``slipstream test``: run the built-in sanity checks under your configuration.

Launches :mod:`slipstream.cli.sanity_check` on every process exactly as ``slipstream launch``
would run a training script, and reports pass/fail per check.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("test", help="check that training works under your config")
    parser.set_defaults(run=run)
    parser.add_argument("--config_file", "--config-file", dest="config_file", default=None)


def run(args: argparse.Namespace) -> int:
    from ..launcher.launch import LaunchRequest, launch
    from .launch import register as register_launch
    from .launch import resolve_config

    # Resolve exactly as `slipstream launch --config_file ... slipstream.cli.sanity_check` would.
    parser = argparse.ArgumentParser()
    register_launch(parser.add_subparsers())
    namespace = parser.parse_args(
        ["launch", *(["--config_file", args.config_file] if args.config_file else []), "-m", "x"]
    )
    config, notes = resolve_config(namespace)
    for note in notes:
        print(f"slipstream test: note: {note}")
    print(
        f"running the sanity checks on {config.num_processes} process(es) "
        f"({config.distributed_type}, mixed_precision={config.mixed_precision})"
    )
    code = launch(LaunchRequest(config=config, script="slipstream.cli.sanity_check", module=True))
    print("slipstream test: all checks passed" if code == 0 else "slipstream test: FAILED")
    return code
