"""The folder protocol of a training checkpoint: what may be replaced, how a save commits, how a crash recovers.

A checkpoint is a folder only shardformer writes. A save writes every file into ``<path>.tmp-<token>``;
when every rank has finished, global rank 0 writes the manifest ``meta.json`` (each file's size and
sha256, and the sha256 of the manifest itself) into it with one atomic rename: a folder holding a manifest is complete, one without it is
not. Then the folder takes the name ``path`` in two renames (the previous checkpoint to
``<path>.old-<token>``, the new one to ``path``) and the old one is deleted, manifest first.

A crash at any instant therefore leaves either ``path`` complete, or no ``path`` and a complete folder
under a temporary name (between the two renames): `recover` (run by the next save and load)
renames the newest complete one back to ``path``. Leftovers of crashed saves are removed by the next save.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid

from shardformer.checkpoint import typed_json
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import SafeFile

META = "meta.json"
FORMAT = "shardformer-checkpoint/4"  # /4: tensors through torch.distributed.checkpoint, under HF names
_UNCHECKED = "shardformer-checkpoint/2"  # written before manifests had a checksum
CHECKSUM = "manifest_sha256"
_LEGACY = "shardformer-checkpoint/1"  # no manifest: replaceable when it holds only its own file names
_LEGACY_FILES = re.compile(r"(meta\.json|model-pp\d+-tp\d+\.safetensors|rank\d+\.(safetensors|json))$")


def checked_path(path, replacing: bool = True) -> str:
    """The absolute checkpoint path; to save, refusing the ones whose replacement would destroy a working tree."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).strip():
        raise CheckpointError(
            f"checkpoint path {path!r} is empty; name a folder of its own, e.g. 'checkpoints/step-100'"
        )
    full = os.path.abspath(os.fspath(path))
    cwd = os.getcwd()
    if not replacing:
        return full
    if full == os.path.dirname(full) or cwd == full or cwd.startswith(full.rstrip(os.sep) + os.sep):
        raise CheckpointError(
            f"checkpoint path {path!r} is {full}, the working directory or one of its parents; "
            "a checkpoint replaces its folder, so give it a folder of its own, e.g. 'checkpoints/step-100'"
        )
    return full


