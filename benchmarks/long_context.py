"""Long context: activation memory per rank against sequence length, the longest sequence each
variant trains within a fixed per-rank memory budget, and the step time of context parallelism's
two modes, for a Llama-like model (sdpa attention).

    .venv/bin/python benchmarks/long_context.py [--seqs 1024 2048 4096 8192] [--budget-mib 512]
        [--only NAME ...] [--variant 'NAME=RANKS:{"shard_config_key": value, ...}' ...]
        [--time-seq 2048] [--time-rounds 3]

Each variant is a row: a number of ranks and the ``ShardConfig`` keyword arguments it shards with
(:data:`VARIANTS`: unsharded, tensor parallelism, sequence parallelism, context parallelism in both
modes, tp x cp); ``--variant`` adds one without editing the script. Every row runs in its own fresh
processes (one thread per rank) and is compared with ``tp=2`` measured in the same run; rows with
context parallelism are also compared with the same layout at cp=1 (``unsharded`` for cp=2,
``tp=2`` for tp=2 x cp=2).

Activation memory is measured, not estimated: the bytes of every tensor autograd saves for the
backward during the training forward ``loss = model(input_ids, labels=input_ids).loss``, each
storage counted once, parameters aside (torch's saved-tensor hooks see each one as it is saved).
That is what the forward leaves alive for the backward, exactly and independent of the allocator,
the machine's load or other processes (RSS is none of these on a shared machine); the logits the
step drops are not counted. The largest rank's bytes are reported. Transient memory inside an op
(the ring's score block of one step, b x heads x n^2 fp32) is not activation memory and not counted.

The longest trainable sequence within ``--budget-mib``: from the largest measured length that fits,
the length doubles until the activations pass the budget, then a bisection narrows the boundary to
``--granularity`` tokens; every probe is a measured forward.

For each row, a full training step at ``--step-seq`` checks the computation: its loss and the norm
of the full (gathered) gradient must equal the baseline's (the script fails otherwise), and
``CollectiveCounter`` gives the bytes each rank sends in that step (every collective in its own
group: ring algorithms for all-reduce, reduce-scatter and all-gather; all-to-all and the ring's
sends as sent).

Step time, ring vs all-to-all: wall times on a shared machine measure the neighbours as much as the
code, so the two modes (and cp=1, each of the 2 ranks computing the whole step, as a reference) are
built in the same 2 processes from the same weights and timed interleaved, ``--time-rounds`` rounds
of one training step each at ``--time-seq`` tokens, the order rotating every round; the fastest and
the median of each are reported (the slower rank per step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shardformer import ShardConfig, shard_model  # noqa: E402
from shardformer.core.comm import CollectiveCounter, all_reduce, group_size  # noqa: E402
from shardformer.core.record import ATTRIBUTE, sharding_of  # noqa: E402
from shardformer.tensor_parallel.slicer import gather_tensor, shard_spec  # noqa: E402
from shardformer.tools.activation_estimate import estimate_activations  # noqa: E402
from shardformer.tools.testing import run_on_ranks  # noqa: E402

# name -> (ranks, ShardConfig keyword arguments; None: the unsharded model on one rank)
VARIANTS: dict[str, tuple[int, dict | None]] = {
    "unsharded": (1, None),
    "tp=2": (2, {"tensor_parallel_size": 2}),
    "tp=2 + sequence parallel (re-gather, default)": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "tp=2 + sequence parallel (keep gathered)": (
        2,
        {"tensor_parallel_size": 2, "sequence_parallel": True, "sequence_parallel_regather": False},
    ),
    "cp=2 ring": (2, {"context_parallel_size": 2, "context_parallel_mode": "ring"}),
    "cp=2 all_to_all": (2, {"context_parallel_size": 2, "context_parallel_mode": "all_to_all"}),
    "tp=2 x cp=2 ring": (4, {"tensor_parallel_size": 2, "context_parallel_size": 2, "context_parallel_mode": "ring"}),
}
BASELINE = "tp=2"
CP_KEYS = ("context_parallel_size", "context_parallel_mode")
# what the estimate knows
ESTIMATED = {"tensor_parallel_size", "sequence_parallel", "sequence_parallel_regather", *CP_KEYS}
TIMED = {"cp=1": None, "ring": "ring", "all_to_all": "all_to_all"}  # the interleaved step-time comparison


def llama_config(args) -> tf.LlamaConfig:
    config = tf.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=1 << 20,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


def _saved_bytes(model, ids) -> tuple[torch.Tensor, int]:
    """The loss and the bytes of the tensors the forward saved for the backward (parameters aside)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    return loss, sum(storages.values())


