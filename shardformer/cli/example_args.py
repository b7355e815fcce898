"""Command-line arguments shared by the example scripts: ``--config PATH --mode MODE [--set KEY=VALUE ...]``.

An example script starts with::

    from shardformer.cli import parse_example_args

    cfg, mode = parse_example_args(extra_keys={"prompt": "Hello", "max_new_tokens": 20})

and is launched as ``shardformer run --nproc_per_node 2 main.py --config config.py --mode train``.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from shardformer.cli.config_file import Config, ConfigError, load_config


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["steps=2", "precision=bf16"]`` -> ``{"steps": 2, "precision": "bf16"}``.

    Values are Python literals when they parse as one (``2``, ``1e-3``, ``None``, ``(1, 2)``),
    and strings otherwise, so paths and words need no quotes.
    """
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        overrides[name.strip().lower()] = value
    return overrides


def find_config_args(script_args: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """Find ``--config PATH`` and ``--set KEY=VALUE`` in a script's arguments (the launcher's pre-flight).

    Accepts both ``--config PATH`` and ``--config=PATH``; stops at ``--``.
    """
    path: str | None = None
    sets: list[str] = []
    i = 0
    while i < len(script_args):
        arg = script_args[i]
        if arg == "--":
            break
        flag, eq, value = arg.partition("=")
        if flag not in ("--config", "--set"):
            i += 1
            continue
        if eq:
            i += 1
        elif i + 1 < len(script_args):
            value = script_args[i + 1]
            i += 2
        else:
            raise ConfigError(f"{flag} needs a value")
        if flag == "--config":
            path = value
        else:
            sets.append(value)
    return path, parse_overrides(sets)


class _RankZeroParser(argparse.ArgumentParser):
    """Every rank parses the same arguments; print a usage error once per node, not once per rank."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_example_args(
    argv: Sequence[str] | None = None,
    extra_keys: Mapping[str, Any] | None = None,
    *,
    modes: Sequence[str] = ("train", "inference"),
    default_config: str | None = None,
    description: str | None = None,
) -> tuple[Config, str]:
    """Parse ``--config PATH --mode MODE [--set KEY=VALUE ...]`` and load the config file.

    Returns ``(config, mode)``. ``extra_keys`` extends the config schema for this script (see
    ``load_config``). A missing or invalid config, or a bad mode, exits with status 2 and one
    clear message (printed by local rank 0 only).
    """
    parser = _RankZeroParser(description=description, allow_abbrev=False)
    parser.add_argument(
        "--config",
        default=default_config,
        required=default_config is None,
        metavar="PATH",
        help="Python file of settings" + (f" (default: {default_config})" if default_config else ""),
    )
    parser.add_argument("--mode", required=True, choices=list(modes), help="what to run")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting of the config file (repeatable), e.g. --set steps=2",
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, extra_keys, overrides=parse_overrides(args.set))
    except ConfigError as exc:
        parser.error(str(exc))
    return config, args.mode
