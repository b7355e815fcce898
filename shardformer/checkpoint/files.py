"""The files of a training checkpoint, and reading a tensor back at any tp size.

A checkpoint folder holds

- ``meta.json``: the manifest (written last, see :mod:`shardformer.checkpoint.commit`): every file's
  size and sha256, format, step, ``extra``, the layout it was saved at, the model's class and config,
  the LR scheduler state, and the sha256 of the manifest itself;
- ``model-pp{p}-tp{t}.safetensors``: stage ``p``'s tensors as tp rank ``t`` holds them (written by
  dp rank 0), with each tensor's ShardSpec, full shape and tied aliases in the file's metadata;
- ``rank{r}.safetensors`` + ``rank{r}.json``: global rank ``r``'s optimizer shard and RNG states.

:class:`ModelIndex` finds every saved piece of a tensor by name and rebuilds it for a new layout:
merge the saved tp shards (``merge_shards``), then cut this rank's shard (``slice_tensor``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict

import torch
from safetensors import safe_open

from shardformer.checkpoint.errors import CheckpointError
from shardformer.tensor_parallel.slicer import ShardSpec, merge_shards, shard_spec, slice_tensor

_MODEL_FILE = re.compile(r"model-pp(\d+)-tp(\d+)\.safetensors$")


def model_file(pp_rank: int, tp_rank: int) -> str:
    return f"model-pp{pp_rank}-tp{tp_rank}.safetensors"


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank{rank}.safetensors", f"rank{rank}.json"


def dtype_kind(dtype: torch.dtype) -> str:
    """float, int or bool: loading may convert within a kind (fp32 to bf16), never across."""
    return "bool" if dtype == torch.bool else "float" if dtype.is_floating_point else "int"


def spec_to_json(spec: ShardSpec | None):
    return None if spec is None else asdict(spec)


def spec_from_json(data) -> ShardSpec | None:
    if data is None:
        return None
    lists = {k: tuple(v) for k in ("blocks", "splits") if isinstance(v := data.get(k), list)}
    return ShardSpec(**(data | lists))


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

    def metadata(self, key: str):
        """A JSON entry of the file's metadata."""
        try:
            return json.loads((self.handle.metadata() or {})[key])
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{self.file}: its metadata entry {key!r} is missing or damaged ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a missing name or damaged data: name the file
            raise CheckpointError(f"{self.file}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None


def full_shape(tensor: torch.Tensor) -> list[int]:
    shape = list(tensor.shape)
    spec = shard_spec(tensor)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return shape


def model_tensors(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Unique tensors under their first name, and the metadata describing each (spec, shape, aliases)."""
    first: dict[int, str] = {}
    tensors, info = {}, {}
    for name, tensor in named.items():
        if id(tensor) in first:
            info[first[id(tensor)]]["aliases"].append(name)
            continue
        first[id(tensor)] = name
        tensors[name] = tensor.detach().contiguous().cpu()
        info[name] = {"spec": spec_to_json(shard_spec(tensor)), "shape": full_shape(tensor), "aliases": []}
    return tensors, info


class ModelIndex:
    """Every model tensor of a checkpoint: name -> {tp rank: (file, spec)}, with full shapes."""

    def __init__(self, path: str, files) -> None:
        self.path = path
        self.pieces: dict[str, dict[int, tuple[str, ShardSpec | None]]] = {}
        self.shapes: dict[str, list[int]] = {}
        self.alias: dict[str, str] = {}
        self._handles: dict[str, SafeFile] = {}
        found = sorted(f for f in files if _MODEL_FILE.match(f))
        if not found:
            raise CheckpointError(f"{path} holds no model-pp*-tp*.safetensors files; is it a training checkpoint?")
        for file in found:
            tp_rank = int(_MODEL_FILE.match(file).group(2))
            handle = self.handle(file)
            info = handle.metadata("shardformer")
            try:
                for name, entry in info.items():
                    self.pieces.setdefault(name, {}).setdefault(tp_rank, (file, spec_from_json(entry["spec"])))
                    self.shapes[name] = list(entry["shape"])
                    for alias in entry["aliases"]:
                        self.alias.setdefault(alias, name)
            except (AttributeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{handle.file}: its tensor list is damaged ({type(e).__name__}: {e})") from None
            missing = sorted(set(info) - set(handle.names()))
            if missing:
                raise CheckpointError(f"{handle.file}: lists tensors {missing[:5]} it does not hold")

    def handle(self, file: str) -> SafeFile:
        if file not in self._handles:
            self._handles[file] = SafeFile(os.path.join(self.path, file))
        return self._handles[file]

    def resolve(self, names: list[str]) -> str | None:
        """The saved name for a tensor known here under any of ``names`` (tied names included)."""
        for name in names:
            if name in self.pieces:
                return name
        for name in names:
            if name in self.alias:
                return self.alias[name]
        return None

    def saved_spec(self, name: str) -> ShardSpec | None:
        return next(iter(self.pieces[name].values()))[1]

    def full(self, name: str) -> torch.Tensor:
        """The full tensor (saved tp shards merged, padding cut)."""
        pieces = self.pieces[name]
        spec = self.saved_spec(name)
        if spec is None:
            file = pieces[min(pieces)][0]
            return self.handle(file).get(name)
        missing = [t for t in range(spec.world_size) if t not in pieces]
        if missing:
            raise CheckpointError(f"{self.path}: the shards of {name!r} from tp ranks {missing} are missing")
        return merge_shards([self.handle(pieces[t][0]).get(name) for t in range(spec.world_size)], spec)

    def shard(self, name: str, spec: ShardSpec | None) -> torch.Tensor:
        """This rank's piece of ``name`` for ``spec`` (the saved shard itself when the layout is the same)."""
        if spec is not None and spec.rank in self.pieces[name]:
            file, saved = self.pieces[name][spec.rank]
            if saved == spec:
                return self.handle(file).get(name)
        full = self.full(name)
        return full if spec is None else slice_tensor(full, spec)


def reshard_local(pieces: dict[int, torch.Tensor], saved: ShardSpec | None, spec: ShardSpec | None) -> torch.Tensor:
    """Tensors shaped like saved tp shards (by saved tp rank) -> this rank's piece under ``spec``."""
    if spec is not None and saved == spec:
        return pieces[spec.rank]
    full = pieces[min(pieces)] if saved is None else merge_shards([pieces[t] for t in range(saved.world_size)], saved)
    return full if spec is None else slice_tensor(full, spec)
