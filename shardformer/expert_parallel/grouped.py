"""Expert parallelism for experts called with their rows already grouped by expert: ``experts(inputs,
expert_size)`` (JetMoE) or ``experts(inputs)`` with every expert taking an equal block of rows (Llama 4,
whose routed experts see every token, scaled by its router score).

Each call becomes: every expert's block of rows goes to the rank holding the expert (all-to-all, after
one of the row counts); the receiving rank puts the rows it got in expert order (each expert's rows from
rank 0, then rank 1, ...) and runs the module's own forward on them with its local experts' counts; the
outputs go back the same way, in the caller's order. Each row's output depends only on its own expert,
so the result is the unsharded module's; the gradients come back through the same exchanges.
"""

from __future__ import annotations

import torch

from shardformer.expert_parallel.dispatch import exchange, exchange_counts, kept_in_graph
from shardformer.expert_parallel.layout import ExpertSpec, expert_params


def _expert_order(counts: torch.Tensor) -> torch.Tensor:
    """The received rows ([sender, local expert] blocks of ``counts`` rows, sender by sender) in expert
    order: expert 0's rows of every sender, then expert 1's, ..."""
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view_as(counts)
    blocks = [
        torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]), device=counts.device)
        for e in range(counts.shape[1])
        for s in range(counts.shape[0])
    ]
    return torch.cat(blocks) if blocks else counts.new_zeros(0)


class GroupedExpertParallel:
    """Mixed into the experts module's class (its parameters keep their names); ``ep_group`` and
    ``ep_spec`` are set per instance."""

    ep_group = None
    ep_spec: ExpertSpec | None = None

    def forward(self, inputs, expert_size=None):
        spec, group = self.ep_spec, self.ep_group
        if expert_size is None:  # every expert takes the same number of rows
            sizes = [inputs.shape[0] // spec.num_experts] * spec.num_experts
        else:
            sizes = [int(n) for n in expert_size]
        sent = torch.tensor(sizes).view(spec.ep_size, spec.local)
        received_counts = exchange_counts(sent.to(inputs.device), group)
        # on meta (``plan --simulate``) no count can be read: the same spread comes back
        received_counts = sent if inputs.is_meta else received_counts.cpu()  # one device sync
        send, recv = sent.sum(1).tolist(), received_counts.sum(1).tolist()
        received = exchange(inputs, send, recv, group)
        order = _expert_order(received_counts).to(inputs.device)
        grouped = received[order]
        if expert_size is None:
            own = super().forward(grouped)
        else:
            own = super().forward(grouped, received_counts.sum(0).tolist())
        own = kept_in_graph(own, [grouped, *expert_params(self).values()])
        back = torch.empty_like(own).index_copy(0, order, own)  # the senders' order again
        return exchange(back, recv, send, group)
