"""PEFT LoRA on sharded models, in either order, cut like the base layers.

- ``shard_model(get_peft_model(model, cfg))``: the sharder takes PEFT's LoRA layers out while the
  policy plans (see `shardformer.tensor_parallel.adapters`) and hands each back here with its
  sharded base, to be cut (`shardformer.integrations.lora_cut.cut_adapter`).
- ``get_peft_model(shard_model(model), cfg)`` and ``PeftModel.from_pretrained(sharded, dir)``: PEFT
  refuses layers it does not know, so its LoRA dispatch learns ours (`.peft_layer`, installed
  once peft is imported and a model is sharded, or when ``shardformer.integrations`` is imported).

The cut: a column-parallel base's ``B`` by output features (the base's blocks and replicas), ``A``
whole; a row-parallel base's ``A`` by input features, ``B`` whole (layers in
`shardformer.tensor_parallel.layers.lora`). Adapters are built full size by PEFT and then cut,
so the same seed gives the same adapter as on the unsharded model. What cannot be cut exactly is
refused before the first step, naming the setting to change.

This module imports peft only when a PEFT object is in hand (``import shardformer`` imports it).
"""

from __future__ import annotations

import sys

import torch.nn as nn

from shardformer.core.config import ShardConfig
from shardformer.integrations.lora_cut import DROP_IT, cut_adapter, lora_settings, refusal_for
from shardformer.tensor_parallel.adapters import register_adapter_support
from shardformer.tensor_parallel.policy import Col_Layer, Layer


def _is_peft_module(module: nn.Module) -> bool:
    return any(c.__module__.startswith("peft.") for c in type(module).__mro__)


class PeftLoraSupport:
    """PEFT's adapter layers, for `shardformer.tensor_parallel.adapters`."""

    def base_of(self, module: nn.Module) -> nn.Module | None:
        if not _is_peft_module(module):
            return None
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Module):  # modules_to_save / trainable_token_indices wrap an original_module
            auxiliary = any(c.__name__ == "AuxiliaryTrainingWrapper" for c in type(module).__mro__)
            base = getattr(module, "original_module", None) if auxiliary else None
        return base if isinstance(base, nn.Module) else None

    def refusal(self, path: str, wrapper: nn.Module, layer: Layer | None, shard_config: ShardConfig) -> str | None:
        experts = shard_config.expert_parallel_size > 1 and any(p.dim() == 3 for p in wrapper.parameters())
        if (layer is not None or experts) and any(c.__name__ == "ParamWrapper" for c in type(wrapper).__mro__):
            # LoRA on a module's raw parameters (an MoE's experts): its low-rank factors span the whole
            # parameter, which the policy's replacement or ep's split of the experts cuts without them
            return (
                "PEFT's ParamWrapper (LoRA on parameters: target_parameters, or 'all-linear' on a mixture of "
                "experts) is not cut with the module it wraps; leave the experts out of the targets, e.g. "
                "LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'])"
            )
        if layer is None:
            return None  # the base stays whole: so does its adapter
        if not hasattr(wrapper, "base_layer"):  # modules_to_save, trainable_token_indices
            return (
                f"PEFT's {type(wrapper).__name__} keeps a trainable copy of a layer tensor parallelism cuts, which "
                f"would hold and save this rank's slice; leave it out of modules_to_save / trainable_token_indices"
            )
        if self.base_of(wrapper.base_layer) is not None:
            return "it wraps another adapter layer; add adapters after sharding, or one per layer"
        embedding = bool(getattr(wrapper, "lora_embedding_A", None))
        if not hasattr(wrapper, "lora_A") or embedding:
            what = "LoRA on embeddings" if embedding else f"{type(wrapper).__name__}"
            return f"{what} is not cut with its base layer (only LoRA on linear layers is); {DROP_IT}"
        if getattr(wrapper, "merged", False):
            return "its adapters are merged into the base weights; unmerge() them first"
        sequence = shard_config.sequence_parallel and shard_config.tensor_parallel_size > 1
        gather = isinstance(layer, Col_Layer) and layer.gather_output
        return refusal_for(
            layer.replace_layer, gather_output=gather, sequence_parallel=sequence, **lora_settings(wrapper)
        )

    def adopt(self, wrapper: nn.Module, base: nn.Module, process_group) -> None:
        # deferred: peft_layer imports peft, which only a model that already holds PEFT layers needs
        from shardformer.integrations.peft_layer import ShardedLoraLinear, install

        install()
        wrapper.base_layer = base
        wrapper.__class__ = ShardedLoraLinear.for_class(type(wrapper))
        for name in list(wrapper.lora_A):
            cut_adapter(wrapper, name, process_group)

    def after_shard(self, model: nn.Module) -> None:
        if "peft" in sys.modules:  # a script that uses PEFT has imported it by now; others pay nothing
            from shardformer.integrations.peft_layer import install

            install()


register_adapter_support(PeftLoraSupport())
