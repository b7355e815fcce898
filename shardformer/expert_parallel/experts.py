"""Expert parallelism on transformers' experts: each ep rank keeps ``num_experts / ep`` whole experts
(its rows of every ``[E, ...]`` or ``[E * rows, ...]`` parameter, `.layout`) and runs the module's own
forward on the tokens routed to them. This file holds the split and the routed call's forward; the
grouped and dense calls' forward is in `.grouped`.

The routed call is the one transformers' MoE blocks make, ``experts(hidden [T, H] (DBRX: [B, S, H]),
top_k_index [T, k], top_k_weights [T, k])``. Here that call becomes:

1. every (token, slot) pair with a real expert is sorted by expert (the order the module's own loop
   adds them in) and sent to the rank holding its expert (all-to-all);
2. the receiving rank runs the module's own forward (every experts implementation transformers
   ships: eager, batched_mm, grouped_mm) on the tokens it got, each with its local expert index and a
   routing weight of one, so it returns the expert's plain output;
3. the outputs come back (all-to-all) and the sending rank weights them with its own routing weights
   and adds them up per token, as the module does.

Nothing is dropped (dropless): the result is the unsharded module's. The routing weights stay on the
rank that routed (their gradient, and the router's, are computed there); each expert's gradient sums
the contributions of every rank's tokens through the backward all-to-all.

With expert-internal tensor parallelism (the tp plan cut each expert's intermediate dimension first),
the tp hooks around this forward still hold: the exchange and the weighting are linear, so summing
the tp ranks' partial outputs once, after the combine, gives the whole output.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardformer.core.comm import group_rank, group_size
from shardformer.expert_parallel.dispatch import exchange, exchange_counts, kept_in_graph
from shardformer.expert_parallel.grouped import GroupedExpertParallel
from shardformer.expert_parallel.layout import ExpertSpec, call_kind, expert_params


class ExpertParallel:
    """Mixed into the experts module's class (the module keeps its parameters' names, so its state
    dict, hooks and PEFT see the same module); ``ep_group`` and ``ep_spec`` are set per instance."""

    ep_group = None
    ep_spec: ExpertSpec | None = None

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        spec, group = self.ep_spec, self.ep_group
        shape = hidden_states.shape  # DBRX passes [batch, seq, hidden] with the routing of [batch * seq]
        hidden_states = hidden_states.reshape(-1, shape[-1])
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        slot = torch.arange(k, device=flat.device).repeat(tokens)
        token = torch.arange(tokens, device=flat.device).repeat_interleave(k)
        if hidden_states.is_meta:
            # a meta tensor holds no router choices to count (``shardformer plan --simulate``): take the
            # routing as spread evenly, each rank sending and receiving ``tokens * k / ep`` rows per rank
            # (the counts are still exchanged, so the simulated job issues every collective a real one does)
            order = torch.arange(tokens * k, device=flat.device)
            exchange_counts(flat.new_empty((spec.ep_size, spec.local)), group)
            rows, extra = divmod(tokens * k, spec.ep_size)
            send = recv = [rows + (r < extra) for r in range(spec.ep_size)]
            local_index = flat.new_empty(sum(recv))
        else:
            # the module's own loop adds expert by expert, slot by slot, token by token: the same order
            real = (flat >= 0) & (flat < spec.num_experts)  # an index past the experts means "none" to the module
            order = torch.argsort((flat * k + slot) * tokens + token)
            order = order[real[order]]
            expert, token = flat[order], token[order]
            # rows per (destination rank, its local expert); rows leave sorted by expert, so each sender's
            # rows arrive grouped by local expert and the counts alone give every row's expert
            sent = torch.bincount(expert, minlength=spec.num_experts).view(spec.ep_size, spec.local)
            received_counts = exchange_counts(sent, group)
            send, recv = torch.stack((sent.sum(1), received_counts.sum(1))).tolist()  # one device sync
            local_ids = torch.arange(spec.local, device=flat.device).repeat(spec.ep_size)
            local_index = local_ids.repeat_interleave(received_counts.reshape(-1))
        received = exchange(hidden_states[token], send, recv, group)
        ones = torch.ones((received.shape[0], 1), dtype=top_k_weights.dtype, device=received.device)
        own = super().forward(received, local_index.unsqueeze(1), ones, *args, **kwargs).reshape(received.shape)
        own = kept_in_graph(own, [received, *expert_params(self).values()])
        back = exchange(own, recv, send, group)
        weights = top_k_weights.reshape(-1)[order]
        weighted = back * weights.unsqueeze(1)
        combined = torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))
        return combined.view(shape)


_CLASSES: dict[type, type] = {}


def _ep_class(cls: type, mixin: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def make_expert_parallel(module: nn.Module, group) -> nn.Module:
    """Keep this rank's experts of ``module`` (in place) and route its calls through the ep group."""
    size, rank = group_size(group), group_rank(group)
    count = module.num_experts
    for name, param in expert_params(module).items():
        spec = ExpertSpec(count, size, rank, param.shape[0] // count)
        new = nn.Parameter(spec.local_part(param.detach()).clone(), requires_grad=param.requires_grad)
        if hasattr(param, "shard_spec"):  # expert-internal tp cut another dimension first
            new.shard_spec = param.shard_spec
        new.expert_spec = spec
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, new)
    mixin = ExpertParallel if call_kind(module) == "routed" else GroupedExpertParallel
    module.__class__ = _ep_class(type(module), mixin)
    module.num_experts = count // size  # what the module's own forward loops over
    module.ep_group, module.ep_spec = group, ExpertSpec(count, size, rank)
    return module
