"""Checkpoints at tp=2 x dp=2 (4 gloo ranks): how long a save blocks training, with and without
``async_save``; and the peak memory per rank of a HuggingFace export, per-rank writes vs the old gathering export.

    .venv/bin/python benchmarks/checkpoint_bench.py          # ~2 minutes here

Stall (one spawn): a GPT-2 trained by ZeRO-1 AdamW (``ZeroOptimizer``) runs the same loop of
``--steps`` steps three times in turn, with no save, with a synchronous save and with an asynchronous
one after the first step (the asynchronous save's ``wait()`` at the end of the loop, as the next save
would). Blocked: the time the ``save_checkpoint`` call takes; lost: the loop's time minus the same
loop without a save (the write thread shares the CPUs with training). Median over ``--repeats``.

Export memory (a fresh spawn per way, so one cannot reuse memory the other freed): every rank's peak
resident memory (VmHWM, reset before the export) minus its resident memory before it, for
``save_pretrained`` (each rank writes its pieces, then its share of the files) and for the old way
(``gather_full_state`` onto global rank 0, which writes the whole state with ``save_file``).
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

from benchmarks.tp_bench import _reset_peak_rss_mib, _status_mib  # noqa: E402


def _model(args):
    import torch
    import transformers as tf

    from shardformer import ShardConfig, shard_model

    config = tf.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.hidden // 64, vocab_size=args.vocab,
                           bos_token_id=0, eos_token_id=0,
                           n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return shard_model(tf.GPT2LMHeadModel(config), ShardConfig(tensor_parallel_size=2))


def _shared_dir():
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="sf-ckpt-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _stall(args) -> dict:
    import torch
    import torch.distributed as dist

    from shardformer.checkpoint import layout_of, save_checkpoint
    from shardformer.data_parallel import ZeroOptimizer

    model = _model(args)
    lay = layout_of(model)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), dp_group=lay.dp_group,
                        tp_group=lay.tp_group, model=model)  # fmt: skip
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(lay.dp_rank))
    path = _shared_dir()

    def step():
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    def loop(mode):
        dist.barrier()
        start, blocked, handle = time.perf_counter(), 0.0, None
        for i in range(args.steps):
            step()
            if i == 0 and mode != "none":
                t = time.perf_counter()
                handle = save_checkpoint(os.path.join(path, mode), model, opt, step=i, async_save=mode == "async")
                blocked = time.perf_counter() - t
        if handle is not None:
            handle.wait()
        return time.perf_counter() - start, blocked

    step()  # warm up
    times = {m: [] for m in ("none", "sync", "async")}
    for _ in range(args.repeats):
        for mode in times:
            times[mode].append(loop(mode))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {m: (statistics.median(t for t, _ in v), statistics.median(b for _, b in v)) for m, v in times.items()}


def _export(args, way: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from shardformer.checkpoint import gather_full_state, save_pretrained

    model = _model(args)
    path = _shared_dir()
    before = _reset_peak_rss_mib()
    start = time.perf_counter()
    if way == "per-rank writes":
        save_pretrained(model, os.path.join(path, "hf"))
    else:
        state = gather_full_state(model)
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(path, "hf"))
            save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
                      os.path.join(path, "hf", "model.safetensors"))  # fmt: skip
        del state
        dist.barrier()
    seconds = time.perf_counter() - start
    added = _status_mib("VmHWM") - before
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"added": added, "seconds": seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from shardformer.tools.testing import run_on_ranks

    stall = run_on_ranks(_stall, 4, args, timeout=1800, threads_per_rank=1)
    exports = {w: run_on_ranks(_export, 4, args, w, timeout=600, threads_per_rank=1)
               for w in ("per-rank writes", "gather on rank 0")}  # fmt: skip
    params = 12 * args.layers * args.hidden**2 + (args.vocab + args.seq) * args.hidden
    print(f"## Checkpoints at tp=2 x dp=2 (GPT-2, ~{params * 4 / 2**20:.0f} MiB fp32 weights, ZeRO-1 AdamW)\n")
    print(f"Run: `.venv/bin/python benchmarks/checkpoint_bench.py` on {platform.machine()} / {os.cpu_count()} "
          f"CPUs, 4 gloo ranks, torch {torch.__version__}.\n")  # fmt: skip
    print("| save | loop s (rank 0) | save call blocks s (max over ranks) | lost vs no save s |")
    print("|---|---|---|---|")
    worst = {m: max(r[m][1] for r in stall) for m in ("none", "sync", "async")}
    lost = {m: stall[0][m][0] - stall[0]["none"][0] for m in ("sync", "async")}
    for mode in ("none", "sync", "async"):
        print(f"| {mode} | {stall[0][mode][0]:.2f} | {worst[mode]:.3f} | {lost.get(mode, 0.0):.2f} |")
    print(f"\nasync / sync: blocked **{worst['async'] / worst['sync']:.2f}x**, "
          f"loop time lost **{lost['async'] / max(lost['sync'], 1e-9):.2f}x**\n")  # fmt: skip
    print("| export | rank | memory added (MiB) | s |")
    print("|---|---|---|---|")
    for way, ranks in exports.items():
        for rank, r in enumerate(ranks):
            print(f"| {way} | {rank} | {r['added']:.0f} | {r['seconds']:.1f} |")
    new, old = (max(r["added"] for r in exports[w]) for w in exports)
    print(f"\nper-rank writes / gather on rank 0, worst rank's added memory: **{new / old:.2f}x**")


if __name__ == "__main__":
    main()
