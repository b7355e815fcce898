"""Resumable training checkpoints: model shards, ZeRO optimizer shards, scheduler, RNG, step, data position.

Saving: every rank writes its own files (see `shardformer.checkpoint.files` for the folder) into
a temporary folder; when all ranks report success, global rank 0 commits it as ``path`` (see
`shardformer.checkpoint.commit`: a manifest with every file's sha256, written last, then renames),
so a crash at any moment leaves the previous or the new checkpoint. Tensors go to safetensors,
everything else to typed JSON (int keys and tuples come back as they went in): loading never unpickles.

Loading: every rank reads and checks everything it will need (manifest, checksums, model config,
names, shapes, optimizer, scheduler and RNG state) without touching the model; one collective then
tells every rank every problem, and either all ranks raise the same error, nothing changed, or all
apply what they read. It works at any (tp, pp, dp, ep): every parameter (and per-element optimizer
state) is put together from the saved pieces (tp shards, ep ranks' experts, dp pieces) and cut again
for this rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

from shardformer.checkpoint import commit, typed_json
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import (
    ModelIndex,
    SafeFile,
    dtype_kind,
    expert_spec,
    full_shape,
    model_file,
    model_tensors,
    rank_files,
)
from shardformer.checkpoint.gather import Layout, layout_of, named_tensors, refuse_context_parallel
from shardformer.checkpoint.hf_export import original_class
from shardformer.checkpoint.model_config import config_differences, config_of
from shardformer.checkpoint.optim_state import apply_optimizer, optimizer_payload, read_optimizer
from shardformer.checkpoint.save_lock import save_lock
from shardformer.data_parallel.fsdp import copy_full_into, reshard
from shardformer.tensor_parallel.slicer import shard_spec


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


def _rng_payload(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    dropout = {}
    for name, module in model.named_modules():
        if callable(getattr(module, "get_rng_state", None)):
            dropout[name] = sorted(module.get_rng_state())
            for device, state in module.get_rng_state().items():
                tensors[f"rng.dropout.{name}.{device}"] = state
    return tensors, {"dropout": dropout, "python": random.getstate()}


def _write_rank(tmp: str, model, optimizer, lay: Layout) -> dict[str, dict]:
    """This rank's files, written into ``tmp``; returns their sizes and checksums."""
    written = []
    named = named_tensors(model)  # on every rank: gathering ZeRO-3 shards is a collective over dp
    # dp replicas hold the same model shard: one writes it. Under expert parallelism dp ranks 0..ep-1
    # hold different experts: dp rank 0 writes everything it holds, the others their experts only.
    if lay.dp_rank < lay.ep:
        tensors, info = model_tensors(named, experts_only=lay.dp_rank > 0)
        name = model_file(lay.pp_rank, lay.tp_rank, lay.dp_rank)
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt", "shardformer": json.dumps(info)})
        written.append(name)
    tensors, rng_info = _rng_payload(model)
    coords = {"pp": lay.pp_rank, "dp": lay.dp_rank, "tp": lay.tp_rank} | ({"ep": lay.ep_rank} if lay.ep > 1 else {})
    info = {"coords": coords, "rng": rng_info, "optimizer": None}
    if optimizer is not None:
        opt_tensors, info["optimizer"] = optimizer_payload(model, optimizer, lay.dp // lay.ep)
        tensors.update(opt_tensors)
    st_name, json_name = rank_files(lay.rank)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, st_name))
    with open(os.path.join(tmp, json_name), "wb") as f:
        f.write(typed_json.dumps(info, f"rank {lay.rank}'s checkpoint state"))
    written += [st_name, json_name]
    return commit.describe(tmp, written)


def _prepare(path, held: contextlib.ExitStack) -> tuple[str, str]:
    full = commit.checked_path(path)
    held.enter_context(save_lock(full))  # until the save ends: another job's save to `path` is refused
    return full, commit.prepare(full)


