"""``shardformer plan``: size a job with no weights and no processes."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="show how a model would be sharded and the bytes per rank, without starting anything",
        description="Build MODEL on the meta device (no weights), apply its policy and print what is replaced, "
        "each rank's parameter shapes, the pipeline stage split and estimated bytes per rank.",
        epilog="examples:\n  shardformer plan gpt2 --tp 2\n  shardformer plan path/to/model --tp 4 --dp 2 --zero 1 "
        "--precision bf16\n  shardformer plan timm:vit_base_patch16_224 --tp 2 --summary\n"
        "  shardformer plan gpt2 --tp 2 --summary --batch 2 --seq 1024\n"
        "  shardformer plan path/to/llama --tp 2 --cp 2 --cp-mode all_to_all --summary --batch 1 --seq 32768\n"
        "  shardformer plan llama3-405b --tp 8 --pp 16 --dp 8 --simulate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help="folder with config.json, a built-in name (gpt2, bert-base, "
                        "vit-base, ...) or timm:<name>")  # fmt: skip
    parser.add_argument("--policy", metavar="MODULE:CLASS", help="a custom Policy class (default: the built-in one)")
    parser.add_argument("--model-class", metavar="NAME", help="transformers class for a config.json without "
                        "'architectures' (e.g. LlamaForCausalLM)")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size: the sequence split over this many "
                        "ranks (default 1; world = tp x cp x pp x dp)")  # fmt: skip
    # core.config.CP_MODES, spelled out: importing it would import torch for `shardformer --help`
    parser.add_argument("--cp-mode", default="ring", choices=("ring", "all_to_all"), help="how attention spans the "
                        "split sequence (default ring)")  # fmt: skip
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (default 0; with "
                        "--simulate 1; 3: bytes by formula)")  # fmt: skip
    parser.add_argument("--simulate", action="store_true", help="build one rank of every kind for real on the "
                        "meta device in a fake process group of the whole world and read its bytes and one "
                        "training step's collectives (default precision bf16)")  # fmt: skip
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default fp32 (bf16 with --simulate)")
    parser.add_argument("--summary", action="store_true", help="leave out the per-parameter list")
    parser.add_argument("--batch", type=int, help="with --seq: estimate activation memory per rank for this batch")
    parser.add_argument("--seq", type=int, help="with --batch: sequence length of the activation estimate")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the job runs: torch's "
                        "dropout keeps float masks on cpu, bool masks on cuda (default cpu)")  # fmt: skip
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule whose bubble to report (pp > 1): "
                        "1f1b, gpipe, interleaved_1f1b, zbv, dualpipev (default 1f1b)")  # fmt: skip
    parser.add_argument("--micro", type=int, default=1, help="micro-batches per step and dp rank (default 1)")
    parser.add_argument("--virtual-stages", type=int, help="model chunks per pp rank for interleaved_1f1b (default 2)")
    parser.set_defaults(func=plan_command)
    return parser


def plan_command(args: argparse.Namespace) -> int:
    # deferred: torch and transformers take seconds to import; `shardformer --help` and `run` never need them
    from shardformer.tools.model_source import load_policy
    from shardformer.tools.plan import build_meta_model, format_plan, plan_model

    sys.path.insert(0, os.getcwd())  # --policy module:Class from the current folder
    if args.simulate:
        return simulate_command(args)
    args.precision = args.precision or "fp32"
    try:
        policy = load_policy(args.policy)
        model = build_meta_model(args.model, args.model_class)
        plan = plan_model(
            model, args.tp, args.pp, args.dp, args.zero, args.precision, policy=policy, batch=args.batch,
            seq=args.seq, device=args.device, cp=args.cp, cp_mode=args.cp_mode,
        )  # fmt: skip
    except (ValueError, NotImplementedError) as e:
        message = str(e).replace("pass it: shard_model(model, config, policy=MyPolicy())", "pass --policy module:Class")
        print(f"shardformer plan: error: {message}", file=sys.stderr)
        return 2
    try:
        bubble = _bubble(args, plan)
    except ValueError as e:
        print(f"shardformer plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, show_params=not args.summary) + bubble)
    return 0


def _bubble(args: argparse.Namespace, plan) -> str:
    """The schedule's bubble at pp > 1 (EngineConfig's and the schedule's checks first)."""
    from shardformer.core.config import EngineConfig
    from shardformer.pipeline.bubble import bubble_report

    if args.pp == 1:
        return ""
    cfg = EngineConfig(
        pp=args.pp, schedule=args.schedule, virtual_stages=args.virtual_stages, num_microbatches=args.micro
    )
    layers = plan.stages[-1][0].stop
    return "\n\n" + bubble_report(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks_per_rank, layers)


def simulate_command(args: argparse.Namespace) -> int:
    from shardformer.tools.simulate import format_simulation, simulate_job

    if args.policy or args.batch or args.seq or args.cp != 1:
        print("shardformer plan: error: --simulate takes no --policy, --batch, --seq or --cp", file=sys.stderr)
        return 2
    try:
        job = simulate_job(
            args.model, args.tp, args.pp, args.dp, args.zero or 1, args.precision or "bf16",
            model_class=args.model_class,
        )  # fmt: skip
    except (ValueError, NotImplementedError) as e:
        print(f"shardformer plan: error: {e}", file=sys.stderr)
        return 2
    print(format_simulation(job))
    return 0
