"""ZeRO-1/2 for a model whose experts are split by expert parallelism: two ZeroOptimizers.

Dense parameters (attention, norms, routers, shared experts) are the same on every dp rank and are
averaged over dp as always. Expert parameters differ between the ep ranks of a dp group; they are
summed over the ranks holding the same experts (expert-dp) and divided by the whole dp size, since
each expert's gradient already holds the tokens every ep rank sent it. The gradient norm adds both
parts (the experts' over the ep ranks too), so clipping equals the unsharded model's.
"""

from __future__ import annotations

import math

import torch

from shardformer.core import comm
from shardformer.data_parallel import ZeroOptimizer
from shardformer.data_parallel.grad_norm import clip_master_grads
from shardformer.expert_parallel.layout import is_expert_param


class ExpertParallelOptimizer:
    """What `shardformer.ParallelEngine` steps with at ep > 1 (ZeRO-1/2): the user's optimizer
    factory is called twice, over the dense and over the expert parameters (same hyper-parameters)."""

    def __init__(self, make_optimizer, params, mesh, stage: int, **zero_kwargs) -> None:
        dense = [p for p in params if not is_expert_param(p)]
        experts = [p for p in params if is_expert_param(p)]
        self.ep_group = mesh.ep_group
        # the experts' norm is summed over the pipeline stages here, where every stage takes part: a stage
        # of dense layers only (DeepSeek's first layers) holds no experts, nor do its ep peers
        self.pp_group = zero_kwargs.pop("pp_group", comm.LOCAL)
        # tied weights (summed over stages after backward, counted once in the norm) are dense
        dense_only = {k: zero_kwargs.pop(k) for k in ("late_grads", "counted_elsewhere") if k in zero_kwargs}
        # hybrid sharding: both sharded inside this rank's shard group, and summed over the replicas too
        zero_kwargs["replicate_group"] = mesh.dp_replicate_group if mesh.dp_replicate_size > 1 else None
        self.dense = ZeroOptimizer(
            make_optimizer(dense), mesh.dp_shard_group, stage, pp_group=self.pp_group, **zero_kwargs, **dense_only
        )
        self.experts = experts and ZeroOptimizer(
            make_optimizer(experts), mesh.expert_dp_shard_group, stage, average_over=mesh.dp_size, **zero_kwargs
        )
        self.parts = (self.dense, self.experts) if experts else (self.dense,)
        self.param_groups = [g for part in self.parts for g in part.param_groups]  # LR schedulers see every group

    @property
    def loss_scale(self) -> float:
        return self.dense.loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def grad_norm(self) -> tuple[float, bool]:
        """(global L2 norm, found_inf): dense over dp x tp x pp, experts over expert-dp x tp, then ep and pp."""
        dense, dense_inf = self.dense.grad_norm()
        experts, experts_inf = self.experts.grad_norm() if self.experts else (0.0, False)
        squares = torch.tensor([experts**2, float(experts_inf)], dtype=torch.float64)
        if self.experts:
            comm.all_reduce(squares, self.ep_group)
        comm.all_reduce(squares, self.pp_group)  # every stage, with experts or without
        return math.sqrt(dense**2 + squares[0].item()), dense_inf or bool(squares[1].item())

    def clip_grad_norm(self, max_norm: float) -> float:
        norm, found_inf = self.grad_norm()
        if not found_inf:
            for part in self.parts:
                clip_master_grads(part.slots, norm, float(max_norm))
        return norm

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "experts": self.experts.state_dict() if self.experts else None}

    def load_state_dict(self, state_dict: dict) -> None:
        self.dense.load_state_dict(state_dict["dense"])
        if self.experts:
            self.experts.load_state_dict(state_dict["experts"])
        self._share_groups()

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a dp-unsharded state numbering the dense parameters first, then the experts (each part
        keeps its own rows; local, no communication). The training checkpoints' route across ep sizes."""
        start, first_group = 0, 0
        zero = state_dict.get("zero") or {}
        for part in self.parts:
            count, groups = len(part.slots), len(part.param_groups)
            mine = range(start, start + count)
            part.load_full_state_dict({
                "state": {int(i) - start: v for i, v in state_dict["state"].items() if int(i) in mine},
                "param_groups": [
                    {**g, "params": [i - start for i in g["params"]]}
                    for g in state_dict["param_groups"][first_group : first_group + groups]
                ],
                "zero": {**zero, "master_params": {
                    int(i) - start: t for i, t in zero.get("master_params", {}).items() if int(i) in mine
                }},
            })  # fmt: skip
            start, first_group = start + count, first_group + groups
        self._share_groups()

    def _share_groups(self) -> None:
        """Loading gave the parts new param-group dicts: an LR scheduler must reach those."""
        self.param_groups = [g for part in self.parts for g in part.param_groups]
