"""Where a rank sits in the (pp, dp, tp, ep) layout, and the full (unsharded) state of a sharded model.

Everything here reads the layout the sharder left on the model: ``param.shard_spec`` for tensor
parallelism, and the ``model.shardformer`` record (mesh, tp group, pipeline stage) for the rest;
each pipeline stage holds the original model object with the modules of the other stages set to
None (so names are the original ones and tied weights live on two stages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from shardformer.core.comm import group_rank, group_size
from shardformer.core.record import is_sharded, sharding_of
from shardformer.data_parallel.fsdp import full_of, reshard
from shardformer.expert_parallel.layout import gather_experts, is_expert_param
from shardformer.tensor_parallel.slicer import gather_tensor, shard_spec


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates and the parallel sizes, with the groups to talk along each axis."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    rank: int
    world: int
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    cp: int = 1  # context-parallel replicas of this (tp, pp, dp) place
    ep: int = 1  # expert parallelism: dp ranks ``expert_dp * ep + ep_rank`` split the experts ``ep`` ways
    ep_rank: int = 0
    dp_replicate: int = 1  # hybrid sharding: ZeRO's groups are dp / dp_replicate ranks

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    def record(self) -> dict[str, int]:
        """The layout as a checkpoint's manifest records it (``ep``, ``cp`` and ``dp_replicate`` only where
        above 1, so a plain layout's record reads as before)."""
        return (
            {"tp": self.tp, "pp": self.pp, "dp": self.dp, "world": self.world}
            | ({"ep": self.ep} if self.ep > 1 else {})
            | ({"cp": self.cp} if self.cp > 1 else {})
            | ({"dp_replicate": self.dp_replicate} if self.dp_replicate > 1 else {})
        )


def rank_place(record: dict[str, int]) -> dict[str, int]:
    """What of a layout's record says where each rank sits (its RNG streams mean that place): all of it but
    ``dp_replicate``, which regroups ZeRO's ranks and moves none."""
    return {k: v for k, v in record.items() if k != "dp_replicate"}


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def layout_of(model: nn.Module) -> Layout:
    """The (tp, pp, dp) layout of a sharded (or plain) model on this rank."""
    rank, world = _world()
    if not is_sharded(model):  # a plain model: every process is a data-parallel replica
        return Layout(1, 1, world, 0, 0, rank, rank, world)
    info = sharding_of(model)
    mesh = info.mesh
    if mesh is not None:
        return Layout(
            mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.tp_rank, mesh.pp_rank, mesh.dp_rank, rank, world,
            mesh.tp_group, mesh.dp_group, mesh.pp_group, mesh.cp_size, mesh.ep_size, mesh.ep_rank,
            mesh.dp_replicate_size,
        )  # fmt: skip
    # No mesh: one process, or a tp group given directly. Only a group spanning the whole world
    # says where every rank sits; otherwise the data-parallel place is unknown, and guessing it
    # would write one replica's shards under another's name.
    tp, tp_rank = group_size(info.tp_group), group_rank(info.tp_group)
    if tp != world or info.num_stages != 1:
        raise ValueError(
            f"{type(model).__name__} was sharded over a tp group of {tp} of the {world} processes without a "
            f"ProcessMesh, so its data-parallel place is unknown; shard it with ShardConfig(mesh=ProcessMesh(...)) "
            f"or through ParallelEngine"
        )
    return Layout(tp, 1, 1, tp_rank, 0, 0, rank, world, info.tp_group)


def refuse_context_parallel(lay: Layout, what: str) -> None:
    """Raise (before any collective) where ``what`` does not handle context-parallel ranks yet."""
    if lay.cp > 1:
        raise ValueError(
            f"{what} does not support context parallelism yet (context_parallel_size={lay.cp}): its ranks hold "
            f"the same shards as their cp peers; save the model with save_pretrained (exported from rank 0), or "
            f"train with context_parallel_size=1"
        )


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by its state-dict name (tied names all listed), ZeRO-3
    (FSDP2) shards gathered over dp: a collective over the dp group for such a model; tied names
    keep pointing at one tensor."""
    reshard(model)  # a ZeRO-3 root gathered by a forward without backward holds plain tensors until then
    full: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in full:
            full[id(tensor)] = full_of(tensor)
        out[name] = full[id(tensor)]
    return out


def full_local_state(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """This stage's tensors, tp shards gathered to full size (collective over the tp group), experts
    split by expert parallelism gathered over the ep group.

    Tied names keep pointing at one tensor; every tp rank returns the same dict (detached, on CPU).
    """
    group = layout_of(model).tp_group if group is None else group
    experts = sharding_of(model).experts if is_sharded(model) else None
    done: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in named_tensors(model).items():
        if id(tensor) not in done:
            spec = shard_spec(tensor)
            value = tensor.detach() if spec is None else gather_tensor(tensor.detach(), spec, group)
            if is_expert_param(tensor):  # this rank's experts: the others' from the ep group
                value = gather_experts(value, experts.ep_group)
            done[id(tensor)] = value.cpu()
        out[name] = done[id(tensor)]
    return out


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's full state on global rank 0 (None elsewhere); collective on all ranks.

    tp shards are gathered inside each stage; one rank per stage (tp rank 0, dp rank 0) then sends
    its stage to global rank 0, which merges the stages (a name on two stages, such as tied
    embeddings on the first and last stage, is kept once).
    """
    lay = layout_of(model)
    local = full_local_state(model, lay.tp_group)
    if lay.world == 1:
        return local
    sender = lay.tp_rank == 0 and lay.dp_rank == 0
    if lay.pp == 1:
        return local if lay.rank == 0 else None
    parts = [None] * lay.world if lay.rank == 0 else None
    dist.gather_object(local if sender and lay.rank != 0 else None, parts, dst=0)
    if lay.rank != 0:
        return None
    merged = dict(local)
    for part in parts:
        for name, value in (part or {}).items():
            merged.setdefault(name, value)
    return merged
