"""Optimizer state in training checkpoints, in torch's `get_optimizer_state_dict` form under HF names.

Saved (`optimizer_entries`): every tensor state of this rank's optimizer as ``{name: {key: tensor}}``,
``name`` the parameter's HuggingFace name: a per-element state (Adam's moments, SGD's momentum) as the
pieces of the unsharded tensor its storage holds (a plain optimizer's tp shard, ZeRO-3's rows of it, a
ZeroOptimizer's flat range of it: see `shardformer.checkpoint.pieces`), anything else (Adam's ``step``)
whole; identical pieces held by several ranks are written once. fp32 master copies of low-precision
parameters go under the key ``__master__``. The hyper-parameters, as torch's ``param_groups`` with
names for params, and non-tensor states go to the manifest (JSON).

Loading (`OptimizerReader`) asks DCP for each per-element state at this rank's tensor-parallel (and
expert) shard, dp-unsharded, and hands the optimizer that state (``ZeroOptimizer.load_full_state_dict``,
``ExpertParallelOptimizer.load_full_state_dict`` and ``FullyShardedOptimizer.load_state_dict`` keep their
dp shard of it). Each parameter takes the hyper-parameters of the group it was saved in.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import expert_spec
from shardformer.checkpoint.pieces import checkpointable, compose, flat_range, storage_pieces, tp_pieces
from shardformer.data_parallel import ZeroOptimizer
from shardformer.data_parallel.fsdp import local_shape
from shardformer.data_parallel.fsdp_optimizer import FullyShardedOptimizer
from shardformer.expert_parallel.layout import is_expert_param
from shardformer.expert_parallel.optimizer import ExpertParallelOptimizer
from shardformer.tensor_parallel.detect import names_by_tensor
from shardformer.tensor_parallel.slicer import shard_spec

MASTER = "__master__"


def parts_of(optimizer) -> list:
    """The optimizers saved one after the other: an ExpertParallelOptimizer's dense and expert parts."""
    return list(optimizer.parts) if isinstance(optimizer, ExpertParallelOptimizer) else [optimizer]


def params_of(optimizer) -> list[torch.nn.Parameter]:
    if isinstance(optimizer, ExpertParallelOptimizer):
        return [p for part in optimizer.parts for p in params_of(part)]
    if isinstance(optimizer, ZeroOptimizer):
        return [slot.param for slot in optimizer.slots]
    return [p for group in optimizer.param_groups for p in group["params"]]


def names_by_id(model: nn.Module) -> dict[int, list[str]]:
    return names_by_tensor(model.state_dict(keep_vars=True).items())


def class_name(optimizer) -> str:
    """The optimizer's own class (AdamW, SGD, ...), inside a ZeroOptimizer (or ZeRO-3's wrapper) or not."""
    optimizer = parts_of(optimizer)[0]
    return type(
        optimizer.optim if isinstance(optimizer, (ZeroOptimizer, FullyShardedOptimizer)) else optimizer
    ).__name__


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


