"""The tables of values the settings may take (ShardConfig, EngineConfig, the CLI and the tools
read them here): precisions, ZeRO stages, pipeline schedules and backends, context-parallel modes,
and the short and long names of the parallel sizes."""

from __future__ import annotations

import torch

# The one table of training precisions (parameter dtypes) the engine, the examples and the CLI accept.
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_SEED = 1024  # base seed of the tensor-parallel dropout RNG
ZERO_STAGES = (1, 2)  # ZeroOptimizer's own: 1 optimizer states sharded over dp; 2 also the reduced gradients
ENGINE_ZERO_STAGES = (*ZERO_STAGES, 3)  # 3: parameters too, on PyTorch FSDP2 (shardformer.data_parallel.fsdp)
SCHEDULES = ("gpipe", "1f1b")  # the pipeline schedules (shardformer.pipeline.schedule runs them)
# Schedules with several model chunks (virtual stages) per pp rank, on torch.distributed.pipelining only
# (shardformer.pipeline.virtual): interleaved 1F1B (chunks looped over the ranks), ZBV and DualPipeV (V-shaped).
VIRTUAL_SCHEDULES = ("interleaved_1f1b", "zbv", "dualpipev")
BACKENDS = ("p2p", "torch")  # how the engine runs a pipeline schedule
# Short names of the parallel sizes (EngineConfig's fields) and their long ones (ShardConfig's, the CLI's).
SIZE_NAMES = {
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "dp": "data_parallel_size",
    "cp": "context_parallel_size",
}
# How context parallelism computes attention over the whole sequence (shardformer.context_parallel).
CP_MODES = ("ring", "all_to_all")
