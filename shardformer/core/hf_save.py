"""A sharded model's own ``save_pretrained`` writes the whole model, never this rank's shards.

transformers' ``PreTrainedModel.save_pretrained`` writes ``state_dict()`` as it is: on a sharded model
that is rank 0's slices under the sharded class's name, a folder ``from_pretrained`` cannot load. The
sharder therefore routes the method of every sharded model to the library's HuggingFace export. That
export lives in the checkpoint package, above this one, so it registers itself here when imported
(``import shardformer`` imports it); submodules that have their own ``save_pretrained`` (GPT2Model
inside GPT2LMHeadModel) refuse, since their slices cannot be gathered on their own.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch.nn as nn

_EXPORT: list[Callable] = []  # the checkpoint package's export, registered when it is imported


def register_export(export: Callable) -> None:
    """Called once by the checkpoint package: ``export(model, save_directory, *args, **kwargs)``."""
    _EXPORT[:] = [export]


def _save_whole(model: nn.Module, save_directory, *args, **kwargs):
    if not _EXPORT:
        raise RuntimeError("shardformer's HuggingFace export is not loaded; `import shardformer` first")
    return _EXPORT[0](model, save_directory, *args, **kwargs)


def _refuse_part(module: nn.Module, save_directory, *args, **kwargs):
    raise ValueError(
        f"{type(module).__name__} is a part of a sharded model and holds only this rank's slices; call "
        f"save_pretrained on the sharded model itself (it writes the whole model, gathered)"
    )


def route_save_pretrained(model: nn.Module) -> None:
    """Point ``model.save_pretrained`` at the export and make its sub-models' refuse (bound methods, so a
    deepcopy of the model saves the copy)."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("peft."):
            continue  # PEFT's save_pretrained writes the adapter: see shardformer.integrations.peft_layer
        # (the model PEFT wraps holds a peft_config too, and its save_pretrained writes the whole model)
        if callable(getattr(type(module), "save_pretrained", None)):
            method = _save_whole if not name else _refuse_part
            object.__setattr__(module, "save_pretrained", types.MethodType(method, module))
