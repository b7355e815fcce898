"""Expert parallelism: training step time and per-rank memory of a Mixtral-like and a Qwen3-MoE-like model.

    .venv/bin/python benchmarks/expert_parallel.py [--ranks 2] [--steps 11] [--batch 8] [--seq 64]

Both models have 8 experts, top-2 routing, hidden 256, expert intermediate 512 and 2 layers, so the
experts are ~86% of the parameters. Each is saved once (``save_pretrained``) and every variant loads it
with ``from_pretrained`` and trains it with AdamW on the same global batches:

- unsharded: the baseline, measured in the same run;
- shardformer ep: ``ParallelEngine(EngineConfig(ep=N))``, dp=N, each rank 1/N of the batch and 8/N whole
  experts, tokens exchanged with all-to-all;
- shardformer expert-internal tp: ``ParallelEngine(EngineConfig(tp=N))``, every expert's intermediate dim
  cut over the N ranks (transformers' tp plan), each rank the whole batch;
- transformers' own expert parallelism: ``from_pretrained(..., distributed_config=DistributedConfig(
  ep_size=N, fsdp_size=N, ep_implementation="all_to_all"))`` (ep over the FSDP2 data-parallel ranks, the
  same layout as ours; ``DistributedConfig(ep_size=N)`` alone is refused, shown with its reason) and
  ``DistributedConfig(ep_size=N, tp_size=N)`` (ep over tensor-parallel ranks that share the batch).

Memory and losses: each variant alone in a fresh spawn (the unsharded one in 1 process): parameter and
expert-parameter bytes per rank, peak RSS growth over ``--memory-steps`` steps (Linux high-water mark reset
just before them, so gradients and optimizer states count), the largest |loss - unsharded loss|. Time: all
variants in one spawn of N ranks, taking turns step by step (order reversed every other step) so load from
elsewhere on a shared machine hits them alike; the unsharded model steps on every rank at once, each rank
the whole batch. Every process runs 1 thread, so perfect scaling is a step time ratio of 1/N. Step time =
forward, backward, gradient reduction and optimizer step, median of all steps but the first.

Checked (asserted): shardformer's ep losses equal the unsharded model's at every step (the first on the
same weights; fp32 atol 1e-5 / rtol 1e-4) and each rank holds at most 0.51 of the unsharded expert bytes at
ep=2 (1/N + 0.01 in general).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers as tf  # noqa: E402

from benchmarks.tp_bench import _reset_peak_rss_mib, _status_mib  # noqa: E402

VOCAB, LR = 1024, 1e-3
VARIANTS = {
    "unsharded": "unsharded (1 process)",
    "ep": "shardformer ep={n} (dp={n})",
    "tp": "shardformer expert-internal tp={n}",
    "hf_ep": "transformers ep_size={n} alone",
    "hf_ep_fsdp": "transformers ep_size={n}, fsdp_size={n}, all_to_all",
    "hf_ep_tp": "transformers ep_size={n}, tp_size={n}",
}


def config(family: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, tie_word_embeddings=False, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=512, num_local_experts=8)
    return tf.Qwen3MoeConfig(
        **common, num_experts=8, moe_intermediate_size=512, intermediate_size=512, decoder_sparse_step=1, head_dim=64
    )


def batch(step: int, size: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _local(p) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _param_bytes(model) -> tuple[int, int]:
    """(all, expert) parameter bytes this rank holds."""
    sizes = [(n, _local(p).numel() * p.element_size()) for n, p in model.named_parameters()]
    return sum(s for _, s in sizes), sum(s for n, s in sizes if _is_expert(n))


def _build(variant: str, path: str, n: int):
    """(model, step function taking the global batch and returning the loss over it)."""
    from shardformer import EngineConfig, ParallelEngine

    if variant in ("ep", "tp"):
        model = tf.AutoModelForCausalLM.from_pretrained(path)
        sizes = {"ep": n} if variant == "ep" else {"tp": n}
        engine = ParallelEngine(model, lambda ps: torch.optim.AdamW(ps, lr=LR), EngineConfig(**sizes))
        return engine.model, engine.train_step
    if variant == "unsharded":
        model, rows = tf.AutoModelForCausalLM.from_pretrained(path), None
    else:
        from transformers.distributed import DistributedConfig

        kw = {"hf_ep_fsdp": {"fsdp_size": n, "ep_implementation": "all_to_all"}, "hf_ep_tp": {"tp_size": n}}
        layout = DistributedConfig(ep_size=n, **kw.get(variant, {}))  # "hf_ep": ep_size alone
        model = tf.AutoModelForCausalLM.from_pretrained(path, distributed_config=layout)
        rows = variant == "hf_ep_fsdp"  # FSDP ranks each take their slice of the batch; tp ranks share it
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(global_batch):
        local = global_batch
        if rows:
            r, size = dist.get_rank(), next(iter(global_batch.values())).shape[0] // n
            local = {k: v[r * size : (r + 1) * size] for k, v in global_batch.items()}
        opt.zero_grad(set_to_none=True)
        loss = model(**local).loss
        loss.backward()
        opt.step()
        loss = loss.detach()
        if rows:  # the global batch's loss: the mean of the ranks' (equal-size) slices
            dist.all_reduce(loss)
            loss /= n
        return loss.item()

    return model, step


def _memory(variant: str, path: str, n: int, steps: int, size: int, seq: int) -> dict:
    """One variant alone in its spawn, so the peak is its own: bytes held, peak RSS growth, losses."""
    model, step = _build(variant, path, n)
    params, experts = _param_bytes(model)
    before = _reset_peak_rss_mib()
    losses = [step(batch(s, size, seq)) for s in range(steps)]
    return {"losses": losses, "params": params, "experts": experts, "peak": _status_mib("VmHWM") - before}


def _timing(variants: list[str], path: str, n: int, steps: int, size: int, seq: int) -> dict:
    """Every variant in one spawn, taking turns step by step (order reversed every other step), so load
    from elsewhere on a shared machine hits them alike. The unsharded model steps on every rank at once."""
    built = {v: _build(v, path, n)[1] for v in variants}
    times = {v: [] for v in variants}
    for s in range(steps):
        b = batch(s, size, seq)
        for v in variants if s % 2 == 0 else reversed(variants):
            dist.barrier()
            start = time.perf_counter()
            built[v](b)
            dist.barrier()
            times[v].append(time.perf_counter() - start)
    return {v: statistics.median(t[1:] or t) for v, t in times.items()}


def _spawn(fn, ranks, *args):
    """run_on_ranks with 1 thread per rank; a failure comes back as its last line (a peer that cannot run is
    reported with its reason, not hidden)."""
    from shardformer.tools.testing import run_on_ranks

    try:
        return run_on_ranks(fn, ranks, *args, timeout=900, threads_per_rank=1)
    except Exception as e:
        return " ".join(str(e).strip().splitlines()[-1].split())[:300]


def _measure(path: str, n: int, args) -> dict:
    """{variant: {time, params, experts, peak, losses} or the reason it cannot run}."""
    results = {}
    for v in VARIANTS:
        per_rank = _spawn(_memory, 1 if v == "unsharded" else n, v, path, n, args.memory_steps, args.batch, args.seq)
        if isinstance(per_rank, str):
            results[v] = per_rank
            continue
        results[v] = {k: max(r[k] for r in per_rank) for k in ("params", "experts", "peak")}
        results[v]["losses"] = per_rank[0]["losses"]
    running = [v for v, r in results.items() if not isinstance(r, str)]
    times = _spawn(_timing, n, running, path, n, args.steps, args.batch, args.seq)
    if isinstance(times, str):
        raise RuntimeError(f"the timing spawn failed: {times}")
    for v in running:
        results[v]["time"] = times[0][v]
    return results


def _check_ep(family, n, ep, base, full_experts):
    """Exactness and the expert bytes: asserted, so a regression fails the benchmark."""
    torch.testing.assert_close(
        torch.tensor(ep["losses"][0]), torch.tensor(base["losses"][0]), atol=1e-5, rtol=1e-4,
        msg=lambda m: f"{family} ep={n}: first-step loss differs from the unsharded model's: {m}",
    )  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(ep["losses"]), torch.tensor(base["losses"]), atol=1e-5, rtol=1e-4,
        msg=lambda m: f"{family} ep={n}: losses over the AdamW steps differ from the unsharded model's: {m}",
    )  # fmt: skip
    share = ep["experts"] / full_experts
    bound = 0.51 if n == 2 else 1 / n + 0.01
    assert share <= bound, f"{family} ep={n}: a rank holds {share:.3f} of the expert bytes (bound {bound})"
    return share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--families", default="mixtral,qwen3_moe")
    args = parser.parse_args()
    n = args.ranks
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors go back to the OS: RSS tracks use
    for quiet in ("TRANSFORMERS_VERBOSITY=error", "HF_HUB_DISABLE_PROGRESS_BARS=1"):  # ranks inherit these
        os.environ.setdefault(*quiet.split("="))
    tf.logging.set_verbosity_error()
    tf.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {platform.machine()}, {os.cpu_count()} cores; "
          f"{n} gloo ranks x 1 thread (unsharded: the whole batch in 1 process); global batch {args.batch} x {args.seq} "
          f"tokens, AdamW; step time: median of {args.steps - 1} steps "
          f"after the first, variants taking turns in one spawn\n")  # fmt: skip
    print("| model | variant | step (ms) | vs unsharded | params / rank (MiB) | expert params / rank (MiB) "
          "| expert share | peak RSS growth / rank (MiB) | vs unsharded | max \\|loss - unsharded\\| |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    checked = []
    for family in args.families.split(","):
        path = tempfile.mkdtemp(prefix=f"sf-ep-bench-{family}-")
        try:
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config(family))
            total = sum(p.numel() for p in model.parameters())
            model.save_pretrained(path)
            del model
            results = _measure(path, n, args)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        base = results["unsharded"]
        if isinstance(base, str):
            raise RuntimeError(f"{family}: the unsharded baseline failed: {base}")
        name = f"{family}-like ({total / 1e6:.1f}M, experts {base['experts'] / base['params']:.0%})"
        for variant, label in VARIANTS.items():
            r = results[variant]
            if isinstance(r, str):
                print(f"| {name} | {label.format(n=n)} | cannot run: {r} | | | | | | | |")
                continue
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            print(f"| {name} | {label.format(n=n)} | {r['time'] * 1e3:.0f} | {r['time'] / base['time']:.2f} | "
                  f"{r['params'] / 2**20:.1f} | {r['experts'] / 2**20:.1f} | {r['experts'] / base['experts']:.3f} | "
                  f"{r['peak']:.0f} | {r['peak'] / base['peak']:.2f} | {diff:.1e} |")  # fmt: skip
        if isinstance(results["ep"], str):
            raise RuntimeError(f"{family}: shardformer ep={n} failed: {results['ep']}")
        checked.append((family, _check_ep(family, n, results["ep"], base, base["experts"])))
    print()
    for family, share in checked:
        print(f"{family}: shardformer ep={n} holds {share:.3f} of the unsharded expert bytes per rank "
              f"(asserted <= {0.51 if n == 2 else round(1 / n + 0.01, 3)}); its losses equal the unsharded "
              f"model's at every step (asserted, atol 1e-5 / rtol 1e-4)")  # fmt: skip


if __name__ == "__main__":
    main()
