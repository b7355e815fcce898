"""Bytes held by tensors, each storage counted once (views, tied weights and a master viewing a
bucket buffer are one allocation); a DTensor counts its local shard. Used by the optimizers' byte
reports and the job simulation."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class StorageBytes:
    """Call with tensors: returns the bytes of the storages not seen by an earlier call."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def __call__(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            storage = local.untyped_storage()
            if storage._cdata not in self._seen:
                self._seen.add(storage._cdata)
                total += storage.nbytes()
        return total
