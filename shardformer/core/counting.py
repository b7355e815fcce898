"""Counting collectives: `CollectiveCounter`, so tests and benchmarks count communication instead of
trusting it.

Two sources feed a counter. shardformer's own primitives (`shardformer.core.comm`) record each
collective as they issue it (`record`). Two torch libraries issue their own: FSDP2, which is ZeRO-3
here (a layer's all-gather, its gradients' reduce-scatter and, under hybrid sharding, the all-reduce
over the replicas), and torch.distributed.pipelining, the "torch" pipeline backend (the sends and
receives between stages). While a counter is active, a dispatch mode (the way torch's
``CommDebugMode`` sees them) records the c10d collectives whose caller is one of those two, and only
those: ours are recorded at issue already (counting them again would double them), and the other
direct c10d calls carry control data (object lists, checks), which counters leave out as `comm` does.
The mode runs only once this process has used one of them (`count_torch_collectives`), so counting
anything else costs no dispatch.

Their bytes are counted as `comm` counts its own: an all-gather its gathered output and a
reduce-scatter its whole input (as ZeRO's flat ones), an all-reduce, a send or a receive its tensors.
"""

from __future__ import annotations

import inspect
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_active_counters: list[CollectiveCounter] = []


class CollectiveCounter:
    """Context manager recording ``(op, numel, bytes)`` for each collective issued inside it, and in
    ``groups`` (same order) the process group each went over (what a simulated job sorts them by)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.groups: list = []

    def __enter__(self) -> CollectiveCounter:
        if not _active_counters and _torch_seen:
            _start_mode()
        _active_counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active_counters.remove(self)
        if not _active_counters and _mode:
            _mode.pop().__exit__(*exc)

    @property
    def counts(self) -> Counter:
        return Counter(op for op, _, _ in self.calls)

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.calls)

    def wire_bytes(self, world: int) -> float:
        """Bytes each rank sends under ring algorithms: an all-reduce of N bytes sends 2(w-1)/w N, a
        reduce-scatter of N bytes or an all-gather into N bytes (w-1)/w N. An all-reduce costs what a
        reduce-scatter plus an all-gather cost, which makes sequence parallelism comparable to plain tp."""
        share = (world - 1) / world
        per_op = {"all_reduce": 2 * share, "reduce_scatter": share, "all_gather": world * share}
        return sum(per_op[op] * b for op, _, b in self.calls if op in per_op)

    def reset(self) -> None:
        self.calls.clear()
        self.groups.clear()


def record(op: str, tensor: torch.Tensor, group, numel: int | None = None, nbytes: int | None = None) -> None:
    """Record one collective of ``tensor`` over ``group`` in every active counter."""
    numel = tensor.numel() if numel is None else numel
    nbytes = numel * tensor.element_size() if nbytes is None else nbytes
    for counter in _active_counters:
        counter.calls.append((op, numel, nbytes))
        counter.groups.append(group)


# -- torch's collectives ---------------------------------------------------------------------------

_ISSUERS = ("torch.distributed.fsdp", "torch.distributed.pipelining")
_torch_seen = False
_mode: list[TorchDispatchMode] = []  # the mode while counters are active

# c10d op: (the kind counters know it by, the argument whose size is counted)
_TORCH_OPS = {
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "allreduce_": ("all_reduce", "tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
}


def count_torch_collectives() -> None:
    """From now on, counters also record the collectives FSDP2 and torch's pipelining issue (called
    where a model is fully sharded, and where a torch pipeline schedule is built)."""
    global _torch_seen
    if not _torch_seen and _active_counters:  # called inside a counter: what follows is counted too
        _start_mode()
    _torch_seen = True


def _start_mode() -> None:
    _mode.append(_TorchCollectives())
    _mode[0].__enter__()


def _issued_by_torch() -> bool:
    """Whether the c10d op being dispatched comes from FSDP2 or pipelining, and is not an object list
    (control data: the pipeline's shape inference sends its shapes as pickled objects), nor one of our own
    primitives running inside them (a ZeRO bucket's all-reduce in a pipeline's backward: recorded at issue)."""
    frame = inspect.currentframe()
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name.endswith(("_object", "_object_list")):
            return False
        if module.startswith(_ISSUERS):
            return True
        if module.startswith("shardformer.") and module != __name__:
            return False
        frame = frame.f_back
    return False


class _TorchCollectives(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and _issued_by_torch():
            named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            kind, counted = _TORCH_OPS.get(func._opname, (func._opname.strip("_"), None))
            tensors = named.get(counted, [a for a in args if isinstance(a, torch.Tensor)])
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
            group = dist.ProcessGroup.unbox(named["process_group"]) if "process_group" in named else None
            if tensors:
                numel = sum(t.numel() for t in tensors)
                record(kind, tensors[0], group, numel, sum(t.numel() * t.element_size() for t in tensors))
        return func(*args, **kwargs)
