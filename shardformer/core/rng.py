"""One RNG discipline for tensor-parallel ranks: every rank of a tp group holds the same global RNG state.

Functional dropout (``F.dropout`` inside a forward) and sampling draw from the global generators,
not from the tp dropout layers' own ones; if the ranks of a tp group held different states, the
"replicated" activations and the sampled tokens would differ per rank. So sharding copies tp rank 0's
state to the other ranks of its group (`agree_on_rng`), and `seed` seeds all ranks alike
(data-parallel replicas may be offset so they see different masks).
"""

from __future__ import annotations

import random

import torch

from shardformer.core.comm import VirtualGroup, broadcast_object, group_size
from shardformer.core.config import check_int

_DP_STRIDE = 7919  # a prime: data-parallel replicas get seeds far apart


def _accelerator():
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator()
    return None


def get_rng_state() -> dict:
    """The global RNG states this process draws from: torch CPU, the current accelerator, Python."""
    state = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    device = _accelerator()
    if device is not None:
        state["accelerator"] = getattr(torch, device.type).get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    device = _accelerator()
    if device is not None and "accelerator" in state:
        getattr(torch, device.type).set_rng_state(state["accelerator"])


def agree_on_rng(group) -> None:
    """Copy the global RNG state of rank 0 of ``group`` to its other ranks (None: the default group)."""
    if isinstance(group, VirtualGroup) or group_size(group) == 1:
        return
    set_rng_state(broadcast_object(get_rng_state(), group))


def seed(value: int, mesh=None) -> None:
    """Seed torch (CPU and accelerator) and Python's ``random`` with ``value`` on this rank.

    Call it with the same ``value`` on every rank. With a `shardformer.ProcessMesh`, each
    data-parallel replica (and pipeline stage) is offset so replicas draw different dropout masks,
    while the ranks of one tensor-parallel group stay identical.
    """
    check_int("seed value", value)
    if mesh is not None:
        value += _DP_STRIDE * (mesh.dp_rank * mesh.pp_size + mesh.pp_rank)
    torch.manual_seed(value)
    random.seed(value)
