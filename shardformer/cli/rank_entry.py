"""What torchrun starts on each rank under ``shardformer run``: ``python -m shardformer.cli.rank_entry SCRIPT ARGS``.

It runs SCRIPT as ``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``, the script's folder on
``sys.path``). If the script raises (or exits with a status other than 0), the exception and the exit
status go into torchelastic's per-rank error file, so the launcher can name the failed rank, its error
and its own exit status in one line instead of "no traceback available" (or torchrun's SIGTERM, when
torchrun stopped the rank while its teardown was still running).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m shardformer.cli.rank_entry SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` does
    try:
        runpy.run_path(script, run_name="__main__")
        _record_finished()
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)  # as Python exits
        _record(exc, code) if code != 0 else _record_finished()
        raise
    except BaseException as exc:
        _record(exc, 1)
        tb = exc.__traceback__
        # Drop this shim's and runpy's frames: the traceback starts in the user's script.
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        tb = tb or exc.__traceback__
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb  # as for an uncaught exception
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        raise SystemExit(1) from None


def _record_finished() -> None:
    """The script returned: a signal after this (an abort in a library's threads during the
    interpreter's teardown, torchrun stopping a rank that was exiting) ends no work of the rank.
    torchrun reads the file only for a rank that fails."""
    now = time.time_ns()
    info = {"py_callstack": "", "timestamp": str(now // 1_000_000_000), "finished_ns": str(now)}
    _write({"message": {"message": "", "extraInfo": info}})


def _write(data: dict) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:
        pass  # the report is a courtesy; the exit code carries the failure


def _record(exc: BaseException, exit_code: int) -> None:
    """Write torchelastic's error-file JSON (what its ``@record`` writes), plus a nanosecond time and
    the exit status the rank is about to exit with.

    torchelastic orders failures by whole seconds; a peer that fails in the same second because this
    rank died ("connection closed by peer") would tie. The finer time lets the launcher name the cause.
    The status is the rank's own even when torchrun stops the rank (SIGTERM) during its teardown.
    """
    now = time.time_ns()
    _write(
        {
            "message": {
                "message": f"{type(exc).__name__}: {exc}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(now // 1_000_000_000),
                    "time_ns": str(now),
                    "exit_code": str(exit_code),
                },
            }
        }
    )


if __name__ == "__main__":
    main()
