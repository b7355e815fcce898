"""Does the tiny-model recipe build and run every class the conformance sweep covers?

Every proof runs on a tiny copy (``shardformer.core.tiny.tiny_copy_config``), so a class whose tiny
copy cannot be built or run cannot be sharded. This walks the rows of ``sweeps/conformance.py``
(the same tasks and filters), and for each class, in one process and without sharding: scales its
default config down, builds the model, makes inputs (``shardformer.models.inputs_for``) and runs
forward and backward (and greedy ``generate`` with ``--generate``). One line per class that fails,
then the failures counted by step and by cause.

    .venv/bin/python sweeps/tiny_copies.py [--task causal-lm] [--only llama,codegen] [--limit 50]
                                               [--generate] [--json out.json]

A few minutes for the whole zoo on one core; rows run through the sweeps' row runner (``sweeps/rows.py``)
on one rank, ``--chunk`` rows a process (hundreds of imported model families grow a process), each row
within ``--row-timeout`` seconds (past it, the process is killed and the row is an error naming the budget).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from sweeps.rows import NOT_TESTED, PASSED, add_budget_flags, run_rows, set_reason  # noqa: E402
from sweeps.zoo import add_filters, chosen_rows, unsharded_failure  # noqa: E402


def check_row(row: dict, generate: bool = False) -> None:
    """The row runner's check: passed, or not tested with the step that failed (``step``) and why."""
    failure = unsharded_failure(row["class"], generate=generate)
    if failure is None:
        row.update(result=PASSED, reason="")
    else:
        row["step"] = failure[0]
        set_reason(row, NOT_TESTED, f"{failure[0]}: {failure[1]}", 300)


def cause(error: str) -> str:
    """The error with its numbers and names blurred, so that rows failing alike count together."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", error)
    text = re.sub(r"\d+", "N", text)
    return text[:110]


def summary(results: list[dict]) -> str:
    failed = [r for r in results if r["result"] != PASSED]
    lines = [f"{len(results)} classes: {len(results) - len(failed)} ran, {len(failed)} failed"]
    # the step that failed; an error row (a crash, or past its budget) and a class not importable have none
    step = {id(r): r.get("step") or ("import" if r["result"] == NOT_TESTED else r["result"]) for r in failed}
    by_step = collections.Counter(step[id(r)] for r in failed)
    lines.append("by step: " + ", ".join(f"{k} {v}" for k, v in by_step.most_common()))
    lines.append("by cause:")
    causes = (f"{step[id(r)]}: {cause(r['reason'].removeprefix(str(r.get('step')) + ': '))}" for r in failed)
    for text, n in collections.Counter(causes).most_common():
        lines.append(f"  {n:4d}  {text}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_filters(parser)
    parser.add_argument("--generate", action="store_true", help="also run greedy generate where the class can")
    add_budget_flags(parser, 60.0)
    parser.add_argument("--chunk", type=int, default=80, help="rows per child process (default 80)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    rows = chosen_rows(args, parser)

    def progress(r: dict) -> None:
        if r["result"] != PASSED:
            print(f"{r['class']}: {r['reason'][:200]}", file=sys.stderr, flush=True)

    check = functools.partial(check_row, generate=args.generate)
    results = run_rows(
        rows,
        check,
        world=1,
        budget=args.row_timeout,
        memory_gib=args.row_memory,
        progress=progress,
        rows_per_spawn=args.chunk,
    )
    print(summary(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
