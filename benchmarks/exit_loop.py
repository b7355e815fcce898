"""A run whose ranks all finish exits 0, every time: the ep=2 ShardedTrainer example launched N times in a row.

    .venv/bin/python benchmarks/exit_loop.py [--runs 20]      (or: make exit-loop; about 15 s a launch here)

Each launch is ``shardformer run --nproc_per_node 2 examples/finetune/main.py --moe`` (a tiny Mixtral at
expert_parallel_size=2 under ShardedTrainer). Not part of ``make test``: too slow. Prints every launch's exit
status and, for one that is not 0, the end of its output; exits 1 unless every launch exited 0. A launch
whose ranks all finished but one then died in the interpreter's teardown exits 0 with a note
(shardformer run says so); the count of those is printed too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "finetune", "main.py")
ENV = {**os.environ, "SHARDFORMER_TIMEOUT_S": "60", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    runs = parser.parse_args().runs
    codes, teardown = [], 0
    for run in range(1, runs + 1):
        with tempfile.TemporaryDirectory() as out:
            argv = [sys.executable, "-m", "shardformer.cli.main", "run", "--nproc_per_node", "2"]
            argv += [EXAMPLE, "--moe", "--output_dir", out]
            start = time.monotonic()
            result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
        codes.append(result.returncode)
        note = [line for line in result.stderr.splitlines() if "died in the interpreter's teardown" in line]
        teardown += bool(note)
        took = f"{time.monotonic() - start:.1f} s"
        print(
            f"launch {run}/{runs}: exit status {result.returncode} ({took}){' ' + note[0] if note else ''}", flush=True
        )
        if result.returncode != 0:
            print(result.stdout[-2000:], result.stderr[-4000:], sep="\n", flush=True)
    print(f"{codes.count(0)}/{runs} launches exited 0; statuses {sorted(set(codes))}; {teardown} with a teardown note")
    return 0 if codes.count(0) == runs else 1


if __name__ == "__main__":
    sys.exit(main())
