"""``shardformer run``: start a script on N processes per node through torchrun (``torch.distributed.run``).

This module only checks the launch, builds torchrun's argument list and calls torchrun in-process;
torchrun starts, watches and stops the ranks. A rank that fails makes torchrun stop the others, and
the command exits with that rank's exit code after a one-line summary naming it and its error.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import signal
import sys
from contextlib import contextmanager

from shardformer.cli import preflight

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MULTINODE_PORT = 29500
DEFAULT_RDZV_TIMEOUT_S = 300
PROG = "shardformer run"

EPILOG = """\
examples:
  # 2 processes on this machine; a free port is picked for the rendezvous
  shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode train

  # the same on a fixed port (fails at once if the port is taken)
  shardformer run --nproc_per_node 2 --master_port 29500 examples/gpt2/main.py \\
      --config examples/gpt2/config.py --mode inference

  # 2 machines x 2 processes: run this on each machine, --node_rank 0 on the machine at --master_addr
  shardformer run --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 10.0.0.1 --master_port 29500 \\
      main.py --config config.py --mode train

Everything after SCRIPT goes to the script untouched. Before any process starts, the launcher checks
that SCRIPT exists, that the script's --config file exists and that its parallel sizes fit the number
of processes (world = tensor_parallel_size x pipeline_parallel_size x data_parallel_size), and that
--master_port is free on node 0. The exit status is 0 when every rank succeeds, else the exit code of
the first rank that failed.

