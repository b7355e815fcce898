"""Resumable training checkpoints through torch.distributed.checkpoint (DCP): model, optimizer, scheduler,
RNG, step, data position.

Saving: the model's tensors under their HuggingFace names (``model.<name>``) and the optimizer state in
torch's `get_optimizer_state_dict` form (``optim.state.<name>.<key>``), each rank giving DCP the pieces of
the unsharded tensors it holds (see `shardformer.checkpoint.pieces`): DCP writes every piece once, in
safetensors files (`shardformer.checkpoint.dcp_io`), so plain ``dcp.load`` with DCP's
``HuggingFaceStorageReader`` fills an unsharded model, whatever layout saved it. Everything else
(step, ``extra``, scheduler, param groups, RNG states) is typed JSON beside them (int keys and tuples come
back as they went in). Every rank writes into a temporary folder; when all report success, global rank 0
commits it as ``path`` (see `shardformer.checkpoint.commit`: a manifest with every file's sha256, written
last, then renames), so a crash at any moment leaves the previous or the new checkpoint.

Loading: every rank reads and checks what it needs (manifest, checksums, model config, names, shapes,
coverage of its pieces, optimizer, scheduler and RNG state) without touching the model; one collective
then tells every rank every problem, and either all ranks raise the same error, nothing changed, or DCP
reads each rank's pieces (resharding any layout to any layout) into copies that are then applied.
Loading never unpickles, unless ``allow_pickle=True`` lets it read a DCP checkpoint of torch's own
format (plain FSDP2, accelerate, transformers' optimizer state), whose metadata is a pickle; other tools'
folders are found by `shardformer.checkpoint.foreign`.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from shardformer.checkpoint import commit, dcp_io, foreign, typed_json
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import dtype_kind, expert_spec
from shardformer.checkpoint.gather import Layout, layout_of, refuse_context_parallel
from shardformer.checkpoint.hf_export import original_class
from shardformer.checkpoint.model_config import config_differences, config_of
from shardformer.checkpoint.optim_state import (
    OptimizerReader,
    apply_optimizer,
    class_name,
    merge_infos,
    optimizer_entries,
)
from shardformer.checkpoint.pieces import checkpointable, covered, storage_pieces
from shardformer.checkpoint.rng_state import apply_rng, read_rng, write_rng
from shardformer.checkpoint.save_lock import save_lock
from shardformer.data_parallel.fsdp import reshard
from shardformer.tensor_parallel.slicer import shard_spec

MODEL = "model."


def _rank_zero_result(lay: Layout, work):
    """``work()`` on global rank 0, its result or error message broadcast to every rank."""
    box = [None]
    if lay.rank == 0:
        try:
            box = [(work(), None)]
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            box = [(None, str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise CheckpointError(error)
    return result


def _gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _report(errors: list[str | None]) -> str:
    """The same text on every rank: each distinct problem once, with the ranks that hit it."""
    by_text: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error:
            by_text.setdefault(error, []).append(rank)
    return "\n  ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}" for e, r in by_text.items())


def _message(e: Exception, path: str) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{path}: {type(e).__name__}: {e}"


def _prepare(path, held: contextlib.ExitStack) -> tuple[str, str]:
    full = commit.checked_path(path)
    held.enter_context(save_lock(full))  # until the save ends: another job's save to `path` is refused
    return full, commit.prepare(full)


def _recovered(path) -> tuple[str, bool]:
    full = commit.checked_path(path, replacing=False)
    commit.recover(full)  # a commit that a crash interrupted
    return full, os.path.isdir(full)


def _unique_named(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """(all state-dict names, tensor) for every distinct tensor of the model, in state-dict order."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(groups.values())


