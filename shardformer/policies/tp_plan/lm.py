"""The vocab-parallel input embedding of a plan-derived model, in the model's own flavour.

(The LM head, its loss and ``generate`` take the route every sharded model takes:
`shardformer.tensor_parallel.lm_head`.)
"""

from __future__ import annotations

import functools

import torch.nn as nn

from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D

# what `VocabParallelEmbedding1D` sets on itself, carried onto the model's own embedding it stands in for
_LOOKUP_ATTRIBUTES = ("process_group", "num_embeddings", "vocab_start", "vocab_end", "padding_idx")
_LOOKUP_ATTRIBUTES += ("_local_padding_idx",)


class _VocabParallelLookup(VocabParallelEmbedding1D, nn.Embedding):
    """The lookup an ``nn.Embedding`` subclass's own forward reaches through ``super().forward(ids)``,
    made vocab-parallel (the class sits between the subclass and ``nn.Embedding``)."""


@functools.cache
def _parallel_subclass(cls: type[nn.Embedding]) -> type[nn.Module]:
    return type(f"VocabParallel{cls.__name__}", (cls, _VocabParallelLookup), {"__module__": __name__})


class SubclassVocabParallelEmbedding1D(VocabParallelEmbedding1D):
    """A model's own ``nn.Embedding`` subclass (Gemma's scaled embedding; T5Gemma2's, which also writes a
    learned ``eoi_embedding`` over one token's rows) with its vocabulary split over ranks: the module keeps
    its class's forward and every parameter, buffer and attribute that forward reads (whatever their
    names), and only the lookup it calls is the vocab-parallel one. A forward that reads ``self.weight``
    itself instead (Whisper's positions) is not followed: the derived route's trace leaves it whole."""

    @classmethod
    def from_native(cls, module: nn.Embedding, process_group=None, **options):
        lookup = VocabParallelEmbedding1D.from_native(module, process_group, **options)
        module.__class__ = _parallel_subclass(type(module))
        module.weight = lookup.weight
        for name in _LOOKUP_ATTRIBUTES:
            setattr(module, name, getattr(lookup, name))
        return module


def embedding_layer(module: nn.Module) -> type[nn.Module] | None:
    """Our vocab-parallel class for an input embedding, or None if its forward is not one we know."""
    if type(module) is nn.Embedding:
        return VocabParallelEmbedding1D
    if isinstance(module, nn.Embedding) and _reaches_lookup(type(module)):
        return SubclassVocabParallelEmbedding1D
    return None


def _reaches_lookup(cls: type[nn.Embedding]) -> bool:
    """Whether every ``forward`` of the subclass's own classes hands the lookup on (``super().forward``),
    so that ``nn.Embedding.forward`` does it: one that looks up ``self.weight`` itself (IDEFICS's decoupled
    embedding calls ``F.embedding``) would read this rank's rows with the whole vocabulary's ids."""
    for klass in cls.__mro__[: cls.__mro__.index(nn.Embedding)]:
        forward = vars(klass).get("forward")
        if forward is not None and not {"super", "forward"} <= set(getattr(forward, "__code__", forward).co_names):
            return False
    return True
