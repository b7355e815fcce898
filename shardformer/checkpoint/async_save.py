"""Asynchronous saves of training checkpoints: the state staged to CPU, the write in a background thread.

`save_checkpoint(..., async_save=True)` copies what this rank saves to CPU memory and returns a
`SaveHandle`; a thread then writes, checksums and commits it exactly as a synchronous save does (the
folder appears at its path complete, or not at all). Its collectives run on a gloo group of their own,
made once with a timeout (`save_group`): sharing a group with the training loop's collectives (a
barrier) deadlocks, since the two threads issue theirs in different orders on different ranks; the
timeout ends a save whose peer died instead of hanging. At most one save is in flight per process:
the next save, and any load, first waits for it (`wait_for_previous`).

torch's ``dcp.async_save`` runs only DCP's write in its thread; the checksums, the manifest and the
rename that commit the folder must follow it in the same background work, so this is a plain thread.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.pieces import staged_copy

TIMEOUT_ENV = "SHARDFORMER_SAVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0  # one collective may wait for the slowest rank's whole write

_groups: dict[int, object] = {}  # the default group's id -> its save group
_in_flight: SaveHandle | None = None


class SaveHandle:
    """A save running in the background; `wait` blocks until it is committed (or raises why it is not)."""

    def __init__(self, path: str, work, release) -> None:
        self.path, self._error, self._reported = path, None, False
        self._thread = threading.Thread(target=self._run, args=(work, release), name=f"save {path}")
        self._thread.start()  # not a daemon: a process that exits normally finishes its save first

    def _run(self, work, release) -> None:
        try:
            work()
        except Exception as e:  # noqa: BLE001 - handed to wait()
            self._error = e if isinstance(e, CheckpointError) else CheckpointError(f"{type(e).__name__}: {e}")
        finally:
            release()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the checkpoint is committed; raise its `CheckpointError` if it failed (the previous
        checkpoint at the path is then untouched)."""
        self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error


def wait_for_previous() -> None:
    """Wait for this process's save in flight, if any; raise its error unless `SaveHandle.wait` did."""
    global _in_flight
    handle, _in_flight = _in_flight, None
    if handle is None:
        return
    seen = handle._reported
    try:
        handle.wait()
    except CheckpointError as e:
        if not seen:
            raise CheckpointError(f"the asynchronous save to {handle.path} failed: {e}") from None


def start(path: str, work, release) -> SaveHandle:
    """Run ``work`` (the rest of a save) in the background; ``release`` after it, whatever happens."""
    global _in_flight
    _in_flight = SaveHandle(path, work, release)
    return _in_flight


def save_group():
    """The gloo group every rank's save thread talks on (None without torch.distributed); collective the
    first time, on every rank."""
    if not dist.is_initialized():
        return None
    key = id(dist.group.WORLD)
    if key not in _groups:
        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
        _groups[key] = dist.new_group(backend="gloo", timeout=timeout)
    return _groups[key]


def staged(state):
    """A copy on CPU of ``state`` (nested dicts of tensors, DCP chunk views kept as such)."""
    if isinstance(state, dict):
        return {k: staged(v) for k, v in state.items()}
    return staged_copy(state) if torch.is_tensor(state) else state
