"""Shard-on-load: build a sharded model from a HuggingFace folder, each rank reading only its slices.

The model is built with its parameters on the meta device (no memory, no initialisation), sharded
by its policy (the slicer cuts meta tensors like real ones, so every parameter gets its ShardSpec;
expert parallelism keeps this rank's experts of the meta tensors, tagged with their ExpertSpec),
and then each rank reads just the rows or columns its specs name from the safetensors files
(byte runs read with ``pread``, see `SafetensorsReader`), so a rank's peak memory is about model / tp instead
of the whole model. Tied weights stay one Parameter: it is materialised once and set under all its
names. Buffers are built for real (they are small, and non-persistent ones are not in the files);
every buffer the files hold is then read from them, cut like the model cut it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from contextlib import contextmanager

import torch
import torch.nn as nn
import transformers
from safetensors import safe_open
from torch.overrides import TorchFunctionMode
from transformers.initialization import no_init_weights

from shardformer.api import shard_model
from shardformer.checkpoint.consolidate import SAFE_INDEX, SAFE_WEIGHTS
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import dtype_kind, expert_spec, full_shape
from shardformer.core.config import ShardConfig
from shardformer.expert_parallel.layout import ExpertSpec
from shardformer.tensor_parallel.slicer import ShardSpec, shard_spec


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` (how layers allocate their weights before initialising them) makes meta tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def parameters_on_meta():
    """Parameters built inside live on the meta device; buffers stay real.

    Weights that layers allocate with ``torch.empty`` are never allocated at all; any other parameter
    (``torch.randn``, ``torch.zeros``, ...) is moved to meta as it is registered.
    """
    register = nn.Module.register_parameter

    def to_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = to_meta
    try:
        with _EmptyOnMeta():
            yield
    finally:
        nn.Module.register_parameter = register


def _inside(path: str, file) -> str:
    """``file`` (a name from the index) as a path inside the folder ``path``; anything else is refused."""
    norm = os.path.normpath(file) if isinstance(file, str) and file else ""
    if not norm or os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep):
        raise CheckpointError(f"{os.path.join(path, SAFE_INDEX)}: names the file {file!r}, which is not inside {path}")
    return norm


def weight_map(path: str) -> dict[str, str]:
    """{tensor name: safetensors file} of a HuggingFace folder (one file, or shards with an index)."""
    index = os.path.join(path, SAFE_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, "rb") as f:
                files = json.loads(f.read().decode("utf-8"))["weight_map"]
            if not isinstance(files, dict):
                raise TypeError(f"weight_map is a {type(files).__name__}, not a dict")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a readable safetensors index ({type(e).__name__}: {e})") from None
        return {name: _inside(path, file) for name, file in files.items()}
    single = os.path.join(path, SAFE_WEIGHTS)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{path} has neither {SAFE_WEIGHTS} nor {SAFE_INDEX}; save it with safetensors")
    reader = SafetensorsReader(single)
    reader.close()
    return dict.fromkeys(reader.header, SAFE_WEIGHTS)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsReader:
    """Reads index ranges of tensors from a safetensors file with ``pread`` straight into the result.

    ``safe_open(...).get_slice`` memory-maps the file, and every page a slice touches then counts in
    the process's resident memory; a column slice touches nearly every page of a weight. Reading
    just the needed byte runs keeps a rank's memory at its own shard. The header is first checked by
    ``safe_open`` itself (every tensor's dtype, shape and byte range consistent, the file fully
    covered), so the offsets read here can be trusted; each read also stays inside its tensor.
    """

    def __init__(self, file: str) -> None:
        self.file = file
        try:
            with safe_open(file, "pt"):
                pass
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                self.header = json.loads(f.read(length))
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: name the file
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
        self.header.pop("__metadata__", None)
        self.base = 8 + length
        self.fd = os.open(file, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)

    def shape(self, name: str) -> list[int]:
        return list(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self.header[name]["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(f"{self.file}: {name} has dtype {code}, which shardformer cannot load")
        return _DTYPES[code]

    def check(self, name: str, tensor: torch.Tensor, shape: list[int]) -> None:
        """Refuse what ``from_pretrained`` refuses: a saved tensor of another size or kind than the model's."""
        if self.shape(name) != list(shape):
            raise CheckpointError(
                f"{self.file}: {name} has shape {self.shape(name)}, the model (built from its config) expects "
                f"{list(shape)}; the config does not match the weights"
            )
        if dtype_kind(self.dtype(name)) != dtype_kind(tensor.dtype):
            raise CheckpointError(
                f"{self.file}: {name} is {self.header[name]['dtype']}, the model holds {tensor.dtype}"
            )

    def _read_into(self, view: memoryview, offset: int, name: str) -> None:
        start, stop = (self.base + o for o in self.header[name]["data_offsets"])
        if offset < start or offset + len(view) > stop:
            raise CheckpointError(f"{self.file}: a read of {name} would leave its bytes [{start}, {stop})")
        while len(view):
            got = os.preadv(self.fd, [view], offset)
            if got <= 0:
                raise CheckpointError(f"{self.file}: ended inside {name} (the file changed while being read?)")
            view, offset = view[got:], offset + got

    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """``tensor.narrow(dim, start, stop - start)`` of the saved tensor, reading only those bytes;
        ``rows`` (with ``dim`` > 0) also narrows dim 0 to ``[rows[0], rows[1])`` (an ep rank's experts)."""
        info = self.header[name]
        dtype, shape = self.dtype(name), list(info["shape"])
        if rows is not None:
            if dim == 0 or not 0 <= rows[0] <= rows[1] <= shape[0]:
                raise CheckpointError(f"{self.file}: rows {rows} of dim 0 of {name} asked with dim {dim}")
            first = rows[0] * math.prod(shape[1:])
            begin_rows = self.base + info["data_offsets"][0] + first * _element_size(dtype)
            return self._narrow(name, dtype, [rows[1] - rows[0], *shape[1:]], begin_rows, dim, start, stop)
        begin = self.base + info["data_offsets"][0]
        if not shape:
            out = torch.empty((), dtype=dtype)
            self._read_into(memoryview(out.reshape(1).view(torch.uint8).numpy()), begin, name)
            return out
        return self._narrow(name, dtype, shape, begin, dim, start, stop)

    def _narrow(self, name, dtype, shape: list[int], begin: int, dim: int, start: int, stop: int | None):
        """The narrowing of ``read`` on a tensor of ``shape`` whose bytes start at ``begin``."""
        stop = shape[dim] if stop is None else stop
        if not 0 <= start <= stop <= shape[dim]:
            raise CheckpointError(f"{self.file}: rows {start}:{stop} of {name} asked, it has {shape[dim]} on dim {dim}")
        out_shape = shape[:dim] + [stop - start] + shape[dim + 1 :]
        out = torch.empty(out_shape, dtype=dtype)
        if out.numel() == 0:
            return out
        inner = math.prod(shape[dim + 1 :]) * out.element_size()
        run, stride = (stop - start) * inner, shape[dim] * inner
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
        for i in range(math.prod(shape[:dim])):
            self._read_into(buffer[i * run : (i + 1) * run], begin + i * stride + start * inner, name)
        return out


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_shard(
    reader: SafetensorsReader, name: str, spec: ShardSpec | None, experts: ExpertSpec | None = None
) -> torch.Tensor:
    """The piece of ``name`` that ``spec`` (and ``experts``: rows of dim 0) give this rank (vocabulary
    padding rows zero)."""
    rows = None if experts is None else experts.row_span
    if spec is None or spec.world_size == 1 and spec.padded_size == spec.full_size:
        return reader.read(name) if rows is None else reader.read(name, 0, *rows)
    if rows is not None and spec.dim == 0:
        raise CheckpointError(f"{reader.file}: {name} is split by experts and by tp on the same dim 0")
    shape = reader.shape(name)
    if rows is not None:
        shape[0] = rows[1] - rows[0]
    pieces, offset = [], 0
    for index, (block, per_block) in enumerate(zip(spec.block_sizes, spec.local_block_sizes)):
        start, offset = offset + spec.piece(index) * per_block, offset + block
        stop = min(start + per_block, spec.full_size)
        if stop > start:
            pieces.append(reader.read(name, spec.dim, start, stop, rows))
        if stop - start < per_block:  # vocabulary padding (n_cast is 1 then)
            pad = list(shape)
            pad[spec.dim] = per_block - max(stop - start, 0)
            pieces.append(torch.zeros(pad, dtype=reader.dtype(name)))
    return torch.cat(pieces, dim=spec.dim) if len(pieces) > 1 else pieces[0]


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    if leaf in owner._parameters:
        owner._parameters[leaf] = value
    else:
        owner._buffers[leaf] = value


