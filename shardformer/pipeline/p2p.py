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
_MAX_PARTS = 6  # an encoder-decoder's decoder stage hands on a layer's outputs and the encoder's output


def _parts(value) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def pack(value) -> torch.Tensor:
    """One tensor to send for a stage's output: itself, or several tensors flattened into one (their
    shapes travel in the header; autograd sees the concatenation, so one gradient comes back)."""
    parts = _parts(value)
    return parts[0] if len(parts) == 1 else torch.cat([t.reshape(-1) for t in parts])


def unpack(message: torch.Tensor, layout):
    """The stage input ``message`` carries (views of it, so their gradients land in its ``.grad``)."""
    shapes, _ = layout
    if len(shapes) == 1:
        return message
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return tuple(t.view(shape) for t, shape in zip(message.split(sizes), shapes))


def _header(value) -> torch.Tensor:
    parts = _parts(value)
    dtypes = {t.dtype for t in parts}
    if len(parts) > _MAX_PARTS or len(dtypes) > 1 or any(t.ndim > _MAX_DIMS for t in parts):
        raise ValueError(
            f"a pipeline stage hands on {len(parts)} tensors of {sorted(map(str, dtypes))}: at most {_MAX_PARTS} of "
            f"one dtype and {_MAX_DIMS} dimensions go in one message"
        )
    header = torch.zeros(2 + _MAX_PARTS * (_MAX_DIMS + 1), dtype=torch.int64)
    header[0], header[1] = len(parts), _DTYPES.index(parts[0].dtype)
    for k, t in enumerate(parts):
        at = 2 + k * (_MAX_DIMS + 1)
        header[at] = t.ndim
        header[at + 1 : at + 1 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
    return header.to(parts[0].device)


def _layout_of(header: torch.Tensor) -> tuple[tuple[tuple[int, ...], ...], torch.dtype]:
    """(the shape of each tensor a message carries, their dtype)."""
    header = header.cpu().tolist()
    shapes = []
    for k in range(header[0]):
        at = 2 + k * (_MAX_DIMS + 1)
        shapes.append(tuple(header[at + 1 : at + 1 + header[at]]))
    return tuple(shapes), _DTYPES[header[1]]


def _layout(value) -> tuple[tuple[tuple[int, ...], ...], torch.dtype]:
    parts = _parts(value)
    return tuple(tuple(t.shape) for t in parts), parts[0].dtype


def _empty(layout, device) -> torch.Tensor:
    """A receive buffer for a message of ``layout``."""
    shapes, dtype = layout
    size = shapes[0] if len(shapes) == 1 else (sum(int(torch.Size(s).numel()) for s in shapes),)
    return torch.empty(size, dtype=dtype, device=device)


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
        self.layouts: dict[int, tuple] = {}  # of the activations received: the tensors each packs

    def _peer(self, kind: str) -> int:
        stage = self.mesh.pp_rank
        return self.mesh.stage_rank(stage - 1 if kind == "act" else stage + 1)

    def send_activation(self, value, i: int) -> None:
        """Send a stage's output: a tensor, or a tuple of tensors (packed into one message)."""
        tensor = pack(tuple(t.detach() for t in _parts(value))).contiguous()
        dst, group = self.mesh.stage_rank(self.mesh.pp_rank + 1), self.mesh.pp_group
        header = _header(value)
        self.sends.append((comm.isend(header, dst, group), header))
        shape = _layout(value)
        self.grad_shapes[i] = (tuple(tensor.shape), tensor.dtype)
        if self.sent_shape is None:
            self.sent_shape = shape
        elif self.early_receives and shape != self.sent_shape:
            # The next stage's receive is posted with the first shape: fill it with a placeholder so
            # it completes, and that stage reads the header and raises too instead of waiting. Sends
            # are finished before raising: a send dropped unfinished may never reach its receiver.
            placeholder = _empty(self.sent_shape, tensor.device).zero_()
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
        header = torch.zeros_like(_header(torch.zeros(())), device=self.device)
        receive = _Receive(header, comm.irecv(header, src, group))
        if self.early_receives and self.act_shape is not None:  # the tensor too, assuming the first shape
            receive.out = _empty(self.act_shape, self.device)
            receive.work, receive.expected = comm.irecv(receive.out, src, group), self.act_shape
        self.receives[key] = receive

    def take(self, key: tuple[str, int]) -> torch.Tensor:
        """The received tensor ``key`` (posting its receive first if nobody did), once it has arrived; an
        activation's layout (what it packs: `unpack`) is kept in ``layouts``."""
        self.post(key)
        receive = self.receives.pop(key)
        if receive.header is not None:
            receive.header_work.wait()
            shape = _layout_of(receive.header)
            if receive.expected is not None and shape != receive.expected:
                receive.work.wait()  # the sender's placeholder: leave no receive unfinished
                raise ValueError(_shape_error(self.mesh.pp_rank - 1, key[1], shape, receive.expected))
            if receive.out is None:
                receive.out = _empty(shape, self.device)
                receive.work = comm.irecv(receive.out, self._peer("act"), self.mesh.pp_group)
            if self.act_shape is None:
                self.act_shape = shape
            self.layouts[key[1]] = shape
        receive.work.wait()
        return receive.out

    def wait(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def _shape_error(stage: int, i: int, shape, first) -> str:
    show = lambda layout: " and ".join(str(list(s)) for s in layout[0])  # noqa: E731
    return (
        f"pipeline stage {stage} produced {shape[1]} of shape {show(shape)} for micro-batch {i}, but "
        f"{first[1]} of shape {show(first)} for the step's first micro-batch. With overlap_p2p=True the "
        f"next stage posts its receives before their shape arrives, so every micro-batch of a step must "
        f"give one shape; make them equal, or set EngineConfig(overlap_p2p=False)"
    )
