"""The one row runner of the sweeps: each row checked on gloo ranks in child processes, within a time budget.

A sweep is a list of rows (dicts: a model class, a technique, a config flip, ...) and a check: a
module-level function that fills a row on every rank (``result``, ``reason`` and what it measured).
:func:`run_rows` runs the rows in fresh processes, ``rows_per_spawn`` at a time (hundreds of imported
model families grow a process past 10 GB over the zoo): a supervisor child, in a session of its own,
starts the ranks (``shardformer.tools.testing.run_on_ranks``), and rank 0 writes a line when a row
starts and one when it ends. The parent reads those lines. A row still running after its budget has the
whole session killed from the parent (SIGKILL works whatever the row is doing; a timer or an alarm
inside the rank waits for a C call that holds the GIL) and becomes an ``error`` row naming the budget;
so does a row during which one of the spawn's processes grows past its memory budget (resident memory,
read by the parent every poll: a row that swaps the machine to a halt is stopped, and what it held is freed);
a crash becomes an ``error`` row with the crash's last line. Either way the sweep goes on in a fresh
spawn after that row.

Every row :func:`run_rows` returns carries a :class:`Verdict` beside its own keys.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import TypedDict

import psutil

from shardformer.tools.testing import run_on_ranks
from sweeps.saved import append_line

# what a row's result can be
PASSED, REFUSED, FAILED, NOT_TESTED, ERROR = "passed", "refused", "failed", "not tested", "error"
# refused with a reason, but by the first training step, not when the engine was built
REFUSED_AT_STEP = "refused at step"
# the class draws random numbers in its training forward beyond dropout (PhiMoE's sampled routing): two
# unsharded runs from the same weights with other RNG seeds differ as well, so the comparison cannot decide
RANDOM_IN_TRAINING = "random in training"
RESULTS = (PASSED, REFUSED, REFUSED_AT_STEP, FAILED, RANDOM_IN_TRAINING, NOT_TESTED, ERROR)
NOT_APPLICABLE = "n/a"  # a technique that does not apply to the row's class (ep without experts)

ROWS_PER_SPAWN = 100
MEMORY_GIB = 8.0  # the resident memory one process of a spawn may reach (its ranks grow over 100 rows)
STARTUP_S = 300.0  # the ranks' start (imports, process group) before the first row's budget begins
POLL_S = 0.5


class Verdict(TypedDict, total=False):
    """What the runner adds to every row."""

    result: str  # one of RESULTS (or NOT_APPLICABLE)
    reason: str  # why, on one line, cut short ("" when passed)
    detail: str  # the whole reason, where ``reason`` is cut
    seconds: float  # the row's time on the ranks (its budget, for a row killed at it)


class NotTested(Exception):
    """Raised by a check: nothing of the library was tested (the tiny model cannot be built, or does not run)."""


def set_reason(row: dict, result: str, text: str, limit: int = 200) -> None:
    """``result`` with its reason on one line: the first ``limit`` characters, the whole as ``detail``."""
    text = " ".join(text.split())
    row.update(result=result, reason=text[:limit])
    if len(text) > limit:
        row["detail"] = text[:4000]


def reason_first(text: str) -> str:
    """A refusal as a row holds it: its reason, then its fix (the library prints the fix first)."""
    fix, newline, reason = text.partition("\n")
    return f"{reason} (fix: {fix})" if newline else text


# -- on the ranks -------------------------------------------------------------------------------------


def _each_row(rows, out_path, check, precheck) -> None:
    """On every rank: ``precheck(row)``, then ``check(row)`` where the precheck left no result; rank 0
    writes ``{"started": index}`` before a row and ``{"row": row}`` after it."""
    import torch.distributed as dist

    first = dist.get_rank() == 0
    for index, row in enumerate(rows):
        row = dict(row)
        if first:
            append_line(out_path, {"started": index})
        start = time.monotonic()
        try:
            if precheck is not None:
                precheck(row)
            if "result" not in row:
                check(row)
        except NotTested as e:
            set_reason(row, NOT_TESTED, str(e))
        except Exception:  # noqa: BLE001 - a crash of the check is the row's result
            set_reason(row, ERROR, traceback.format_exc().strip().splitlines()[-1], 300)
        row["seconds"] = round(time.monotonic() - start, 1)
        dist.barrier()  # ranks stay in step: a rank that fails alone shows as a timeout here
        if first:
            append_line(out_path, {"row": row})


def _supervise(rows, out_path, check, precheck, world, timeout) -> None:
    """The spawn's parent: a session of its own, so that one signal ends it, its ranks and their fork server."""
    os.setsid()
    try:
        run_on_ranks(_each_row, world, rows, out_path, check, precheck, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - reported on the row the ranks were on
        last = (str(e).strip().splitlines() or [""])[-1]
        append_line(out_path, {"crash": f"{type(e).__name__}: {last[:200]}"})


# -- in the parent ------------------------------------------------------------------------------------


def run_rows(
    rows: list[dict],
    check: Callable[[dict], None],
    precheck: Callable[[dict], None] | None = None,
    *,
    world: int = 2,
    budget: float = 300.0,
    memory_gib: float = MEMORY_GIB,
    progress: Callable[[dict], None] | None = None,
    rows_per_spawn: int = ROWS_PER_SPAWN,
) -> list[dict]:
    """Each row checked on ``world`` ranks (``check`` and ``precheck`` module-level: they are pickled), with
    ``budget`` seconds a row and ``memory_gib`` of resident memory a process; the rows with their
    :class:`Verdict`, ``progress(row)`` called as each ends. A row holding ``skip`` (a reason) is not tested
    without a spawn."""
    os.environ.setdefault("SHARDFORMER_TIMEOUT_S", "120")  # a collective waiting on a dead peer fails in 2 minutes
    done: list[dict] = []

    def report(row: dict) -> None:
        done.append(row)
        if progress is not None:
            progress(row)

    for row in rows:
        if "skip" in row:
            report({k: v for k, v in row.items() if k != "skip"} | {"result": NOT_TESTED, "reason": row["skip"]})
    remaining = [r for r in rows if "skip" not in r]
    while remaining:
        finished, stopped = _spawn(remaining[:rows_per_spawn], check, precheck, world, (budget, memory_gib), report)
        remaining = remaining[finished:]
        if stopped is not None and remaining:
            report(dict(remaining.pop(0), **stopped))
    return done


def _spawn(chunk, check, precheck, world, budgets, report) -> tuple[int, dict | None]:
    """One spawn over ``chunk``: how many rows finished, and the verdict of the row it stopped on (None
    when it finished them all). ``budgets``: (seconds a row, GiB a process)."""
    budget, memory_gib = budgets
    fd, out_path = tempfile.mkstemp(prefix="sf-sweep-", suffix=".jsonl")
    os.close(fd)
    backstop = budget * len(chunk) + STARTUP_S  # run_on_ranks' own limit; the parent's budget comes first
    process = mp.get_context("spawn").Process(
        target=_supervise, args=(chunk, out_path, check, precheck, world, backstop)
    )
    process.start()
    finished, offset, stopped = 0, 0, None
    started, deadline = False, time.monotonic() + STARTUP_S
    try:
        while finished < len(chunk) and stopped is None:
            alive = process.is_alive()  # before reading: what it wrote before it exited is read
            lines, offset = _new_lines(out_path, offset)
            for line in lines:
                if "started" in line:
                    started, deadline = True, time.monotonic() + budget
                elif "row" in line:  # the time until the next row's start is that row's
                    finished, deadline = finished + 1, time.monotonic() + budget
                    report(line["row"])
                else:
                    stopped = {"result": ERROR, "reason": line["crash"]}
            if stopped is None and finished < len(chunk) and not alive:
                stopped = {"result": ERROR, "reason": f"the ranks exited (code {process.exitcode}) without a result"}
            elif stopped is None and finished < len(chunk) and time.monotonic() > deadline:
                stopped = _over_budget(started, budget)
                _kill(process)
            elif stopped is None and finished < len(chunk) and _largest_rss_gib(process.pid) > memory_gib:
                stopped = _over_memory(memory_gib, time.monotonic() - deadline + budget)
                _kill(process)
            if stopped is None and finished < len(chunk):
                time.sleep(POLL_S)
    finally:
        if process.is_alive() and finished < len(chunk):  # killed at a budget, or the parent interrupted
            _kill(process)
        process.join(timeout=60)  # the ranks tear their process group down
        if process.is_alive():
            _kill(process)
        os.remove(out_path)
    return finished, stopped


def _over_budget(started: bool, budget: float) -> dict:
    if not started:
        return {"result": ERROR, "reason": f"the ranks did not start within {STARTUP_S:g} s: they were killed"}
    return {
        "result": ERROR,
        "reason": f"no result within the row budget of {budget:g} s (--row-timeout): the ranks were killed",
        "seconds": budget,
    }


def _over_memory(memory_gib: float, seconds: float) -> dict:
    return {
        "result": ERROR,
        "reason": f"a rank grew past the memory budget of {memory_gib:g} GiB (--row-memory): the ranks were killed",
        "seconds": round(seconds, 1),
    }


def _largest_rss_gib(pid: int) -> float:
    """The largest resident memory among ``pid`` and its descendants (the supervisor, the ranks, their fork
    server), in GiB; 0 for processes gone while reading."""
    try:
        tree = [psutil.Process(pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    largest = 0
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            largest = max(largest, proc.memory_info().rss)
    return largest / 2**30


def add_budget_flags(parser, seconds: float = 300.0) -> None:
    """``--row-timeout`` and ``--row-memory``, the two budgets of a row, on a sweep's command line."""
    parser.add_argument(
        "--row-timeout", type=float, default=seconds, help=f"seconds one row may take (default {seconds:g})"
    )
    parser.add_argument(
        "--row-memory",
        type=float,
        default=MEMORY_GIB,
        help=f"GiB of resident memory one rank may reach during a row (default {MEMORY_GIB:g})",
    )


def _kill(process) -> None:
    """SIGKILL to the supervisor's session: it, the ranks and their fork server."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet in a session of its own
        process.kill()
    process.join()


def _new_lines(path: str, offset: int) -> tuple[list[dict], int]:
    """The whole lines written to ``path`` after ``offset``, and the offset after them."""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read()
    end = text.rfind(b"\n") + 1
    return [json.loads(line) for line in text[:end].splitlines() if line.strip()], offset + end
