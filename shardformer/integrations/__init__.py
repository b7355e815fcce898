"""The tools HuggingFace users fine-tune with, on sharded models: transformers' Trainer and PEFT LoRA.

Needs the ``hf`` extra (``pip install "shardformer[hf]"``: accelerate and peft). ``import shardformer``
imports only `.peft`, which imports peft itself only when a PEFT model is in hand;
``ShardedTrainer`` (transformers' Trainer, accelerate) is imported on first use.
"""

__all__ = ["ShardedSFTTrainer", "ShardedTrainer", "install_peft"]


def install_peft() -> None:
    """Let PEFT add LoRA to (and load adapters onto) sharded models; done by ``shard_model`` already
    when peft was imported before it."""
    from shardformer.integrations.peft_layer import install  # deferred: it imports peft, an optional dependency

    install()


def __getattr__(name: str):
    if name == "ShardedTrainer":  # transformers' Trainer and accelerate take seconds to import
        from shardformer.integrations.trainer import ShardedTrainer

        return ShardedTrainer
    if name == "ShardedSFTTrainer":  # needs TRL (not part of the hf extra's minimum: pip install trl)
        from shardformer.integrations.sft import ShardedSFTTrainer

        return ShardedSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
