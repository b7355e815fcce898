"""Export a sharded model to a folder that plain HuggingFace ``from_pretrained`` (or timm) loads.

No rank gathers the model: every rank hands torch.distributed.checkpoint the pieces of the unsharded
tensors it holds (`shardformer.checkpoint.pieces`: fused Q/K/V in order, vocabulary padding cut, ZeRO-3
rows, experts), DCP writes each piece once into a staging folder, and then every rank writes its share
of the output files, one whole tensor at a time (`shardformer.checkpoint.consolidate`). So no rank
holds more than its own share plus one tensor. Global rank 0 adds ``config.json`` (``architectures``
names the original transformers class, not the sharder's subclass) and the generation config; the
folder is written beside the target and swapped in as a whole (`shardformer.checkpoint.export_folder`),
as ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus an index above
``max_shard_size``. Tied weights are written once, under the name transformers expects. Every rank
must see the folder (a shared file system on several machines), as for training checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil

import torch
import torch.nn as nn

from shardformer.checkpoint import commit, consolidate, dcp_io, export_folder, ranks
from shardformer.checkpoint.consolidate import SAFE_INDEX
from shardformer.checkpoint.gather import layout_of
from shardformer.checkpoint.pieces import merged_names, model_entries
from shardformer.checkpoint.save_lock import save_lock
from shardformer.core.hf_save import register_export
from shardformer.data_parallel.fsdp import reshard

PIECES = ".pieces"  # the staging folder of every rank's pieces, inside the export's temporary folder
_OWN_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors$")  # what an export names its files


def original_class(model: nn.Module) -> type:
    """The first class in the model's MRO defined by transformers (or timm); else its own class."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith(("transformers.", "timm.")):
            return cls
    return type(model)


