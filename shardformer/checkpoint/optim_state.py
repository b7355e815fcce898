"""Optimizer state in training checkpoints: each rank's shard out, any layout's shard back in.

Saved per rank: every tensor state of this rank's optimizer (a ZeroOptimizer's dp shards, ZeRO-3's
dp row shards, a plain optimizer's states, or an ExpertParallelOptimizer's two ZeroOptimizers one
after the other), named ``opt.<index>.<key>``, plus JSON saying which parameter (all its names, its
ShardSpec, ExpertSpec, local shape and param group) each index is, which states are per-element, the
scalars, the param groups and the loss scaler. Loading puts each per-element state of a parameter
back together like the parameter itself (the dp pieces of its ZeRO group concatenated, tp shards
merged, the ep ranks' experts stacked), cuts this rank's experts and tp shard and hands the optimizer
a dp-unsharded state (``ZeroOptimizer.load_full_state_dict``,
``ExpertParallelOptimizer.load_full_state_dict`` and ``FullyShardedOptimizer.load_state_dict`` shard
it over their groups). Each parameter takes the hyper-parameters of the group it was saved in, so an
optimizer whose groups are split differently (one group at ep=1, dense and expert groups at ep > 1)
loads the same settings. Reading (`read_optimizer`) checks every state against this rank's parameters and changes
nothing; `apply_optimizer` then cannot fail on the checkpoint's account.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from shardformer.checkpoint import typed_json
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import (
    SafeFile,
    cut,
    expert_spec,
    experts_from_json,
    experts_to_json,
    own_piece,
    put_together,
    rank_files,
    spec_from_json,
    spec_to_json,
)
from shardformer.data_parallel import ZeroOptimizer
from shardformer.data_parallel.fsdp import local_shape
from shardformer.data_parallel.fsdp_optimizer import FullyShardedOptimizer
from shardformer.expert_parallel.experts import is_expert_param
from shardformer.expert_parallel.optimizer import ExpertParallelOptimizer
from shardformer.tensor_parallel.detect import names_by_tensor
from shardformer.tensor_parallel.slicer import shard_spec

MASTER = "__master__"


def _parts(optimizer) -> list:
    """The optimizers saved one after the other: an ExpertParallelOptimizer's dense and expert parts."""
    return list(optimizer.parts) if isinstance(optimizer, ExpertParallelOptimizer) else [optimizer]


def _params_of(optimizer) -> list[torch.nn.Parameter]:
    if isinstance(optimizer, ExpertParallelOptimizer):
        return [p for part in optimizer.parts for p in _params_of(part)]
    if isinstance(optimizer, ZeroOptimizer):
        return [slot.param for slot in optimizer.slots]
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names_by_id(model: nn.Module) -> dict[int, list[str]]:
    return names_by_tensor(model.state_dict(keep_vars=True).items())


def _class_name(optimizer) -> str:
    """The optimizer's own class (AdamW, SGD, ...), inside a ZeroOptimizer (or ZeRO-3's wrapper) or not."""
    optimizer = _parts(optimizer)[0]
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


def _refuse_experts_over_dp(part, expert_dp_size: int) -> None:
    """A ZeroOptimizer over the whole dp group would mix different ep ranks' experts in one flat shard."""
    if isinstance(part, ZeroOptimizer) and part.dp_size != expert_dp_size:
        held = [s.param for s in part.slots if is_expert_param(s.param)]
        if held:
            raise CheckpointError(
                f"a ZeroOptimizer over {part.dp_size} dp ranks holds expert-parallel parameters (split over "
                f"ep={held[0].expert_spec.ep_size}), whose ZeRO group must be the {expert_dp_size} ranks holding "
                f"the same experts; train with ParallelEngine(EngineConfig(ep=...)), which steps them apart"
            )


