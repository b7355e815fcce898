"""Saving and loading ZeroOptimizer state: per-rank shards, or the full (unsharded) state.

Sharded (``state_dict``): each rank saves its own shards in the wrapped optimizer's format plus a
``"zero"`` entry (dp size and rank, param sizes, loss scaler, fp32 masters of half-precision
params). It loads back only at the same dp size, on the same dp rank.

Full (``full_state_dict``): what the wrapped optimizer would save if it had run on the whole
model: every per-element state tensor has its parameter's shape. It is the same at any dp size,
so it reshards (save at dp=2, load at dp=4), and loads into / from a plain torch optimizer.
A state tensor counts as per-element when it has the shape of the master shard (sharded side) or
of the parameter (full side); anything else (Adam's ``step``) is copied as is.
"""

from __future__ import annotations

import torch

from shardformer.core import comm
from shardformer.data_parallel.layout import LOW_PRECISION, read_rows, shard_of

MASTER_KEY = "master_params"


def _low_precision_slots(zo):
    return [s for s in zo.slots if s.param.dtype in LOW_PRECISION]


def _check_param_groups(zo, state_dict: dict, kind: str) -> None:
    saved = [len(g["params"]) for g in state_dict["param_groups"]]
    mine = [len(g["params"]) for g in zo.param_groups]
    if saved != mine:
        raise ValueError(
            f"the {kind} optimizer state has param groups of sizes {saved}, this optimizer {mine}; load a "
            f"state saved for the same model and the same param groups"
        )


def _finish_load(zo, zero: dict, masters: dict[int, torch.Tensor]) -> None:
    """Masters from the saved fp32 copies where there are any, else from the model's weights."""
    zo.reload_master_params()
    with torch.no_grad():
        for slot in zo.slots:
            if slot.index in masters:
                slot.master.copy_(masters[slot.index])
    if zo.loss_scaler is not None and zero.get("loss_scaler") is not None:
        zo.loss_scaler.load_state_dict(zero["loss_scaler"])
    # torch's load_state_dict gave the wrapped optimizer new param-group dicts: share them again, or
    # an LR scheduler (which edits the wrapper's groups) would no longer reach the optimizer.
    zo.param_groups = zo.optim.param_groups
    zo.state = zo.optim.state


def sharded_state_dict(zo) -> dict:
    state_dict = zo.optim.state_dict()
    state_dict["zero"] = {
        "format": "sharded",
        "dp_size": zo.dp_size,
        "dp_rank": zo.dp_rank,
        "stage": zo.stage,
        "numels": [s.numel for s in zo.slots],
        "loss_scaler": zo.loss_scaler.state_dict() if zo.loss_scaler is not None else None,
        MASTER_KEY: {s.index: s.master.detach().clone() for s in _low_precision_slots(zo)},
    }
    return state_dict


def load_sharded_state_dict(zo, state_dict: dict) -> None:
    zero = state_dict.get("zero")
    if zero is None or zero.get("format") != "sharded":
        raise ValueError(
            "this is not a sharded ZeroOptimizer state (no 'zero' entry of format 'sharded'); load a full or "
            "plain-optimizer state with load_full_state_dict()"
        )
    if (zero["dp_size"], zero["dp_rank"]) != (zo.dp_size, zo.dp_rank):
        raise ValueError(
            f"this shard was saved by dp rank {zero['dp_rank']} of {zero['dp_size']}, but this is dp rank "
            f"{zo.dp_rank} of {zo.dp_size}; load each rank's own file at the same dp size, or save with "
            f"full_state_dict() and load with load_full_state_dict() to change the dp size"
        )
    if zero["numels"] != [s.numel for s in zo.slots]:
        raise ValueError("the saved parameter sizes differ from this model's; load a state saved for this model")
    _check_param_groups(zo, state_dict, "sharded")
    # torch's load keeps the given tensors; clone so the saved dict and this optimizer never alias.
    state = {index: _cloned(entry) for index, entry in state_dict["state"].items()}
    zo.optim.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
    _finish_load(zo, zero, zero.get(MASTER_KEY, {}))


