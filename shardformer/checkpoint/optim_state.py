"""Optimizer state in training checkpoints: each rank's shard out, any layout's shard back in.

Saved per rank: every tensor state of this rank's optimizer (a ZeroOptimizer's dp shards, ZeRO-3's
dp row shards or a plain optimizer's states), named ``opt.<index>.<key>``, plus JSON saying which
parameter (all its names, its ShardSpec and local shape) each index is, which states are
per-element, the scalars, the param groups and the loss scaler. Loading puts each per-element state
of a parameter back together like the parameter itself (dp pieces concatenated, tp shards merged),
cuts this rank's tp shard and hands the optimizer a dp-unsharded state
(``ZeroOptimizer.load_full_state_dict`` and ``FullyShardedOptimizer.load_state_dict`` shard it over
dp). Reading (:func:`read_optimizer`) checks every state against this rank's parameters and changes
nothing; :func:`apply_optimizer` then cannot fail on the checkpoint's account.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from shardformer.checkpoint import typed_json
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import SafeFile, rank_files, reshard_local, spec_from_json, spec_to_json
from shardformer.data_parallel import ZeroOptimizer
from shardformer.data_parallel.fsdp import local_shape
from shardformer.data_parallel.fsdp_optimizer import FullyShardedOptimizer
from shardformer.tensor_parallel.detect import names_by_tensor
from shardformer.tensor_parallel.slicer import shard_spec

MASTER = "__master__"


def _params_of(optimizer) -> list[torch.nn.Parameter]:
    if isinstance(optimizer, ZeroOptimizer):
        return [slot.param for slot in optimizer.slots]
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names_by_id(model: nn.Module) -> dict[int, list[str]]:
    return names_by_tensor(model.state_dict(keep_vars=True).items())


def _class_name(optimizer) -> str:
    """The optimizer's own class (AdamW, SGD, ...), inside a ZeroOptimizer (or ZeRO-3's wrapper) or not."""
    return type(
        optimizer.optim if isinstance(optimizer, (ZeroOptimizer, FullyShardedOptimizer)) else optimizer
    ).__name__


def _packed_groups(optimizer) -> list[dict]:
    """torch's state-dict param groups (hyper-parameters, params numbered in order) without asking the
    optimizer for its state (at ZeRO-3 that gathers every state over dp)."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + count))}
        )
        start += count
    return groups


def _check_class(saved: _Saved, optimizer) -> None:
    """Refuse another kind of optimizer: its states would load without error and mean something else
    (AdamW's moments dropped by SGD, SGD's momentum buffers unread by AdamW)."""
    mine = _class_name(optimizer)
    for rank, info in saved.ranks.items():
        theirs = info["optimizer"].get("class")  # None: saved before the class was recorded
        if theirs not in (None, mine):
            file = os.path.join(saved.path, rank_files(rank)[1])
            raise CheckpointError(
                f"{file} holds {theirs} optimizer state, and this optimizer is {mine}; resume with "
                f"torch.optim.{theirs}(...) (or your own {theirs}), or call load_checkpoint without optimizer= "
                "to start a fresh optimizer state"
            )


def _is_per_element(value, shape, key) -> bool:
    return torch.is_tensor(value) and tuple(value.shape) == tuple(shape) and not (len(shape) == 0 and key == "step")


def optimizer_payload(model: nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's optimizer state as (tensors for safetensors, JSON-able description)."""
    zero = isinstance(optimizer, ZeroOptimizer)
    fsdp = isinstance(optimizer, FullyShardedOptimizer)  # dp shards too: rows of dim 0, in dp order
    state_dict = optimizer.local_state_dict() if fsdp else optimizer.state_dict()
    params = _params_of(optimizer)
    names = _names_by_id(model)
    tensors, per_element, scalars = {}, {}, {}
    for index, param in enumerate(params):
        shape = optimizer.slots[index].master.shape if zero else local_shape(param) if fsdp else param.shape
        per_element[index], scalars[index] = [], {}  # int keys: typed JSON keeps them
        for key, value in state_dict["state"].get(index, {}).items():
            if torch.is_tensor(value):
                tensors[f"opt.{index}.{key}"] = value.detach().cpu()
                if _is_per_element(value, shape, key):
                    per_element[index].append(key)
            else:
                scalars[index][key] = value
    zero_info = state_dict.get("zero", {})
    for index, master in zero_info.get("master_params", {}).items():
        tensors[f"opt.{index}.{MASTER}"] = master.detach().cpu()
        per_element[index].append(MASTER)
    info = {
        "kind": "zero" if zero or fsdp else "plain",
        "class": _class_name(optimizer),
        "params": [
            {"names": names.get(id(p), []), "spec": spec_to_json(shard_spec(p)), "shape": list(p.shape)} for p in params
        ],
        "per_element": per_element,
        "has_state": [i for i in range(len(params)) if i in state_dict["state"]],
        "scalars": scalars,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]],
        "loss_scaler": zero_info.get("loss_scaler"),
    }
    return tensors, info