def materialize_from_safetensors(model: nn.Module, path: str, device=None) -> None:
    """Replace every meta tensor of ``model`` by this rank's slice read from the folder at ``path``."""
    files = weight_map(path)
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    # Meta tensors (parameters, empty-built buffers) and every persistent buffer the files hold: a buffer
    # built for real (mBART's final_logits_bias, zeros) still carries the checkpoint's values.
    todo = [
        (names, t)
        for names, t in groups.values()
        if t.device.type == "meta" or not isinstance(t, nn.Parameter) and any(n in files for n in names)
    ]
    missing = [names[0] for names, _ in todo if not any(n in files for n in names)]
    unknown = sorted(set(files) - {n for names, _ in groups.values() for n in names})
    if missing and unknown:
        raise CheckpointError(
            f"{path} lacks the tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} and holds tensors this "
            f"model does not name ({unknown[:4]}{' ...' if len(unknown) > 4 else ''}): it is saved in a layout "
            f"transformers converts when loading (experts one by one, as transformers' own save_pretrained writes "
            f"Mixtral or Qwen3-MoE, for one); load_sharded reads the model's own layout only: load it with "
            f"from_pretrained + shard_model, or export it once with shardformer's save_pretrained"
        )
    if missing:
        raise CheckpointError(f"{path} lacks the tensors {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
                         f"was it saved from this model class? (a buffer built with torch.empty and not saved cannot be restored)")  # fmt: skip
    handles = {}
    try:
        problems = []  # every header checked before any read, all mismatches reported at once
        for names, tensor in todo:
            saved = next(n for n in names if n in files)
            file = files[saved]
            if file not in handles:
                handles[file] = SafetensorsReader(os.path.join(path, file))
            if saved not in handles[file].header:
                raise CheckpointError(f"{os.path.join(path, file)}: lacks {saved}, which the index places there")
            try:
                handles[file].check(saved, tensor, full_shape(tensor))
            except CheckpointError as e:
                problems.append(str(e))
        if problems:
            raise CheckpointError(f"cannot load {path} into this model:\n  " + "\n  ".join(problems))
        for names, tensor in todo:
            saved = next(n for n in names if n in files)
            file = files[saved]
            spec, experts = shard_spec(tensor), expert_spec(tensor)
            value = read_shard(handles[file], saved, spec, experts).to(device=device or "cpu", dtype=tensor.dtype)
            if value.shape != tensor.shape:
                raise CheckpointError(
                    f"{saved}: read {tuple(value.shape)} from {file}, this rank holds {tuple(tensor.shape)}"
                )
            if isinstance(tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=tensor.requires_grad)
            if spec is not None:  # a cut buffer (final_logits_bias with a vocab-parallel head) keeps its layout
                value.shard_spec = spec
            if experts is not None:
                value.expert_spec = experts
            for name in names:
                _set_tensor(model, name, value)
    finally:
        for reader in handles.values():
            reader.close()


