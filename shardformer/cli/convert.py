"""``shardformer convert CHECKPOINT --to hf OUT``: a training checkpoint as a HuggingFace folder, offline on CPU."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "convert",
        help="turn a training checkpoint (save_checkpoint) into a HuggingFace folder, on CPU",
        description="Consolidate the model weights of a training checkpoint written by save_checkpoint, at any "
        "layout, into the folder save_pretrained writes (config.json, safetensors, index, generation config) "
        "that from_pretrained loads. One process, CPU only, no torch.distributed; memory: one tensor at a "
        "time. Exit status 0: written; 1: the checkpoint is refused (named with the reason); 2: bad arguments.",
        epilog="example:\n  shardformer convert ckpt/step-1000 --to hf out/model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder written by save_checkpoint")
    parser.add_argument("--to", required=True, choices=["hf"], help="the output format (hf: a HuggingFace folder)")
    parser.add_argument("out", metavar="OUT", help="the folder to write (replaced as save_pretrained replaces it)")
    parser.add_argument("--max-shard-size", default="2GB", help="split the weights into files of at most this size")
    parser.set_defaults(func=convert_command)
    return parser


def convert_command(args: argparse.Namespace) -> int:
    # deferred: torch and transformers take seconds to import; `shardformer --help` never needs them
    from shardformer.checkpoint.convert import convert_to_hf
    from shardformer.checkpoint.errors import CheckpointError

    try:
        out = convert_to_hf(args.checkpoint, args.out, args.max_shard_size)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"shardformer convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
