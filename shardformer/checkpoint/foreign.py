"""Where a checkpoint's tensors are: in ours, and in the torch.distributed.checkpoint (DCP) folders other
tools write, so that `load_checkpoint` resumes from them.

- shardformer's own (``meta.json``): one folder, the model under ``model.``, the optimizer under
  ``optim.state.``; tensors read from safetensors headers.
- plain DCP (``.metadata`` at the path, as ``dcp.save({"model": get_model_state_dict(m), "optim": ...})``
  after plain FSDP2 writes): the model under ``model.``, the optimizer under ``optim.state.`` or
  ``optimizer.state.``.
- accelerate's FSDP2 sharded state (``save_state`` under ``SHARDED_STATE_DICT``): ``pytorch_model_fsdp_<i>/``
  (``model.``) and ``optimizer_<i>/`` (``optimizer.state.``), two DCP folders; the path is accelerate's
  output folder or the model folder inside it.
- transformers' distributed checkpoint (``save_pretrained(..., distributed_checkpoint=True)``):
  ``shard-NNNNN-model-NNNNN-of-NNNNN.safetensors`` files, names without a prefix, read from their headers;
  its optimizer state (``save_optimizer_distributed``, ``optimizer.state.``) is a DCP folder of its own, at
  the same path or at ``optimizer_path``.

A foreign folder whose metadata is a pickle is read only when unpickling is allowed (`dcp_io.reader_for`).
A foreign optimizer state records its hyper-parameters by parameter name (accelerate: param groups listing
names; transformers: flattened per name); they come back as the manifest's would (`Found.settings`).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from shardformer.checkpoint import commit, dcp_io
from shardformer.checkpoint.errors import CheckpointError

OURS = "shardformer"
_ACCELERATE_MODEL = re.compile(r"pytorch_model_fsdp_(\d+)$")
_TRANSFORMERS_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$")
_SCHEDULER_KEYS = {"initial_lr"}  # added to a param group by an LR scheduler, not by the optimizer


@dataclass(frozen=True)
class Stored:
    """Tensors of one DCP folder whose names start with ``key`` (``"model"``, ``"optim.state"``; ``""``: none)."""

    folder: str
    reader: object
    metadata: Metadata
    key: str

    def name(self, name: str) -> str:
        """The DCP name of the model name (or optimizer state name) ``name``."""
        return f"{self.key}.{name}" if self.key else name

    def names(self) -> list[str]:
        """The names under ``key``, without it."""
        start = len(self.key) + 1 if self.key else 0
        return [k[start:] for k in self.metadata.state_dict_metadata if not self.key or k.startswith(self.key + ".")]

    def nest(self, targets: dict) -> dict:
        """``targets`` (by names without ``key``) as DCP flattens them into this folder's names."""
        return {self.key: targets} if self.key else targets


@dataclass(frozen=True)
class Found:
    """A checkpoint's model tensors, its optimizer state (None: not asked for), and, for a foreign one, the
    optimizer's hyper-parameters by name as the manifest holds them (``{"param_groups", "scalars"}``)."""

    tool: str
    model: Stored
    optimizer: Stored | None
    settings: dict | None = None

    def loads(self, model_targets: dict, optimizer_targets: dict | None) -> list[tuple[dict, object]]:
        """(targets, reader) for each ``dcp.load`` this checkpoint takes: one per folder."""
        if optimizer_targets is None:
            return [(self.model.nest(model_targets), self.model.reader)]
        if self.optimizer.reader is self.model.reader:
            return [(self.model.nest(model_targets) | self.optimizer.nest(optimizer_targets), self.model.reader)]
        return [
            (self.model.nest(model_targets), self.model.reader),
            (self.optimizer.nest(optimizer_targets), self.optimizer.reader),
        ]


def _stored(folder: str, allow_pickle: bool, key: str, reader=None) -> Stored:
    reader = reader if reader is not None else dcp_io.reader_for(folder, allow_pickle)
    return Stored(folder, reader, dcp_io.read_metadata(folder, reader), key)


def ours(path: str, with_optimizer: bool) -> Found:
    model = _stored(path, False, "model")
    optimizer = Stored(path, model.reader, model.metadata, "optim.state") if with_optimizer else None
    return Found(OURS, model, optimizer)


def _optimizer_key(stored: Stored) -> str | None:
    """``optim.state`` or ``optimizer.state``: where ``get_optimizer_state_dict``'s states sit in the folder."""
    for key in ("optim.state", "optimizer.state"):
        if any(k.startswith(key + ".") for k in stored.metadata.state_dict_metadata):
            return key
    return None


