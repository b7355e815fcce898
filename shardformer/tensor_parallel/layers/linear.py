"""Column- and row-parallel linear layers, for ``nn.Linear`` and transformers' ``Conv1D``.

``Conv1D`` stores its weight ``[in, out]`` (``reversed=True`` here) and computes ``addmm(b, x, W)``;
the parallel layers keep each module's own layout, so a shard is a plain slice of the original
weight and state-dict names and orientations are unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardformer.core.comm import group_rank, group_size, reduce_from_parallel, start_all_reduce
from shardformer.tensor_parallel.regions import (
    SharedInputCopy,
    copy_to_parallel,
    gather_from_parallel,
    split_to_parallel,
    sum_replicas,
)
from shardformer.tensor_parallel.slicer import Slicer, shard_spec


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (weight [in, out]), recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reversed: bool) -> torch.Tensor:
    if not reversed:
        return F.linear(x, weight, bias)
    out_shape = x.shape[:-1] + (weight.shape[1],)
    flat = x.reshape(-1, x.shape[-1])
    y = torch.mm(flat, weight) if bias is None else torch.addmm(bias, flat, weight)
    return y.view(out_shape)


class _ColumnLinearOverlapped(torch.autograd.Function):
    """``copy_to_parallel`` then ``_matmul`` in one function, so backward can start the input
    gradient's all-reduce and compute the weight and bias gradients while it runs (Megatron's async
    grad all-reduce). The same products as autograd's backward of the two, in the same dtype.
    ``reduce`` False: no all-reduce here (a shared input copy before it reduces the sum)."""

    @staticmethod
    def forward(ctx, x, weight, bias, reversed, group, reduce):
        ctx.save_for_backward(x, weight)
        ctx.reversed, ctx.group, ctx.reduce, ctx.has_bias = reversed, group, reduce, bias is not None
        return _matmul(x, weight, bias, reversed)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            grad_x = flat_grad.mm(weight.t() if ctx.reversed else weight)
            if ctx.reduce:
                grad_x, handle = start_all_reduce(grad_x, ctx.group)
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = flat_x.t().mm(flat_grad) if ctx.reversed else flat_grad.t().mm(flat_x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0)
        if handle is not None:
            handle.wait()
        return None if grad_x is None else grad_x.view(x.shape), grad_w, grad_b, None, None, None


class _ColumnLinearRegathered(torch.autograd.Function):
    """``_matmul`` of an input all-gathered along the sequence that saves this rank's ``chunk`` of it
    instead of the gathered ``x`` (Megatron-LM's sequence parallelism): backward starts re-gathering
    the chunk (``source``, a `shardformer.tensor_parallel.sequence_regions.GatheredSequence`), computes the input
    gradient meanwhile and the weight gradient from the re-gathered input. The same products as
    autograd's backward of ``_matmul``.

    ``to_chunk`` False (the blocks' column layers): the input gradient, a partial sum, goes to ``x``,
    whose gather reduce-scatters it; ``chunk`` only rides along. ``to_chunk`` True (the LM head after
    the sequence-parallel region's end): ``x`` is a replicated copy whose other readers (the model's
    returned hidden states) need no sum, so the head reduce-scatters its own partial input gradient
    straight into ``chunk`` (Megatron's sequence-parallel head) and ``x`` only rides along."""

    @staticmethod
    def forward(ctx, x, chunk, weight, bias, reversed, source, to_chunk=False):
        ctx.save_for_backward(chunk, weight)
        ctx.reversed, ctx.source, ctx.has_bias, ctx.x_shape = reversed, source, bias is not None, x.shape
        ctx.to_chunk = to_chunk
        source.add_reader()
        return _matmul(x, weight, bias, reversed)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        chunk, weight = ctx.saved_tensors
        gathering = ctx.source.start(chunk)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1 if ctx.to_chunk else 0]:
            grad_x = flat_grad.mm(weight.t() if ctx.reversed else weight).view(ctx.x_shape)
        x = gathering.wait()
        ctx.source.done(x)
        if ctx.needs_input_grad[2]:
            flat_x = x.reshape(-1, x.shape[-1])
            grad_w = flat_x.t().mm(flat_grad) if ctx.reversed else flat_grad.t().mm(flat_x)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = flat_grad.sum(0)
        if ctx.to_chunk:
            grad_chunk = None if grad_x is None else ctx.source.reduce_scatter(grad_x)
            return None, grad_chunk, grad_w, grad_b, None, None, None
        return grad_x, None, grad_w, grad_b, None, None, None


def _native_parts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    if is_conv1d(module):
        return module.weight, module.bias, True
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


class Linear1D_Col(nn.Module):
    """Output features split over the tensor-parallel group: ``y_r = x A_r + b_r``.

    Forward issues no collective (the input is replicated); backward all-reduces the input
    gradient once. With ``gather_output`` the full output is all-gathered (fused blocks put back
    in order, vocabulary padding cut). ``n_cast`` > 1 slices fused blocks (Q/K/V) each on their
    own, so every rank holds ``[Q_r | K_r | V_r]`` and the model's ``split`` keeps working.
    ``input_copy``: a `SharedInputCopy` shared with the other column layers reading the same
    input, so their backward all-reduce happens once (None: this layer's own).
    ``sequence_parallel``: the model's `shardformer.tensor_parallel.sequence_parallel.SequenceParallel`
    state (given by the sharder when the layer sits in a sequence-parallel block); while it is active
    the input was gathered along the sequence by the enclosing block, whose backward reduce-scatters
    the gradient; with the state's ``regather`` this layer keeps only this rank's chunk of the
    gathered input for its backward and all-gathers it again there (not under autocast or
    ``torch.compile``, which keep the gathered input).
    ``overlap_communication``: backward starts the input gradient's all-reduce and computes the
    weight gradient meanwhile (False: one after the other), in a layer with an input of its own:
    no ``input_copy``, or one that saw this layer read its inputs alone (from its second step on).
    Layers reading one input keep their one shared all-reduce after the sum of their gradients
    (three overlapped ones would send three times the bytes).
    """

    supports_sequence_parallel = True

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        process_group=None,
        gather_output: bool = False,
        reversed: bool = False,
        input_copy: SharedInputCopy | None = None,
        *,
        overlap_communication: bool = True,
        sequence_parallel=None,
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.process_group, self.gather_output, self.reversed = process_group, gather_output, reversed
        self.input_copy = input_copy
        self.overlap_communication, self.sequence_parallel = overlap_communication, sequence_parallel
        spec = shard_spec(weight)
        self.n_cast = (spec.blocks or spec.n_cast) if spec else 1  # block sizes when they differ
        self.out_features = spec.full_size if spec else weight.shape[1 if reversed else 0]
        self.in_features = weight.shape[0 if reversed else 1]

    @classmethod
    def from_native(
        cls,
        module: nn.Module,
        process_group=None,
        gather_output: bool = False,
        n_cast: int | tuple[int, ...] = 1,
        pad_to_multiple: int | None = None,
        input_copy: SharedInputCopy | None = None,
        overlap_communication: bool = True,
        sequence_parallel=None,
        head_width: int | tuple[int, ...] | None = None,
        **_,
    ) -> Linear1D_Col:
        weight, bias, reversed = _native_parts(module)
        slicer = Slicer(group_rank(process_group), group_size(process_group))
        w = slicer.column_weight(weight, reversed, n_cast, pad_to_multiple, head_width)
        b = None if bias is None else slicer.column_bias(bias, n_cast, pad_to_multiple, head_width)
        for param in (w, b):  # heads replicated over ranks (fewer key/value heads than ranks)
            if param is not None and shard_spec(param).splits and param.requires_grad:
                param.register_hook(functools.partial(sum_replicas, spec=shard_spec(param), group=process_group))
        return cls(
            w, b, process_group, gather_output, reversed, input_copy,
            overlap_communication=overlap_communication, sequence_parallel=sequence_parallel,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel is not None and self.sequence_parallel.active:
            # the input gradient is reduce-scattered where the sequence was gathered: nothing to reduce here
            source, chunk = self.sequence_parallel.regather_source(x)
            if source is not None and not torch.is_autocast_enabled(x.device.type):
                y = _ColumnLinearRegathered.apply(x, chunk, self.weight, self.bias, self.reversed, source)
            else:  # keep the gathered input for the backward
                y = _matmul(x, self.weight, self.bias, self.reversed)
        elif self._overlaps(x):
            # Sharers and loners run the same function (it saves the same tensors), so activation
            # checkpointing's recompute matches the forward even if reads_alone changed in between.
            alone = self.input_copy is None or torch.compiler.is_compiling() or self.input_copy.reads_alone(self)
            if not alone:
                x = self.input_copy(x, self.process_group, self)  # one all-reduce after the sharers' sum
            y = _ColumnLinearOverlapped.apply(x, self.weight, self.bias, self.reversed, self.process_group, alone)
        else:
            if self.input_copy is not None:
                x = self.input_copy(x, self.process_group, self)
            else:
                x = copy_to_parallel(x, self.process_group)
            y = _matmul(x, self.weight, self.bias, self.reversed)
        if self.gather_output:
            y = gather_from_parallel(y, self.process_group, self.out_features, self.n_cast)
        return y

    def _overlaps(self, x: torch.Tensor) -> bool:
        """Whether backward runs through the overlapping function (under autocast the plain path runs:
        its backward computes in the autocast dtype)."""
        return (
            self.overlap_communication
            and group_size(self.process_group) > 1
            and torch.is_grad_enabled()
            and x.requires_grad
            and not (not x.is_meta and torch.is_autocast_enabled(x.device.type))  # meta: tools/simulate, no autocast
        )

    def extra_repr(self) -> str:
        local = self.weight.shape[1 if self.reversed else 0]
        return (
            f"in={self.in_features}, out={self.out_features} (local {local}), n_cast={self.n_cast}, "
            f"gather_output={self.gather_output}, reversed={self.reversed}"
        )


class Linear1D_Row(nn.Module):
    """Input features split over the tensor-parallel group: ``y = sum_r x_r A_r + b``.

    Forward all-reduces the output once (the bias, replicated, is added after it); backward
    issues no collective. With ``input_is_parallel=False`` the full input is split first.
    Under active sequence parallelism the output is reduce-scattered along the sequence instead.
    """

    supports_sequence_parallel = True

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        process_group=None,
        input_is_parallel: bool = True,
        reversed: bool = False,
        *,
        sequence_parallel=None,
        sequence_parallel_name: str | None = None,
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.process_group, self.input_is_parallel, self.reversed = process_group, input_is_parallel, reversed
        self.sequence_parallel = sequence_parallel  # as Linear1D_Col's; the name is for its errors
        self.sequence_parallel_name = sequence_parallel_name or type(self).__name__
        spec = shard_spec(weight)
        self.in_features = spec.full_size if spec else weight.shape[0 if reversed else 1]
        self.out_features = weight.shape[1 if reversed else 0]

    @classmethod
    def from_native(
        cls,
        module: nn.Module,
        process_group=None,
        input_is_parallel: bool = True,
        sequence_parallel=None,
        sequence_parallel_name: str | None = None,
        **_,
    ) -> Linear1D_Row:
        weight, bias, reversed = _native_parts(module)
        w = Slicer(group_rank(process_group), group_size(process_group)).row_weight(weight, reversed)
        return cls(
            w, bias, process_group, input_is_parallel, reversed,
            sequence_parallel=sequence_parallel, sequence_parallel_name=sequence_parallel_name,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_parallel(x, self.process_group)
        y = _matmul(x, self.weight, None, self.reversed)
        sp = self.sequence_parallel
        if sp is not None and sp.active:
            y = sp.reduce_scatter(y, self.sequence_parallel_name)
        else:
            y = reduce_from_parallel(y, self.process_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        local = self.weight.shape[0 if self.reversed else 1]
        return f"in={self.in_features} (local {local}), out={self.out_features}, reversed={self.reversed}"


class Linear1D_RowIntoParallel(Linear1D_Row):
    """A row-parallel linear whose whole output feeds work cut over the ranks again (Mamba's ``x_proj``:
    ``[dt | B | C]`` for each rank's channels). Each rank's gradient of that output covers its own
    channels only: one all-reduce in backward sums it (`copy_to_parallel`), as a column layer sums its
    input's. Forward: the row's one all-reduce."""

    supports_sequence_parallel = False  # its output feeds a scan over the whole sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_parallel(super().forward(x), self.process_group)


class VocabParallelLMHead1D(Linear1D_Col):
    """An LM head with the vocabulary split over ranks (padded to a multiple of the group size).

    Logits stay vocab-parallel for `shardformer.tensor_parallel.layers.loss.vocab_parallel_cross_entropy`
    unless ``gather_output``, which returns logits of the true vocabulary size.

    ``sequence_parallel_end``: the model's sequence-parallel state, when the region ends at the final
    norm that this head reads. If the head's input is that norm's all-gathered output (unchanged, the
    whole of it), it keeps only this rank's chunk for the backward, re-gathers it there and
    reduce-scatters its input gradient into the chunk (Megatron's sequence-parallel output layer);
    anything else (a slice for ``logits_to_keep``, autocast, ``torch.compile``) runs as plain tp.
    """

    def __init__(self, *args, sequence_parallel_end=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sequence_parallel_end = sequence_parallel_end

    @classmethod
    def from_native(
        cls,
        module: nn.Module,
        process_group=None,
        gather_output: bool = False,
        pad_to_multiple: int = 1,
        input_copy: SharedInputCopy | None = None,
        overlap_communication: bool = True,
        sequence_parallel_end=None,
        **_,
    ) -> VocabParallelLMHead1D:
        head = super().from_native(
            module, process_group, gather_output, 1, pad_to_multiple, input_copy,
            overlap_communication=overlap_communication,
        )  # fmt: skip
        head.sequence_parallel_end = sequence_parallel_end
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = self.sequence_parallel_end
        source, chunk = (None, None) if end is None else end.head_source(x)
        if source is None or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        y = _ColumnLinearRegathered.apply(x, chunk, self.weight, self.bias, self.reversed, source, True)
        if self.gather_output:
            y = gather_from_parallel(y, self.process_group, self.out_features, self.n_cast)
        return y

    @property
    def vocab_size(self) -> int:
        return self.out_features
