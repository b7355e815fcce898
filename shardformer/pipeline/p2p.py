"""Activations and gradients between neighbouring pipeline stages, sent and received asynchronously.

Every transfer is posted with ``isend`` / ``irecv`` and waited on only when its tensor is needed:
sends are waited at the end of the step, and a receive can be *posted early* (``post``) so the
data arrives while this stage computes something else, then *taken* (``take``) when needed.

Activations (stage s-1 -> s) carry a shape header, since only the sender knows their shape;
gradients (s+1 -> s) do not: they have the shape of the activation this stage sent. A receive
posted before its header arrived assumes the shape of the step's first activation, so with early
receives every micro-batch of a step must produce one shape (each header is still checked).
Messages between two ranks match in the order they were posted, so receives are posted in the
order the peer sends: micro-batch order in each direction, in both schedules.
"""

from __future__ import annotations

import torch

from shardformer.core import comm

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_MAX_DIMS = 8


def _header(tensor: torch.Tensor) -> torch.Tensor:
    header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
    header[0], header[1] = tensor.ndim, _DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(tensor.device)


def _shape_of(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    header = header.cpu()
    return tuple(header[2 : 2 + int(header[0])].tolist()), _DTYPES[int(header[1])]


class _Receive:
    """One posted receive: its header (activations only), its tensor, and their pending works."""

    def __init__(self, header=None, header_work=None, out=None, work=None, expected=None) -> None:
        self.header, self.header_work, self.out, self.work, self.expected = header, header_work, out, work, expected


class P2P:
    """Sends and (early) receives of one step on one stage.

    Keys name a transfer: ``("act", i)`` is micro-batch ``i``'s activation from the previous
    stage, ``("grad", i)`` its gradient from the next stage.
    """

    def __init__(self, mesh, device, early_receives: bool) -> None:
        self.mesh, self.device, self.early_receives = mesh, device, early_receives
        self.sends: list = []
        self.receives: dict[tuple[str, int], _Receive] = {}
        self.grad_shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # of the activations sent
        self.act_shape = None  # the step's first activation received: what early receives assume
        self.sent_shape = None  # the step's first activation sent

    def _peer(self, kind: str) -> int:
        stage = self.mesh.pp_rank
        return self.mesh.stage_rank(stage - 1 if kind == "act" else stage + 1)

    def send_activation(self, tensor: torch.Tensor, i: int) -> None:
        tensor = tensor.contiguous()
        dst, group = self.mesh.stage_rank(self.mesh.pp_rank + 1), self.mesh.pp_group
        header = _header(tensor)
        self.sends.append((comm.isend(header, dst, group), header))
        shape = (tuple(tensor.shape), tensor.dtype)
        self.grad_shapes[i] = shape
        if self.sent_shape is None:
            self.sent_shape = shape
        elif self.early_receives and shape != self.sent_shape:
            # The next stage's receive is posted with the first shape: fill it with a placeholder so
            # it completes, and that stage reads the header and raises too instead of waiting. Sends
            # are finished before raising: a send dropped unfinished may never reach its receiver.
            placeholder = torch.zeros(self.sent_shape[0], dtype=self.sent_shape[1], device=tensor.device)
            self.sends.append((comm.isend(placeholder, dst, group), placeholder))
            self.wait()
            raise ValueError(_shape_error(self.mesh.pp_rank, i, shape, self.sent_shape))
        self.sends.append((comm.isend(tensor, dst, group), tensor))

    def send_grad(self, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        dst = self.mesh.stage_rank(self.mesh.pp_rank - 1)
        self.sends.append((comm.isend(tensor, dst, self.mesh.pp_group), tensor))

    def post(self, key: tuple[str, int]) -> None:
        """Post the receive ``key`` now if it is not yet posted and its shape is known."""
        if key in self.receives:
            return
        kind, i = key
        src, group = self._peer(kind), self.mesh.pp_group
        if kind == "grad":
            if i not in self.grad_shapes:
                return  # its activation has not been sent yet
            shape, dtype = self.grad_shapes[i]
            out = torch.empty(shape, dtype=dtype, device=self.device)
            self.receives[key] = _Receive(out=out, work=comm.irecv(out, src, group))
            return
        if self.act_shape is None and any(k[0] == "act" for k in self.receives):
            return  # the earlier activation's tensor receive must be posted first, once its header is in
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        receive = _Receive(header, comm.irecv(header, src, group))
        if self.early_receives and self.act_shape is not None:  # the tensor too, assuming the first shape
            shape, dtype = self.act_shape
            receive.out = torch.empty(shape, dtype=dtype, device=self.device)
            receive.work, receive.expected = comm.irecv(receive.out, src, group), self.act_shape
        self.receives[key] = receive

    def take(self, key: tuple[str, int]) -> torch.Tensor:
        """The received tensor ``key`` (posting its receive first if nobody did), once it has arrived."""
        self.post(key)
        receive = self.receives.pop(key)
        if receive.header is not None:
            receive.header_work.wait()
            shape = _shape_of(receive.header)
            if receive.expected is not None and shape != receive.expected:
                receive.work.wait()  # the sender's placeholder: leave no receive unfinished
                raise ValueError(_shape_error(self.mesh.pp_rank - 1, key[1], shape, receive.expected))
            if receive.out is None:
                receive.out = torch.empty(shape[0], dtype=shape[1], device=self.device)
                receive.work = comm.irecv(receive.out, self._peer("act"), self.mesh.pp_group)
            if self.act_shape is None:
                self.act_shape = shape
        receive.work.wait()
        return receive.out

    def wait(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def _shape_error(stage: int, i: int, shape, first) -> str:
    return (
        f"pipeline stage {stage} produced {shape[1]} of shape {list(shape[0])} for micro-batch {i}, but "
        f"{first[1]} of shape {list(first[0])} for the step's first micro-batch. With overlap_p2p=True the "
        f"next stage posts its receives before their shape arrives, so every micro-batch of a step must "
        f"give one shape; make them equal, or set EngineConfig(overlap_p2p=False)"
    )
