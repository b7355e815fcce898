"""Whole HuggingFace safetensors files from the pieces that torch.distributed.checkpoint (DCP) wrote.

DCP's `HuggingFaceStorageWriter` with ``save_distributed=True`` (`shardformer.checkpoint.dcp_io`) leaves
each rank's pieces in safetensors files whose header says, per tensor, where the piece sits in the
whole tensor (``DCP_SHARDING_INFO``). Consolidation reads those headers (`chunks_in`), splits the
output tensors into files as transformers does (`plan_files`: ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``), and writes each file one
tensor at a time (`write_file`): a writer holds one whole tensor and one piece, never the model. Files
are independent, so every rank can write its share of them (``files[rank::world]``). This is the idea
of DCP's ``consolidate_safetensors_files``, written small so that a file's tensors can be renamed
(a training checkpoint's ``model.`` prefix) and chosen (not its optimizer state).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors.torch import _getdtype

from shardformer.checkpoint.errors import CheckpointError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_SHARDING = "DCP_SHARDING_INFO"


@dataclass(frozen=True)
class Chunk:
    """One piece of a tensor: bytes ``[start, stop)`` of ``file``, at ``offsets`` in the whole tensor."""

    file: str
    start: int
    stop: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    dtype: str  # safetensors' name of it ("F32", "BF16", ...)


def _header(file: str) -> tuple[dict, int]:
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def chunks_in(folder: str) -> dict[str, list[Chunk]]:
    """Every tensor's pieces in the DCP safetensors files at the top of ``folder``, by its saved name."""
    out: dict[str, list[Chunk]] = {}
    for name in sorted(os.listdir(folder)):
        file = os.path.join(folder, name)
        if not name.endswith(".safetensors") or not os.path.isfile(file):
            continue
        try:
            header, data_start = _header(file)
            sharding = json.loads(header.get("__metadata__", {})[_SHARDING])
        except (OSError, ValueError, KeyError, struct.error) as e:
            raise CheckpointError(
                f"{file}: not a safetensors file of pieces DCP wrote ({type(e).__name__}: {e})"
            ) from None
        for key, entry in header.items():
            if key != "__metadata__":
                begin, end = entry["data_offsets"]
                offsets = tuple(sharding[key]["saved_offsets"])
                chunk = Chunk(
                    file, data_start + begin, data_start + end, tuple(entry["shape"]), offsets, entry["dtype"]
                )
                out.setdefault(key, []).append(chunk)
    return out


def whole_shape(chunks: list[Chunk]) -> tuple[int, ...]:
    return tuple(max(c.offsets[d] + c.shape[d] for c in chunks) for d in range(len(chunks[0].shape)))


def dtype_of(chunks: list[Chunk]) -> torch.dtype:
    return _getdtype(chunks[0].dtype)


def nbytes(chunks: list[Chunk]) -> int:
    return math.prod(whole_shape(chunks)) * _getdtype(chunks[0].dtype).itemsize


def plan_files(sizes: dict[str, int], max_shard_size: int | str) -> tuple[dict[str, list[str]], bool]:
    """``{file name: output names}`` in order, as transformers splits a state dict; whether it is split."""
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda n: n, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    return {name: list(names) for name, names in split.filename_to_tensors.items()}, split.is_sharded


def _assembled(name: str, chunks: list[Chunk]) -> torch.Tensor:
    """The whole tensor from its pieces (each read straight from its file, not mapped)."""
    dtype = _getdtype(chunks[0].dtype)
    whole = torch.empty(whole_shape(chunks), dtype=dtype)
    covered = 0
    for chunk in chunks:
        with open(chunk.file, "rb") as f:
            f.seek(chunk.start)
            data = bytearray(f.read(chunk.stop - chunk.start))
        piece = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape))
        whole[box] = piece.view(chunk.shape)
        covered += math.prod(chunk.shape)
    if covered != whole.numel():  # pieces never overlap: DCP writes each once
        raise CheckpointError(f"{name}: the saved pieces cover {covered} of its {whole.numel()} elements")
    return whole


def write_file(file: str, names: dict[str, str], chunks: dict[str, list[Chunk]]) -> None:
    """Write ``file`` holding ``names`` (``{output name: saved name}``, in order), one tensor at a time."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for out, saved in names.items():
        size = nbytes(chunks[saved])
        header[out] = {"dtype": chunks[saved][0].dtype, "shape": list(whole_shape(chunks[saved])),
                       "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for out, saved in names.items():
            whole = _assembled(out, chunks[saved])
            f.write(memoryview(whole.reshape(-1).view(torch.uint8).numpy()))  # no copy of the tensor
        f.flush()
        os.fsync(f.fileno())


def write_index(folder: str, files: dict[str, list[str]], sizes: dict[str, int]) -> None:
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {n: file for file, names in files.items() for n in names}}  # fmt: skip
    with open(os.path.join(folder, SAFE_INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