def _flat_piece(value: torch.Tensor, param, dp_size: int, dp_rank: int) -> torch.Tensor:
    """A ZeroOptimizer's flat shard of ``param``'s state as DCP chunks of the unsharded tensor: the shard
    copied into the whole rows of the tp shard that it touches."""
    shape, numel = tuple(param.shape), param.numel()
    k = -(-numel // dp_size)
    start, stop = min(dp_rank * k, numel), min((dp_rank + 1) * k, numel)
    full_shape, outer = tp_pieces(shape, shard_spec(param), expert_spec(param))
    first, inner = flat_range(shape, start, stop)
    if not shape:
        return checkpointable(value.reshape(-1)[:1].reshape(()).clone(), full_shape, compose(outer, inner))
    row = math.prod(shape[1:])
    rows = value.new_zeros((-(-stop // row) - first if stop > start else 0, *shape[1:]))
    rows.view(-1)[start - first * row : stop - first * row].copy_(value.reshape(-1)[: stop - start])
    return checkpointable(rows, full_shape, compose(outer, inner))


def _as_saved(value, param, part, per_element: bool, name: str, key: str) -> torch.Tensor:
    if not per_element:
        if value.dim() and _split(param, part):  # one rank's copy would be written for every rank
            raise CheckpointError(
                f"the optimizer state {key!r} of {name} has shape {list(value.shape)}, not the shape of the "
                f"parameter's shard {list(param.shape)}: it is not kept per element (Adafactor's factored "
                f"moments are such a state), so its pieces on the ranks the parameter is split over cannot be "
                f"put together into the unsharded model's state; use an optimizer whose state is per element "
                f"(AdamW, SGD with momentum, ...) or do not split this parameter (tensor_parallel_size=1, ZeRO off)"
            )
        return value.detach().clone()
    if isinstance(part, ZeroOptimizer):
        return _flat_piece(value.detach(), param, part.dp_size, part.dp_rank)
    local, full_shape, pieces = storage_pieces(param, shard_spec(param), expert_spec(param))
    return checkpointable(value.detach().reshape(local.shape), full_shape, pieces)


def _split(param, part) -> bool:
    """Whether ``param``'s optimizer state is split over ranks: cut by tp or ep, or sharded by ZeRO."""
    if shard_spec(param) is not None or expert_spec(param) is not None:
        return True
    if isinstance(part, ZeroOptimizer):
        return part.dp_size > 1
    return isinstance(param, DTensor) and param.device_mesh.size() > 1


def _per_element(value, shape, key) -> bool:
    return torch.is_tensor(value) and tuple(value.shape) == tuple(shape) and not (len(shape) == 0 and key == "step")


def optimizer_entries(model: nn.Module, optimizer, expert_dp_size: int) -> tuple[dict, dict]:
    """This rank's optimizer state for DCP, ``{name: {key: tensor}}``, and its JSON part:
    ``{"param_groups": [settings + params by name], "scalars": {name: {key: value}}, "loss_scaler"}``."""
    names = names_by_id(model)
    state, scalars, groups, loss_scaler = {}, {}, [], None
    for part_index, part in enumerate(parts_of(optimizer)):
        _refuse_experts_over_dp(part, expert_dp_size)
        fsdp = isinstance(part, FullyShardedOptimizer)
        state_dict = part.local_state_dict() if fsdp else part.state_dict()
        params = params_of(part)
        for group in state_dict["param_groups"]:
            named = [names[id(params[i])][0] for i in group["params"] if id(params[i]) in names]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": named})
        zero = state_dict.get("zero", {})
        for local, param in enumerate(params):
            if id(param) not in names:
                continue
            name = names[id(param)][0]
            shape = part.slots[local].master.shape if isinstance(part, ZeroOptimizer) else local_shape(param)
            entry = {**state_dict["state"].get(local, {})}
            if local in zero.get("master_params", {}):
                entry[MASTER] = zero["master_params"][local]
            for key, value in entry.items():
                if torch.is_tensor(value):
                    per_element = _per_element(value, shape, key)
                    state.setdefault(name, {})[key] = _as_saved(value, param, part, per_element, name, key)
                else:
                    scalars.setdefault(name, {})[key] = value
        if part_index == 0:
            loss_scaler = zero.get("loss_scaler")
    return state, {"param_groups": groups, "scalars": scalars, "loss_scaler": loss_scaler}


def merge_infos(infos: list[dict], optimizer_class: str) -> dict:
    """Every rank's JSON part as one: each param group with the names of every stage's parameters."""
    groups: list[dict] = []
    scalars: dict = {}
    for info in infos:
        for number, group in enumerate(info["param_groups"]):
            if number == len(groups):
                groups.append({**group, "params": []})
            groups[number]["params"] += [n for n in group["params"] if n not in groups[number]["params"]]
        scalars.update(info["scalars"])
    return {
        "class": optimizer_class,
        "param_groups": groups,
        "scalars": scalars,
        "loss_scaler": infos[0]["loss_scaler"],
    }


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


def _settings_by_group(where: str, optimizer, saved_group: dict[int, dict | None]) -> list[dict]:
    """torch's param groups for ``optimizer``, each with the hyper-parameters its parameters were saved
    under (where the checkpoint does not record them, the optimizer keeps its own)."""
    groups = _packed_groups(optimizer)
    for number, group in enumerate(groups):
        settings = [saved_group[i] for i in group["params"] if saved_group.get(i) is not None]
        if any(s != settings[0] for s in settings):
            raise CheckpointError(
                f"{where}: the parameters of param group {number} were saved in param groups with different "
                f"settings ({settings[0]} and {next(s for s in settings if s != settings[0])}); build the "
                f"optimizer's param groups as they were when saved"
            )
        if settings:
            group.update(settings[0])
    return groups


class OptimizerReader:
    """What to ask DCP for to give ``optimizer`` its saved state at this rank's layout (`targets`), checked
    against the checkpoint's tensor metadata; then the state to load (`state_dict`). Changes nothing."""

    def __init__(self, where: str, saved: dict | None, metadata, model, optimizer, candidates, prefix: str) -> None:
        """``saved``: the manifest's optimizer part, or what a foreign checkpoint records of it (None:
        nothing); ``candidates(names)``: the names a tensor known here by ``names`` may be saved under (tied
        names too); ``prefix``: what the states' names start with in ``metadata``."""
        self.optimizer, self.saved, self.where = optimizer, saved, where
        names = names_by_id(model)
        by_name: dict[str, list[str]] = {}  # saved name -> its state keys in the metadata
        for fqn, md in metadata.state_dict_metadata.items():
            if fqn.startswith(prefix) and "." in fqn[len(prefix) :] and isinstance(md, TensorStorageMetadata):
                name, key = fqn[len(prefix) :].rsplit(".", 1)
                by_name.setdefault(name, []).append(key)
        group_of = {n: {k: v for k, v in g.items() if k != "params"} for g in (saved or {}).get("param_groups", []) for n in g["params"]}  # fmt: skip
        self.targets, self.plan, self.saved_group, problems = {}, [], {}, []
        for index, param in enumerate(params_of(optimizer)):
            mine = names.get(id(param), [f"parameter {index}"])
            name = next((n for n in candidates(mine) if n in by_name or n in group_of), None)
            if name is None:  # not even in a saved param group: a parameter the checkpoint does not know
                problems.append(f"{mine[0]}: no optimizer state in the checkpoint")
                continue
            self.saved_group[index] = group_of.get(name)
            full_shape, pieces = tp_pieces(tuple(param.shape), shard_spec(param), expert_spec(param))
            for key in by_name.get(name, []):
                md = metadata.state_dict_metadata[f"{prefix}{name}.{key}"]
                if tuple(md.size) == full_shape and (full_shape or key != "step"):  # per element: this rank's shard
                    value = checkpointable(torch.zeros(param.shape, dtype=md.properties.dtype), full_shape, pieces)
                elif key == MASTER:
                    problems.append(
                        f"{name}: its fp32 master has shape {list(md.size)}, the parameter {list(full_shape)}"
                    )
                    continue
                else:  # Adam's step, or a state of its own shape: whole
                    value = torch.zeros(md.size, dtype=md.properties.dtype)
                self.targets.setdefault(name, {})[key] = value
                self.plan.append((index, name, key))
        if problems:
            raise CheckpointError(f"{where} does not fit this optimizer:\n    " + "\n    ".join(problems[:20]))

    def state_dict(self) -> dict:
        state, masters = {}, {}
        scalars = (self.saved or {}).get("scalars", {})
        for index, name, key in self.plan:
            value = self.targets[name][key].detach().clone()  # a plain tensor, not the DCP view
            if key == MASTER:
                masters[index] = value
            else:
                state.setdefault(index, dict(scalars.get(name, {})))[key] = value
        groups = _settings_by_group(self.where, self.optimizer, self.saved_group)
        out = {"state": state, "param_groups": groups}
        if isinstance(self.optimizer, (ZeroOptimizer, ExpertParallelOptimizer)):
            loss_scaler = (self.saved or {}).get("loss_scaler")
            out["zero"] = {"format": "full", "loss_scaler": loss_scaler, "master_params": masters}
        return out


def apply_optimizer(optimizer, state_dict: dict) -> None:
    if isinstance(optimizer, (ZeroOptimizer, ExpertParallelOptimizer)):
        optimizer.load_full_state_dict(state_dict)
    else:
        optimizer.load_state_dict(state_dict)
