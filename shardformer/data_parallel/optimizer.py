"""ZeroOptimizer: ZeRO stage 1/2 around any ``torch.optim.Optimizer``.

Each rank of the data-parallel group steps only its 1/dp shard of every parameter, so the wrapped
optimizer's states (Adam's moments, SGD's momentum) take 1/dp of the memory. Half-precision
parameters get an fp32 master copy of that shard; fp32 parameters are stepped in place (the shard
is a view of the parameter: no second copy). After each step the updated shards are all-gathered
back into the model's parameters, which stay in their own dtype (fp32, bf16 or fp16).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist

from shardformer.core import comm
from shardformer.core.comm import group_size
from shardformer.core.memory import StorageBytes
from shardformer.data_parallel.grad_norm import clip_master_grads, global_grad_norm
from shardformer.data_parallel.layout import build_buckets, build_slots, copy_rows_into, shard_of
from shardformer.data_parallel.loss_scaler import DynamicLossScaler
from shardformer.data_parallel.optimizer_surface import share_surface
from shardformer.data_parallel.reducer import GradientReducer
from shardformer.data_parallel.state import (
    gather_full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
)
from shardformer.data_parallel.validate import check_arguments, check_same_on_all_ranks

# Elements per bucket, all dp rows together: 16 MiB of fp32. It bounds the transient buffers of
# both the gradient reduction and the parameter all-gather (two buckets in flight).
DEFAULT_BUCKET_SIZE = 2**22


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard the optimizer states (stage 1) and the reduced gradients (stage 2) over ``dp_group``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` already built over the model's parameters (its
            param groups and hyper-parameters are kept; their params become this rank's shards).
        dp_group: the data-parallel group (default: the whole world).
        stage: 1 all-reduces gradients, 2 reduce-scatters them (each rank keeps only its shard).
        bucket_size: elements per bucket, all dp rows together (gradients and the param all-gather).
        overlap_communication: reduce each bucket during backward, as soon as its gradients are final
            (default; always exact: see ``backwards_per_step``). False: reduce everything in ``step``.
        backwards_per_step: backward passes per step (micro-batches of gradient accumulation); with
            overlap, buckets are sent during the last one. More backward passes than announced are
            still exact (every bucket is reduced again at ``step``, with a warning) unless
            ``release_grads``, where they are an error; ``no_sync()`` passes do not count.
        reduce_dtype: dtype the gradients are summed in (default: the master dtype, fp32).
        release_grads: stage 2 only: free each ``param.grad`` once copied into its bucket (with the
            buckets freed once reduce-scattered, a rank then holds only its 1/dp rows after backward;
            ``ParallelEngine`` sets it at ``zero_stage=2``).
        tp_group, pp_group: tensor / pipeline groups, for the global grad norm and the fp16
            overflow flag (omitted: no such parallelism; dp_group None is the default group).
        loss_scaler: a `DynamicLossScaler`; ``"auto"`` makes one when any param is fp16.
        model: optional; when given, every trainable parameter of it must be in ``optimizer``.
        counted_elsewhere: parameters another pipeline stage also holds and counts in the gradient norm.
        late_grads: parameters whose ``.grad`` the caller still changes after backward (a tied weight
            summed over pipeline stages): with overlap their buckets wait for ``step``.
        native_collectives: use the backend's own reduce-scatter / all-gather (default: except on
            gloo, where per-rank reduce / broadcast are faster; results are identical).
        sum_group: a group whose ranks hold the same parameters and computed parts of the same
            batch (context parallelism's cp group): each bucket is summed over it before the dp
            average (the model's own per-parameter cp reduction must then be off:
            ``ContextParallel.sum_grads_elsewhere``).
        replicate_group: hybrid sharding (HSDP): ranks holding the same shard of another copy of the
            model (one per shard group, at this rank's place); each bucket's reduced shard is also summed
            over it, so the states are sharded over ``dp_group`` and the gradients averaged over both.
        average_over: what the summed gradients are divided by (default: the dp group's size, times the
            replicate group's). Experts
            split by expert parallelism are summed over the ranks holding the same experts and averaged
            over the whole dp (their gradients already hold the tokens of every ep rank).

    Gradients are averaged over dp (as DDP does): the result equals one process running
    ``optimizer`` on the concatenated batch with a mean loss.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dp_group: dist.ProcessGroup | None = None,
        stage: int = 1,
        *,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        overlap_communication: bool = True,
        backwards_per_step: int = 1,
        reduce_dtype: torch.dtype | None = None,
        release_grads: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        loss_scaler: DynamicLossScaler | str | None = "auto",
        model: torch.nn.Module | None = None,
        counted_elsewhere=(),
        late_grads=(),
        native_collectives: bool | None = None,
        sum_group=None,
        replicate_group=None,
        average_over: int | None = None,
    ) -> None:
        check_arguments(
            optimizer, stage, bucket_size, release_grads, reduce_dtype, loss_scaler, model, backwards_per_step
        )
        self.optim = optimizer
        self.stage = stage
        # an omitted tp / pp group is an absent dimension (None would be the default group: the world)
        self.tp_group = comm.LOCAL if tp_group is None else tp_group
        self.pp_group = comm.LOCAL if pp_group is None else pp_group
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.replicate_group = replicate_group
        self.replicas = 1 if replicate_group is None else group_size(replicate_group)
        self.average_over = average_over or self.dp_size * self.replicas
        if native_collectives is None:
            native_collectives = not comm.per_rank_is_faster(dp_group)
        self.per_rank = not native_collectives
        model_params = [list(group["params"]) for group in optimizer.param_groups]
        check_same_on_all_ranks(model_params, stage, bucket_size, overlap_communication, backwards_per_step, dp_group)

        self.slots = build_slots(model_params, self.dp_size, self.dp_rank)
        self.buckets = build_buckets(self.slots, bucket_size, self.dp_size)
        # Re-point the wrapped optimizer at the shards; hyper-parameters and groups stay as they were.
        start = 0
        for group, params in zip(optimizer.param_groups, model_params):
            group["params"] = [slot.master for slot in self.slots[start : start + len(params)]]
            start += len(params)
        self.reducer = GradientReducer(
            self.slots,
            self.buckets,
            dp_group,
            stage,
            reduce_dtype,
            overlap_communication,
            release_grads,
            self.per_rank,
            backwards_per_step,
            late_grads,
            sum_group,
            replicate_group=replicate_group,
            divisor=self.average_over,
            names=None if model is None else {id(p): n for n, p in model.named_parameters()},
        )
        if loss_scaler == "auto":
            loss_scaler = DynamicLossScaler() if any(s.param.dtype == torch.float16 for s in self.slots) else None
        self.loss_scaler: DynamicLossScaler | None = loss_scaler
        self.last_step_skipped = False
        self._grad_stats: tuple[float, bool] | None = None
        # Parameters another pipeline stage also holds and counts (a tied weight on the last
        # stage): left out of this rank's share of the global gradient norm, so they count once.
        elsewhere = {id(p) for p in counted_elsewhere}
        self._norm_slots = [s for s in self.slots if id(s.param) not in elsewhere]

        # The torch.optim.Optimizer surface, shared with the wrapped optimizer, so LR schedulers and
        # step hooks work on the wrapper: param_groups are the very same dicts.
        share_surface(self, optimizer)

    # -- the training loop ------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (1 unless fp16 loss scaling is on)."""
        return loss * self.loss_scale if self.loss_scaler is not None else loss

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``scale_loss(loss).backward()``: use it instead of ``loss.backward()`` with fp16 params."""
        self.scale_loss(loss).backward(**kwargs)

    @contextmanager
    def no_sync(self):
        """Micro-steps of gradient accumulation: backward inside only accumulates into ``param.grad``.

        With overlap (the default) wrap all but the last backward of a step in it (or pass
        ``backwards_per_step``), else the buckets sent during the first are sent again at ``step``.
        Without overlap nothing is ever sent during backward; it is harmless either way.
        """
        with self.reducer.no_sync():
            yield

    def sync_grads(self) -> None:
        """Reduce this step's gradients over dp now (``clip_grad_norm`` and ``step`` call it).

        Afterwards stage 1 leaves the dp-averaged gradient in every ``param.grad`` (like DDP);
        stage 2 leaves each rank's own, unreduced ``param.grad`` (None with ``release_grads``).
        """
        self.reducer.sync(1.0 / (self.average_over * self.loss_scale))

    def grad_norm(self) -> tuple[float, bool]:
        """``(global L2 norm of the gradients, found_inf)`` over dp x tp x pp; a collective."""
        if self._grad_stats is None:
            self.sync_grads()
            self._grad_stats = global_grad_norm(self._norm_slots, self.dp_group, self.tp_group, self.pp_group)
        return self._grad_stats

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to global L2 norm ``max_norm``; return the norm before clipping.

        Call between backward and `step`. The norm equals the unsharded model's (tp-sharded
        params summed over ``tp_group``, stages over ``pp_group``); it is inf/NaN on an fp16
        overflow, and that step will be skipped.
        """
        norm, found_inf = self.grad_norm()
        if not found_inf:
            clip_master_grads(self.slots, norm, float(max_norm))
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce gradients, step this rank's shards, all-gather the updated params.

        With a loss scaler, an inf/NaN gradient on any rank skips the step on every rank and
        lowers the scale (``last_step_skipped`` tells which happened).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync_grads()
        found_inf = self.grad_norm()[1] if self.loss_scaler is not None else False
        self.last_step_skipped = found_inf
        if not found_inf:
            self.optim.step()
            for slot in self.slots:
                slot.master.grad = None  # free the gradient shards before the all-gather buffers exist
            self._gather_params()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        self._end_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (and this step's shards). Never called behind your back."""
        for slot in self.slots:
            p = slot.param
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    with torch.no_grad():
                        p.grad.zero_()
        self._end_step()

    def _end_step(self) -> None:
        for slot in self.slots:
            slot.master.grad = None
        self.reducer.reset()
        self._grad_stats = None

    @torch.no_grad()
    def _gather_params(self) -> None:
        """All-gather every bucket's updated shards into the model params (two buckets in flight)."""
        pending = deque()
        for bucket in self.buckets:
            pending.append(self._launch_gather(bucket))
            if len(pending) > 1:
                self._finish_gather(*pending.popleft())
        while pending:
            self._finish_gather(*pending.popleft())

    def _launch_gather(self, bucket):
        """Updated shards into this rank's row of a ``[dp, row]`` buffer (the bucket's gradient
        buffer when the dtypes match: no fresh allocation each step), then all-gather the rows."""
        first = bucket.slots[0]
        out = self.reducer.spare_buffer(bucket, first.param.dtype)
        if out is None:
            out = torch.empty(self.dp_size, bucket.row_numel, dtype=first.param.dtype, device=first.master.device)
        mine = out[self.dp_rank]
        for slot in bucket.slots:
            mine[slot.offset : slot.offset + slot.shard_numel].copy_(slot.master)
        if self.dp_size == 1:
            return bucket, None, out
        send = mine if self.per_rank else mine.clone()  # the native all-gather wants separate input
        return bucket, comm.start_all_gather_flat(out.view(-1), send, self.dp_group, self.per_rank), out

    @staticmethod
    def _finish_gather(bucket, work, out) -> None:
        if work is not None:
            work.wait()
        for slot in bucket.slots:
            copy_rows_into(slot.param.data, out[:, slot.offset : slot.offset + slot.shard_numel])

    # -- weights, state and sizes -------------------------------------------------------------------

    @torch.no_grad()
    def reload_master_params(self) -> None:
        """Copy the model's current weights into the master shards (after loading model weights)."""
        for slot in self.slots:
            slot.master.copy_(
                shard_of(slot.param.detach().reshape(-1).to(slot.master.dtype), self.dp_size, self.dp_rank)
            )

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer: wrapped-optimizer states and master shards (copies
        only: an fp32 parameter's master is a view of the parameter itself)."""
        states = sum(
            v.numel() * v.element_size() for st in self.optim.state.values() for v in st.values() if torch.is_tensor(v)
        )
        masters = sum(s.master.numel() * s.master.element_size() for s in self.slots if s.master.dtype != s.param.dtype)
        return {"optimizer_states": states, "master_params": masters}

    def gradient_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for gradients now: the model's ``param.grad`` and the reduction's fp32
        buffers (bucket buffers and this rank's reduced rows), each storage counted once."""
        size = StorageBytes()
        grads = size(s.param.grad for s in self.slots if s.param.grad is not None)
        return {"gradients": grads, "gradient buffers": size(self.reducer.held_buffers())}

    def state_dict(self) -> dict:
        """This rank's shard of the state; loads back at the same dp size on the same dp rank."""
        return sharded_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this rank's `state_dict`. Load the model's weights first (fp32 masters follow them)."""
        load_sharded_state_dict(self, state_dict)

    def full_state_dict(self) -> dict:
        """The unsharded state, as the wrapped optimizer on the full model would save it (collective)."""
        return gather_full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load an unsharded state (from `full_state_dict` at any dp size, or a plain optimizer).

        Local, no communication. Load the model's weights first (fp32 masters follow them).
        """
        load_full_state_dict(self, state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "ZeroOptimizer cannot add param groups after wrapping; add them to the wrapped optimizer "
            "before building ZeroOptimizer"
        )

    def close(self) -> None:
        """Remove the backward hooks (overlap mode); the optimizer is unusable afterwards."""
        self.reducer.remove_hooks()

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, dp={self.dp_rank}/{self.dp_size}, "
            + (f"replicas={self.replicas}, " if self.replicas > 1 else "")
            + f"params={len(self.slots)}, "
            f"buckets={len(self.buckets)}, optimizer={type(self.optim).__name__}, loss_scaler={self.loss_scaler})"
        )
