"""Checkpoints: HuggingFace export, resumable training checkpoints, shard-on-load.

- `save_pretrained` writes a sharded model as a plain HuggingFace (or timm) folder; a sharded
  model's own ``model.save_pretrained(dir)`` is routed to it.
- `save_checkpoint` / `load_checkpoint` save and resume training at any (tp, pp, dp).
- `convert_to_hf` writes a training checkpoint as that HuggingFace folder, offline on CPU.
- `load_sharded` builds a sharded model from a HuggingFace folder, each rank reading only its slices.
- `CheckpointError` is what they raise for a path or a file they refuse, naming it and the problem.
"""

from shardformer.checkpoint.convert import convert_to_hf
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.gather import gather_full_state, layout_of
from shardformer.checkpoint.hf_export import save_pretrained
from shardformer.checkpoint.shard_load import load_sharded
from shardformer.checkpoint.training import load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "convert_to_hf",
    "gather_full_state",
    "layout_of",
    "load_checkpoint",
    "load_sharded",
    "save_checkpoint",
    "save_pretrained",
]