def _largest_rank(value: int) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    return int(all_reduce(torch.tensor([value], dtype=torch.int64), None, op=dist.ReduceOp.MAX).item())


def _ids(seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))


def _held(model, seq: int, vocab: int) -> int:
    loss, held = _saved_bytes(model, _ids(seq, vocab))
    del loss  # drop the graph before the next probe
    return _largest_rank(held)


def _full_grad_norm(model) -> float:
    """Norm of the whole model's gradient: split parameters gathered over the tp group."""
    group = sharding_of(model).tp_group if ATTRIBUTE in model.__dict__ else None
    total = 0.0
    for p in model.parameters():
        if p.grad is None:
            continue
        spec = shard_spec(p)
        grad = p.grad if spec is None else gather_tensor(p.grad.contiguous(), spec, group)
        total += grad.double().square().sum().item()
    return total**0.5


def _step(model, seq: int, vocab: int) -> tuple[float, float, float, float]:
    model.zero_grad(set_to_none=True)
    ids = _ids(seq, vocab)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    with CollectiveCounter() as counter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    seconds = time.perf_counter() - start
    return loss.item(), _full_grad_norm(model), _sent_bytes(counter) / 2**20, seconds


def _sent_bytes(counter: CollectiveCounter) -> float:
    """Bytes this rank sends: ring algorithms in each call's own group (an all-reduce of N bytes over w
    ranks sends 2(w-1)/w N, a reduce-scatter (w-1)/w N, an all-gather of N bytes per rank (w-1) N), an
    all-to-all the (w-1)/w of its input that leaves, a send what it sends."""
    share = {"all_reduce": lambda w: 2 * (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w}
    share.update(all_gather=lambda w: w - 1, all_to_all=lambda w: (w - 1) / w, send=lambda w: 1.0)
    return sum(
        share[op](group_size(group)) * nbytes
        for (op, _, nbytes), group in zip(counter.calls, counter.groups)
        if op in share
    )


def _longest(model, vocab: int, measured: dict[int, int], budget: int, granularity: int) -> tuple[int, dict]:
    """The longest length (a multiple of ``granularity``) whose activations fit ``budget`` bytes."""
    probes = dict(measured)
    fits = [s for s, b in probes.items() if b <= budget]
    low = max(fits) if fits else 0
    high = min((s for s, b in probes.items() if b > budget), default=None)
    while high is None:  # double until over the budget
        seq = max(2 * low, granularity)
        probes[seq] = _held(model, seq, vocab)
        low, high = (seq, None) if probes[seq] <= budget else (low, seq)
    while high - low > granularity:
        seq = (low + high) // 2 // granularity * granularity
        if seq in (low, high):
            break
        probes[seq] = _held(model, seq, vocab)
        low, high = (seq, high) if probes[seq] <= budget else (low, seq)
    return low, probes


def run_variant(options: dict | None, args) -> dict:
    """One row, on each of its ranks: the step check, memory at each length, the longest within budget."""
    model = _build(options, args)
    _step(model, 64, args.vocab)  # warm-up: lazy buffers, generators
    steps = [_step(model, args.step_seq, args.vocab) for _ in range(args.step_repeats)]
    step = (*steps[0][:3], min(s[3] for s in steps))  # the fastest: the least disturbed by other processes
    model.zero_grad(set_to_none=True)
    measured = {seq: _held(model, seq, args.vocab) for seq in args.seqs}
    budget = int(args.budget_mib * 2**20)
    longest, probes = _longest(model, args.vocab, measured, budget, args.granularity)
    return {"step": step, "held": measured, "longest": longest, "probes": probes}


def _build(options: dict | None, args) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(llama_config(args)).train()
    return model if options is None else shard_model(model, ShardConfig(**options))


def time_modes(args) -> dict[str, list[float]]:
    """On each of 2 ranks: step times of cp=1 (the whole step on each rank), cp=2 ring and cp=2
    all-to-all, interleaved round by round (the order rotating), and each mode's loss."""
    models = {
        name: _build(None if mode is None else {"context_parallel_size": 2, "context_parallel_mode": mode}, args)
        for name, mode in TIMED.items()
    }
    for model in models.values():
        _step(model, 64, args.vocab)  # warm-up: lazy buffers, generators
    names, times, losses = list(models), {name: [] for name in models}, {}
    for r in range(args.time_rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            loss, _, _, seconds = _step(models[name], args.time_seq, args.vocab)
            times[name].append(seconds)
            losses[name] = loss
    slowest = lambda xs: [_largest_rank_float(x) for x in xs]  # noqa: E731
    return {"times": {name: slowest(xs) for name, xs in times.items()}, "losses": losses}


def _largest_rank_float(value: float) -> float:
    return float(all_reduce(torch.tensor([value], dtype=torch.float64), None, op=dist.ReduceOp.MAX).item())


def _cp1_counterpart(options: dict | None, variants: dict) -> str | None:
    """The row with the same layout at cp=1 (None: not a context-parallel row, or no such row)."""
    if not options or options.get("context_parallel_size", 1) == 1:
        return None
    rest = {k: v for k, v in options.items() if k not in CP_KEYS} or None
    return next((name for name, (_, o) in variants.items() if (o or None) == rest), None)


def _estimate(options: dict | None, config, seq: int) -> int | None:
    if options is not None and not set(options) <= ESTIMATED:
        return None  # a layout the estimate does not model
    options = dict(options or {})
    tp = options.pop("tensor_parallel_size", 1)
    return estimate_activations(config, 1, seq, tp, **options).total


def _parse_variant(text: str) -> tuple[str, tuple[int, dict]]:
    name, _, rest = text.partition("=")
    ranks, _, kwargs = rest.partition(":")
    if not name or not ranks.isdigit() or not kwargs:
        raise SystemExit(f"--variant {text!r}: expected 'NAME=RANKS:{{json ShardConfig kwargs}}'")
    return name, (int(ranks), json.loads(kwargs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--budget-mib", type=float, default=512.0, help="per-rank activation budget")
    parser.add_argument("--granularity", type=int, default=256, help="tokens: resolution of the longest length")
    parser.add_argument("--step-seq", type=int, default=4096, help="length of the checked, timed training step")
    parser.add_argument("--step-repeats", type=int, default=3, help="timed steps (the fastest is reported)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--only", nargs="+", help="run only these variants (and the baseline)")
    parser.add_argument("--variant", action="append", default=[], help="add a row: 'NAME=RANKS:{json kwargs}'")
    parser.add_argument("--time-seq", type=int, default=2048, help="length of the interleaved ring/all-to-all steps")
    parser.add_argument("--time-rounds", type=int, default=3, help="interleaved rounds (0: no timing)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    variants = dict(VARIANTS)
    variants.update(_parse_variant(text) for text in args.variant)
    if args.only:
        unknown = set(args.only) - set(variants)
        if unknown:
            raise SystemExit(f"--only {sorted(unknown)}: not among the variants {list(variants)}")
        variants = {k: v for k, v in variants.items() if k in args.only or k == BASELINE}
    rows = {}
    for name, (ranks, options) in variants.items():
        start = time.perf_counter()
        per_rank = run_on_ranks(run_variant, ranks, options, args, threads_per_rank=1, timeout=args.timeout)
        rows[name] = per_rank[0]
        print(f"# {name}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    timed = None
    if args.time_rounds > 0:
        start = time.perf_counter()
        timed = run_on_ranks(time_modes, 2, args, threads_per_rank=1, timeout=args.timeout)[0]
        print(f"# interleaved step times: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    config = llama_config(args)
    base = rows[BASELINE]
    ref_loss, ref_norm = base["step"][:2]
    print(f"Llama-like: {args.layers} layers x hidden {args.hidden}, {args.heads} heads, intermediate "
          f"{args.intermediate}, vocab {args.vocab}, sdpa, fp32, batch 1; torch {torch.__version__}, "
          f"transformers {tf.__version__}, {platform.machine()}, {os.cpu_count()} cores\n")  # fmt: skip
    print(
        "Activation memory per rank (MiB saved for the backward; in brackets: vs tp=2; `shardformer plan` estimate)\n"
    )
    print("| variant | ranks | " + " | ".join(f"seq {s}" for s in args.seqs) + " |")
    print("|---|---:|" + "---:|" * len(args.seqs))
    for name, row in rows.items():
        ranks, options = variants[name]
        cells = []
        for seq in args.seqs:
            held, estimate = row["held"][seq], _estimate(options, config, seq)
            est = "" if estimate is None else f"; est. {estimate / 2**20:.0f}"
            cells.append(f"{held / 2**20:.0f} ({held / base['held'][seq]:.2f}x{est})")
        print(f"| {name} | {ranks} | " + " | ".join(cells) + " |")
    pairs = {name: _cp1_counterpart(variants[name][1], variants) for name in rows}
    pairs = {name: other for name, other in pairs.items() if other in rows}
    if pairs:
        print("\nContext parallelism against the same layout at cp=1 (activation memory per rank, ratio)\n")
        print("| variant | vs | " + " | ".join(f"seq {s}" for s in args.seqs) + " | longest sequence |")
        print("|---|---|" + "---:|" * (len(args.seqs) + 1))
        for name, other in pairs.items():
            cells = [f"{rows[name]['held'][s] / rows[other]['held'][s]:.2f}x" for s in args.seqs]
            longest = rows[name]["longest"] / rows[other]["longest"]
            print(f"| {name} | {other} | " + " | ".join(cells) + f" | {longest:.2f}x |")
    print(f"\nLongest sequence within {args.budget_mib:.0f} MiB of activations per rank (multiples of "
          f"{args.granularity} tokens; probes measured)\n")  # fmt: skip
    print("| variant | longest sequence | vs tp=2 | activations at it (MiB) |")
    print("|---|---:|---:|---:|")
    for name, row in rows.items():
        longest = row["longest"]
        at = row["probes"].get(longest)
        at = "—" if at is None else f"{at / 2**20:.0f}"
        print(f"| {name} | {longest} | {longest / base['longest']:.2f} | {at} |")
    print(f"\nA training step at seq {args.step_seq} (loss and full gradient norm must match; bytes each "
          f"rank sends; wall time, fastest of {args.step_repeats}: noisy, see the interleaved table)\n")  # fmt: skip
    print("| variant | loss | grad norm | sent / rank (MiB) | vs tp=2 | step (s) | vs tp=2 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        loss, norm, sent, seconds = row["step"]
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (name, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-4 * max(1.0, abs(ref_norm)), (name, norm, ref_norm)
        ratio = f"{sent / base['step'][2]:.2f}" if base["step"][2] else "—"
        print(f"| {name} | {loss:.6f} | {norm:.6f} | {sent:.0f} | {ratio} | {seconds:.1f} | "
              f"{seconds / base['step'][3]:.2f} |")  # fmt: skip
    if timed is not None:
        _print_timed(timed, args)


def _print_timed(timed: dict, args) -> None:
    times, losses = timed["times"], timed["losses"]
    ref = losses["cp=1"]
    for name, loss in losses.items():
        assert abs(loss - ref) <= 1e-5 * max(1.0, abs(ref)), (name, loss, ref)
    fastest = {name: min(xs) for name, xs in times.items()}
    median = {name: statistics.median(xs) for name, xs in times.items()}
    print(f"\nStep time at seq {args.time_seq}, 2 ranks, interleaved over {args.time_rounds} rounds (forward + "
          f"backward, the slower rank; loss {ref:.6f} in every mode)\n")  # fmt: skip
    print("| mode | every round (s) | fastest (s) | median (s) | median vs all_to_all | median vs cp=1 |")
    print("|---|---|---:|---:|---:|---:|")
    for name, xs in times.items():
        rounds = ", ".join(f"{x:.1f}" for x in xs)
        print(f"| {name} | {rounds} | {fastest[name]:.1f} | {median[name]:.1f} | "
              f"{median[name] / median['all_to_all']:.2f} | {median[name] / median['cp=1']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
