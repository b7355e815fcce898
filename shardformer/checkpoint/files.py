"""The files of a training checkpoint, and reading a tensor back at any tp size.

A checkpoint folder holds

- ``meta.json``: the manifest (written last, see `shardformer.checkpoint.commit`): every file's
  size and sha256, format, step, ``extra``, the layout it was saved at, the model's class and config,
  the LR scheduler state, and the sha256 of the manifest itself;
- ``model-pp{p}-tp{t}.safetensors``: stage ``p``'s tensors as tp rank ``t`` holds them (written by
  dp rank 0), with each tensor's ShardSpec, ExpertSpec, full shape and tied aliases in the file's
  metadata;
- ``model-pp{p}-tp{t}-ep{e}.safetensors`` (expert parallelism): the experts ep rank ``e > 0`` holds
  (written by dp rank ``e``, the first rank holding them), experts only;
- ``rank{r}.safetensors`` + ``rank{r}.json``: global rank ``r``'s optimizer shard and RNG states.

`ModelIndex` finds every saved piece of a tensor by name and rebuilds it for a new layout
(`put_together`: the saved tp shards merged within each ep rank's experts, the ep ranks'
experts stacked), then cuts this rank's piece (`cut`: its experts' rows, then its tp shard).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
from safetensors import safe_open

from shardformer.checkpoint.errors import CheckpointError
from shardformer.expert_parallel.experts import ExpertSpec
from shardformer.tensor_parallel.slicer import ShardSpec, merge_shards, shard_spec, slice_tensor

_MODEL_FILE = re.compile(r"model-pp(\d+)-tp(\d+)(?:-ep(\d+))?\.safetensors$")


def model_file(pp_rank: int, tp_rank: int, ep_rank: int = 0) -> str:
    return f"model-pp{pp_rank}-tp{tp_rank}{f'-ep{ep_rank}' if ep_rank else ''}.safetensors"


def expert_spec(tensor) -> ExpertSpec | None:
    """How expert parallelism split ``tensor`` (rows of dim 0), or None."""
    return getattr(tensor, "expert_spec", None)


def experts_to_json(spec: ExpertSpec | None):
    return None if spec is None else asdict(spec)


def experts_from_json(data) -> ExpertSpec | None:
    return None if data is None else ExpertSpec(**data)


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
    """The unsharded shape: the tp-cut dimension at full size, every expert counted."""
    shape = list(tensor.shape)
    spec = shard_spec(tensor)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    experts = expert_spec(tensor)
    if experts is not None:
        shape[0] = experts.num_experts
    return shape


def model_tensors(named: dict[str, torch.Tensor], experts_only: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Unique tensors under their first name, and the metadata describing each (specs, shape, aliases);
    ``experts_only``: just the expert-parallel ones (an ep rank > 0 writes only what differs from ep rank 0)."""
    first: dict[int, str] = {}
    tensors, info = {}, {}
    for name, tensor in named.items():
        if id(tensor) in first:
            info[first[id(tensor)]]["aliases"].append(name)
            continue
        first[id(tensor)] = name
        if experts_only and expert_spec(tensor) is None:
            continue
        tensors[name] = tensor.detach().contiguous().cpu()
        info[name] = {
            "spec": spec_to_json(shard_spec(tensor)), "experts": experts_to_json(expert_spec(tensor)),
            "shape": full_shape(tensor), "aliases": [],
        }  # fmt: skip
    return tensors, info


def put_together(
    pieces: dict[tuple[int, int], Callable[[], torch.Tensor]], spec: ShardSpec | None, experts: ExpertSpec | None,
    what: str,
) -> torch.Tensor:  # fmt: skip
    """The full tensor from its saved pieces, keyed (ep rank, tp rank) and read when needed: the tp shards
    merged within each ep rank's experts, the ep ranks' experts stacked on dim 0 in expert order."""
    parts = []
    for ep_rank in range(experts.ep_size if experts is not None else 1):
        mine = {t: read for (e, t), read in pieces.items() if e == ep_rank}
        needed = range(spec.world_size) if spec is not None else sorted(mine)[:1] or [0]
        missing = [t for t in needed if t not in mine]
        if missing:
            where = f" of ep rank {ep_rank}" if experts is not None else ""
            raise CheckpointError(f"{what}: the pieces from tp ranks {missing}{where} are missing")
        read = [mine[t]() for t in needed]
        parts.append(read[0] if spec is None else merge_shards(read, spec))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def expert_split(spec: ExpertSpec | None) -> ExpertSpec | None:
    """How a tensor's experts are split, whichever rank holds which (the ExpertSpec of ep rank 0)."""
    return None if spec is None else replace(spec, rank=0)


def own_piece(
    saved: dict[tuple[int, int], ShardSpec | None], saved_experts: ExpertSpec | None, spec: ShardSpec | None,
    experts: ExpertSpec | None,
) -> tuple[int, int] | None:  # fmt: skip
    """The (ep rank, tp rank) of the saved piece that is this rank's piece as it is (the layout it was saved
    at), else None; ``saved`` maps each saved piece to its ShardSpec."""
    if expert_split(saved_experts) != expert_split(experts):
        return None
    ep_rank = 0 if experts is None else experts.rank
    if spec is not None:
        key = (ep_rank, spec.rank)
        return key if key in saved and saved[key] == spec else None
    whole = sorted(t for (e, t), s in saved.items() if e == ep_rank and s is None)
    return (ep_rank, whole[0]) if whole else None


def cut(full: torch.Tensor, spec: ShardSpec | None, experts: ExpertSpec | None) -> torch.Tensor:
    """This rank's piece of a full tensor: its experts' rows of dim 0, then its tp shard."""
    if experts is not None:
        full = full[experts.first : experts.first + experts.local]
    return full if spec is None else slice_tensor(full, spec)


class ModelIndex:
    """Every model tensor of a checkpoint: name -> {(ep rank, tp rank): (file, spec)}, with full shapes
    and the ExpertSpec each expert tensor was saved under."""

    def __init__(self, path: str, files) -> None:
        self.path = path
        self.pieces: dict[str, dict[tuple[int, int], tuple[str, ShardSpec | None]]] = {}
        self.experts: dict[str, ExpertSpec | None] = {}
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
                    experts = experts_from_json(entry.get("experts"))
                    key = (0 if experts is None else experts.rank, tp_rank)
                    self.pieces.setdefault(name, {}).setdefault(key, (file, spec_from_json(entry["spec"])))
                    self.experts[name] = expert_split(experts)
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

    def _reader(self, name: str, file: str) -> Callable[[], torch.Tensor]:
        return lambda: self.handle(file).get(name)

    def shard(self, name: str, spec: ShardSpec | None, experts: ExpertSpec | None = None) -> torch.Tensor:
        """This rank's piece of ``name`` for ``spec`` and ``experts`` (the saved piece itself when the
        layout is the same)."""
        pieces = self.pieces[name]
        key = own_piece({k: s for k, (_, s) in pieces.items()}, self.experts[name], spec, experts)
        if key is not None:
            return self.handle(pieces[key][0]).get(name)
        readers = {key: self._reader(name, file) for key, (file, _) in pieces.items()}
        full = put_together(readers, self.saved_spec(name), self.experts[name], f"{self.path}: {name!r}")
        return cut(full, spec, experts)
