"""One save at a time per path: a lock that another job's save finds, and that dies with its holder.

A save (checkpoint or export) holds an exclusive ``flock`` on ``<path>.lock`` from before it clears
leftovers until its folder is in place. Without it, a second job saving to the same path took the
first one's live ``<path>.tmp-<token>`` for a crashed save's leftover and deleted it. The kernel
drops the lock when its process dies, so a crashed save never blocks the next one; the file names
the holder (pid and host) for the error, and is removed when the save ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

from shardformer.checkpoint.errors import CheckpointError


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if text:
            return text
    return "a process that has not written its name yet"


@contextlib.contextmanager
def save_lock(path: str):
    """Hold the lock of ``path`` (an absolute path) for the body; raise if another save holds it."""
    file = f"{path}.lock"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointError(
                f"{path} is being saved by another job ({holder}; lock {file}); wait for that save to "
                "finish, or save to another path"
            ) from None
        try:  # the holder we waited for may have removed the file: the lock counts only on the one at `file`
            current = os.stat(file, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)  # while still held: a save that opens it now finds it gone and retries
        os.close(fd)
