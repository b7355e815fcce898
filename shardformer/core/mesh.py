"""Process groups for (pp, dp, cp, tp) over the world, and process-group start-up from torchrun.

Ranks are laid out with tp innermost, then cp (context parallelism), then dp, then pp:

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

so tensor-parallel peers are neighbours (on one node they share the fastest links), and context-
parallel peers (which exchange keys and values every layer) come next. At cp=1 this is the
(pp, dp, tp) layout the library always had.

Hybrid sharded data parallelism (HSDP, ``dp_replicate_size`` > 1) splits the dp ranks further,
``dp_rank = dp_replicate_rank * dp_shard_size + dp_shard_rank``: a shard group is consecutive dp
ranks (inside a node), and ZeRO shards over it; the replicate group joins the ranks at one shard
position in every shard group, and sums gradients across them. The batch is still split over the
whole dp group.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shardformer.core.comm import LOCAL, VirtualGroup, group_rank, group_size  # noqa: F401 - re-exported
from shardformer.core.sizes import check_replicate_divides, resolve_sizes  # resolve_sizes: imported from here too

DEFAULT_TIMEOUT_S = 300


def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("SHARDFORMER_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


@dataclass
class ProcessMesh:
    """This rank's place in a (pp, dp, cp, tp) grid and the process groups along each axis.

    Every rank must build the mesh with the same sizes (group creation is collective).
    ``embedding_group`` joins the first and last pipeline stage of this rank's (dp, tp) column:
    it sums the gradients of weights tied across those stages (word embeddings and LM head).
    Middle stages belong to no embedding group: theirs is ``None``.
    ``dp_shard_group`` / ``dp_replicate_group`` (and their sizes and ranks): hybrid sharding's split of
    the dp group (the module docstring); at ``dp_replicate_size=1`` the shard group is ``dp_group``.
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int | None = None
    cp_size: int = 1
    ep_size: int = 1
    dp_replicate_size: int = 1
    rank: int = field(init=False)
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call shardformer.init_distributed() first "
                "(or start the script with `shardformer run`)"
            )
        _tear_down_at_exit()  # also a group started by someone else (accelerate's TrainingArguments, torch)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.pp_size, self.dp_size, self.tp_size = resolve_sizes(
            self.world_size, self.tp_size, self.pp_size, self.dp_size, self.cp_size
        )
        check_replicate_divides(self.dp_replicate_size, self.dp_size, "ProcessMesh.dp_replicate_size", self.ep_size)
        pp, dp, cp, tp = self.pp_size, self.dp_size, self.cp_size, self.tp_size
        self.pp_rank, rest = divmod(self.rank, dp * cp * tp)
        self.dp_rank, rest = divmod(rest, cp * tp)
        self.cp_rank, self.tp_rank = divmod(rest, tp)

        timeout = _timeout()

        def build(rank_lists: list[list[int]]) -> dist.ProcessGroup:
            # new_group is collective over the world: every rank creates every group, in one order.
            mine = None
            for ranks in rank_lists:
                group = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    mine = group
            return mine

        rank = self.global_rank
        cells = [(p, d, c, t) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]

        def along(axis: int) -> list[list[int]]:  # the groups that vary only the coordinate ``axis``
            lines: dict[tuple, list[int]] = {}
            for cell in cells:
                lines.setdefault(cell[:axis] + cell[axis + 1 :], []).append(rank(cell[0], cell[1], cell[3], cell[2]))
            return list(lines.values())

        # Groups are created in the order they always were (tp, dp, pp), then cp's when there is one.
        self.tp_group = build(along(3))
        self.dp_group = build(along(1))
        self.pp_group = build(along(0))
        self.embedding_group = build(
            [sorted({rank(0, d, t, c), rank(pp - 1, d, t, c)}) for d in range(dp) for c in range(cp) for t in range(tp)]
        )
        self.cp_group = build(along(2)) if cp > 1 else LOCAL  # None would mean the whole world
        self._build_expert_groups(cells, rank, build)
        self._build_hybrid_groups(cells, rank, build)

    def _build_expert_groups(self, cells, rank, build) -> None:
        """Expert parallelism folds into dp: ``dp_rank = expert_dp_rank * ep + ep_rank``. The ep group
        (consecutive dp ranks) splits the experts; the expert-dp group holds the same experts."""
        ep = self.ep_size
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or self.dp_size % ep:
            raise ValueError(
                f"expert_parallel_size={ep} must be a positive divisor of data_parallel_size={self.dp_size} "
                f"(expert-parallel ranks are drawn from the data-parallel ones); pick a divisor of {self.dp_size}"
            )
        self.ep_rank, self.expert_dp_rank = self.dp_rank % ep, self.dp_rank // ep
        self.expert_dp_size = self.dp_size // ep
        if ep == 1:
            self.ep_group, self.expert_dp_group = LOCAL, self.dp_group
            return
        lines, spans = _split_dp(cells, rank, ep)
        self.ep_group = build(lines)
        self.expert_dp_group = build(spans)  # a real group even of one: ZeRO reduces over it

    def _build_hybrid_groups(self, cells, rank, build) -> None:
        """HSDP: the dp group as ``dp_replicate_size`` shard groups of consecutive dp ranks; the replicate
        groups join the ranks at one place of every shard group. At dp_replicate_size=1 the shard group
        is the dp group and nothing is created (the groups of a plain mesh stay as they were). With
        experts split over ep ranks (inside a shard group), ``expert_dp_shard_group`` is the ranks of the
        shard group holding this rank's experts: their ZeRO group; the replicate group holds them too."""
        replicate = self.dp_replicate_size
        shard = self.dp_shard_size = self.dp_size // replicate
        self.dp_replicate_rank, self.dp_shard_rank = divmod(self.dp_rank, shard)
        self.expert_dp_shard_size = self.expert_dp_size // replicate
        if replicate == 1:
            self.dp_shard_group, self.dp_replicate_group = self.dp_group, LOCAL
            self.expert_dp_shard_group = self.expert_dp_group
            return
        shards, replicas = _split_dp(cells, rank, shard)
        self.dp_shard_group = build(shards)
        self.dp_replicate_group = build(replicas)
        self.expert_dp_shard_group = self.dp_shard_group  # at ep=1 the experts are dense parameters
        if self.ep_size > 1:  # the ranks of one shard group holding the same experts (ep divides dp_shard)
            holders: dict[tuple, list[int]] = {}
            for p, d, c, t in cells:
                holders.setdefault((p, d // shard, d % self.ep_size, c, t), []).append(rank(p, d, t, c))
            self.expert_dp_shard_group = build(list(holders.values()))

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int | None = None) -> int:
        """The global rank at these coordinates (``cp_rank`` None: this rank's own)."""
        cp_rank = self.cp_rank if cp_rank is None else cp_rank
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    @property
    def coords(self) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of this process."""
        return self.pp_rank, self.dp_rank, self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stages_group(self, stages) -> dist.ProcessGroup | None:
        """The group of this rank's (dp, cp, tp) column at pipeline stages ``stages`` (None off them): the
        stages holding one weight sum its gradients over it (an encoder-decoder's embeddings are on up to
        three). Collective on first use: every rank asks for the same stages in one order."""
        stages = tuple(sorted(set(stages)))
        if stages == tuple(sorted({0, self.pp_size - 1})):
            return self.embedding_group
        groups = self.__dict__.setdefault("_stages_groups", {})
        if stages not in groups:
            mine = None
            for d in range(self.dp_size):
                for c in range(self.cp_size):
                    for t in range(self.tp_size):
                        ranks = [self.global_rank(p, d, t, c) for p in stages]
                        group = dist.new_group(ranks, timeout=_timeout())
                        mine = group if self.rank in ranks else mine
            groups[stages] = mine
        return groups[stages]

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the process at pipeline stage ``pp_rank`` with this rank's (dp, tp) place."""
        return self.global_rank(pp_rank, self.dp_rank, self.tp_rank)

    def __repr__(self) -> str:
        return (
            f"ProcessMesh(rank={self.rank}/{self.world_size}, pp={self.pp_rank}/{self.pp_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, "
            + (f"cp={self.cp_rank}/{self.cp_size}, " if self.cp_size > 1 else "")
            + (f"ep={self.ep_rank}/{self.ep_size}, " if self.ep_size > 1 else "")
            + (
                f"dp_replicate={self.dp_replicate_rank}/{self.dp_replicate_size}, "
                f"dp_shard={self.dp_shard_rank}/{self.dp_shard_size}, "
                if self.dp_replicate_size > 1
                else ""
            )
            + f"tp={self.tp_rank}/{self.tp_size})"
        )


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> torch.device:
    """Start the default process group from torchrun's environment and return this rank's device.

    Picks NCCL when CUDA is available and gloo otherwise; the timeout is finite
    (``timeout_s``, else ``$SHARDFORMER_TIMEOUT_S``, else 300 s) so a lost peer ends the job.
    Calling it again once initialised only returns the device.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise RuntimeError(
            f"environment variables {missing} are not set; start the script with "
            f"`shardformer run --nproc_per_node N script.py` (or torchrun)"
        )
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else _timeout()
        dist.init_process_group(backend=backend or ("nccl" if use_cuda else "gloo"), timeout=timeout)
    _tear_down_at_exit()
    return device


_EXIT_HANDLER: list = []  # registered once per process


def _tear_down_at_exit() -> None:
    if not _EXIT_HANDLER:
        _EXIT_HANDLER.append(atexit.register(_tear_down))


def _tear_down() -> None:
    """At exit, the process groups the library used (a script need not call destroy_process_group):
    left to the interpreter's teardown, their threads can be destroyed still running, and the process
    ends with SIGABRT ("terminate called without an active exception") after the script succeeded.
    After an uncaught exception it does nothing: peers may still wait in a collective on this rank,
    and the process must end at once so the launcher sees this rank's failure first."""
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return
    if dist.is_initialized():
        dist.destroy_process_group()


launch_from_torch = init_distributed


def _split_dp(cells, rank, width: int) -> tuple[list[list[int]], list[list[int]]]:
    """The dp ranks of every (pp, cp, tp) place cut into blocks of ``width`` consecutive dp ranks (the
    ranks of each block), and joined across the blocks at one offset (the ranks at each offset)."""
    blocks: dict[tuple, list[int]] = {}
    offsets: dict[tuple, list[int]] = {}
    for p, d, c, t in cells:
        blocks.setdefault((p, d // width, c, t), []).append(rank(p, d, t, c))
        offsets.setdefault((p, d % width, c, t), []).append(rank(p, d, t, c))
    return list(blocks.values()), list(offsets.values())
