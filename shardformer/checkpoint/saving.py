"""Saving a resumable training checkpoint through torch.distributed.checkpoint (DCP); how it is laid
out and read back is described in `shardformer.checkpoint.training`.

Every rank gives DCP the pieces of the model's (and optimizer's) unsharded tensors it holds and writes
its RNG files into a temporary folder; when all report success, global rank 0 commits it as ``path``
(`shardformer.checkpoint.commit`). An asynchronous save stages that state on CPU and runs the write
and the commit in the background (`shardformer.checkpoint.async_save`).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch.nn as nn

from shardformer.checkpoint import async_save as async_save_
from shardformer.checkpoint import commit, dcp_io, ranks, typed_json
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.gather import Layout, layout_of
from shardformer.checkpoint.hf_export import is_timm, original_class
from shardformer.checkpoint.model_config import config_of
from shardformer.checkpoint.optim_state import class_name, merge_infos, optimizer_entries
from shardformer.checkpoint.pieces import MODEL, merged_names, model_entries
from shardformer.checkpoint.rng_state import write_rng
from shardformer.checkpoint.save_lock import save_lock
from shardformer.data_parallel.fsdp import reshard


def _prepare(path, held: contextlib.ExitStack) -> tuple[str, str]:
    full = commit.checked_path(path)
    held.enter_context(save_lock(full))  # until the save ends: another job's save to `path` is refused
    return full, commit.prepare(full)


def _write_rank_part(tmp: str, model, optimizer, lay: Layout) -> tuple[dict, list[str], dict]:
    """What this rank gives DCP, the RNG files it wrote, and its JSON part for the manifest."""
    entries, ties = model_entries(model)
    state, part = {"model": entries}, {"ties": ties, "optimizer": None, "names": list(entries)}
    if optimizer is not None:
        opt_state, part["optimizer"] = optimizer_entries(model, optimizer, lay.dp // lay.ep // lay.dp_replicate)
        state["optim"] = {"state": opt_state}
    coords = {"pp": lay.pp_rank, "dp": lay.dp_rank, "tp": lay.tp_rank} | ({"ep": lay.ep_rank} if lay.ep > 1 else {})
    return state, write_rng(tmp, model, lay.rank, coords), part


def _merged_ties(parts: list[dict]) -> list[list[str]]:
    groups: list[list[str]] = []
    for part in parts:
        for names in part["ties"]:
            if names not in groups:
                groups.append(names)
    return groups


def save_checkpoint(
    path: str, model: nn.Module, optimizer=None, scheduler=None, step: int = 0, extra=None, async_save: bool = False
) -> async_save_.SaveHandle | None:
    """Save a resumable training checkpoint at ``path`` (a folder); collective on all ranks.

    ``extra`` is any dict of None, bool, int, float, str, list, tuple, set and dict (data position,
    epoch, ...), handed back exactly by `load_checkpoint`. ``path`` must be new, an empty
    folder or a checkpoint holding only its own files; anything else is refused, as are the working
    directory and its parents. The previous checkpoint at ``path`` is replaced only once every rank
    has written its part; a crash at any moment leaves the previous or the new one.

    ``async_save=True`` returns a `SaveHandle` as soon as the state is copied to CPU memory; the
    write and the commit run in the background (on a gloo group of their own) while training goes
    on, and ``handle.wait()`` blocks until the checkpoint is committed, raising if it failed. One save
    is in flight at a time: the next `save_checkpoint` or `load_checkpoint` first waits for it.
    """
    async_save_.wait_for_previous()
    held = contextlib.ExitStack()  # global rank 0's lock on the path, until the commit
    try:
        write = _stage(path, model, optimizer, scheduler, step, extra, held, async_save)
        if write is not None and async_save:
            group = async_save_.save_group()
            return async_save_.start(commit.checked_path(path, replacing=False), lambda: write(group), held.close)
        if write is not None:
            write(None)
    except BaseException:
        held.close()
        raise
    held.close()
    return None


def _stage(path, model, optimizer, scheduler, step, extra, held: contextlib.ExitStack, copy: bool):
    """Everything a save does before DCP writes (the RNG files, the state to write, on CPU if ``copy``);
    the rest of the save as a function of the process group it runs on."""
    lay = layout_of(model)
    full, tmp = ranks.rank_zero_result(lay.rank, lambda: _prepare(path, held))
    reshard(model)  # ZeRO-3: the dp shards, not a root a forward left gathered, are what is saved
    manifest, error, state, rank_files, part = None, None, None, [], None
    try:
        if lay.rank == 0:  # encoded before any writing: a value JSON cannot hold is refused up front
            manifest = {
                "format": commit.FORMAT, "step": step, "extra": extra, "model_class": original_class(model).__name__,
                "config": config_of(model), "layout": lay.record(),
                "scheduler": None if scheduler is None else {"class": type(scheduler).__name__, "state": scheduler.state_dict()},
                "has_optimizer": optimizer is not None,
            } | ({"num_classes": getattr(model, "num_classes", None)} if is_timm(model) else {})  # fmt: skip
            typed_json.dumps(manifest, "the step, extra and scheduler state")
        os.makedirs(tmp, exist_ok=True)
        state, rank_files, part = _write_rank_part(tmp, model, optimizer, lay)
        if copy:
            state = async_save_.staged(state)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = ranks.message(e, tmp)
    failed = any(ranks.gather(error))  # DCP's save is collective: every rank takes part, or none
    optimizer_class = None if optimizer is None else class_name(optimizer)

    def write(group) -> None:
        _write_and_commit(lay, full, tmp, manifest, state, rank_files, part, error, failed, optimizer_class, group)

    if failed:  # nothing to write: report it now, on every rank
        write(None)
    return write


def _write_and_commit(lay, full, tmp, manifest, state, rank_files, part, error, failed, optimizer_class, group):
    files = {}
    if not failed:
        try:
            apart = {MODEL + n: i for names in part["ties"] for i, n in enumerate(names) if i}
            files = commit.describe(tmp, dcp_io.save_state(tmp, state, apart, group)[0] + rank_files)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            error = ranks.message(e, tmp)
    reports = ranks.gather((error, files, part), group)
    errors = [e for e, _, _ in reports]

    def finish():
        if any(errors):
            commit.discard(tmp)
            return
        parts = [p for _, _, p in reports]
        if optimizer_class is not None:
            manifest["optimizer"] = merge_infos([p["optimizer"] for p in parts], optimizer_class)
            typed_json.dumps(manifest, "the optimizer's param groups")
        manifest["ties"] = _merged_ties(parts)
        manifest["names"] = merged_names([p["names"] for p in parts])  # the order an export writes them in
        manifest["files"] = {name: entry for _, written, _ in reports for name, entry in written.items()}
        manifest["saved_at"] = time.time_ns()
        commit.commit(tmp, full, manifest)

    try:
        ranks.rank_zero_result(lay.rank, finish, group)
    except CheckpointError as e:
        raise CheckpointError(f"committing the checkpoint {full} failed on rank 0: {e}") from None
    if any(errors):
        raise CheckpointError(
            f"saving the checkpoint {full} failed; the previous checkpoint is untouched:\n  {ranks.report(errors)}"
        )