def _cloned(entry: dict) -> dict:
    return {key: value.clone() if torch.is_tensor(value) else value for key, value in entry.items()}


def _per_element(value, shape: torch.Size, key) -> bool:
    # A 0-dim parameter has 0-dim moments and a 0-dim `step`: only the name tells them apart.
    return torch.is_tensor(value) and value.shape == shape and not (len(shape) == 0 and key == "step")


def gather_full_state_dict(zo) -> dict:
    """Collective over the dp group; every rank returns the same full state."""
    inner = zo.optim.state_dict()
    entries = []  # (slot, key, shard): everything that must be all-gathered, in one order on all ranks
    for slot in zo.slots:
        for key, value in inner["state"].get(slot.index, {}).items():
            if _per_element(value, slot.master.shape, key):
                entries.append((slot, key, value))
    for slot in _low_precision_slots(zo):
        entries.append((slot, MASTER_KEY, slot.master.detach()))

    # A snapshot: scalars (Adam's `step`) are cloned, or the next step would change them in place.
    full_state = {index: _cloned(st) for index, st in inner["state"].items()}
    masters = {}
    for dtype in sorted({e[2].dtype for e in entries}, key=str):
        group = [e for e in entries if e[2].dtype == dtype]
        send = torch.cat([shard.reshape(-1) for _, _, shard in group])
        out = send.new_empty(zo.dp_size, send.numel())
        if zo.dp_size > 1:
            comm.start_all_gather_flat(out.view(-1), send, zo.dp_group, zo.per_rank).wait()
        else:
            out[0].copy_(send)
        offset = 0
        for slot, key, shard in group:
            full = read_rows(out[:, offset : offset + shard.numel()], slot.numel).view(slot.param.shape).clone()
            offset += shard.numel()
            if key == MASTER_KEY:
                masters[slot.index] = full
            else:
                full_state[slot.index][key] = full
    return {
        "state": full_state,
        "param_groups": inner["param_groups"],
        "zero": {
            "format": "full",
            "loss_scaler": zo.loss_scaler.state_dict() if zo.loss_scaler is not None else None,
            MASTER_KEY: masters,
        },
    }


def load_full_state_dict(zo, state_dict: dict) -> None:
    """Take this rank's shard of every per-element state; local, no communication."""
    zero = state_dict.get("zero") or {}
    if zero.get("format") == "sharded":
        raise ValueError(
            "this is a sharded ZeroOptimizer state (one rank's shard); load it with load_state_dict() at the "
            "same dp size, or save with full_state_dict() to reshard"
        )
    _check_param_groups(zo, state_dict, "full")
    sharded = {}
    for index, entry in state_dict["state"].items():
        index = int(index)
        if not 0 <= index < len(zo.slots):
            raise ValueError(f"the saved state names parameter {index}, but this optimizer has {len(zo.slots)}")
        slot = zo.slots[index]
        sharded[index] = {}
        for key, value in entry.items():
            if _per_element(value, slot.param.shape, key):
                value = shard_of(value.reshape(-1), zo.dp_size, zo.dp_rank)  # a new tensor
            elif torch.is_tensor(value) and value.dim() > 0:
                raise ValueError(
                    f"state {key!r} of parameter {index} has shape {tuple(value.shape)}, but the parameter has "
                    f"shape {tuple(slot.param.shape)}; load a state saved for this model"
                )
            elif torch.is_tensor(value):
                value = value.clone()  # torch's load keeps given tensors: never alias the saved dict
            sharded[index][key] = value
    zo.optim.load_state_dict({"state": sharded, "param_groups": state_dict["param_groups"]})
    masters = {
        int(i): shard_of(t.reshape(-1).to(zo.slots[int(i)].master.dtype), zo.dp_size, zo.dp_rank)
        for i, t in zero.get(MASTER_KEY, {}).items()
    }
    _finish_load(zo, zero, masters)