class _Saved:
    """All ranks' saved optimizer descriptions, and lazy access to their tensors."""

    def __init__(self, path: str, world: int) -> None:
        self.path, self.ranks, self._files = path, {}, {}
        for rank in range(world):
            file = os.path.join(path, rank_files(rank)[1])
            info = typed_json.load(file)
            try:
                if info["optimizer"] is not None:
                    self.ranks[rank] = info
                    for key in ("kind", "params", "per_element", "has_state", "scalars", "param_groups"):
                        info["optimizer"][key]  # noqa: B018 - present, or reported below naming the file
            except (KeyError, TypeError) as e:
                raise CheckpointError(f"{file}: the optimizer description is damaged (no {e})") from None
        self.where: dict[str, list[tuple[int, int]]] = {}
        for rank, info in self.ranks.items():
            for index, param in enumerate(info["optimizer"]["params"]):
                for name in param["names"]:
                    self.where.setdefault(name, []).append((rank, index))

    def _file(self, rank: int) -> SafeFile:
        if rank not in self._files:
            self._files[rank] = SafeFile(os.path.join(self.path, rank_files(rank)[0]))
        return self._files[rank]

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        return self._file(rank).get(key)

    def keys(self, rank: int) -> list[str]:
        return self._file(rank).names()

    def locate(self, names: list[str]) -> dict[int, list[tuple[int, int]]]:
        """{saved tp rank: [(global rank, index) by dp rank]} of one pipeline stage holding the param."""
        hits = next((self.where[n] for n in names if n in self.where), None)
        if hits is None:
            raise CheckpointError(f"{self.path}: no rank file holds optimizer state for parameter {names[0]!r}")
        stage = self.ranks[hits[0][0]]["coords"]["pp"]
        by_tp: dict[int, list[tuple[int, int, int]]] = {}
        for rank, index in hits:
            coords = self.ranks[rank]["coords"]
            if coords["pp"] == stage:
                by_tp.setdefault(coords["tp"], []).append((coords["dp"], rank, index))
        return {t: [(r, i) for _, r, i in sorted(v)] for t, v in by_tp.items()}


def _put_together(saved: _Saved, located, key: str, my_spec) -> torch.Tensor:
    pieces = {}
    spec = None
    for tp_rank, replicas in located.items():
        rank0, index0 = replicas[0]
        opt = saved.ranks[rank0]["optimizer"]
        param = opt["params"][index0]
        spec = spec_from_json(param["spec"])
        shape = param["shape"]
        numel = int(torch.Size(shape).numel())
        # dp pieces of the flattened param in dp order: ZeroOptimizer's padded flat pieces, or ZeRO-3's
        # dim-0 row chunks (contiguous, so flattened they are consecutive pieces too)
        if opt["kind"] == "zero":
            flat = torch.cat([saved.tensor(r, f"opt.{i}.{key}").reshape(-1) for r, i in replicas])
            pieces[tp_rank] = flat[:numel].view(shape)
        else:
            pieces[tp_rank] = saved.tensor(rank0, f"opt.{index0}.{key}").view(shape)
    return reshard_local(pieces, spec, my_spec)


def read_optimizer(path: str, model: nn.Module, optimizer, world: int) -> dict:
    """The state to give ``optimizer`` from the checkpoint at ``path``, at this rank's layout; changes nothing."""
    saved = _Saved(path, world)
    _check_class(saved, optimizer)
    zero = isinstance(optimizer, ZeroOptimizer)
    names = _names_by_id(model)
    state, masters = {}, {}
    reference = None
    for index, param in enumerate(_params_of(optimizer)):
        my_names = names.get(id(param), [f"parameter {index}"])
        located = saved.locate(my_names)
        rank0, index0 = next(iter(located.values()))[0]
        opt = saved.ranks[rank0]["optimizer"]
        reference = reference or opt
        if index0 not in opt["has_state"]:
            continue
        entry = dict(opt["scalars"].get(index0, {}))
        for key in opt["per_element"].get(index0, []):
            value = _put_together(saved, located, key, shard_spec(param))
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{os.path.join(path, rank_files(rank0)[0])}: state {key!r} of {my_names[0]} comes to "
                    f"{tuple(value.shape)}, this rank's parameter is {tuple(param.shape)}"
                )
            if key == MASTER:
                masters[index] = value
            else:
                entry[key] = value
        prefix = f"opt.{index0}."
        for full_key in saved.keys(rank0):
            key = full_key[len(prefix) :] if full_key.startswith(prefix) else None
            if key is not None and key not in entry and key != MASTER:
                entry[key] = saved.tensor(rank0, full_key)  # scalars such as Adam's step
        state[index] = entry
    groups = _packed_groups(optimizer)
    saved_groups = reference["param_groups"] if reference else []
    if reference is not None and len(saved_groups) != len(groups):
        raise CheckpointError(
            f"{path}: the saved optimizer has {len(saved_groups)} param groups, this one {len(groups)}"
        )
    for group, old in zip(groups, saved_groups):
        group.update({k: v for k, v in old.items() if k != "params"})
    if zero:
        return {"state": state, "param_groups": groups,
                "zero": {"format": "full", "loss_scaler": reference and reference["loss_scaler"], "master_params": masters}}  # fmt: skip
    return {"state": state, "param_groups": groups}


def apply_optimizer(optimizer, state_dict: dict) -> None:
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_full_state_dict(state_dict)
    else:
        optimizer.load_state_dict(state_dict)
