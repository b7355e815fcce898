"""Run a function on N gloo ranks in fresh processes, for tests and small scripts.

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` spawned processes joined by a
process group on a free port, calls ``fn(*args)`` in each, and returns the per-rank results.
Any rank's exception is re-raised here with that rank's traceback; ranks still running after
``timeout`` seconds are killed and a ``TimeoutError`` names them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


# Ranks fork from a server process that imported these once, instead of each importing them anew
# (about 4 s of CPU per rank on a 2-core machine: most of a small test's time).
_PRELOAD = ["torch", "torch.distributed", "transformers", "shardformer"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(fn, rank, world_size, port, results, threads, env, args, kwargs):
    # The fork server started with the environment of the first call: take the caller's of now.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        timeout = timedelta(seconds=float(os.environ.get("SHARDFORMER_TIMEOUT_S", 120)))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        out = fn(*args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    threads_per_rank: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` and its arguments must be picklable (a module-level function), since ranks are spawned.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    # The parent hosts the rendezvous store on a port the OS picks: no race for a "free" port.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = _context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, store.port, results, threads, dict(os.environ), args, kwargs),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(outputs) + len(errors) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
                (outputs if status == "ok" else errors)[rank] = payload
                if errors:
                    break  # one failed rank is enough: the others may be waiting on it forever
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
            if dead:
                time.sleep(0.5)  # give its traceback a moment to arrive
                while not results.empty():
                    rank, status, payload = results.get()
                    (outputs if status == "ok" else errors)[rank] = payload
                for r in dead:
                    errors.setdefault(r, f"rank {r} exited with code {procs[r].exitcode} and no traceback")
                break
            if time.monotonic() > deadline:
                hung = [r for r in range(world_size) if r not in outputs and r not in errors]
                raise TimeoutError(f"ranks {hung} of {world_size} did not finish within {timeout:.0f} s; killed")
        finished = not errors
    finally:
        for p in procs:
            if finished:
                p.join(timeout=10)  # ranks are tearing down their process group
            if p.is_alive():
                p.kill()
            p.join()
        results.close()
        del store

    if errors:
        first = min(errors)
        others = f" (ranks {sorted(errors)} failed)" if len(errors) > 1 else ""
        raise RankError(f"rank {first} of {world_size} failed{others}:\n{errors[first]}")
    return [outputs[r] for r in range(world_size)]


def _run_named_checks(checks):
    results = {}
    for check in checks:
        try:
            check()
            results[check.__name__] = None
        except Exception:  # noqa: BLE001 - reported per check to the parent
            results[check.__name__] = traceback.format_exc()
            # Stop here: peers may be waiting in a collective this rank will never join; leaving makes
            # their collectives fail at once (connection closed) instead of at the timeout.
            break
    return results


def run_checks(checks: list[Callable[[], None]], world_size: int, timeout: float = 240.0) -> dict[str, str | None]:
    """Run many module-level check functions in ONE spawn of ``world_size`` ranks.

    Returns ``{check name: None if it passed on every rank, else the first failing rank's
    traceback}``; a rank stops at its first failing check, and checks it never ran are reported
    as not run, so a test module can report each check as its own test while paying for one
    process start. Checks run in order on every rank and must issue the same collectives.
    """
    merged: dict[str, str | None] = {}
    for rank, results in enumerate(run_on_ranks(_run_named_checks, world_size, checks, timeout=timeout)):
        for check in checks:
            name = check.__name__
            error = results.get(name, "not run: an earlier check failed on this rank")
            if merged.get(name) is None:
                merged[name] = None if error is None else f"rank {rank}:\n{error}"
    return merged
