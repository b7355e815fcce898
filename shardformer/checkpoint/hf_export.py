"""Export a sharded model to a folder that plain HuggingFace ``from_pretrained`` (or timm) loads.

The tp shards are gathered by their ShardSpec (fused Q/K/V back in order, vocabulary padding cut),
the pipeline stages are merged on global rank 0, and only global rank 0 writes, into a new folder
swapped in as a whole (`shardformer.checkpoint.export_folder`): ``config.json``
(``architectures`` names the original transformers class, not the sharder's subclass) and
safetensors weights, split into ``model-0000k-of-0000n.safetensors`` plus an index above
``max_shard_size``. Tied weights are written once, under the name transformers expects.
"""

from __future__ import annotations

import copy
import json
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from shardformer.checkpoint import commit, export_folder
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.gather import gather_full_state
from shardformer.checkpoint.save_lock import save_lock
from shardformer.core.hf_save import register_export
from shardformer.tensor_parallel.detect import names_by_tensor

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_OWN_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors$")  # what write_safetensors names files


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


def _drop_tied(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(state)
    for target, source in tied_targets(model).items():
        if target in out and source in out and torch.equal(out[target], out[source]):
            del out[target]
    # Any other aliases (same tensor under two names) are written once, under the first name.
    for names in names_by_tensor(list(out.items())).values():
        for alias in names[1:]:
            del out[alias]
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


def write_safetensors(state: dict[str, torch.Tensor], path: str, max_shard_size: int | str = "2GB") -> list[str]:
    """Write ``state`` into ``path`` as one safetensors file, or shards plus an index; returns file names."""

    state = {k: v.detach().contiguous() for k, v in state.items()}
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=_parse_size(max_shard_size)
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, os.path.join(path, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                 "weight_map": split.tensor_to_filename}  # fmt: skip
        with open(os.path.join(path, SAFE_INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return sorted(split.filename_to_tensors)


def _replaced(name: str) -> bool:
    """Files of an earlier export that a new one replaces, whether it writes them again or not
    (stale weights would confuse loaders); any other file in the folder is kept."""
    return bool(_OWN_WEIGHTS.match(name)) or name == SAFE_INDEX


def _stored_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype the weights are written in: the first floating-point tensor's, as transformers reads it."""
    return next((v.dtype for v in state.values() if v.is_floating_point()), None)


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


def _is_timm(model: nn.Module) -> bool:
    return original_class(model).__module__.startswith("timm.")


def _write_export(model: nn.Module, state: dict[str, torch.Tensor], full: str, max_shard_size) -> None:
    """Global rank 0: the export written beside ``full``, then swapped in (or removed on failure)."""
    tmp = export_folder.prepare(full)
    try:
        write_safetensors(_drop_tied(state, model), tmp, max_shard_size)
        if _is_timm(model):
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({"architecture": original_class(model).__name__,
                           "num_classes": getattr(model, "num_classes", None)}, f, indent=2)  # fmt: skip
        else:
            _write_config(model, tmp, _stored_dtype(state))
        export_folder.finish(tmp, full, _replaced)
    except BaseException:
        if os.path.isdir(tmp) and not os.path.lexists(f"{full}.old-{tmp.rsplit('-', 1)[1]}"):
            commit.discard(tmp)  # not yet swapped: nothing else holds the new export
        raise


def save_pretrained(model: nn.Module, path: str, max_shard_size: int | str = "2GB") -> None:
    """Write ``model`` (sharded over any tp x pp x dp) as a plain HuggingFace folder at ``path``.

    Collective: call it on every rank of the model's world. Global rank 0 writes; the others wait.
    ``transformers.<Class>.from_pretrained(path)`` then loads it without shardformer. A timm model
    gets a ``model.safetensors`` (and ``config.json`` with its architecture) that
    ``timm.create_model(...).load_state_dict(safetensors.torch.load_file(...))`` accepts.
    """
    state = gather_full_state(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if rank == 0:
        try:
            full = export_folder.target(path)
            with save_lock(full):
                _write_export(model, state, full, max_shard_size)
        except Exception as e:  # noqa: BLE001 - told to every rank below, then raised
            error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"save_pretrained to {path!r} failed on rank 0: {error}")


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
    through `save_pretrained`, collective on every rank (global rank 0 writes, whatever
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
            f"save_pretrained of a sharded {original_class(model).__name__} does not take {refused}: it gathers "
            f"the whole model and writes safetensors; save the folder, then push or convert it"
        )
    save_pretrained(model, os.fspath(save_directory), max_shard_size)


register_export(save_pretrained_as_hf)