def _model_entries(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Every model tensor under each of its state-dict names, as the pieces this rank holds; the tied names."""
    entries, ties = {}, []
    for names, tensor in _unique_named(model):
        view = checkpointable(*storage_pieces(tensor, shard_spec(tensor), expert_spec(tensor)))
        entries.update(dict.fromkeys(names, view))
        if len(names) > 1:
            ties.append(names)
    return entries, ties


def _write_rank_part(tmp: str, model, optimizer, lay: Layout) -> tuple[dict, list[str], dict]:
    """What this rank gives DCP, the RNG files it wrote, and its JSON part for the manifest."""
    entries, ties = _model_entries(model)
    state, part = {"model": entries}, {"ties": ties, "optimizer": None}
    if optimizer is not None:
        opt_state, part["optimizer"] = optimizer_entries(model, optimizer, lay.dp // lay.ep)
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


def save_checkpoint(path: str, model: nn.Module, optimizer=None, scheduler=None, step: int = 0, extra=None) -> None:
    """Save a resumable training checkpoint at ``path`` (a folder); collective on all ranks.

    ``extra`` is any dict of None, bool, int, float, str, list, tuple, set and dict (data position,
    epoch, ...), handed back exactly by `load_checkpoint`. ``path`` must be new, an empty
    folder or a checkpoint holding only its own files; anything else is refused, as are the working
    directory and its parents. The previous checkpoint at ``path`` is replaced only once every rank
    has written its part; a crash at any moment leaves the previous or the new one.
    """
    with contextlib.ExitStack() as held:  # global rank 0's lock on the path
        _save(path, model, optimizer, scheduler, step, extra, held)


def _save(path, model, optimizer, scheduler, step, extra, held: contextlib.ExitStack) -> None:
    lay = layout_of(model)
    refuse_context_parallel(lay, "a resumable training checkpoint")
    full, tmp = _rank_zero_result(lay, lambda: _prepare(path, held))
    reshard(model)  # ZeRO-3: the dp shards, not a root a forward left gathered, are what is saved
    manifest, error, files, part = None, None, {}, None
    try:
        if lay.rank == 0:  # encoded before any writing: a value JSON cannot hold is refused up front
            manifest = {
                "format": commit.FORMAT, "step": step, "extra": extra, "model_class": original_class(model).__name__,
                "config": config_of(model), "layout": lay.record(),
                "scheduler": None if scheduler is None else {"class": type(scheduler).__name__, "state": scheduler.state_dict()},
                "has_optimizer": optimizer is not None,
            }  # fmt: skip
            typed_json.dumps(manifest, "the step, extra and scheduler state")
        os.makedirs(tmp, exist_ok=True)
        state, rank_files, part = _write_rank_part(tmp, model, optimizer, lay)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = _message(e, tmp)
    if not any(_gather(error)):  # DCP's save is collective: every rank takes part, or none
        try:
            apart = {MODEL + n: i for names in part["ties"] for i, n in enumerate(names) if i}
            files = commit.describe(tmp, dcp_io.save_state(tmp, state, apart) + rank_files)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            error = _message(e, tmp)
    reports = _gather((error, files, part))
    errors = [e for e, _, _ in reports]

    def finish():
        if any(errors):
            commit.discard(tmp)
            return
        parts = [p for _, _, p in reports]
        if optimizer is not None:
            manifest["optimizer"] = merge_infos([p["optimizer"] for p in parts], class_name(optimizer))
            typed_json.dumps(manifest, "the optimizer's param groups")
        manifest["ties"] = _merged_ties(parts)
        manifest["files"] = {name: entry for _, written, _ in reports for name, entry in written.items()}
        manifest["saved_at"] = time.time_ns()
        commit.commit(tmp, full, manifest)

    try:
        _rank_zero_result(lay, finish)
    except CheckpointError as e:
        raise CheckpointError(f"committing the checkpoint {full} failed on rank 0: {e}") from None
    if any(errors):
        raise CheckpointError(
            f"saving the checkpoint {full} failed; the previous checkpoint is untouched:\n  {_report(errors)}"
        )


def _candidates(ties: list[list[str]]):
    """The names a tensor known here by ``names`` may be saved under: its own, then the names tied to them
    (a pipeline stage holds a tied weight under one name only)."""

    def candidates(names: list[str]) -> list[str]:
        out = list(names)
        for group in ties:
            if any(n in group for n in names):
                out += [n for n in group if n not in out]
        return out

    return candidates


def _model_targets(path: str, meta: dict | None, found: foreign.Found, model: nn.Module, lay: Layout, candidates):
    """DCP's targets for this rank's model pieces (copies of what it holds, by model name), and (tensor,
    copy) pairs."""
    problems = []
    if meta is not None:
        if meta["model_class"] != original_class(model).__name__:
            problems.append(f"saved from {meta['model_class']}, loading into {original_class(model).__name__}")
        problems += config_differences(meta.get("config"), config_of(model))
    stored = found.model
    saved = stored.metadata.state_dict_metadata
    targets, copies, known = {}, [], set()
    for names, tensor in _unique_named(model):
        known.update(candidates(names))
        name = next((n for n in candidates(names) if stored.name(n) in saved), None)
        local, full_shape, pieces = storage_pieces(tensor, shard_spec(tensor), expert_spec(tensor))
        md = saved.get(stored.name(name)) if name is not None else None
        if md is None or not hasattr(md, "chunks"):
            problems.append(f"{names[0]}: not in the checkpoint")
        elif list(md.size) != list(full_shape):
            problems.append(f"{names[0]}: shape {list(md.size)} in the checkpoint, {list(full_shape)} here")
        elif dtype_kind(md.properties.dtype) != dtype_kind(local.dtype):
            problems.append(f"{names[0]}: saved as {md.properties.dtype}, this model holds {local.dtype}")
        elif not covered(pieces, md.chunks):
            problems.append(f"{names[0]}: the checkpoint holds only part of it")
        else:
            copy = local.detach().clone()  # padding rows keep their value: no piece covers them
            targets[name] = checkpointable(copy, full_shape, pieces)
            copies.append((local, copy))
    if lay.pp == 1:
        problems += [f"{n}: in the checkpoint but not in this model" for n in stored.names() if n not in known]
    if problems:
        shown = "\n    ".join(problems[:20]) + (
            f"\n    ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        origin = f"saved at {meta['layout']}" if meta is not None else f"written by {found.tool}"
        raise CheckpointError(
            f"the checkpoint {path} ({origin}) does not fit this model "
            f"({', '.join(f'{k}={v}' for k, v in lay.record().items() if k != 'world')}):\n    {shown}"
        )
    return targets, copies


def _check_optimizer(path: str, meta: dict | None, optimizer, found: foreign.Found) -> None:
    if meta is None:
        foreign.check_same_kind(found.optimizer.folder, found.settings, optimizer, class_name(optimizer))
        return
    if not meta["has_optimizer"]:
        raise CheckpointError(f"{path} was saved without an optimizer; call load_checkpoint without optimizer=")
    theirs, mine = meta["optimizer"]["class"], class_name(optimizer)
    if theirs != mine:  # its states would load without error and mean something else
        raise CheckpointError(
            f"{os.path.join(path, commit.META)} holds {theirs} optimizer state, and this optimizer is {mine}; "
            f"resume with torch.optim.{theirs}(...) (or your own {theirs}), or call load_checkpoint without "
            "optimizer= to start a fresh optimizer state"
        )


def _read_scheduler(path: str, meta: dict | None, scheduler) -> dict:
    saved = None if meta is None else meta["scheduler"]
    if saved is None:
        raise CheckpointError(f"{path} was saved without an LR scheduler; call load_checkpoint without scheduler=")
    if saved["class"] != type(scheduler).__name__:
        raise CheckpointError(f"{path} holds the state of a {saved['class']}, not of a {type(scheduler).__name__}")
    missing = sorted(set(scheduler.state_dict()) - set(saved["state"]))
    if missing:
        raise CheckpointError(f"{path}: the saved {saved['class']} state lacks {missing}")
    return saved["state"]


def _read_all(path: str, model: nn.Module, optimizer, scheduler, lay: Layout, allow_pickle, optimizer_path) -> dict:
    reshard(model)  # ZeRO-3: the dp shards, not a root a forward left gathered, are what loading fills
    found = foreign.locate(path, optimizer is not None, allow_pickle, optimizer_path)
    meta = None
    if found is None:  # ours (or nothing recognized: the manifest check says so)
        meta = commit.read_meta(path)
        commit.verify_files(path, meta, lay.rank, lay.world)
        found = foreign.ours(path, optimizer is not None)
    candidates = _candidates([] if meta is None else meta.get("ties", []))
    targets, copies = _model_targets(path, meta, found, model, lay, candidates)
    opt = None
    if optimizer is not None:
        _check_optimizer(path, meta, optimizer, found)
        saved = found.settings if meta is None else meta["optimizer"]
        stored = found.optimizer
        opt = OptimizerReader(stored.folder, saved, stored.metadata, model, optimizer, candidates, stored.name(""))
    keep_rng = meta is not None and meta["layout"] == lay.record()  # a rank's streams mean that rank's place
    return {
        "meta": meta,
        "loads": found.loads(targets, None if opt is None else opt.targets),
        "copies": copies,
        "optimizer": opt,
        "scheduler": None if scheduler is None else _read_scheduler(path, meta, scheduler),
        "rng": read_rng(path, model, lay.rank) if keep_rng else None,
    }


def load_checkpoint(
    path: str, model: nn.Module, optimizer=None, scheduler=None, allow_pickle: bool = False, optimizer_path=None
) -> dict:
    """Load a checkpoint written by `save_checkpoint` into ``model`` (and optimizer, scheduler).

    Collective. Works at any (tp, pp, dp, ep, ZeRO) layout. Everything is read and checked first
    (checksums, model class and config, names, shapes, optimizer and scheduler state); if anything is
    wrong on any rank, every rank raises the same `CheckpointError` listing the problems and nothing is
    changed; no folder at ``path`` raises FileNotFoundError on every rank. Returns
    ``{"step", "extra", "layout", "rng_restored"}``; RNG states are restored only at the layout they
    were saved at.

    It also resumes from the torch.distributed.checkpoint folders other tools write (see
    `shardformer.checkpoint.foreign`): plain DCP (``dcp.save`` of ``{"model": ..., "optim": ...}``), accelerate's
    FSDP2 sharded state (its output folder or the ``pytorch_model_fsdp_0`` inside), transformers' distributed
    checkpoint; the model alone, or with the optimizer state in torch's `get_optimizer_state_dict` form for
    the same optimizer class, each parameter taking the hyper-parameters recorded under its name.
    ``optimizer_path``: the folder of that optimizer state when the tool wrote it elsewhere (transformers'
    ``save_optimizer_distributed``). ``step``, ``extra`` and ``layout`` come back None. Their ``.metadata``
    is a pickle, read only with ``allow_pickle=True``: unpickling can run any code the file holds, so allow
    it only for a checkpoint you trust.
    """
    lay = layout_of(model)
    refuse_context_parallel(lay, "a resumable training checkpoint")
    full, found = _rank_zero_result(lay, lambda: _recovered(path))
    if not found:  # its own type, so that "resume if there is a checkpoint" can tell it apart
        raise FileNotFoundError(f"no checkpoint at {full}")
    staged, error = None, None
    try:
        staged = _read_all(full, model, optimizer, scheduler, lay, allow_pickle, optimizer_path)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = _message(e, full)
    errors = _gather(error)
    if any(errors):
        raise CheckpointError(f"loading the checkpoint {full} failed; nothing was changed:\n  {_report(errors)}")
    try:  # into copies: a failed read changes nothing
        for targets, reader in staged["loads"]:  # one per folder: accelerate keeps the optimizer apart
            dcp_io.load_state(targets, reader)
        opt_state = None if optimizer is None else staged["optimizer"].state_dict()
    except Exception as e:  # noqa: BLE001 - DCP raises on every rank when one fails
        raise CheckpointError(
            f"loading the checkpoint {full} failed; nothing was changed:\n  {_message(e, full)}"
        ) from None
    with torch.no_grad():
        for tensor, value in staged["copies"]:
            tensor.copy_(value)
    if optimizer is not None:
        apply_optimizer(optimizer, opt_state)
    if scheduler is not None:
        scheduler.load_state_dict(staged["scheduler"])
    if staged["rng"] is not None:
        apply_rng(model, staged["rng"])
    meta = staged["meta"] or {}
    return {
        "step": meta.get("step"),
        "extra": meta.get("extra"),
        "layout": meta.get("layout"),
        "rng_restored": staged["rng"] is not None,
    }
