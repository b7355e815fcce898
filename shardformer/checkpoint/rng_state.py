"""Each rank's random number generators in a training checkpoint: CPU, CUDA, Python's, and the per-rank
dropout streams of tensor-parallel layers; restored only at the layout they were saved at (elsewhere a
rank's streams mean something else)."""

from __future__ import annotations

import os
import random

import torch
import torch.nn as nn
from safetensors.torch import save_file

from shardformer.checkpoint import typed_json
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.files import SafeFile, rank_files


def rng_payload(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    dropout = {}
    for name, module in model.named_modules():
        if callable(getattr(module, "get_rng_state", None)):
            dropout[name] = sorted(module.get_rng_state())
            for device, state in module.get_rng_state().items():
                tensors[f"rng.dropout.{name}.{device}"] = state
    return tensors, {"dropout": dropout, "python": random.getstate()}


def write_rng(folder: str, model: nn.Module, rank: int, coords: dict) -> list[str]:
    """This rank's RNG files in ``folder``; their names."""
    tensors, info = rng_payload(model)
    st_name, json_name = rank_files(rank)
    os.makedirs(os.path.dirname(os.path.join(folder, st_name)), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, st_name))
    with open(os.path.join(folder, json_name), "wb") as f:
        f.write(typed_json.dumps({"coords": coords, "rng": info}, f"rank {rank}'s checkpoint state"))
    return [st_name, json_name]


def read_rng(path: str, model: nn.Module, rank: int) -> dict:
    """This global rank's saved RNG states."""
    st_name, json_name = rank_files(rank)
    file = os.path.join(path, json_name)
    info = typed_json.load(file)
    try:
        dropout, python = info["rng"]["dropout"], info["rng"]["python"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: the RNG state is damaged (no {e})") from None
    tensors = SafeFile(os.path.join(path, st_name))
    modules = dict(model.named_modules())
    return {
        "cpu": tensors.get("rng.cpu"),
        "cuda": [tensors.get(k) for k in sorted(k for k in tensors.names() if k.startswith("rng.cuda."))],
        "dropout": {
            n: {d: tensors.get(f"rng.dropout.{n}.{d}") for d in ds} for n, ds in dropout.items() if n in modules
        },
        "python": python,
    }


def apply_rng(model: nn.Module, rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    modules = dict(model.named_modules())
    for name, states in rng["dropout"].items():
        modules[name].set_rng_state(states)
    random.setstate(rng["python"])