def tied_targets(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` of the weights transformers ties (and so saves once, as the source)."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:
        tied = getattr(model, "_tied_weights_keys", None)
    return dict(tied) if isinstance(tied, dict) else {}


def _kept(entries: dict[str, torch.Tensor], ties: list[list[str]], model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's tensors under the names the export writes: a tensor known by several names (tied)
    under its first one; a weight transformers ties (``lm_head.weight`` to the embedding) only where
    its source is exported (a pipeline stage may hold the target alone: it is dropped after the write)."""
    out = dict(entries)
    for names in ties:
        for alias in names[1:]:
            out.pop(alias, None)
    for target, source in tied_targets(model).items():
        if source in entries:
            out.pop(target, None)
    return out


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, factor in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    if text.endswith("B"):
        text = text[:-1]
    return int(text)


def replaced_by_an_export(name: str) -> bool:
    """Files of an earlier export that a new one replaces, whether it writes them again or not
    (stale weights would confuse loaders); any other file in the folder is kept."""
    return bool(_OWN_WEIGHTS.match(name)) or name == SAFE_INDEX


def _write_config(model: nn.Module, path: str, dtype: torch.dtype | None) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [original_class(model).__name__]
    if dtype is not None:  # what from_pretrained(dtype="auto") loads in; the config may still say float32
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(path)


def is_timm(model: nn.Module) -> bool:
    return original_class(model).__module__.startswith("timm.")


def write_weights(folder: str, chunks: dict, names: dict[str, str], max_shard_size, rank: int, world: int) -> None:
    """This rank's share of the weight files of ``names`` (``{output name: saved name}``, in order) from
    the pieces ``chunks`` (`consolidate.chunks_in`); one file is ``model.safetensors``, more get an index."""
    sizes = {out: consolidate.nbytes(chunks[saved]) for out, saved in names.items()}
    files, split = consolidate.plan_files(sizes, _parse_size(max_shard_size))
    for number, (file, outs) in enumerate(files.items()):
        if number % world == rank:
            consolidate.write_file(os.path.join(folder, file), {n: names[n] for n in outs}, chunks)
    if split and rank == 0:
        consolidate.write_index(folder, files, sizes)


def stored_dtype(chunks: dict, names: dict[str, str]) -> torch.dtype | None:
    """The dtype the weights are written in: the first floating-point tensor's, as transformers reads it."""
    dtypes = (consolidate.dtype_of(chunks[saved]) for saved in names.values())
    return next((d for d in dtypes if d.is_floating_point), None)


def write_timm_config(folder: str, architecture: str, num_classes: int | None) -> None:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architecture": architecture, "num_classes": num_classes}, f, indent=2)


def write_description(folder: str, model: nn.Module, dtype: torch.dtype | None) -> None:
    """``config.json`` (and the generation config) of the export of ``model``; a timm model's own one."""
    if is_timm(model):
        write_timm_config(folder, original_class(model).__name__, getattr(model, "num_classes", None))
    else:
        _write_config(model, folder, dtype)


def prepare_export(path, held: contextlib.ExitStack) -> tuple[str, str]:
    full = export_folder.target(path)
    held.enter_context(save_lock(full))  # until the swap: another job's export to `path` is refused
    return full, export_folder.prepare(full)


def save_pretrained(model: nn.Module, path: str, max_shard_size: int | str = "2GB") -> None:
    """Write ``model`` (sharded over any tp x pp x dp x ep, ZeRO-3 included) as a plain HuggingFace folder at ``path``.

    Collective: call it on every rank of the model's world; each rank writes what it holds, then its
    share of the output files (every rank must see ``path``). ``transformers.<Class>.from_pretrained(path)``
    then loads it without shardformer. A timm model gets a ``model.safetensors`` (and ``config.json``
    with its architecture) that ``timm.create_model(...).load_state_dict(safetensors.torch.load_file(...))``
    accepts.
    """
    lay = layout_of(model)
    with contextlib.ExitStack() as held:  # global rank 0's lock on the path
        try:
            full, tmp = ranks.rank_zero_result(lay.rank, lambda: prepare_export(path, held))
        except Exception as e:  # noqa: BLE001 - the same error on every rank
            raise RuntimeError(f"save_pretrained to {path!r} failed on rank 0: {e}") from None
        _export(model, lay, full, tmp, max_shard_size)


def _export(model, lay, full: str, tmp: str, max_shard_size) -> None:
    pieces, error, dtype, order = os.path.join(tmp, PIECES), None, None, []
    try:
        reshard(model)  # ZeRO-3: the dp shards, not a root a forward left gathered, are what is written
        entries, ties = model_entries(model)
        order = list(entries)
        entries = _kept(entries, ties, model)
        os.makedirs(pieces, exist_ok=True)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = ranks.message(e, tmp)
    reports = ranks.gather((error, order))
    failed = any(e for e, _ in reports)
    if not failed:
        try:
            dcp_io.save_state(pieces, entries, {})
            chunks = consolidate.chunks_in(pieces)
            dropped = {t for t, s in tied_targets(model).items() if s in chunks}
            names = {n: n for n in merged_names([o for _, o in reports]) if n in chunks and n not in dropped}
            write_weights(tmp, chunks, names, max_shard_size, lay.rank, lay.world)
            dtype = stored_dtype(chunks, names)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            error = ranks.message(e, tmp)
    errors = ranks.gather(error)

    def finish():
        if any(errors):
            commit.discard(tmp)
            raise RuntimeError(ranks.report(errors))
        shutil.rmtree(pieces)
        write_description(tmp, model, dtype)
        export_folder.finish(tmp, full, replaced_by_an_export)

    try:
        ranks.rank_zero_result(lay.rank, finish)
    except Exception as e:  # noqa: BLE001 - the same error on every rank
        raise RuntimeError(f"save_pretrained to {full!r} failed: {e}") from None


def save_pretrained_as_hf(
    model: nn.Module,
    save_directory: str,
    is_main_process: bool = True,
    state_dict: dict | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "50GB",
    safe_serialization: bool = True,
    variant: str | None = None,
    **_ignored,
) -> None:
    """``model.save_pretrained(...)`` of a sharded model, with transformers' signature: the whole model
    through `save_pretrained`, collective on every rank (every rank writes its share, whatever
    ``is_main_process`` says). What it cannot honour is refused before any collective."""
    unsupported = {
        "state_dict": state_dict is not None,  # a state dict of a sharded model is one rank's slices
        "push_to_hub": push_to_hub,
        "variant": variant is not None,
        "safe_serialization=False": not safe_serialization,
    }
    refused = [name for name, asked in unsupported.items() if asked]
    if refused:
        raise ValueError(
            f"save_pretrained of a sharded {original_class(model).__name__} does not take {refused}: it writes "
            f"the whole model as safetensors; save the folder, then push or convert it"
        )
    save_pretrained(model, os.fspath(save_directory), max_shard_size)


register_export(save_pretrained_as_hf)
