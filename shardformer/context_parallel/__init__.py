"""Context parallelism: the sequence split over cp ranks, attention over the whole sequence through
transformers' attention interface, by Ulysses all-to-all or ring attention.

``ShardConfig(context_parallel_size=C, context_parallel_mode="ring" | "all_to_all")``; see
`.model` for what happens to a forward, `.attention` for how attention is reached,
`.ring` and `.ulysses` for the two ways it is computed, and `.checks` for what is refused.
"""

from shardformer.context_parallel.attention import IMPLEMENTATION
from shardformer.context_parallel.checks import check_context_parallel
from shardformer.context_parallel.layout import ZigzagLayout, gather_split
from shardformer.context_parallel.model import ContextParallel, apply_context_parallel, context_parallel_stage_forward

__all__ = [
    "IMPLEMENTATION",
    "ContextParallel",
    "ZigzagLayout",
    "apply_context_parallel",
    "check_context_parallel",
    "context_parallel_stage_forward",
    "gather_split",
]