def sha256_of(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe(folder: str, names) -> dict[str, dict]:
    """``{name: {"bytes", "sha256"}}`` of files just written, synced to disk."""
    out = {}
    for name in names:
        file = os.path.join(folder, name)
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        out[name] = {"bytes": os.path.getsize(file), "sha256": sha256_of(file)}
    return out


def manifest_digest(data: dict) -> str:
    """sha256 of a manifest's JSON data (tags not decoded) without its checksum, in one canonical spelling."""
    body = {k: v for k, v in data.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()).hexdigest()


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written to ``meta.json``, its own checksum added."""
    data = typed_json.encode(manifest, "the checkpoint manifest")
    return typed_json.dumps({**manifest, CHECKSUM: manifest_digest(data)}, "the checkpoint manifest")


def read_meta(folder: str, any_format: bool = False) -> dict:
    """The manifest of a checkpoint folder, checked to be ours, intact (its checksum) and well formed
    (``any_format``: of any shardformer format, to know its files)."""
    file = os.path.join(folder, META)
    if not os.path.isfile(file):
        raise CheckpointError(f"{folder} has no {META}: it is not a (finished) shardformer checkpoint")
    data = typed_json.load(file, tagged=False)
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith("shardformer-checkpoint/"):
        raise CheckpointError(f"{file}: not a shardformer checkpoint manifest (no 'format' naming one)")
    checked = CHECKSUM in data or data["format"] != _UNCHECKED  # a /2 manifest carries no checksum
    if checked and data.get(CHECKSUM) != manifest_digest(data):
        raise CheckpointError(
            f"{file}: the manifest does not match its own sha256 ({CHECKSUM}): the file is damaged, and "
            "its step, layout and file checksums cannot be trusted; restore the checkpoint from a copy, or save a new one"
        )
    meta = typed_json.decoded(data, file)
    if any_format and isinstance(meta.get("files"), dict):
        return meta
    if data["format"] != FORMAT:
        raise CheckpointError(
            f"{file}: format {data['format']!r}, this shardformer reads {FORMAT!r}; load it with the shardformer "
            "that wrote it and save it again"
        )
    for key in ("step", "files", "layout", "model_class", "has_optimizer", "saved_at"):
        if key not in meta:
            raise CheckpointError(f"{file}: the manifest lacks {key!r}; the file is damaged")
    return meta


def _own_files(folder: str) -> set[str]:
    """The names a checkpoint folder may hold at its top; raises if it is not a checkpoint."""
    try:
        return {META, *(name.split("/")[0] for name in read_meta(folder, any_format=True)["files"])}
    except CheckpointError:
        meta = os.path.join(folder, META)
        if os.path.isfile(meta):  # the previous format: no manifest, known file names
            try:
                if typed_json.load(meta).get("format") == _LEGACY:
                    return {n for n in os.listdir(folder) if _LEGACY_FILES.match(n)}
            except (CheckpointError, AttributeError):
                pass
        raise


def check_replaceable(path: str) -> None:
    """Refuse to replace anything but nothing, an empty folder, or a checkpoint holding only its own files."""
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link; save to the folder it points to, or to a new path")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a folder; save the checkpoint to a new path")
    entries = set(os.listdir(path))
    if not entries:
        return
    try:
        own = _own_files(path)
    except CheckpointError as e:
        raise CheckpointError(
            f"{path} is a non-empty folder that is not a shardformer checkpoint ({e}); saving would delete "
            "it, so save to a new or empty folder, or remove it yourself"
        ) from None
    foreign = sorted(entries - own)
    if foreign:
        raise CheckpointError(
            f"{path} is a checkpoint that also holds files it did not write ({', '.join(foreign[:5])}); "
            "saving would delete them: move them out, or save to another path"
        )


def siblings(path: str, kind: str) -> list[str]:
    """The folders ``<path>.<kind>-<token>`` a save made. A symbolic link of that name is not one of
    them: it is never renamed, nor deleted with what it points to."""
    parent, base = os.path.split(path)
    pattern = re.compile(re.escape(base) + r"\." + kind + r"-[0-9a-f]{8}$")
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    found = [os.path.join(parent, n) for n in sorted(names) if pattern.match(n)]
    return [f for f in found if os.path.isdir(f) and not os.path.islink(f)]


def _saved_at(folder: str) -> int | None:
    try:
        return int(read_meta(folder)["saved_at"])
    except (CheckpointError, ValueError, TypeError):
        return None


def recover(path: str) -> str | None:
    """Finish a commit that a crash interrupted; returns the folder renamed to ``path``, if any."""
    if os.path.lexists(path):
        return None
    complete = [(t, d) for d in siblings(path, "tmp") + siblings(path, "old") if (t := _saved_at(d)) is not None]
    if not complete:
        return None
    newest = max(complete)[1]
    os.rename(newest, path)
    _sync_dir(os.path.dirname(path))
    return newest


def discard(folder: str) -> None:
    """Delete a checkpoint folder, manifest first, so a half-deleted folder never looks complete.
    Links are never followed: a link in its place is left alone, links inside are removed as links."""
    if os.path.islink(folder):
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, META))
    shutil.rmtree(folder, ignore_errors=True)


def prepare(path: str) -> str:
    """Global rank 0, before a save: recover, refuse what must not be replaced, clear leftovers; the new tmp name."""
    recover(path)
    check_replaceable(path)
    for leftover in siblings(path, "tmp") + siblings(path, "old"):
        discard(leftover)
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def _sync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, path: str, manifest: dict) -> None:
    """Global rank 0, after every rank wrote its files into ``tmp``: mark it complete, put it at ``path``."""
    typed_json.write_atomic(os.path.join(tmp, META), manifest_bytes(manifest))
    swap(tmp, path)


def swap(tmp: str, path: str) -> None:
    """Put the finished folder ``tmp`` at ``path`` (two renames), then delete what was there."""
    _sync_dir(tmp)
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{tmp.rsplit('-', 1)[1]}"
        os.rename(path, old)
    os.rename(tmp, path)
    _sync_dir(os.path.dirname(path))
    if old is not None:
        discard(old)


def verify_files(path: str, meta: dict, rank: int, world: int) -> None:
    """Every manifest file present with its size; this rank's share of the files checksummed; every
    tensor file's header readable (DCP reads them all)."""
    problems = []
    names = sorted(meta["files"])
    for i, name in enumerate(names):
        file, entry = os.path.join(path, name), meta["files"][name]
        if not os.path.isfile(file):
            problems.append(f"{file}: missing")
        elif os.path.getsize(file) != entry["bytes"]:
            problems.append(f"{file}: {os.path.getsize(file)} bytes, the manifest says {entry['bytes']}")
        elif i % world == rank and sha256_of(file) != entry["sha256"]:
            problems.append(f"{file}: its content does not match its sha256 in the manifest (damaged file)")
    if problems:
        raise CheckpointError("\n  ".join(problems))
    for name in names:
        if "/" not in name and name.endswith(".safetensors"):
            SafeFile(os.path.join(path, name))
