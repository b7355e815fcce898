"""Does the tiny-model recipe build and run every class the conformance sweep covers?

Every proof runs on a tiny copy (``shardformer.core.tiny.tiny_copy_config``), so a class whose tiny
copy cannot be built or run cannot be sharded. This walks the rows of ``sweeps/conformance.py``
(the same tasks and filters), and for each class, in one process and without sharding: scales its
default config down, builds the model, makes inputs (``shardformer.models.inputs_for``) and runs
forward and backward (and greedy ``generate`` with ``--generate``). One line per class that fails,
then the failures counted by step and by cause.

    .venv/bin/python sweeps/tiny_copies.py [--task causal-lm] [--only llama,codegen] [--limit 50]
                                               [--generate] [--json out.json]

A few minutes for the whole zoo on one core; rows run in child processes of ``--chunk`` rows each
(hundreds of imported model families grow a process), each row limited to ``--row-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conformance import TASKS, task_rows, tiny_config_of  # noqa: E402


class _RowTimeout(Exception):
    pass


def _alarm(*_):
    raise _RowTimeout


def check(class_name: str, generate: bool = False) -> tuple[str, str]:
    """``(step, error)`` of the first step that fails for the class's tiny copy, or ``("", "")``."""
    import torch
    import transformers as tf

    from shardformer.core.tiny import fill_zero_matrices
    from shardformer.models import inputs_for
    from shardformer.tools.verify import _generate, _loss_and_output

    step = "config"
    try:
        config = tiny_config_of(class_name)
        step = "build"
        torch.manual_seed(0)
        model = getattr(tf, class_name)(config)
        fill_zero_matrices(model)
        model.eval()
        step = "inputs"
        inputs = inputs_for(model, 1)
        step = "forward"
        loss, out = _loss_and_output(model, inputs, None, None, None)
        step = "backward"
        (loss if loss is not None else out.float().sum()).backward()
        if generate and callable(getattr(model, "can_generate", None)) and model.can_generate():
            step = "generate"
            _generate(model, inputs)
    except _RowTimeout:
        return step, "timeout"
    except Exception as e:  # noqa: BLE001 - what the row reports
        return step, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return "", ""


def _worker(rows, generate, row_timeout, queue):
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _alarm)
    for row in rows:
        start = time.time()
        signal.alarm(int(row_timeout))
        try:
            step, error = ("import", row["skip"]) if "skip" in row else check(row["class"], generate)
        finally:
            signal.alarm(0)
        queue.put(dict(row, step=step, error=error, seconds=round(time.time() - start, 2)))
    queue.put(None)


def run(rows, generate=False, row_timeout=60, chunk=80, progress=None) -> list[dict]:
    """One result per row: ``step`` (empty when the tiny copy ran) and ``error``."""
    ctx = mp.get_context("spawn")
    done: list[dict] = []
    remaining = list(rows)
    while remaining:
        part = remaining[:chunk]
        queue = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(part, generate, row_timeout, queue))
        proc.start()
        got = 0
        while got < len(part):
            try:
                item = queue.get(timeout=row_timeout + 120)
            except Exception:  # noqa: BLE001 - the child died or hung: its row is reported, the rest rerun
                item = None
            if item is None:
                break
            done.append(item)
            got += 1
            if progress is not None:
                progress(item)
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
        if got < len(part):  # the row it was on crashed the process
            done.append(dict(part[got], step="crash", error=f"the process died (exit code {proc.exitcode})"))
            got += 1
        remaining = remaining[got:]
    return done


def cause(error: str) -> str:
    """The error with its numbers and names blurred, so that rows failing alike count together."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", error)
    text = re.sub(r"\d+", "N", text)
    return text[:110]


def summary(results: list[dict]) -> str:
    failed = [r for r in results if r["step"]]
    lines = [f"{len(results)} classes: {len(results) - len(failed)} ran, {len(failed)} failed"]
    by_step = collections.Counter(r["step"] for r in failed)
    lines.append("by step: " + ", ".join(f"{k} {v}" for k, v in by_step.most_common()))
    lines.append("by cause:")
    for text, n in collections.Counter(f"{r['step']}: {cause(r['error'])}" for r in failed).most_common():
        lines.append(f"  {n:4d}  {text}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="", help=f"comma-separated tasks (default: all): {','.join(TASKS)}")
    parser.add_argument("--only", default="", help="comma-separated model types or class names (default: all)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many classes (after the filters)")
    parser.add_argument("--generate", action="store_true", help="also run greedy generate where the class can")
    parser.add_argument("--row-timeout", type=float, default=60.0, help="seconds one class may take (default 60)")
    parser.add_argument("--chunk", type=int, default=80, help="rows per child process (default 80)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    tasks = set(filter(None, args.task.split(",")))
    rows = task_rows(tasks, set(filter(None, args.only.split(","))))
    rows = rows[: args.limit] if args.limit else rows

    def progress(r: dict) -> None:
        if r["step"]:
            print(f"{r['class']}: {r['step']}: {r['error'][:200]}", file=sys.stderr, flush=True)

    results = run(rows, args.generate, args.row_timeout, args.chunk, progress)
    print(summary(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
