"""What expert parallelism puts on a rank, counted without processes (``shardformer plan``): experts per
rank, the experts' share of the parameters, and the bytes a rank sends in the token exchanges."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from shardformer.expert_parallel.find import ExpertParallelError, find_experts
from shardformer.expert_parallel.layout import expert_params

_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")


@dataclass(frozen=True)
class ExpertSizing:
    """A model's experts at one expert-parallel size."""

    paths: tuple[str, ...]  # the stacked-experts modules (one per MoE layer)
    experts: int  # experts per layer
    ep: int
    top_k: int  # experts each token is routed to
    hidden: int
    expert_numel: int  # stacked expert parameters of the whole model

    @property
    def per_rank(self) -> int:
        return self.experts // self.ep

    def exchange_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """Bytes one rank sends in one training step of ``tokens`` tokens through every MoE layer: the
        dispatch and the combine, forward and backward, each ``tokens * top_k * hidden`` values of which
        ``(ep - 1) / ep`` leave the rank (routing spread evenly; a skewed router sends more)."""
        per_exchange = tokens * self.top_k * self.hidden * dtype_bytes * (self.ep - 1) // self.ep
        return 4 * len(self.paths) * per_exchange

    def summary(self, total_numel: int) -> str:
        share = self.expert_numel / max(total_numel, 1)
        return (
            f"{len(self.paths)} MoE layers x {self.experts} experts (top-{self.top_k}); experts hold {share:.0%} of the "
            f"parameters; {self.per_rank} experts per layer per rank at ep={self.ep}"
        )


def expert_sizing(model: nn.Module, ep: int = 1) -> ExpertSizing | None:
    """The experts of ``model`` (a meta-device model will do) at ``ep``; None for a model without stacked
    experts. An ExpertParallelError when ``ep`` does not divide them."""
    try:
        paths, _ = find_experts(model, 1)
    except ExpertParallelError:
        return None
    if ep > 1:
        find_experts(model, ep)  # the divisibility check, with its message
    modules = [model.get_submodule(p) for p in paths]
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = next((getattr(text, n) for n in _TOP_K if isinstance(getattr(text, n, None), int)), 1)
    numel = sum(p.numel() for m in modules for p in expert_params(m).values())
    hidden = getattr(text, "hidden_size", None) or modules[0].parameters().__next__().shape[-1]
    return ExpertSizing(tuple(paths), modules[0].num_experts, ep, top_k, hidden, numel)
