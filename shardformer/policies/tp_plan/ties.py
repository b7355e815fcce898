"""Ties between a module a route cuts and one it leaves whole, closed before the sharder checks them.

A tensor shared by several modules must be cut the same way in all of them or in none
(`shardformer.tensor_parallel.detect.check_ties_are_cut_alike` refuses anything else). A route
proposes its cut module by module, so it can meet a tie half-cut: an encoder-decoder's LM head tied
to the decoder's own token embedding (BERT2BERT, T5Gemma) while the route cuts only the model's input
embedding with it. A vocabulary shared by LM heads and token embeddings is then split in every one of
them (the same rows per rank); any other half-cut tie, or one a member's class cannot join, is kept
whole everywhere. A layer that only hooks the weights (`GradAllReduce`) cuts nothing. The route's
proof then says whether the model computes what it did.
"""

from __future__ import annotations

import torch.nn as nn

from shardformer.policies.tp_plan.lm import embedding_layer
from shardformer.tensor_parallel.detect import cuts_weights, find_ties, is_cuttable
from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.tensor_parallel.policy import Col_Layer, Layer


def _splits_vocabulary(layer: Layer) -> bool:
    cls = layer.replace_layer
    return isinstance(cls, type) and issubclass(cls, (VocabParallelEmbedding1D, VocabParallelLMHead1D))


def cut_ties_alike(model: nn.Module, layers: dict[str, Layer]) -> None:
    """Close every half-cut tie of ``model`` in ``layers`` (``{module path: layer}``), in place."""
    modules = dict(model.named_modules())
    for names in find_ties(model):
        paths = list(dict.fromkeys(name.rpartition(".")[0] for name in names))
        cut = [p for p in paths if p in layers and cuts_weights(layers[p])]
        whole = [p for p in paths if p not in layers and is_cuttable(modules[p])]
        if not cut or not whole:
            continue
        if all(_splits_vocabulary(layers[p]) for p in cut):
            embeddings = {p: embedding_layer(modules[p]) for p in whole}
            if all(embeddings.values()):  # token embeddings: the rows of the vocabulary the heads split
                layers.update({p: Col_Layer(p, bias=None, replace_layer=cls) for p, cls in embeddings.items()})
                continue
        for path in cut:
            del layers[path]
