"""The files of a training checkpoint, and reading a tensor back at any tp size.

A checkpoint folder holds

- ``meta.json``: format, step, ``extra``, the layout it was saved at, the LR scheduler state;
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

from shardformer.slicer import ShardSpec, merge_shards, shard_spec, slice_tensor

META = "meta.json"
FORMAT = "shardformer-checkpoint/1"
_MODEL_FILE = re.compile(r"model-pp(\d+)-tp(\d+)\.safetensors$")


def model_file(pp_rank: int, tp_rank: int) -> str:
    return f"model-pp{pp_rank}-tp{tp_rank}.safetensors"


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank{rank}.safetensors", f"rank{rank}.json"


def spec_to_json(spec: ShardSpec | None):
    return None if spec is None else asdict(spec)


def spec_from_json(data) -> ShardSpec | None:
    return None if data is None else ShardSpec(**data)


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


def json_dump(obj, path: str, what: str) -> None:
    def refuse(value):
        if isinstance(value, tuple):
            return list(value)
        raise TypeError(f"{what} holds {type(value).__name__} {value!r}, which JSON cannot store")

    with open(path, "w") as f:
        json.dump(obj, f, default=refuse, indent=1)


def json_load(path: str):
    with open(path) as f:
        return json.load(f)


class ModelIndex:
    """Every model tensor of a checkpoint: name -> {tp rank: (file, spec)}, with full shapes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pieces: dict[str, dict[int, tuple[str, ShardSpec | None]]] = {}
        self.shapes: dict[str, list[int]] = {}
        self.alias: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        found = sorted(f for f in os.listdir(path) if _MODEL_FILE.match(f))
        if not found:
            raise FileNotFoundError(f"{path} holds no model-pp*-tp*.safetensors files; is it a training checkpoint?")
        for file in found:
            tp_rank = int(_MODEL_FILE.match(file).group(2))
            info = json.loads(self.handle(file).metadata()["shardformer"])
            for name, entry in info.items():
                self.pieces.setdefault(name, {}).setdefault(tp_rank, (file, spec_from_json(entry["spec"])))
                self.shapes[name] = entry["shape"]
                for alias in entry["aliases"]:
                    self.alias.setdefault(alias, name)

    def handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), "pt")
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
            return self.handle(file).get_tensor(name)
        missing = [t for t in range(spec.world_size) if t not in pieces]
        if missing:
            raise ValueError(f"{self.path}: the shards of {name!r} from tp ranks {missing} are missing")
        return merge_shards([self.handle(pieces[t][0]).get_tensor(name) for t in range(spec.world_size)], spec)

    def shard(self, name: str, spec: ShardSpec | None) -> torch.Tensor:
        """This rank's piece of ``name`` for ``spec`` (the saved shard itself when the layout is the same)."""
        if spec is not None and spec.rank in self.pieces[name]:
            file, saved = self.pieces[name][spec.rank]
            if saved == spec:
                return self.handle(file).get_tensor(name)
        full = self.full(name)
        return full if spec is None else slice_tensor(full, spec)


def reshard_local(pieces: dict[int, torch.Tensor], saved: ShardSpec | None, spec: ShardSpec | None) -> torch.Tensor:
    """Tensors shaped like saved tp shards (by saved tp rank) -> this rank's piece under ``spec``."""
    if spec is not None and saved == spec:
        return pieces[spec.rank]
    full = pieces[min(pieces)] if saved is None else merge_shards([pieces[t] for t in range(saved.world_size)], saved)
    return full if spec is None else slice_tensor(full, spec)
