"""FullyShardedOptimizer: the ZeRO-3 side of the engine's step, around a plain torch optimizer.

The optimizer itself is any ``torch.optim.Optimizer`` built over the model's FSDP2 (DTensor)
parameters: each rank's states are its dp shard's by construction. This wrapper gives it the
surface the engine and the checkpoints use with ZeroOptimizer: gradient hooks run on the sharded
gradients, the global gradient norm over tp x dp (x pp), clipping, and the optimizer state as the
full (dp-gathered) state in torch's own format, which every layout loads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from shardformer.core import comm
from shardformer.data_parallel.fsdp import GradHooks, kept_whole, local_bytes
from shardformer.data_parallel.grad_norm import reduce_norm_stats
from shardformer.data_parallel.optimizer_surface import share_surface
from shardformer.tensor_parallel.slicer import shard_spec

_FULL = StateDictOptions(full_state_dict=True)


class FullyShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-3: ``optimizer`` over a model sharded by `shardformer.data_parallel.fsdp.fully_shard_model`.

    Args:
        optimizer: a torch optimizer built over ``model``'s (FSDP2) parameters.
        model: the fully sharded model (for the state dict's parameter names).
        dp_group, tp_group, pp_group: the groups the gradient norm is summed over (tp / pp omitted:
            that dimension is absent).
        grad_hooks: what `fully_shard_model` returned: hooks to run on the sharded gradients.
        counted_elsewhere: parameters another pipeline stage also holds and counts in the gradient
            norm (a tied embedding on the last stage): left out here so they count once.

    FSDP2 averages gradients over dp in backward; ``step`` steps each rank's shards.
    """

    loss_scaler = None  # fp16 loss scaling is not offered at stage 3 (EngineConfig refuses fp16)
    loss_scale = 1.0
    stage = 3

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        dp_group=None,
        *,
        tp_group=None,
        pp_group=None,
        grad_hooks: GradHooks = (),
        counted_elsewhere=(),
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FullyShardedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        plain = [
            n for n, p in model.named_parameters() if id(p) in mine and not isinstance(p, DTensor) and not kept_whole(p)
        ]
        if plain:
            raise ValueError(
                f"{plain[0]} is not sharded by FSDP2 (not a DTensor); build the optimizer after fully_shard_model"
            )
        self.optim, self.model = optimizer, model
        self.dp_group = dp_group
        self._dp_size = comm.group_size(dp_group)
        self.tp_group = comm.LOCAL if tp_group is None else tp_group
        self.pp_group = comm.LOCAL if pp_group is None else pp_group
        self.grad_hooks = list(grad_hooks)
        elsewhere = {id(p) for p in counted_elsewhere}  # held and counted in the norm by another stage too
        self._norm_params = [p for p in self._params() if id(p) not in elsewhere]
        self._synced = False
        self._grad_stats: tuple[float, bool] | None = None
        # The torch.optim.Optimizer surface, shared with the wrapped optimizer (LR schedulers edit these dicts).
        share_surface(self, optimizer)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    # -- the training loop ------------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss.backward(**kwargs)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Run the gradient hooks (sums over tp) on this step's sharded gradients, once."""
        if self._synced:
            return
        for param, hooks in self.grad_hooks:
            if param.grad is None:
                continue
            local = _local(param.grad)
            for hook in hooks:
                result = hook(local)
                if result is not None:
                    local.copy_(result)
        self._synced = True

    @torch.no_grad()
    def grad_norm(self) -> tuple[float, bool]:
        """``(global L2 norm of the gradients, found_inf)`` over dp x tp x pp; a collective."""
        if self._grad_stats is None:
            self.sync_grads()
            device = self._params()[0].device
            sums = {True: torch.zeros((), dtype=torch.float64, device=device)}
            sums[False] = torch.zeros((), dtype=torch.float64, device=device)
            for p in self._norm_params:
                if p.grad is not None:  # each dp rank holds its disjoint rows: the dp sum is the whole
                    square = torch.linalg.vector_norm(_local(p.grad), 2, dtype=torch.float64).square()
                    if not isinstance(p.grad, DTensor):  # kept whole on every dp rank: counted once over dp
                        square = square / self._dp_size
                    sums[shard_spec(p) is not None] += square
            self._grad_stats = reduce_norm_stats(sums[True], sums[False], self.dp_group, self.tp_group, self.pp_group)
        return self._grad_stats

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to global L2 norm ``max_norm`` (as torch's clip_grad_norm_ on the
        unsharded model); return the norm before clipping."""
        norm, found_inf = self.grad_norm()
        coef = float(max_norm) / (norm + 1e-6)
        if coef < 1.0 and not found_inf:
            for p in self._params():
                if p.grad is not None:
                    _local(p.grad).mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync_grads()
        self.optim.step()
        self._end_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self._end_step()

    def _end_step(self) -> None:
        self._synced = False
        self._grad_stats = None

    # -- state and sizes ---------------------------------------------------------------------------

    def _names(self) -> list[str]:
        """Each optimizer parameter's name in the model, in the optimizer's order."""
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return [by_id[id(p)] for p in self._params()]

    def state_dict(self) -> dict:
        """The full state, as the wrapped optimizer on the unsharded (tp-local) model would save it:
        torch's format, every per-element state with its parameter's shape. Collective over dp."""
        if not self.optim.state:  # nothing to gather (torch's helper would initialise the state by stepping)
            return self.optim.state_dict()
        names = self._names()
        full = get_optimizer_state_dict(self.model, self.optim, options=_FULL)
        index = {n: i for i, n in enumerate(names)}
        groups, start = [], 0
        for saved, mine in zip(full["param_groups"], self.optim.param_groups):
            groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": list(range(start, start + len(mine["params"])))})  # fmt: skip
            start += len(mine["params"])
        return {"state": {index[n]: entry for n, entry in full["state"].items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (from `state_dict` at any dp size, a plain optimizer, or a
        ZeroOptimizer's ``full_state_dict``): each rank keeps its dp shard. Collective over dp."""
        names = self._names()
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.optim.param_groups]:
            raise ValueError(
                f"the optimizer state has param groups of sizes {[len(g['params']) for g in groups]}, this "
                f"optimizer {[len(g['params']) for g in self.optim.param_groups]}; load a state saved for this model"
            )
        by_name = {
            "state": {names[int(i)]: dict(entry) for i, entry in state_dict["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in groups],
        }
        set_optimizer_state_dict(self.model, self.optim, by_name, options=_FULL)
        # torch's load gave the wrapped optimizer new param-group dicts: share them again (LR schedulers)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def local_state_dict(self) -> dict:
        """This rank's dp shard of the state (torch's format, DTensor states as their local rows):
        what a training checkpoint saves, without gathering anything."""
        state_dict = self.optim.state_dict()
        state = {
            index: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
            for index, entry in state_dict["state"].items()
        }
        return {"state": state, "param_groups": state_dict["param_groups"]}

    full_state_dict = state_dict
    load_full_state_dict = load_state_dict

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer (its dp shards of every state; no master copies:
        the sharded fp32 parameters are the masters)."""
        states = sum(local_bytes(v) for st in self.optim.state.values() for v in st.values() if torch.is_tensor(v))
        return {"optimizer_states": states, "master_params": 0}

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("add param groups to the wrapped optimizer before building FullyShardedOptimizer")

    def __repr__(self) -> str:
        dp = dist.get_world_size(self.dp_group) if dist.is_initialized() else 1
        return f"FullyShardedOptimizer(dp={dp}, optimizer={type(self.optim).__name__})"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: a DTensor's local shard, or a tensor kept whole (a scalar) itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
