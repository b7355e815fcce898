"""``generate()`` on any sharded model: full-vocabulary logits, and the same tokens on every tp rank.

A vocab-parallel LM head gives each rank logits over its slice of the vocabulary; picking tokens
from those would give each rank different tokens. At sharding, a model that can generate gets a
subclass (same name, see :func:`shardformer.sharded_class.adapt_class`) whose ``generate``

- gathers the logits of every vocab-parallel head in the model for the duration of the call, and
- when sampling, or when the logits do not come from a head it gathers, appends, after every other
  logits processor and warper, :class:`AgreeOnTokens`: tp rank 0 picks the token (argmax, or a draw
  from the processed distribution with the RNG state the model's own draw would use) and broadcasts
  it; every rank then keeps only that token. Sampled tokens are the same on every rank by
  construction, so no rank reaches EOS alone and leaves the others waiting.

Greedy decoding through a gathered vocab-parallel head needs no broadcast: the all-gather hands every
rank the same bytes, and the processors and argmax that follow are deterministic, so each decoded
token costs the Megatron minimum (the embedding's all-reduce, two per layer, the head's all-gather).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.nn as nn

from shardformer.layers import VocabParallelLMHead1D
from shardformer.layers.comm import broadcast
from shardformer.mesh import VirtualGroup, group_size
from shardformer.policies.lm_heads import gathered_logits
from shardformer.topology import is_sharded, sharding_of


class AgreeOnTokens:
    """Logits processor: tp rank 0 chooses each next token, every rank gets scores selecting it alone.

    The returned scores are ``-inf`` except at the chosen token (0), so ``output_scores`` of a
    sharded ``generate`` show the choice rather than the distribution.
    """

    def __init__(self, group, do_sample: bool) -> None:
        self.group, self.do_sample = group, do_sample

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.do_sample:
            devices = [scores.device] if scores.device.type != "cpu" else []
            # fork: the model's own draw that follows consumes the same state, as it would unsharded
            with torch.random.fork_rng(devices=devices, device_type=scores.device.type):
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = scores.argmax(dim=-1)
        broadcast(tokens, self.group)
        chosen = torch.full_like(scores, float("-inf"))
        chosen.scatter_(1, tokens.unsqueeze(1), 0.0)
        return chosen


def tp_group_of(model: nn.Module):
    """The tensor-parallel group of a sharded model (None if it has none)."""
    return sharding_of(model).tp_group if is_sharded(model) else None


class ParallelGeneration:
    """Mixed into a sharded model's class: see the module docstring."""

    def generate(self, *args, **kwargs):
        with ExitStack() as stack:
            for head in self.modules():
                if isinstance(head, VocabParallelLMHead1D):
                    stack.enter_context(gathered_logits(head))
            return super().generate(*args, **kwargs)

    def _get_logits_processor(self, generation_config, *args, **kwargs):
        # transformers appends the warpers (temperature, top-k, top-p) after user processors: only
        # here does ours run last, on the distribution the token is actually drawn from
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        group = tp_group_of(self)
        single_beam = (generation_config.num_beams or 1) == 1
        sampled = bool(generation_config.do_sample)
        if group is None or isinstance(group, VirtualGroup) or group_size(group) == 1 or not single_beam:
            return processors
        if sampled or not isinstance(self.get_output_embeddings(), VocabParallelLMHead1D):
            processors.append(AgreeOnTokens(group, sampled))
        return processors
