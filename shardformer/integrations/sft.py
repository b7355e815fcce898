"""``ShardedSFTTrainer``: TRL's ``SFTTrainer`` on a model sharded by shardformer.

TRL's trainers are subclasses of transformers' ``Trainer``; this one puts `ShardedTrainer` under
``SFTTrainer``, so every change ShardedTrainer makes to Trainer (batches over dp only, no DDP, the
global gradient norm, exports, exact resume, whole-vocabulary logits for what reads them) holds for
SFT too, and TRL's own logic (dataset preparation, completion-only and assistant-only losses, entropy
and token-accuracy logs, ``peft_config``) runs unchanged on top. What reads the LM head's weight or the
logits inside the loss (``loss_type="dft"``, Liger kernels) is refused by ShardedTrainer unless the
model gathers its logits. TRL's default ``loss_type="chunked_nll"`` replaces the model's forward with
one that multiplies by the LM head's weight itself (this rank's slice of it): it runs as ``"nll"``,
the same loss, computed by the model's vocab-parallel cross-entropy (which never holds logits over
the whole vocabulary either).
"""

from __future__ import annotations

import copy
import logging
import os

import trl
from transformers import TrainingArguments
from trl import SFTConfig, SFTTrainer

from shardformer.integrations.trainer import ShardedTrainer

logger = logging.getLogger(__name__)

# The TRL releases the parity test has proven (tests/integrations/test_sft.py). TRL 1.16 computes the loss
# from the LM head's weight itself (fused_lm_head: one rank's vocabulary slice here), 15% off in that
# test: a release not listed here is refused, not trusted.
PROVEN_TRL = ("1.13.",)


class ShardedSFTTrainer(SFTTrainer, ShardedTrainer):
    """``trl.SFTTrainer`` for a shardformer-sharded model; takes exactly SFTTrainer's arguments (the model
    itself, sharded: ShardedTrainer refuses a name or path)."""

    def __init__(self, model=None, args: TrainingArguments | None = None, *rest, **kwargs):
        if not trl.__version__.startswith(PROVEN_TRL):
            raise RuntimeError(
                f"ShardedSFTTrainer is proven exact with TRL {', '.join(v + 'x' for v in PROVEN_TRL)}, and this is TRL "
                f"{trl.__version__}; install a proven release (pip install 'trl>=1.13,<1.14', as shardformer's hf extra "
                f"does), or train with ShardedTrainer"
            )
        if isinstance(model, (str, os.PathLike)):
            raise ValueError(
                f"ShardedSFTTrainer trains a sharded model; load {model!r} and shard it with shard_model first"
            )
        super().__init__(model, _nll_args(model, args), *rest, **kwargs)


def _nll_args(model, args: TrainingArguments | None) -> SFTConfig:
    """SFTConfig as SFTTrainer would build it, with loss_type "chunked_nll" (TRL's default) run as "nll"."""
    if args is None:
        name = os.path.basename(str(getattr(getattr(model, "config", None), "_name_or_path", "") or "model"))
        args = SFTConfig(f"{name}-SFT")
    elif not isinstance(args, SFTConfig):
        options = args.to_dict()
        options["hub_token"] = args.hub_token  # to_dict hides it
        args = SFTConfig(**options)
    if args.loss_type == "chunked_nll":
        args = copy.copy(args)
        args.loss_type = "nll"
        logger.info("ShardedSFTTrainer: loss_type 'chunked_nll' runs as 'nll' (same loss, vocab-parallel)")
    return args