environment: OMP_NUM_THREADS defaults to cores / nproc_per_node; SHARDFORMER_TIMEOUT_S (set by
--timeout) bounds every collective, so a lost peer ends the job instead of hanging it."""


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run",
        prog=PROG,
        help="run a script on N processes per node (torchrun underneath)",
        description="Run SCRIPT on --nproc_per_node processes per node, with torchrun underneath.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("processes")
    where.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        type=_int_at_least(1),
        default=1,
        metavar="N",
        help="processes on this node (default: 1)",
    )
    where.add_argument("--nnodes", type=_int_at_least(1), default=1, metavar="N", help="number of nodes (default: 1)")
    where.add_argument(
        "--node_rank",
        "--node-rank",
        type=_int_at_least(0),
        default=0,
        metavar="R",
        help="this node's rank, 0..nnodes-1 (default: 0)",
    )
    rdzv = parser.add_argument_group("rendezvous")
    rdzv.add_argument(
        "--master_addr",
        "--master-addr",
        default=DEFAULT_MASTER_ADDR,
        metavar="ADDR",
        help=f"address of node 0, the same on every node (default: {DEFAULT_MASTER_ADDR})",
    )
    rdzv.add_argument(
        "--master_port",
        "--master-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"port on node 0 (default: a free port on one node, {DEFAULT_MULTINODE_PORT} with --nnodes > 1)",
    )
    rdzv.add_argument(
        "--rdzv_timeout",
        "--rdzv-timeout",
        type=_positive_float,
        default=DEFAULT_RDZV_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long nodes wait for each other at start (default: {DEFAULT_RDZV_TIMEOUT_S})",
    )
    other = parser.add_argument_group("other")
    other.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="process-group timeout for every collective (sets SHARDFORMER_TIMEOUT_S; default: 300)",
    )
    other.add_argument(
        "--dry-run", "--dry_run", action="store_true", help="check and print the torchrun command, start nothing"
    )
    other.add_argument("-v", "--verbose", action="store_true", help="show torchrun's own log lines")
    parser.add_argument("script", metavar="SCRIPT", help="Python script to run on every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for SCRIPT")
    parser.set_defaults(func=run_command)
    return parser


def rendezvous_port(args: argparse.Namespace) -> int | None:
    """The port node 0 listens on; ``None`` on one node without --master_port: the OS picks one."""
    if args.master_port is not None:
        return args.master_port
    return DEFAULT_MULTINODE_PORT if args.nnodes > 1 else None


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """torchrun's arguments for this launch; each rank runs ``python -m shardformer.cli.rank_entry SCRIPT ...``."""
    argv = ["--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node), "--max-restarts", "0"]
    port = rendezvous_port(args)
    if port is None:
        # torchrun's standalone mode: a local c10d store on a port the OS picks, so jobs never collide.
        argv += ["--standalone", "--rdzv-conf", f"join_timeout={int(args.rdzv_timeout)}"]
    else:
        argv += ["--rdzv-backend", "static", "--master-addr", args.master_addr, "--master-port", str(port)]
        argv += ["--node-rank", str(args.node_rank), "--rdzv-conf", f"timeout={int(args.rdzv_timeout)}"]
    argv += ["--module", "shardformer.cli.rank_entry", args.script, *args.script_args]
    return argv


def _check(args: argparse.Namespace) -> None:
    preflight.check_layout(args.nproc_per_node, args.nnodes, args.node_rank)
    preflight.check_script(args.script)
    config = preflight.load_script_config(args.script_args)
    if config is not None:
        preflight.check_sizes(config, args.nnodes, args.nproc_per_node, preflight.sizes_from_set(args.script_args))
    port = rendezvous_port(args)
    if port is not None and args.node_rank == 0:
        preflight.check_port(port, args.nnodes)


def _set_rank_env(args: argparse.Namespace) -> None:
    """Environment every rank inherits: bounded collectives and no CPU oversubscription."""
    if args.timeout is not None:
        os.environ["SHARDFORMER_TIMEOUT_S"] = str(args.timeout)
    else:
        from shardformer.core.mesh import (
            DEFAULT_TIMEOUT_S,  # deferred: imports torch (seconds); pre-flight errors come first
        )

        os.environ.setdefault("SHARDFORMER_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // args.nproc_per_node)))


def run_command(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except preflight.LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    argv = torchrun_argv(args)
    if args.dry_run:
        print("torchrun " + shlex.join(argv))
        return 0
    _set_rank_env(args)
    if args.nnodes > 1:
        # Without this line a node waiting for the others looks hung.
        print(
            f"{PROG}: node {args.node_rank} of {args.nnodes} meeting at {args.master_addr}:{rendezvous_port(args)} "
            f"(waits up to {args.rdzv_timeout:g} s for the other nodes)",
            file=sys.stderr,
            flush=True,
        )
    return launch(argv, world_size=args.nnodes * args.nproc_per_node, verbose=args.verbose)


class _DropTorchrunChatter(logging.Filter):
    """torchrun logs every stop and failure at length; the summary below says it in one line."""

    NAMES = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL or not record.name.startswith(self.NAMES)


@contextmanager
def _quiet_torchrun(enabled: bool):
    handlers = {h for name in ("torch", "torch.distributed", "") for h in logging.getLogger(name).handlers}
    chatter = _DropTorchrunChatter()
    if enabled:
        for handler in handlers:
            handler.addFilter(chatter)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(chatter)


def launch(argv: list[str], world_size: int, verbose: bool = False) -> int:
    """Call torchrun with ``argv`` in this process; return the job's exit status."""
    # deferred: torch takes seconds to import, and every pre-flight check runs before it
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    with _quiet_torchrun(not verbose):
        try:
            run(parse_args(argv))
        except ChildFailedError as exc:
            if all_finished(exc):  # the ranks' work is done: a teardown crash is not the run's failure
                print(finished_note(exc, world_size), file=sys.stderr)
                return 0
            summary, code = summarize_failure(exc, world_size)
            print(summary, file=sys.stderr)
            return code
        except SignalException as exc:
            print(f"{PROG}: stopped by {signal.Signals(exc.sigval).name}; the ranks were stopped", file=sys.stderr)
            return 128 + int(exc.sigval)
        except (RendezvousError, dist.DistError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"{PROG}: error: the processes could not meet ({type(exc).__name__}): {first}", file=sys.stderr)
            return 1
    return 0


def _error_text(failure, limit: int = 300) -> str:
    """The failed rank's exception as ``Type: message`` (first line), or '' when it left none."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or message.startswith("To enable traceback"):
        return ""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _own_code(failure) -> int:
    """The rank's own exit status. One that recorded its failure (rank_entry) and then died by a signal
    during its teardown (torchrun's SIGTERM, a peer's failure having reached torchrun first; an abort in
    a library's threads) had already failed with the status in its record (1 for an exception)."""
    if failure.exitcode < 0 and _recorded_ns(failure) is not None:
        return int(_extra(failure).get("exit_code", 1))
    return failure.exitcode


def _how(failure) -> str:
    code = _own_code(failure)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _extra(failure) -> dict:
    info = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
    extra = info.get("extraInfo", {}) if isinstance(info, dict) else {}
    return extra if isinstance(extra, dict) else {}


def _recorded_ns(failure) -> int | None:
    """When the rank's own exception was recorded (by rank_entry), in ns, or None."""
    extra = _extra(failure)
    return int(extra["time_ns"]) if "time_ns" in extra else None


def _stopped(failure) -> bool:
    """Stopped by torchrun (SIGTERM) before failing on its own (no exception recorded)."""
    return failure.exitcode == -signal.SIGTERM and _recorded_ns(failure) is None


def _failure_time(failure) -> tuple[int, int]:
    """Sort key: when it failed (ns when rank_entry recorded it); ranks stopped by torchrun come last
    (one that recorded its own exception and was stopped while exiting failed when it recorded it)."""
    recorded = _recorded_ns(failure)
    return int(_stopped(failure)), recorded if recorded is not None else int(failure.timestamp * 1_000_000_000)


def all_finished(exc) -> bool:
    """Every rank torchrun reports failed had returned from its script (rank_entry's record) and then
    died by a signal: an abort in a library's native threads during the interpreter's teardown
    ("terminate called without an active exception"), or torchrun stopping a rank that was exiting."""
    return all(f.exitcode < 0 and "finished_ns" in _extra(f) for f in exc.failures.values())


def finished_note(exc, world_size: int) -> str:
    died = ", ".join(f"rank {r} ({_how(exc.failures[r])})" for r in sorted(exc.failures))
    return (
        f"{PROG}: every rank of {world_size} finished its script; {died} then died in the interpreter's "
        f"teardown, after its work was done: exit status 0"
    )


_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _stuck_line(rank: int, error: str, exc, world_size: int) -> str | None:
    """When the first failure is a collective's timeout, the ranks still running then (stopped by
    torchrun, not failed on their own) are the ones it waited for: name them, not the waiting rank."""
    if not _TIMEOUT.search(error):
        return None
    running = sorted(r for r, f in exc.failures.items() if _stopped(f))
    if not running:
        return None
    who = f"rank {running[0]}" if len(running) == 1 else f"one of ranks {', '.join(map(str, running))}"
    return (
        f"{PROG}: {who} of {world_size} stopped making progress: rank {rank} timed out waiting for it in a "
        f"collective ({error})"
    )


def summarize_failure(exc, world_size: int) -> tuple[str, int]:
    """A few lines naming the first rank that failed and its error (or, when it timed out waiting in a
    collective, the ranks it waited for), and the exit status to return."""
    rank = min(exc.failures, key=lambda r: _failure_time(exc.failures[r]) + (r,))
    failure = exc.failures[rank]
    error = _error_text(failure)
    stuck = _stuck_line(rank, error, exc, world_size)
    lines = [stuck or f"{PROG}: rank {rank} of {world_size} failed ({_how(failure)})" + (f": {error}" if error else "")]
    for other in sorted(r for r in exc.failures if r != rank):
        f = exc.failures[other]
        if _stopped(f):
            continue  # stopped by torchrun because of the first failure
        text = _error_text(f, limit=120)
        lines.append(f"{PROG}: rank {other} also failed ({_how(f)})" + (f": {text}" if text else ""))
    lines.append(f"{PROG}: the other ranks were stopped; the ranks' own output above has the details")
    code = _own_code(failure)
    code = code if code > 0 else (128 - code if code < 0 else 1)
    return "\n".join(lines), code