def _recovered(path) -> tuple[str, bool]:
    full = commit.checked_path(path, replacing=False)
    commit.recover(full)  # a commit that a crash interrupted
    return full, os.path.isdir(full)


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
    manifest, error, files = None, None, {}
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
        files = _write_rank(tmp, model, optimizer, lay)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = _message(e, tmp)
    reports = _gather((error, files))
    errors = [e for e, _ in reports]

    def finish():
        if any(errors):
            commit.discard(tmp)
            return
        manifest["files"] = {name: entry for _, part in reports for name, entry in part.items()}
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


def _unique_named(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """(all state-dict names, tensor) for every distinct tensor of the model, in state-dict order."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(groups.values())


def _verify_files(path: str, meta: dict, lay: Layout) -> None:
    """Every manifest file present with its size; this rank's share of the files checksummed."""
    problems = []
    names = sorted(meta["files"])
    for i, name in enumerate(names):
        file, entry = os.path.join(path, name), meta["files"][name]
        if not os.path.isfile(file):
            problems.append(f"{file}: missing")
        elif os.path.getsize(file) != entry["bytes"]:
            problems.append(f"{file}: {os.path.getsize(file)} bytes, the manifest says {entry['bytes']}")
        elif i % lay.world == lay.rank and commit.sha256_of(file) != entry["sha256"]:
            problems.append(f"{file}: its content does not match its sha256 in the manifest (damaged file)")
    if problems:
        raise CheckpointError("\n  ".join(problems))


def _read_model(path: str, meta: dict, model: nn.Module, lay: Layout) -> list:
    """(tensor, value) for every tensor of this rank, checked against the checkpoint."""
    problems = []
    if meta["model_class"] != original_class(model).__name__:
        problems.append(f"saved from {meta['model_class']}, loading into {original_class(model).__name__}")
    problems += config_differences(meta.get("config"), config_of(model))
    index = ModelIndex(path, meta["files"])
    plan, known = [], set()
    for names, tensor in _unique_named(model):
        known.update(names)
        saved = index.resolve(names)
        if saved is None:
            problems.append(f"{names[0]}: not in the checkpoint")
        elif index.shapes[saved] != full_shape(tensor):
            problems.append(f"{names[0]}: shape {index.shapes[saved]} in the checkpoint, {full_shape(tensor)} here")
        else:
            plan.append((saved, names, tensor))
    if lay.pp == 1:
        problems += [f"{n}: in the checkpoint but not in this model" for n in index.pieces if n not in known]
    if problems:
        shown = "\n    ".join(problems[:20]) + (
            f"\n    ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise CheckpointError(
            f"the checkpoint {path} (saved at {meta['layout']}) does not fit this model "
            f"({', '.join(f'{k}={v}' for k, v in lay.record().items() if k != 'world')}):\n    {shown}"
        )
    values = []
    for saved, names, tensor in plan:
        value = index.shard(saved, shard_spec(tensor), expert_spec(tensor))
        if value.shape != tensor.shape:
            raise CheckpointError(f"{path}: {names[0]} comes to a shard of {tuple(value.shape)}, "
                                  f"this rank holds {tuple(tensor.shape)}")  # fmt: skip
        if dtype_kind(value.dtype) != dtype_kind(tensor.dtype):
            raise CheckpointError(f"{path}: {names[0]} is saved as {value.dtype}, this model holds {tensor.dtype}")
        values.append((tensor, value))
    return values


def _read_scheduler(path: str, meta: dict, scheduler) -> dict:
    saved = meta["scheduler"]
    if saved is None:
        raise CheckpointError(f"{path} was saved without an LR scheduler; call load_checkpoint without scheduler=")
    if saved["class"] != type(scheduler).__name__:
        raise CheckpointError(f"{path} holds the state of a {saved['class']}, not of a {type(scheduler).__name__}")
    missing = sorted(set(scheduler.state_dict()) - set(saved["state"]))
    if missing:
        raise CheckpointError(f"{path}: the saved {saved['class']} state lacks {missing}")
    return saved["state"]


def _read_rng(path: str, model: nn.Module, lay: Layout, meta: dict) -> dict | None:
    """This global rank's RNG states, when the layout is the one saved (else None: left alone)."""
    if meta["layout"] != lay.record():
        return None
    st_name, json_name = rank_files(lay.rank)
    file = os.path.join(path, json_name)
    info = typed_json.load(file)
    try:
        dropout, python = info["rng"]["dropout"], info["rng"]["python"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: the RNG state is damaged (no {e})") from None
    tensors = SafeFile(os.path.join(path, st_name))
    modules = dict(model.named_modules())
    return {
        "cpu": tensors.get("rng.cpu"),
        "cuda": [tensors.get(k) for k in sorted(k for k in tensors.names() if k.startswith("rng.cuda."))],
        "dropout": {
            n: {d: tensors.get(f"rng.dropout.{n}.{d}") for d in ds} for n, ds in dropout.items() if n in modules
        },
        "python": python,
    }


def _apply_rng(model: nn.Module, rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    modules = dict(model.named_modules())
    for name, states in rng["dropout"].items():
        modules[name].set_rng_state(states)
    random.setstate(rng["python"])


def _read_all(path: str, model: nn.Module, optimizer, scheduler, lay: Layout) -> dict:
    reshard(model)  # ZeRO-3: the dp shards, not a root a forward left gathered, are what loading fills
    meta = commit.read_meta(path)
    _verify_files(path, meta, lay)
    if optimizer is not None and not meta["has_optimizer"]:
        raise CheckpointError(f"{path} was saved without an optimizer; call load_checkpoint without optimizer=")
    return {
        "meta": meta,
        "model": _read_model(path, meta, model, lay),
        "optimizer": None if optimizer is None else read_optimizer(path, model, optimizer, meta["layout"]["world"]),
        "scheduler": None if scheduler is None else _read_scheduler(path, meta, scheduler),
        "rng": _read_rng(path, model, lay, meta),
    }


def load_checkpoint(path: str, model: nn.Module, optimizer=None, scheduler=None) -> dict:
    """Load a checkpoint written by `save_checkpoint` into ``model`` (and optimizer, scheduler).

    Collective. Works at any (tp, pp, dp) layout. Everything is read and checked first (checksums,
    model class and config, names, shapes, optimizer and scheduler state); if anything is wrong on
    any rank, every rank raises the same `CheckpointError` listing the problems and nothing
    is changed; no folder at ``path`` raises FileNotFoundError on every rank. Returns
    ``{"step", "extra", "layout", "rng_restored"}``; RNG states are restored
    only at the layout they were saved at.
    """
    lay = layout_of(model)
    refuse_context_parallel(lay, "a resumable training checkpoint")
    full, found = _rank_zero_result(lay, lambda: _recovered(path))
    if not found:  # its own type, so that "resume if there is a checkpoint" can tell it apart
        raise FileNotFoundError(f"no checkpoint at {full}")
    staged, error = None, None
    try:
        staged = _read_all(full, model, optimizer, scheduler, lay)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = _message(e, full)
    errors = _gather(error)
    if any(errors):
        raise CheckpointError(f"loading the checkpoint {full} failed; nothing was changed:\n  {_report(errors)}")
    with torch.no_grad():
        for tensor, value in staged["model"]:
            copy_full_into(tensor, value)  # a ZeRO-3 parameter keeps its dp shard of the value
    if optimizer is not None:
        apply_optimizer(optimizer, staged["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(staged["scheduler"])
    if staged["rng"] is not None:
        _apply_rng(model, staged["rng"])
    meta = staged["meta"]
    return {
        "step": meta["step"],
        "extra": meta["extra"],
        "layout": meta["layout"],
        "rng_restored": staged["rng"] is not None,
    }
