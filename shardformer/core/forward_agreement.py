"""Tensor- and context-parallel ranks run one batch: checked in the sharded model's own forward.

The ranks of a tensor-parallel group (and of a context-parallel group, with their tp peers) compute
parts of one model on one batch. Given different batches (a data sampler split over every rank, not
over the data-parallel ranks only) their collectives still pair up: tp ranks return a plausible loss
that no batch gives, and cp ranks given sequences of different lengths abort inside the collective
library (gloo: SIGABRT, no Python message). ParallelEngine compares its ranks' batches in every step
(`shardformer.core.step_agreement`); a model from ``shard_model`` driven by a user's own loop
or a Trainer is checked here, in a forward pre-hook that runs before context parallelism splits.

Cost: on every forward (by default), each rank hashes its tensor inputs' names, dtypes and shapes on
the host and checksums their values on their device (`fingerprint_tensor`, the engine's step
checksum), and the ranks that must hold the same inputs all-gather those numbers: a fixed-size
collective, so ranks whose inputs differ in shape still meet in it, before any collective of the
forward. The verdict is then read on the host, because raising is the host's business: on a GPU that
is the check's one device sync per forward (the host waits for the work queued before the forward,
usually the previous step, and the small gather; nothing else is read back). It is the price of an
error before a wrong loss is returned, measured in benchmarks/forward_agreement_bench.py.
``ShardConfig(forward_agreement_every=N)`` compares on every N-th forward instead (counted over
forwards that returned, so a refused forward uses up nothing): the others cost a counter, and a wrong
batch there returns a loss no batch gives, or aborts the job (other lengths). On a difference every
rank of the group raises the same error naming the inputs that differ, the ranks and the fix. A
forward that runs whole on every cp rank (one with a cache: ``generate``) is checked over the tp group
only. ParallelEngine, which compares every step's batch itself after the step, has its local batch's
shapes compared here before every step (its stage forwards need not call the model's forward).
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from shardformer.core.comm import VirtualGroup, all_gather_control, global_rank, group_size
from shardformer.core.mesh import _timeout
from shardformer.core.step_agreement import batch_fingerprint, fingerprint_tensor


class ForwardAgreement:
    """The check of one sharded model (``model.shardformer.forward_agreement``).

    ``tp_group``: checked on every forward; ``block_group``: the tp x cp ranks, checked instead on a
    forward that context parallelism splits (``splits(arguments)``). ParallelEngine, whose stage
    forwards may not call the model's forward, calls `check_inputs` itself before each step
    (``in_forward`` off) and compares shapes only (``compare_values`` off): its step agreement
    compares the values."""

    def __init__(self, model: nn.Module, tp_group, block_group=None, splits: Callable[[dict], bool] | None = None,
                 every: int = 1):  # fmt: skip
        self.tp_group = tp_group if _checkable(tp_group) else None
        self.block_group = block_group if _checkable(block_group) else None
        self.splits = splits
        self.every = every  # ShardConfig.forward_agreement_every
        self.in_forward = True
        self.compare_values = True
        self.calls: dict[str, int] = {"tp": 0, "block": 0}  # forwards begun over each group (checked or not)
        self.returned: dict[str, int] = {"tp": 0, "block": 0}  # of them, those that returned: the schedule
        self._running: str | None = None  # the group of the forward under way
        self._signature = inspect.signature(model.forward)

    def before(self, model: nn.Module, args, kwargs):
        """The forward pre-hook."""
        self._running = None
        if self.in_forward and not torch.compiler.is_compiling():
            arguments = self._arguments(args, kwargs)
            split = self.block_group is not None and self.splits(arguments)
            self._running = self.check_inputs(model, arguments, split)
        return None

    def after(self, model: nn.Module, args, output):
        """The forward hook: the forward returned (a refused one never gets here, and is not counted)."""
        if self._running is not None:
            self.returned[self._running] += 1
            self._running = None
        return None

    def check_inputs(self, model: nn.Module, inputs: dict, split: bool) -> str | None:
        """Count a forward on ``inputs`` (split by context parallelism or not) and compare the peers'
        inputs when due: on every forward, or with ``every`` N on the first and then after every N
        that returned. Returns the group's key ("tp" or "block"), None where no group pairs the ranks."""
        group, which = (self.block_group, "block") if split else (self.tp_group, "tp")
        if group is None:  # a whole forward on cp ranks without tp: no collective pairs the ranks
            return None
        self.calls[which] += 1
        if self.returned[which] % self.every == 0:
            self.check(model, inputs, group, self.calls[which])
        return which

    def _arguments(self, args, kwargs) -> dict:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        for name, p in self._signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                bound.update(bound.pop(name, {}))
        return bound

    def check(self, model: nn.Module, arguments: dict, group, count: int) -> None:
        """Raise on every rank of ``group`` when its ranks' tensor inputs differ."""
        inputs = {k: v for k, v in arguments.items() if torch.is_tensor(v)}
        device = _device(model, inputs)
        if device.type == "meta":  # a plan on meta tensors: nothing to compare
            return
        # built on the device without reading anything back: the verdict below is the one host read
        row = torch.zeros(3, dtype=torch.int64, device=device)
        row[0], row[2] = _layout_hash(inputs), self.every  # the schedule too: ranks must gather alike
        if self.compare_values:
            row[1] = fingerprint_tensor(inputs, device)
        table = all_gather_control(row, group)
        if not bool((table != table[0]).any()):  # a device sync on a GPU: one per compared forward
            return
        table = table.cpu()
        ranks = [global_rank(group, r) for r in range(group_size(group))]
        if len(set(table[:, 2].tolist())) > 1:
            given = ", ".join(f"rank {r}: {int(n)}" for r, n in zip(ranks, table[:, 2]))
            raise ValueError(
                f"ShardConfig.forward_agreement_every differs between the ranks of one model ({given}): they "
                f"would compare their inputs on different forwards; give every rank the same value"
            )
        # every rank saw the difference: the details travel in a second gather all of them join
        details = [None] * group_size(group)
        dist.all_gather_object(details, _describe(inputs, self.compare_values), group=group)
        kind = "tensor-parallel" if group is self.tp_group else "context-parallel"
        if group is self.block_group and self.tp_group is not None:
            kind = "tensor- and context-parallel"
        raise RuntimeError(_message(model, details, ranks, count, kind))


