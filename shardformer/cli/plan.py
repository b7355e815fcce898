"""``shardformer plan``: size a job with no weights and no processes."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    from shardformer.tools.model_names import known_names_help  # no torch: help stays fast

    parser = subparsers.add_parser(
        "plan",
        help="show how a model would be sharded and the bytes per rank, without starting anything",
        description="Build MODEL on the meta device (no weights), apply its policy and print what is replaced, "
        "each rank's parameter shapes, the pipeline stage split and estimated bytes per rank.",
        epilog="examples:\n  shardformer plan gpt2 --tp 2\n  shardformer plan path/to/model --tp 4 --dp 2 --zero 1 "
        "--precision bf16\n  shardformer plan timm:vit_base_patch16_224 --tp 2 --summary\n"
        "  shardformer plan gpt2 --tp 2 --summary --batch 2 --seq 1024\n"
        "  shardformer plan path/to/llama --tp 2 --cp 2 --cp-mode all_to_all --summary --batch 1 --seq 32768\n"
        "  shardformer plan llama3-405b --tp 8 --pp 16 --dp 8 --simulate\n"
        "  shardformer plan deepseek-v3 --tp 8 --pp 16 --dp 8 --ep 8 --zero 1 --precision bf16 --summary "
        "--batch 1 --seq 4096\n"
        "  shardformer plan llama-3-70b --tp 8 --gpus 8 --gpu-memory 80GB --zero 1 --precision bf16 "
        "--batch 1 --seq 4096\n"
        "  shardformer plan llama-7b --pp 2 --gpus 8 --gpu-memory 80GB --precision bf16 --batch 1 --seq 4096 "
        "--microbatches 8 --simulate\n"
        "  shardformer plan llama-3-70b --search --gpus 16 --gpu-memory 80GB --seq 4096 --global-batch 32\n\n"
        + known_names_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help="folder with config.json, a hub id downloaded before (org/name), "
                        "a built-in name (listed below) or timm:<name>")  # fmt: skip
    parser.add_argument("--policy", metavar="MODULE:CLASS", help="a custom Policy class (default: the built-in one)")
    parser.add_argument("--model-class", metavar="NAME", help="transformers class for a config.json without "
                        "'architectures' (e.g. LlamaForCausalLM)")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--dp", type=int, help="data-parallel size (default: --gpus / (tp x cp x pp), else 1)")
    parser.add_argument("--dp-replicate", type=int, default=1, help="hybrid sharded data parallelism (HSDP, "
                        "EngineConfig.dp_replicate): the dp ranks as this many replicas, ZeRO sharding the model "
                        "state over dp / dp-replicate ranks inside each (default 1: over all dp ranks)")  # fmt: skip
    parser.add_argument("--gpus", type=int, help="GPUs of the job in all: sets --dp (or checks it)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="memory of one GPU (80GB, 80GiB, 141GB; GB = 2**30 "
                        "bytes): add up each stage's bytes per rank and answer whether the job fits")  # fmt: skip
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step and dp rank, each of "
                        "--batch sequences (default 1; with pp they fill the pipeline)")  # fmt: skip
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"),
                        help="pipeline schedule (pp > 1): its bubble, and how many micro-batches a stage keeps "
                        "activations for (1f1b: up to pp; the others counted as all of them, an upper bound; "
                        "default 1f1b)")  # fmt: skip
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size: the sequence split over this many "
                        "ranks (default 1; world = tp x cp x pp x dp)")  # fmt: skip
    # core.choices.CP_MODES, spelled out: importing it would import torch for `shardformer --help`
    parser.add_argument("--cp-mode", default="ring", choices=("ring", "all_to_all"), help="how attention spans the "
                        "split sequence (default ring)")  # fmt: skip
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size: each MoE layer's experts split "
                        "over this many of the dp ranks (default 1)")  # fmt: skip
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (default 0; with "
                        "--simulate 1; 3: bytes by formula)")  # fmt: skip
    parser.add_argument("--simulate", action="store_true", help="build one rank of every kind for real on the "
                        "meta device in a fake process group of the whole world and read its bytes and one "
                        "training step's collectives (default precision bf16)")  # fmt: skip
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default fp32 (bf16 with --simulate)")
    parser.add_argument("--summary", action="store_true", help="leave out the per-parameter list")
    parser.add_argument("--batch", type=int, help="with --seq: estimate activation memory per rank for micro-batches "
                        "of this many sequences")  # fmt: skip
    parser.add_argument("--seq", type=int, help="with --batch: sequence length of the activation estimate")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the job runs: torch's "
                        "dropout keeps float masks on cpu, bool masks on cuda (default cpu)")  # fmt: skip
    parser.add_argument("--virtual-stages", type=int, help="model chunks per pp rank for interleaved_1f1b (default 2)")
    search = parser.add_argument_group("search (--search: which layout?)")
    search.add_argument("--search", action="store_true", help="enumerate every layout the model admits on --gpus "
                        "of --gpu-memory (tp, cp, pp with schedule and virtual stages, dp with ZeRO stage, ep, "
                        "micro-batches, checkpointing, sequence parallelism), keep those that fit, rank them by "
                        "estimated step time and print the best as EngineConfig and `shardformer run` lines; "
                        "needs --gpus, --gpu-memory and --seq")  # fmt: skip
    search.add_argument("--global-batch", type=int, help="sequences per step over all data-parallel ranks; the "
                        "micro-batch size and count are searched (default: --gpus)")  # fmt: skip
    search.add_argument("--nodes", type=int, help="nodes of the job (default: --gpus / --gpus-per-node)")
    search.add_argument("--gpus-per-node", type=int, help="GPUs per node: groups within a node use the fast "
                        "link (default 8, or --gpus / --nodes)")  # fmt: skip
    search.add_argument("--hardware", default="h100", choices=("h100", "h200", "a100"), help="the cost model's "
                        "GPU and links (default h100)")  # fmt: skip
    search.add_argument("--headroom", type=float, default=0.1, help="fraction of --gpu-memory left free for the "
                        "CUDA context, NCCL and fragmentation (default 0.1)")  # fmt: skip
    search.add_argument("--top", type=int, default=3, help="layouts to print (default 3)")
    search.add_argument("--no-simulate", action="store_true", help="rank on the formula alone (no simulated ranks)")
    search.add_argument("--no-prove", action="store_true", help="do not prove the chosen route on a tiny copy")
    parser.set_defaults(func=plan_command)
    return parser


def plan_command(args: argparse.Namespace) -> int:
    # deferred: torch and transformers take seconds to import; `shardformer --help` and `run` never need them
    from shardformer.tools.model_source import load_policy
    from shardformer.tools.plan import build_meta_model, format_plan, plan_model

    sys.path.insert(0, os.getcwd())  # --policy module:Class from the current folder
    try:
        if args.search:
            return search_command(args)
        check_sizes(args)
        if args.simulate:
            return simulate_command(args)
        args.precision = args.precision or "fp32"
        policy = load_policy(args.policy)
        model = build_meta_model(args.model, args.model_class)
        plan = plan_model(
            model, args.tp, args.pp, args.dp, args.zero, args.precision, policy=policy, batch=args.batch,
            seq=args.seq, device=args.device, cp=args.cp, cp_mode=args.cp_mode, ep=args.ep,
        )  # fmt: skip
        # hybrid sharding changes only the group ZeRO shards over (Plan.dp_shard), not the cut
        plan = dataclasses.replace(plan, dp_replicate=args.dp_replicate)
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
    if args.gpu_memory:
        # deferred: this module imports nothing heavy at its top (`shardformer --help` stays fast)
        from shardformer.tools.fit import format_fit, plan_stages

        stages, missing = plan_stages(
            plan, getattr(model, "config", None), args.batch, args.seq, args.microbatches, args.schedule, args.device
        )  # fmt: skip
        print("\n" + format_fit(stages, args.gpu_memory, plan.world, fit_header(args), missing))
    return 0


def search_command(args: argparse.Namespace) -> int:
    """``--search``: every layout of --gpus, ranked (`shardformer.tools.search`)."""
    # deferred: this module imports nothing heavy at its top (`shardformer --help` stays fast)
    from shardformer.tools.fit import parse_memory
    from shardformer.tools.search import search
    from shardformer.tools.search_report import format_search

    fixed = [f"--{k}" for k in ("tp", "pp", "dp", "cp", "ep") if getattr(args, k) not in (None, 1)]
    fixed += ["--dp-replicate"] if args.dp_replicate != 1 else []
    fixed += ["--batch"] if args.batch is not None else []
    if fixed or args.simulate or args.policy:
        raise ValueError(f"--search chooses the layout itself; drop {', '.join(fixed) or '--simulate / --policy'}")
    if args.gpus is None or args.gpu_memory is None or args.seq is None:
        raise ValueError("--search needs --gpus N, --gpu-memory SIZE and --seq TOKENS")
    gpus_per_node = args.gpus_per_node or (args.gpus // args.nodes if args.nodes else min(args.gpus, 8))
    if args.nodes and args.nodes * gpus_per_node != args.gpus:
        raise ValueError(f"--nodes {args.nodes} x --gpus-per-node {gpus_per_node} is not --gpus {args.gpus}")
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom {args.headroom} must be a fraction in [0, 1)")
    result = search(
        args.model, args.gpus, parse_memory(args.gpu_memory), seq=args.seq, global_batch=args.global_batch,
        gpus_per_node=gpus_per_node, precision=args.precision or "bf16", hardware=args.hardware,
        headroom=args.headroom, top=args.top, simulate=not args.no_simulate, prove=not args.no_prove,
        model_class=args.model_class, device=args.device,
    )  # fmt: skip
    print(format_search(result))
    return 0 if result.ranked else 1


def check_sizes(args: argparse.Namespace) -> None:
    """--gpus sets --dp (or checks it); --gpu-memory becomes bytes; sizes are positive; --dp-replicate divides dp."""
    # deferred: this module imports nothing heavy at its top (`shardformer --help` stays fast)
    from shardformer.core.sizes import check_replicate_divides  # EngineConfig's own check and message
    from shardformer.tools.fit import parse_memory

    if args.microbatches < 1:
        raise ValueError(f"--microbatches {args.microbatches} must be at least 1")
    if args.gpu_memory is not None:
        args.gpu_memory = parse_memory(args.gpu_memory)
    per_replica = args.tp * args.cp * args.pp
    if args.gpus is not None:
        if args.gpus < 1 or args.gpus % per_replica:
            raise ValueError(
                f"--gpus {args.gpus} does not divide into tp x cp x pp = {per_replica}; use a multiple of {per_replica}"
            )
        if args.dp is not None and args.dp * per_replica != args.gpus:
            raise ValueError(
                f"--gpus {args.gpus} but tp x cp x pp x dp = {args.dp * per_replica}; drop --dp (it is then "
                f"{args.gpus // per_replica}) or make them agree"
            )
        args.dp = args.gpus // per_replica
    args.dp = args.dp or 1
    if args.dp_replicate != 1:  # at 1, ep against dp is plan_model's check, with its own message
        check_replicate_divides(args.dp_replicate, args.dp, "--dp-replicate", ep=args.ep)


def fit_header(args: argparse.Namespace) -> str:
    if args.batch is None:
        return "will it fit? (model state and buffers; give --batch and --seq for activations)"
    flight = f", {args.microbatches} micro-batches per step ({args.schedule})" if args.pp > 1 else ""
    return f"will it fit? micro-batch {args.batch} x seq {args.seq}{flight}"


def _bubble(args: argparse.Namespace, plan) -> str:
    """The schedule's bubble at pp > 1 (EngineConfig's and the schedule's checks first)."""
    # deferred: this module imports nothing heavy at its top (`shardformer --help` stays fast)
    from shardformer.core.config import EngineConfig
    from shardformer.pipeline.bubble import bubble_report

    if args.pp == 1:
        return ""
    cfg = EngineConfig(
        pp=args.pp, schedule=args.schedule, virtual_stages=args.virtual_stages, num_microbatches=args.microbatches
    )
    layers = plan.stages[-1][0].stop
    return "\n\n" + bubble_report(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks_per_rank, layers)