def _optimizer(folder: str, allow_pickle: bool, tool: str, model: Stored | None = None) -> Stored:
    """The optimizer state in ``folder`` (the model's own folder when ``model`` is given)."""
    if not os.path.isdir(folder):
        raise CheckpointError(
            f"{folder}: no such folder, where {tool} keeps the optimizer state; pass optimizer_path=, or call "
            "load_checkpoint without optimizer= to start a fresh optimizer state"
        )
    stored = model if model is not None else _stored(folder, allow_pickle, "")
    key = _optimizer_key(stored)
    if key is None:
        raise CheckpointError(
            f"{folder} (written by {tool}) holds no optimizer state (no 'optim.state.' or 'optimizer.state.' "
            "names); pass optimizer_path=, or call load_checkpoint without optimizer= to start a fresh one"
        )
    return Stored(stored.folder, stored.reader, stored.metadata, key)


def _accelerate_model(path: str) -> str | None:
    """accelerate's model folder at ``path`` or inside it (``pytorch_model_fsdp_<i>``), or None."""
    if _ACCELERATE_MODEL.match(os.path.basename(os.path.normpath(path))) and dcp_io.is_pickled(path):
        return path
    inside = sorted(
        n for n in os.listdir(path) if _ACCELERATE_MODEL.match(n) and dcp_io.is_pickled(os.path.join(path, n))
    )
    if len(inside) > 1:
        raise CheckpointError(
            f"{path} holds the states of {len(inside)} models saved by accelerate ({', '.join(inside)}); "
            "pass the folder of the one to load"
        )
    return os.path.join(path, inside[0]) if inside else None


def locate(path: str, with_optimizer: bool, allow_pickle: bool, optimizer_path: str | None) -> Found | None:
    """The foreign checkpoint at ``path`` (None: ours, or nothing recognized: the manifest check says which)."""
    if os.path.isfile(os.path.join(path, commit.META)):
        return None
    accelerate = _accelerate_model(path)
    if accelerate is not None:
        tool = "accelerate (FSDP2 sharded state)"
        model = _stored(accelerate, allow_pickle, "model")
        index = _ACCELERATE_MODEL.match(os.path.basename(os.path.normpath(accelerate))).group(1)
        default = os.path.join(os.path.dirname(os.path.normpath(accelerate)), f"optimizer_{index}")
    elif any(_TRANSFORMERS_SHARD.match(n) for n in os.listdir(path)):
        tool = "transformers (distributed checkpoint)"
        model = _stored(path, False, "", reader=dcp_io.safetensors_reader(path))
        default = path
    elif dcp_io.is_pickled(path):
        tool = "torch.distributed.checkpoint"
        model = _stored(path, allow_pickle, "model")
        default = path
    else:
        return None
    if not with_optimizer:
        return Found(tool, model, None)
    where = os.path.abspath(optimizer_path) if optimizer_path is not None else default
    same = where == model.folder and model.key  # the optimizer beside the model, in one DCP folder
    optimizer = _optimizer(where, allow_pickle, tool, model if same else None)
    return Found(tool, model, optimizer, _settings(optimizer, allow_pickle))


def _settings(stored: Stored, allow_pickle: bool) -> dict:
    """The hyper-parameters (by parameter name) and non-tensor states that ``stored`` holds as objects:
    torch's param groups (``<top>.param_groups.<i>.<key>``, ``params`` listing names) or their flattened
    form (``<top>.param_groups.<name>.<key>``, as ``flatten_optimizer_state_dict`` writes)."""
    top = stored.key.removesuffix(".state")
    wanted = {k: None for k, md in stored.metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    wanted = {k: v for k, v in wanted.items() if k.startswith((f"{top}.param_groups.", f"{stored.key}."))}
    if wanted:  # each rank reads them by itself: no collective before every rank's checks agree
        with warnings.catch_warnings():  # DCP warns that no_dist reads in one process: asked for, here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(wanted, storage_reader=dcp_io.reader_for(stored.folder, allow_pickle), no_dist=True)
    groups: dict[str, dict] = {}
    scalars: dict[str, dict] = {}
    for k, value in wanted.items():
        inside, key = k.rsplit(".", 1)
        if inside.startswith(f"{top}.param_groups."):
            groups.setdefault(inside[len(f"{top}.param_groups.") :], {})[key] = value
        else:
            scalars.setdefault(inside[len(stored.key) + 1 :], {})[key] = value
    param_groups = []
    for group, settings in groups.items():
        params = settings.pop("params", None)
        param_groups.append({**settings, "params": list(params) if params is not None else [group]})
    return {"param_groups": param_groups, "scalars": scalars, "loss_scaler": None}


def check_same_kind(where: str, settings: dict, optimizer, mine: str) -> None:
    """A foreign optimizer state names no class: refuse one whose param groups hold other hyper-parameters
    (an SGD's state given to an AdamW would load its momentum as nothing, or fail late)."""
    own = set(optimizer.param_groups[0]) - {"params"} - _SCHEDULER_KEYS
    for group in settings["param_groups"]:
        theirs = set(group) - {"params"} - _SCHEDULER_KEYS
        if theirs != own:
            raise CheckpointError(
                f"{where}: the optimizer state was saved with the hyper-parameters {sorted(theirs)}, and this "
                f"{mine} has {sorted(own)}: resume with the optimizer class that saved it, or call "
                "load_checkpoint without optimizer= to start a fresh optimizer state"
            )
