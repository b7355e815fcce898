"""Resumable training checkpoints: model shards, ZeRO optimizer shards, scheduler, RNG, step, data position.

Every rank writes its own files at once (see :mod:`shardformer.checkpoint.files` for the folder)
into ``<path>.tmp-<token>``; only when all ranks report success does global rank 0 swap it in for
``<path>``, so a crash mid-save leaves the previous checkpoint whole. Tensors go to safetensors,
everything else to JSON: loading never unpickles.

Loading works at any (tp, pp, dp): every parameter (and every per-element optimizer state) is put
together from the saved pieces (dp shards concatenated, tp shards merged by their ShardSpec) and cut
again for this rank, so a checkpoint saved at (tp=2, dp=2) resumes at (tp=1, dp=4) or (tp=4, dp=1).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

from shardformer.checkpoint.files import (
    FORMAT,
    META,
    ModelIndex,
    full_shape,
    json_dump,
    json_load,
    model_file,
    model_tensors,
    rank_files,
)
from shardformer.checkpoint.gather import Layout, layout_of
from shardformer.checkpoint.hf_export import original_class
from shardformer.checkpoint.optim_state import load_optimizer, optimizer_payload
from shardformer.slicer import shard_spec

_FAULT_HOOK = None  # tests: called as _FAULT_HOOK(rank, tmp_path) after a rank wrote its files


def _broadcast(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_errors(error: str | None) -> list[tuple[int, str]]:
    if not dist.is_initialized():
        return [(0, error)] if error else []
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return [(r, e) for r, e in enumerate(errors) if e]


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


def _write_rank(tmp: str, model, optimizer, lay: Layout) -> None:
    if lay.dp_rank == 0:  # dp replicas hold the same model shard: one writes it
        tensors, info = model_tensors(dict(model.state_dict(keep_vars=True)))
        save_file(tensors, os.path.join(tmp, model_file(lay.pp_rank, lay.tp_rank)), metadata={
            "format": "pt", "shardformer": json.dumps(info)})  # fmt: skip
    tensors, rng_info = _rng_payload(model)
    info = {"coords": {"pp": lay.pp_rank, "dp": lay.dp_rank, "tp": lay.tp_rank}, "rng": rng_info, "optimizer": None}
    if optimizer is not None:
        opt_tensors, info["optimizer"] = optimizer_payload(model, optimizer)
        tensors.update(opt_tensors)
    st_name, json_name = rank_files(lay.rank)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, st_name))
    json_dump(info, os.path.join(tmp, json_name), f"rank {lay.rank}'s checkpoint state")


def save_checkpoint(path: str, model: nn.Module, optimizer=None, scheduler=None, step: int = 0, extra=None) -> None:
    """Save a resumable training checkpoint at ``path`` (a folder); collective on all ranks.

    ``extra`` is any JSON-serialisable dict (data position, epoch, ...), handed back by
    :func:`load_checkpoint`. An existing checkpoint at ``path`` is replaced only once every rank
    has written its part.
    """
    lay = layout_of(model)
    path = os.path.abspath(path.rstrip("/"))
    tmp = _broadcast(f"{path}.tmp-{uuid.uuid4().hex[:8]}" if lay.rank == 0 else None)
    error = None
    try:
        os.makedirs(tmp, exist_ok=True)
        if lay.rank == 0:
            meta = {
                "format": FORMAT, "step": step, "extra": extra, "model_class": original_class(model).__name__,
                "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "world": lay.world},
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "has_optimizer": optimizer is not None,
            }  # fmt: skip
            json_dump(meta, os.path.join(tmp, META), "the step, extra and scheduler state")
        _write_rank(tmp, model, optimizer, lay)
        if _FAULT_HOOK is not None:
            _FAULT_HOOK(lay.rank, tmp)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = f"{type(e).__name__}: {e}"
    errors = _all_errors(error)
    if lay.rank == 0:
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = f"{tmp}.old"
            if os.path.exists(path):
                os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    if errors:
        listing = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise RuntimeError(f"saving the checkpoint {path} failed ({listing}); the previous checkpoint is untouched")


def _unique_named(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """(all state-dict names, tensor) for every distinct tensor of the model, in state-dict order."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(groups.values())


def _validate(path: str, index: ModelIndex, model: nn.Module, lay: Layout, meta: dict) -> list:
    problems, plan = [], []
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}; is it a shardformer checkpoint?")
    if meta["model_class"] != original_class(model).__name__:
        problems.append(f"saved from {meta['model_class']}, loading into {original_class(model).__name__}")
    known = set()
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
        extra = [n for n in index.pieces if n not in known]
        problems += [f"{n}: in the checkpoint but not in this model" for n in extra]
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(
            f"the checkpoint {path} (saved at {meta['layout']}) does not fit this model "
            f"(tp={lay.tp}, pp={lay.pp}, dp={lay.dp}):\n  {shown}"
        )
    return plan


def _restore_rng(path: str, model: nn.Module, lay: Layout, meta: dict) -> bool:
    """RNG states of the same global rank, when the layout is the one saved; else left alone."""
    same = meta["layout"] == {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "world": lay.world}
    if not same:
        return False
    from safetensors import safe_open

    st_name, json_name = rank_files(lay.rank)
    info = json_load(os.path.join(path, json_name))["rng"]
    with safe_open(os.path.join(path, st_name), "pt") as f:
        torch.set_rng_state(f.get_tensor("rng.cpu"))
        cuda = sorted(k for k in f.keys() if k.startswith("rng.cuda."))  # noqa: SIM118 - not a dict
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([f.get_tensor(k) for k in cuda])
        modules = dict(model.named_modules())
        for name, devices in info["dropout"].items():
            if name in modules:
                modules[name].set_rng_state({d: f.get_tensor(f"rng.dropout.{name}.{d}") for d in devices})
    state = info["python"]
    random.setstate((state[0], tuple(state[1]), state[2]))
    return True


def load_checkpoint(path: str, model: nn.Module, optimizer=None, scheduler=None) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and optimizer, scheduler).

    Works at any (tp, pp, dp) layout. Checks names and full shapes first and raises a ValueError
    listing every mismatch before anything is changed. Returns ``{"step", "extra", "layout",
    "rng_restored"}``; RNG states are restored only at the layout they were saved at.
    """
    path = os.path.abspath(path.rstrip("/"))
    if not os.path.isfile(os.path.join(path, META)):
        raise FileNotFoundError(f"{path} has no {META}; it is not a (finished) shardformer checkpoint")
    meta = json_load(os.path.join(path, META))
    lay = layout_of(model)
    index = ModelIndex(path)
    plan = _validate(path, index, model, lay, meta)
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"{path} was saved without an optimizer; call load_checkpoint without optimizer=")
    if scheduler is not None and meta["scheduler"] is None:
        raise ValueError(f"{path} was saved without an LR scheduler; call load_checkpoint without scheduler=")
    with torch.no_grad():
        for saved, names, tensor in plan:
            value = index.shard(saved, shard_spec(tensor))
            if value.shape != tensor.shape:
                raise ValueError(f"{names[0]}: the checkpoint gives a shard of {tuple(value.shape)}, "
                                 f"this rank holds {tuple(tensor.shape)}")  # fmt: skip
            tensor.copy_(value)
    if optimizer is not None:
        load_optimizer(path, model, optimizer, meta["layout"]["world"])
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    restored = _restore_rng(path, model, lay, meta)
    return {"step": meta["step"], "extra": meta["extra"], "layout": meta["layout"], "rng_restored": restored}
