"""Copy a HuggingFace folder's weights into an already sharded model, in place (each rank its slices).

What resuming needs: the optimizer holds the model's Parameter objects, so they are written into,
never replaced. The folder is the one `save_pretrained` writes (tied names saved once).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import expert_spec
from shardformer.checkpoint.shard_load import SafetensorsReader, read_shard, weight_map
from shardformer.tensor_parallel.slicer import shard_spec


def load_pretrained_into(model: nn.Module, path: str) -> None:
    """Overwrite every parameter and buffer of ``model`` with this rank's slice of the folder at ``path``."""
    files = weight_map(path)
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    missing = [names[0] for names, _ in groups.values() if not any(n in files for n in names)]
    if missing:
        raise CheckpointError(f"{path} lacks {missing[:10]}; was it saved from this model?")
    readers: dict[str, SafetensorsReader] = {}
    try:
        for names, tensor in groups.values():
            saved = next(n for n in names if n in files)
            if files[saved] not in readers:
                readers[files[saved]] = SafetensorsReader(os.path.join(path, files[saved]))
            value = read_shard(readers[files[saved]], saved, shard_spec(tensor), expert_spec(tensor))
            if value.shape != tensor.shape:
                raise CheckpointError(
                    f"{saved}: {path} holds {tuple(value.shape)} for this rank, the model {tuple(tensor.shape)}"
                )
            with torch.no_grad():
                tensor.copy_(value)
    finally:
        for reader in readers.values():
            reader.close()
