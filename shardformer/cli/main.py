"""The ``shardformer`` command: a dispatcher over subcommands (``run`` today; room for ``plan`` and others).

Each subcommand module provides ``add_parser(subparsers)`` that registers its parser and sets
``func``, a callable taking the parsed arguments and returning the exit status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from shardformer.cli import convert, plan, run, verify

SUBCOMMANDS = (run, plan, verify, convert)


def _version() -> str:
    try:
        return version("shardformer")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardformer",
        description="Tensor, pipeline and ZeRO parallelism for HuggingFace and timm models.",
        epilog="Run `shardformer COMMAND --help` for a command's options.\n\n"
        "example:\n  shardformer run --nproc_per_node 2 examples/gpt2/main.py "
        "--config examples/gpt2/config.py --mode train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardformer {_version()}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardformer`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