def load_sharded(cls_or_name, path: str, shard_config=None, policy=None, device=None, **hf_kwargs) -> nn.Module:
    """Build ``cls`` (a transformers class or its name) from the folder ``path``, sharded on load.

    ``shard_config`` / ``policy`` are as for `shardformer.shard_model`; ``hf_kwargs`` go to the
    model's construction (``attn_implementation=``, ``dtype=``) or its config; weights are read
    straight onto ``device`` (default CPU; buffers are moved there too). Every rank reads only
    its own slices; the result equals ``shard_model(cls.from_pretrained(path), shard_config)``.
    """
    cls = getattr(transformers, cls_or_name) if isinstance(cls_or_name, str) else cls_or_name
    build = {k: hf_kwargs.pop(k) for k in ("attn_implementation", "dtype", "torch_dtype") if k in hf_kwargs}
    dtype = build.pop("dtype", build.pop("torch_dtype", None))
    config = cls.config_class.from_pretrained(path, **hf_kwargs)
    with parameters_on_meta(), no_init_weights():
        model = cls._from_config(config, **build)
        if callable(getattr(model, "tie_weights", None)):
            model.tie_weights()  # transformers ties on loading, not on construction
    if dtype is not None:
        model = model.to(dtype)
    model.eval()  # as from_pretrained returns it
    model = shard_model(model, shard_config or ShardConfig(), policy)
    materialize_from_safetensors(model, path, device)
    return model if device is None else model.to(device)
