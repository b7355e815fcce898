"""The files of a training checkpoint beside DCP's tensor files, and reading safetensors naming the file.

A checkpoint folder holds

- ``meta.json``: the manifest (written last, see `shardformer.checkpoint.commit`): every file's
  size and sha256, format, step, ``extra``, the layout it was saved at, the model's class and config,
  the LR scheduler state, the optimizer's class and param groups, tied names, and the sha256 of the
  manifest itself;
- ``tensors-rank<rank>-<k>-of-<n>.safetensors``: the model and optimizer tensors, written by
  torch.distributed.checkpoint (see `shardformer.checkpoint.dcp_io`) under their HuggingFace names
  (``model.<name>``, ``optim.state.<name>.<key>``);
- ``ranks/rank{r}.safetensors`` + ``ranks/rank{r}.json``: global rank ``r``'s RNG states (in a folder of
  their own: DCP's reader takes every safetensors file at the top as tensor data).
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from shardformer.checkpoint.errors import CheckpointError
from shardformer.expert_parallel.layout import ExpertSpec
from shardformer.tensor_parallel.slicer import shard_spec

RANKS = "ranks"


def expert_spec(tensor) -> ExpertSpec | None:
    """How expert parallelism split ``tensor`` (rows of dim 0), or None."""
    return getattr(tensor, "expert_spec", None)


def rank_files(rank: int) -> tuple[str, str]:
    return f"{RANKS}/rank{rank}.safetensors", f"{RANKS}/rank{rank}.json"


def dtype_kind(dtype: torch.dtype) -> str:
    """float, int or bool: loading may convert within a kind (fp32 to bf16), never across."""
    return "bool" if dtype == torch.bool else "float" if dtype.is_floating_point else "int"


class SafeFile:
    """A safetensors file opened for reading, every failure reported naming the file."""

    def __init__(self, file: str) -> None:
        self.file = file
        try:
            self.handle = safe_open(file, "pt")
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike: name the file
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None

    def names(self) -> list[str]:
        return list(self.handle.keys())  # noqa: SIM118 - a safetensors handle, not a dict

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a missing name or damaged data: name the file
            raise CheckpointError(f"{self.file}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None


def full_shape(tensor: torch.Tensor) -> list[int]:
    """The unsharded shape: the tp-cut dimension at full size, every expert counted."""
    shape = list(tensor.shape)
    spec = shard_spec(tensor)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    experts = expert_spec(tensor)
    if experts is not None:
        shape[0] = experts.full_rows
    return shape
