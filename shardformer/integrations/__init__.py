"""The tools HuggingFace users fine-tune with, on sharded models: transformers' Trainer and PEFT LoRA.

Needs the ``hf`` extra (``pip install "shardformer[hf]"``: accelerate and peft); ``import shardformer``
does not import this package.
"""

from shardformer.integrations.trainer import ShardedTrainer

__all__ = ["ShardedTrainer"]
