"""Tensors of a training checkpoint through torch.distributed.checkpoint (DCP), in safetensors files.

Each rank writes its chunks with DCP's `HuggingFaceStorageWriter` (``save_distributed``): safetensors
files whose headers say where each chunk sits in its global tensor. A safetensors file holds a name
once, and a rank may hold several chunks of one tensor (Q, K and V of a fused weight), so a rank's
k-th chunk of a tensor goes to its k-th file (`_ChunkFiles`). Reading back uses DCP's
`HuggingFaceStorageReader`, which rebuilds DCP's metadata from those headers: loading never unpickles.
DCP's own format (``.metadata``, a pickle, and ``.distcp`` files), as plain FSDP2 or accelerate write
it, is read only when the caller allows unpickling (`reader_for`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import Metadata

from shardformer.checkpoint.errors import CheckpointError

PICKLED_METADATA = ".metadata"  # DCP's FileSystemWriter: a pickle


def tensor_file(rank: int, number: int, count: int) -> str:
    """The name of a rank's ``number``-th of ``count`` tensor files. `HuggingFaceStorageReader` reads every
    ``*.safetensors`` file at the top of the folder, whatever its name; this one is not transformers'
    ``shard-...-model-...`` (`shardformer.checkpoint.foreign` tells the two apart by it)."""
    return f"tensors-rank{rank:05d}-{number:05d}-of-{count:05d}.safetensors"


class _ChunkFiles(HuggingFaceStorageWriter):
    """HuggingFaceStorageWriter that puts a rank's repeated chunks of one tensor, and the tensors named in
    ``apart`` (a tied weight's second name: safetensors refuses two names of one storage in a file),
    into files of their own; it remembers the files it wrote."""

    def __init__(self, path: str, apart: dict[str, int]) -> None:
        super().__init__(path, save_distributed=True)
        self.apart, self.written = apart, []

    def write_data(self, plan, planner):
        files: dict[tuple[int, int], list] = {}
        seen: dict[str, int] = {}
        for item in plan.items:
            k = seen.get(item.index.fqn, 0)
            seen[item.index.fqn] = k + 1
            files.setdefault((self.apart.get(item.index.fqn, 0), k), []).append(item)
        work: queue.Queue = queue.Queue()
        for number, items in enumerate((files[k] for k in sorted(files)), start=1):
            name = tensor_file(plan.storage_data["shard_index"] - 1, number, len(files))  # 1-based: DCP's plans
            self.written.append(name)
            work.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, work)


@contextlib.contextmanager
def _single_process_allowed():
    """Without torch.distributed, DCP warns that it assumes one process on every call: one process is
    what is meant, so that warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_state(folder: str, state_dict: dict, apart: dict[str, int], group=None) -> tuple[list[str], Metadata]:
    """Save ``state_dict`` (nested dicts of tensors, chunked ones as `pieces.checkpointable` views) into
    ``folder``; collective. Identical chunks held by several ranks are written once. ``apart``: the
    (flattened) names that share storage with another, each with its number among those names.
    Returns the names of the files this rank wrote and DCP's metadata of every rank's tensors.
    ``group``: the process group of its collectives."""
    writer = _ChunkFiles(folder, apart)
    with _single_process_allowed():
        metadata = dcp.save(state_dict, storage_writer=writer, process_group=group)
    return writer.written, metadata


def is_pickled(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, PICKLED_METADATA))


def safetensors_reader(folder: str) -> HuggingFaceStorageReader:
    """DCP's reader of the safetensors files in ``folder``: their headers are the metadata."""
    return HuggingFaceStorageReader(folder)


def reader_for(folder: str, allow_pickle: bool):
    """The DCP reader for ``folder``: safetensors headers, or DCP's pickled metadata when allowed."""
    if not is_pickled(folder):
        return safetensors_reader(folder)
    if not allow_pickle:
        raise CheckpointError(
            f"{os.path.join(folder, PICKLED_METADATA)} is a pickle (a torch.distributed.checkpoint folder written "
            "by its FileSystemWriter, as plain FSDP2 and accelerate save): unpickling can run any code the file "
            "holds, so it is read only with load_checkpoint(..., allow_pickle=True), for a checkpoint you trust"
        )
    return FileSystemReader(folder)


def read_metadata(folder: str, reader) -> Metadata:
    try:
        return reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged header or pickle alike: name the folder
        raise CheckpointError(f"{folder}: its tensor metadata cannot be read ({type(e).__name__}: {e})") from None


def load_state(state_dict: dict, reader) -> None:
    """Fill ``state_dict``'s tensors (chunked ones only in their pieces) from ``reader``; collective."""
    with _single_process_allowed():
        dcp.load(state_dict, storage_reader=reader)