def simulate_command(args: argparse.Namespace) -> int:
    # deferred: this module imports nothing heavy at its top (`shardformer --help` stays fast)
    from shardformer.tools.simulate import simulate_job
    from shardformer.tools.simulate_report import format_simulation

    if args.policy or args.cp != 1:
        print("shardformer plan: error: --simulate takes no --policy or --cp", file=sys.stderr)
        return 2
    if args.dp_replicate != 1:  # a rank holds what it holds at plain dp over its shard group
        print("shardformer plan: error: --simulate takes no --dp-replicate; simulate the shard group's job "
              "(--dp dp / dp-replicate)", file=sys.stderr)  # fmt: skip
        return 2
    if (args.batch is None) != (args.seq is None):
        raise ValueError(f"--batch {args.batch} and --seq {args.seq}: give both, or neither")
    sizes = {"batch": args.batch, "seq": args.seq} if args.batch is not None else {}
    job = simulate_job(
        args.model, args.tp, args.pp, args.dp, args.zero or 1, args.precision or "bf16",
        model_class=args.model_class, ep=args.ep, **sizes,
    )  # fmt: skip
    print(format_simulation(job))
    if args.gpu_memory:
        # deferred: this module imports nothing heavy at its top (`shardformer --help` stays fast)
        from shardformer.tools.fit import format_fit, simulated_stages

        stages, missing = simulated_stages(job, args.batch, args.seq, args.microbatches, args.schedule, args.device)
        print("\n" + format_fit(stages, args.gpu_memory, job.world, fit_header(args), missing))
    return 0
