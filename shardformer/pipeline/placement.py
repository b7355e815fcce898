"""Where the engine's model goes over the pipeline ranks, read from its EngineConfig: the checks run
before any process waits (the split's sizes, paths and ties; what a virtual-stage schedule needs), the
weights several chunks hold (found on the model not yet split) and the split itself (this rank's stage,
or its chunks under a virtual-stage schedule)."""

from __future__ import annotations

import torch.nn as nn

from shardformer.core.config import EngineConfig
from shardformer.pipeline.spec import PipelineSpec, check_split
from shardformer.pipeline.spec_check import check_pipeline_spec
from shardformer.pipeline.tied import Tied, tied_weights
from shardformer.pipeline.virtual import PLACEMENT, Chunks, check_virtual, chunk_layers, chunk_ranks, keep_chunks


def check_placement(spec: PipelineSpec | None, model: nn.Module, config: EngineConfig) -> tuple[int, list | None]:
    """``(num_chunks, counts)``: the chunks (stages) over all pp ranks and the layers of each (None:
    balanced), checked before any collective."""
    num_chunks, counts = config.pp * config.chunks_per_rank, config.layers_per_stage
    if config.chunks_per_rank > 1:  # virtual stages: the schedule's needs, the layers per chunk
        layers = len(spec.layer_paths(model))  # every stack's (an encoder-decoder's two)
        counts = check_virtual(
            config.schedule, config.pp, config.chunks_per_rank, config.num_microbatches, layers,
            config.layers_per_stage,
        )  # fmt: skip
    if config.pp > 1:  # the split's sizes, paths and ties, before any process waits
        check_pipeline_spec(spec, model, num_chunks, counts)
    return num_chunks, counts


def keep_stage_or_chunks(
    spec: PipelineSpec | None, model: nn.Module, config: EngineConfig, pp_rank: int, num_chunks: int, counts
) -> tuple[Chunks | None, list[Tied]]:
    """Split ``model`` in place to what pp rank ``pp_rank`` holds. Returns its chunks (None: one stage
    per rank, or pp=1) and the weights several chunks hold, found before the split."""
    if config.pp == 1:
        return None, []
    tied = _tied_weights(spec, model, config, pp_rank, num_chunks, counts)
    if config.chunks_per_rank > 1:
        return keep_chunks(spec, model, config.schedule, pp_rank, config.pp, config.chunks_per_rank, counts), tied
    spec.keep_stage(model, pp_rank, config.pp, config.layers_per_stage)
    return None, tied


def _tied_weights(spec: PipelineSpec, model: nn.Module, config: EngineConfig, pp_rank: int, num_chunks: int, counts):
    """The weights several chunks hold, from the spec's placement of the model not yet split."""
    layers = chunk_layers(check_split(len(spec.layer_paths(model)), num_chunks, counts))
    virtual = config.chunks_per_rank > 1
    ranks = chunk_ranks(PLACEMENT[config.schedule], config.pp, num_chunks) if virtual else range(config.pp)
    placement = [[layers[c] for c, r in enumerate(ranks) if r == rank] for rank in range(config.pp)]
    return tied_weights(spec, model, placement, pp_rank)
