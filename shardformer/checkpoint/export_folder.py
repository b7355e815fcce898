"""The folder protocol of a HuggingFace export: written beside the target, swapped in as a whole.

An export writes into ``<path>.tmp-<token>``. Files of the folder it replaces that it does not
write itself (a tokenizer, notes, a ``model_best.safetensors``) are carried over as hard links
(copies where links are impossible); the weights and index of the earlier export are not. Then the
folder takes the name ``path`` by the two renames a training checkpoint uses
(`shardformer.checkpoint.commit.swap`). A crash at any instant leaves the earlier export
whole, the new one whole, or, between the two renames, no ``path`` and both folders: the next
export renames the new one back (``<path>.old-<token>`` beside ``<path>.tmp-<token>`` means the
latter was complete) and removes the leftovers of crashed exports.
"""

from __future__ import annotations

import os
import shutil
import uuid

from shardformer.checkpoint import commit
from shardformer.checkpoint.errors import CheckpointError


def _recover(path: str) -> None:
    """Finish a swap that a crash interrupted between its two renames."""
    if os.path.lexists(path):
        return
    olds = {d.rsplit("-", 1)[1] for d in commit.siblings(path, "old")}
    for tmp in commit.siblings(path, "tmp"):
        if tmp.rsplit("-", 1)[1] in olds:  # the old folder moved aside only once this one was complete
            os.rename(tmp, path)
            return


def target(path) -> str:
    """The absolute folder an export to ``path`` replaces."""
    full = commit.checked_path(path)
    if os.path.islink(full):  # the folder the link points to is replaced; the link stays
        full = commit.checked_path(os.path.realpath(full))
    return full


def prepare(full: str) -> str:
    """Global rank 0, holding the path's save lock, before an export: a new empty folder to write into."""
    _recover(full)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise CheckpointError(f"{full} exists and is not a folder; export to a folder")
    for leftover in commit.siblings(full, "tmp") + commit.siblings(full, "old"):
        commit.discard(leftover)
    tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    if os.path.isdir(full):
        shutil.copymode(full, tmp)
    return tmp


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def finish(tmp: str, path: str, replaced) -> None:
    """Carry over ``path``'s entries the export neither wrote nor ``replaced(name)``, then swap ``tmp`` in."""
    for name in os.listdir(tmp):  # what the export wrote, on disk before the folder is swapped in
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            src, dst = os.path.join(path, name), os.path.join(tmp, name)
            if os.path.lexists(dst) or replaced(name):
                continue
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(src, dst)
    commit.swap(tmp, path)


def abandon(tmp: str, path: str) -> None:
    """Remove the folder of a failed export, unless the swap began (``path`` moved aside: ``tmp`` is
    then the complete new export, which the next export puts in place)."""
    if os.path.isdir(tmp) and not os.path.lexists(f"{path}.old-{tmp.rsplit('-', 1)[1]}"):
        commit.discard(tmp)
