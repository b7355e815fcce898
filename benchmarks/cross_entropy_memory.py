"""Peak memory of the LM loss per rank: unsharded F.cross_entropy vs vocab-parallel cross-entropy.

Each variant runs in fresh processes (spawned gloo ranks) and reports the growth of the process's
peak RSS over LM head + loss forward and backward, beyond what the inputs already took. Large
allocations are mmapped (MALLOC_MMAP_THRESHOLD_) so freed memory really leaves the process.

    .venv/bin/python benchmarks/cross_entropy_memory.py [--tokens 2048] [--vocab 50257] [--hidden 256]
"""

import argparse
import os
import platform
import resource

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardformer.tensor_parallel.layers import VocabParallelLMHead1D, vocab_parallel_cross_entropy
from shardformer.tools.testing import run_on_ranks


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measure(tokens, vocab, hidden, parallel):
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False)
    if parallel:
        head = VocabParallelLMHead1D.from_native(head, None)
    x = torch.randn(tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    before = _peak_rss_mib()
    logits = head(x)
    loss = vocab_parallel_cross_entropy(logits, labels, None, vocab) if parallel else F.cross_entropy(logits, labels)
    del logits  # the loss keeps what backward needs
    loss.backward()
    return _peak_rss_mib() - before, loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")

    logits_mib = args.tokens * args.vocab * 4 / 2**20
    base = run_on_ranks(_measure, 1, args.tokens, args.vocab, args.hidden, False)[0]
    rows = [("unsharded F.cross_entropy", 1, base[0], base[1])]
    for tp in args.tp:
        per_rank = run_on_ranks(_measure, tp, args.tokens, args.vocab, args.hidden, True)
        rows.append((f"vocab-parallel, tp={tp}", tp, max(m for m, _ in per_rank), per_rank[0][1]))

    print(f"torch {torch.__version__}, {platform.machine()}, gloo on CPU, {torch.get_num_threads()} threads")
    print(f"tokens={args.tokens} vocab={args.vocab} hidden={args.hidden}; full fp32 logits = {logits_mib:.0f} MiB\n")
    print("| loss | ranks | peak RSS growth per rank (MiB) | vs unsharded | loss value |")
    print("|---|---:|---:|---:|---:|")
    for name, ranks, mib, loss in rows:
        print(f"| {name} | {ranks} | {mib:.0f} | {mib / base[0]:.2f} | {loss:.6f} |")


if __name__ == "__main__":
    main()