def _checkable(group) -> bool:
    """A real process group of several ranks (not a plan's virtual one, nor the simulator's fake one)."""
    if group is None or isinstance(group, VirtualGroup) or group_size(group) == 1:
        return False
    return dist.get_backend(group) != "fake"


def _device(model: nn.Module, inputs: dict) -> torch.device:
    """Where the gathered numbers live: the model's (NCCL gathers GPU tensors only)."""
    param = next(model.parameters(), None)
    if param is not None:
        return param.device
    return next(iter(inputs.values())).device if inputs else torch.device("cpu")


def _layout_hash(inputs: dict) -> int:
    text = ";".join(f"{k}:{v.dtype}:{tuple(v.shape)}" for k, v in sorted(inputs.items()))
    return zlib.crc32(text.encode())


def _describe(inputs: dict, values: bool) -> dict:
    return {
        k: (tuple(v.shape), str(v.dtype).removeprefix("torch."), batch_fingerprint({k: v}) if values else None)
        for k, v in sorted(inputs.items())
    }


def _message(model: nn.Module, details: list[dict], ranks: list[int], count: int, kind: str) -> str:
    names = sorted({name for d in details for name in d})
    differ = []
    for name in names:
        seen = [d.get(name) for d in details]
        if len({s[:2] if s else None for s in seen}) > 1:
            shapes = ", ".join(f"rank {r}: {f'{list(s[0])} {s[1]}' if s else 'absent'}" for r, s in zip(ranks, seen))
            differ.append(f"{name} ({shapes})")
        elif len(set(seen)) > 1:
            differ.append(f"{name} (same shape {list(seen[0][0])}, other values)")
    abort = ", or abort inside the collective library on different lengths" if "context" in kind else ""
    return (
        f"{type(model).__name__}: ranks {', '.join(map(str, ranks))} are {kind} peers and must run the same "
        f"batch, but forward #{count} got different inputs: {'; '.join(differ)}. Their collectives would still "
        f"pair up and give a result that no batch gives{abort}. Give every tp/cp rank the same batch: split "
        f"the data over the data-parallel ranks only, e.g. DistributedSampler(dataset, "
        f"num_replicas=model.shardformer.mesh.dp_size, rank=model.shardformer.mesh.dp_rank)"
    )


def block_group(mesh):
    """The group of this rank's tp x cp ranks (they share one batch); the tp or cp group itself where
    the other is 1. Creating groups is collective: every rank calls this with the same mesh."""
    if mesh is None or mesh.cp_size == 1:
        return None
    if mesh.tp_size == 1:
        return mesh.cp_group

    mine = None
    for p in range(mesh.pp_size):
        for d in range(mesh.dp_size):
            ranks = [mesh.global_rank(p, d, t, c) for c in range(mesh.cp_size) for t in range(mesh.tp_size)]
            group = dist.new_group(ranks, timeout=_timeout())
            if mesh.rank in ranks:
                mine = group
    return mine


def install(
    model: nn.Module, mesh, tp_group, splits: Callable[[dict], bool] | None, every: int = 1
) -> ForwardAgreement | None:
    """Check ``model``'s forwards (before any other pre-hook: context parallelism's split comes after)."""
    agreement = ForwardAgreement(model, tp_group, block_group(mesh) if splits is not None else None, splits, every)
    if agreement.tp_group is None and agreement.block_group is None:
        return None
    model.register_forward_pre_hook(agreement.before, with_kwargs=True, prepend=True)
    model.register_forward_hook(agreement.after)
    return agreement
