"""``shardformer verify``: a model sharded vs unsharded on local gloo processes; exit 1 if they differ."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify",
        help="run a model sharded and unsharded on the same inputs and name the first module that diverges",
        description="Build MODEL on TP local gloo processes, shard one copy (with --policy, or the built-in "
        "policy), and compare outputs, loss, every gradient, one SGD step and greedy generate with the "
        "unsharded copy. On a difference, name the first module whose output diverges. Exit status 0: "
        "everything matches; 1: something differs or sharding was refused; 2: bad arguments.",
        epilog="examples:\n  shardformer verify gpt2-tiny\n  shardformer verify path/to/llama --policy "
        "my_policy:LlamaPolicy --tp 2\n  shardformer verify path/to/config --model-class OPTForCausalLM "
        "--policy my_policy:OPTPolicy\n  shardformer verify my_models:build_tiny --policy my_policy:MyPolicy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help="folder with config.json (random weights unless it has "
                        "weights), module:function returning a model, timm:<name>, or a built-in name "
                        "(gpt2-tiny, bert-tiny, vit-tiny, timm-vit-tiny, gpt2, bert-base, ...)")  # fmt: skip
    parser.add_argument("--policy", metavar="MODULE:CLASS", help="a custom Policy class (default: built-in)")
    parser.add_argument("--model-class", metavar="NAME", help="transformers class for a config.json without "
                        "'architectures' (e.g. LlamaForCausalLM)")  # fmt: skip
    parser.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel size (default 2; processes started: tp x pp)"
    )
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (processes: tp x pp; default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the processes are killed")
    parser.set_defaults(func=verify_command)
    return parser


def verify_command(args: argparse.Namespace) -> int:
    # deferred: torch and transformers take seconds to import; `shardformer --help` never needs them
    from shardformer.tools.model_source import load_policy
    from shardformer.tools.verify import verify

    sys.path.insert(0, os.getcwd())  # module:Class from the current folder, as `python -m` would find it
    try:
        # resolve names here first: a typo is a usage error, not a failed verification
        load_policy(args.policy)
        report = verify(args.model, args.policy, args.tp, args.pp, model_class=args.model_class, seed=args.seed,
                        timeout=args.timeout)  # fmt: skip
    except ValueError as e:
        print(f"shardformer verify: error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.ok else 1
