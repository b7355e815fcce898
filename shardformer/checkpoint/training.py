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

import os

import torch
import torch.nn as nn

from shardformer.checkpoint import async_save, commit, dcp_io, foreign, ranks
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import dtype_kind, expert_spec
from shardformer.checkpoint.gather import Layout, layout_of, rank_place
from shardformer.checkpoint.hf_export import original_class
from shardformer.checkpoint.model_config import config_differences, config_of
from shardformer.checkpoint.optim_state import OptimizerReader, apply_optimizer, class_name
from shardformer.checkpoint.pieces import checkpointable, covered, storage_pieces, unique_named
from shardformer.checkpoint.rng_state import apply_rng, read_rng
from shardformer.checkpoint.saving import save_checkpoint  # noqa: F401 - its import path before saving.py
from shardformer.data_parallel.fsdp import reshard
from shardformer.tensor_parallel.slicer import shard_spec


def _recovered(path) -> tuple[str, bool]:
    full = commit.checked_path(path, replacing=False)
    commit.recover(full)  # a commit that a crash interrupted
    return full, os.path.isdir(full)


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
    for names, tensor in unique_named(model):
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
    keep_rng = meta is not None and rank_place(meta["layout"]) == rank_place(lay.record())
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
    async_save.wait_for_previous()  # a commit of ours in flight must not meet this load's recovery
    lay = layout_of(model)
    full, found = ranks.rank_zero_result(lay.rank, lambda: _recovered(path))
    if not found:  # its own type, so that "resume if there is a checkpoint" can tell it apart
        raise FileNotFoundError(f"no checkpoint at {full}")
    staged, error = None, None
    try:
        staged = _read_all(full, model, optimizer, scheduler, lay, allow_pickle, optimizer_path)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = ranks.message(e, full)
    errors = ranks.gather(error)
    if any(errors):
        raise CheckpointError(f"loading the checkpoint {full} failed; nothing was changed:\n  {ranks.report(errors)}")
    try:  # into copies: a failed read changes nothing
        for targets, reader in staged["loads"]:  # one per folder: accelerate keeps the optimizer apart
            dcp_io.load_state(targets, reader)
        opt_state = None if optimizer is None else staged["optimizer"].state_dict()
    except Exception as e:  # noqa: BLE001 - DCP raises on every rank when one fails
        raise CheckpointError(
            f"loading the checkpoint {full} failed; nothing was changed:\n  {ranks.message(e, full)}"
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