def optimizer_payload(model: nn.Module, optimizer, expert_dp_size: int) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's optimizer state as (tensors for safetensors, JSON-able description)."""
    names = _names_by_id(model)
    tensors, per_element, scalars, params, groups, has_state = {}, {}, {}, [], [], []
    loss_scaler = None
    for part_index, part in enumerate(_parts(optimizer)):
        _refuse_experts_over_dp(part, expert_dp_size)
        zero = isinstance(part, ZeroOptimizer)
        fsdp = isinstance(part, FullyShardedOptimizer)  # dp shards too: rows of dim 0, in dp order
        state_dict = part.local_state_dict() if fsdp else part.state_dict()
        group_of = {i: len(groups) + g for g, group in enumerate(state_dict["param_groups"]) for i in group["params"]}
        start = len(params)
        for local, param in enumerate(_params_of(part)):
            index = start + local
            shape = part.slots[local].master.shape if zero else local_shape(param) if fsdp else param.shape
            per_element[index], scalars[index] = [], {}  # int keys: typed JSON keeps them
            state = state_dict["state"].get(local)
            if state is not None:
                has_state.append(index)
            for key, value in (state or {}).items():
                if torch.is_tensor(value):
                    tensors[f"opt.{index}.{key}"] = value.detach().cpu()
                    if _is_per_element(value, shape, key):
                        per_element[index].append(key)
                else:
                    scalars[index][key] = value
            params.append({
                "names": names.get(id(param), []), "spec": spec_to_json(shard_spec(param)),
                "experts": experts_to_json(expert_spec(param)), "shape": list(param.shape), "group": group_of.get(local),
            })  # fmt: skip
        zero_info = state_dict.get("zero", {})
        for local, master in zero_info.get("master_params", {}).items():
            tensors[f"opt.{start + local}.{MASTER}"] = master.detach().cpu()
            per_element[start + local].append(MASTER)
        groups += [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
        if part_index == 0:
            loss_scaler = zero_info.get("loss_scaler")
    kind = "zero" if isinstance(_parts(optimizer)[0], (ZeroOptimizer, FullyShardedOptimizer)) else "plain"
    info = {
        "kind": kind, "class": _class_name(optimizer), "params": params, "per_element": per_element,
        "has_state": has_state, "scalars": scalars, "param_groups": groups, "loss_scaler": loss_scaler,
    }  # fmt: skip
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

    def locate(self, names: list[str]) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """{(saved ep rank, tp rank): [(global rank, index) by dp rank]} of one pipeline stage holding
        the param: the ranks of each list hold pieces of the same tensor (its ZeRO group)."""
        hits = next((self.where[n] for n in names if n in self.where), None)
        if hits is None:
            raise CheckpointError(f"{self.path}: no rank file holds optimizer state for parameter {names[0]!r}")
        stage = self.ranks[hits[0][0]]["coords"]["pp"]
        by_place: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for rank, index in hits:
            coords = self.ranks[rank]["coords"]
            experts = experts_from_json(self.ranks[rank]["optimizer"]["params"][index].get("experts"))
            if coords["pp"] == stage:
                place = (0 if experts is None else experts.rank, coords["tp"])
                by_place.setdefault(place, []).append((coords["dp"], rank, index))
        return {place: [(r, i) for _, r, i in sorted(v)] for place, v in by_place.items()}


def _put_together(saved: _Saved, located, key: str, param: torch.Tensor) -> torch.Tensor:
    """State ``key`` of a parameter, from the saved pieces, cut for this rank's ``param`` (only this rank's
    piece read where the layout is the one saved)."""
    pieces, specs, experts = {}, {}, None
    for place, replicas in located.items():
        rank0, index0 = replicas[0]
        opt = saved.ranks[rank0]["optimizer"]
        entry = opt["params"][index0]
        specs[place], experts = spec_from_json(entry["spec"]), experts_from_json(entry.get("experts"))
        shape = entry["shape"]
        numel = int(torch.Size(shape).numel())
        # dp pieces of the flattened param in dp order: ZeroOptimizer's padded flat pieces, or ZeRO-3's
        # dim-0 row chunks (contiguous, so flattened they are consecutive pieces too)
        if opt["kind"] == "zero":
            pieces[place] = lambda replicas=replicas, shape=shape, numel=numel: torch.cat(
                [saved.tensor(r, f"opt.{i}.{key}").reshape(-1) for r, i in replicas]
            )[:numel].view(shape)
        else:
            pieces[place] = lambda rank0=rank0, index0=index0, shape=shape: saved.tensor(
                rank0, f"opt.{index0}.{key}"
            ).view(shape)
    own = own_piece(specs, experts, shard_spec(param), expert_spec(param))
    if own is not None:
        return pieces[own]()
    full = put_together(pieces, next(iter(specs.values())), experts, f"{saved.path}: optimizer state {key!r}")
    return cut(full, shard_spec(param), expert_spec(param))


def _settings_by_group(path: str, optimizer, saved_group: dict[int, dict | None], reference) -> list[dict]:
    """torch's param groups for ``optimizer``, each with the hyper-parameters its parameters were saved
    under; checkpoints that did not record each parameter's group match the groups by position."""
    groups = _packed_groups(optimizer)
    if reference is None:
        return groups
    if any(v is None for v in saved_group.values()):
        saved_groups = reference["param_groups"]
        if len(saved_groups) != len(groups):
            raise CheckpointError(
                f"{path}: the saved optimizer has {len(saved_groups)} param groups, this one {len(groups)}"
            )
        for group, old in zip(groups, saved_groups):
            group.update({k: v for k, v in old.items() if k != "params"})
        return groups
    for number, group in enumerate(groups):
        settings = [saved_group[i] for i in group["params"]]
        if any(s != settings[0] for s in settings):
            raise CheckpointError(
                f"{path}: the parameters of param group {number} were saved in param groups with different "
                f"settings ({settings[0]} and {next(s for s in settings if s != settings[0])}); build the "
                f"optimizer's param groups as they were when saved"
            )
        if settings:
            group.update({k: v for k, v in settings[0].items() if k != "params"})
    return groups


def read_optimizer(path: str, model: nn.Module, optimizer, world: int) -> dict:
    """The state to give ``optimizer`` from the checkpoint at ``path``, at this rank's layout; changes nothing."""
    saved = _Saved(path, world)
    _check_class(saved, optimizer)
    names = _names_by_id(model)
    state, masters, saved_group = {}, {}, {}
    reference = None
    for index, param in enumerate(_params_of(optimizer)):
        my_names = names.get(id(param), [f"parameter {index}"])
        located = saved.locate(my_names)
        rank0, index0 = next(iter(located.values()))[0]
        opt = saved.ranks[rank0]["optimizer"]
        reference = reference or opt
        group = opt["params"][index0].get("group")
        saved_group[index] = None if group is None else opt["param_groups"][group]
        if index0 not in opt["has_state"]:
            continue
        entry = dict(opt["scalars"].get(index0, {}))
        for key in opt["per_element"].get(index0, []):
            value = _put_together(saved, located, key, param)
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
    groups = _settings_by_group(path, optimizer, saved_group, reference)
    if isinstance(optimizer, (ZeroOptimizer, ExpertParallelOptimizer)):
        return {"state": state, "param_groups": groups,
                "zero": {"format": "full", "loss_scaler": reference and reference["loss_scaler"], "master_params": masters}}  # fmt: skip
    return {"state": state, "param_groups": groups}


def apply_optimizer(optimizer, state_dict: dict) -> None:
    if isinstance(optimizer, (ZeroOptimizer, ExpertParallelOptimizer)):
        optimizer.load_full_state_dict(state_dict)
    else:
        optimizer.load_state_dict(state_dict)
