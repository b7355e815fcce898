"""How a LoRA adapter is cut beside a parallel base layer, and what is refused because it cannot be.

A column-parallel base: ``B`` cut by output features exactly like the base's weight (fused blocks,
padding, replicated key/value heads), ``A`` whole. A row-parallel base: ``A`` cut by input features,
``B`` whole. The halves are in `shardformer.tensor_parallel.layers.lora`. Works on PEFT's layout
(``lora_A`` / ``lora_B`` module dicts of full-size ``nn.Linear``) without importing peft.
"""

from __future__ import annotations

import torch.nn as nn

from shardformer.tensor_parallel.layers import Linear1D_Col, Linear1D_Row, VocabParallelLMHead1D
from shardformer.tensor_parallel.layers.lora import LoraColumnB, LoraRowA, _LoraHalf
from shardformer.tensor_parallel.slicer import shard_spec

DROP_IT = "drop it from the LoraConfig's target_modules"


def refusal_for(base: type, *, gather_output=False, sequence_parallel=False, variants=(), bias=False, dropout=0.0):
    """Why LoRA cannot be cut beside a base layer becoming ``base`` (a class), or None."""
    if not issubclass(base, (Linear1D_Col, Linear1D_Row)) or issubclass(base, VocabParallelLMHead1D):
        kind = "an embedding or LM head" if "Vocab" in base.__name__ else "not a column/row-parallel linear layer"
        return f"its base layer becomes {base.__name__} ({kind}), which LoRA is not cut beside; {DROP_IT}"
    if gather_output:
        return f"its base layer gathers its output (gather_output=True); {DROP_IT}"
    if sequence_parallel:
        return "LoRA is not cut under sequence parallelism; shard with ShardConfig(sequence_parallel=False)"
    if variants:
        return f"LoRA variants ({', '.join(variants)}, e.g. use_dora=True) are not cut; use plain LoRA"
    if bias:
        return "lora_bias=True is not cut; set lora_bias=False"
    if dropout > 0 and issubclass(base, Linear1D_Row):
        return (
            f"lora_dropout={dropout} on a row-parallel base would drop this rank's input features with a mask "
            f"unrelated to the unsharded one; set lora_dropout=0, or {DROP_IT}"
        )
    return None


def lora_settings(wrapper: nn.Module) -> dict:
    dropouts = [getattr(d, "p", 0.0) for d in wrapper.lora_dropout.values()]
    return {
        "variants": [type(v).__name__ for v in getattr(wrapper, "lora_variant", {}).values()],
        "bias": any(getattr(wrapper, "lora_bias", {}).values()),
        "dropout": max(dropouts, default=0.0),
    }


def cut_adapter(wrapper: nn.Module, name: str, process_group) -> None:
    """Cut adapter ``name`` of ``wrapper`` (PEFT's full-size halves) like its parallel base layer."""
    base = wrapper.base_layer
    spec = shard_spec(base.weight)
    if isinstance(base, Linear1D_Col) and not isinstance(wrapper.lora_B[name], _LoraHalf):
        wrapper.lora_B[name] = LoraColumnB.cut(wrapper.lora_B[name], spec, 0, process_group)
    elif isinstance(base, Linear1D_Row) and not isinstance(wrapper.lora_A[name], _LoraHalf):
        wrapper.lora_A[name] = LoraRowA.cut(wrapper.lora_A[name], spec, 1, process_group)
