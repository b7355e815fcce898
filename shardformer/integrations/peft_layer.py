"""PEFT's LoRA layer around our parallel layers, and what PEFT needs to reach it (imports peft).

PEFT picks a LoRA layer class by the target's type and knows nothing of ``Linear1D_Col`` /
``Linear1D_Row``; ``LoraConfig._register_custom_module`` would teach it, but per config object, which
a user of ``get_peft_model`` or ``PeftModel.from_pretrained`` (whose config is read from the folder)
never gets to touch. `install` therefore puts our layers first in LoRA's dispatch, and makes
``PeftModel.save_pretrained`` on a sharded model write the adapter gathered (full shapes, global
rank 0 writing), which plain PEFT loads on an unsharded model. Both leave unsharded models to PEFT.
"""

from __future__ import annotations

import functools
import inspect

import torch.distributed as dist
from peft import PeftModel
from peft.tuners import tuners_utils
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora.model import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer

from shardformer.core.comm import gather_tensor
from shardformer.core.record import is_sharded, sharding_of
from shardformer.integrations.lora_cut import cut_adapter, refusal_for
from shardformer.tensor_parallel.layers import (
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.tensor_parallel.slicer import shard_spec

_PARALLEL = (Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D)
# inits that read the base weight (a slice of it here) to build the adapter; the others are random or zero
_WHOLE_WEIGHT_INITS = ("pissa", "corda", "olora", "mica", "loftq", "orthogonal", "lora_ga", "eva")


class ShardedLoraLinear(LoraLinear):
    """PEFT's ``lora.Linear`` whose base layer is one of our parallel layers: each adapter PEFT adds
    (full size, PEFT's own init) is cut like the base right after (``update_layer``)."""

    @classmethod
    def for_class(cls, wrapper_class: type) -> type:
        if issubclass(wrapper_class, cls):
            return wrapper_class
        if wrapper_class is not LoraLinear:
            raise TypeError(f"{wrapper_class.__name__} is not PEFT's lora.Linear; only plain LoRA layers are cut")
        return cls

    def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.fan_in_fan_out = self.get_base_layer().reversed  # Conv1D's [in, out] layout, whatever the config says

    def _get_in_out_features(self, module) -> tuple[int, int]:
        # PEFT's lookup by type does not know our layers and warns "Unsupported layer type ... at your own
        # risk" before reading the same two attributes: the full sizes, which update_layer checks below
        return module.in_features, module.out_features

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        base = self.get_base_layer()
        init = config.init_lora_weights
        if isinstance(init, str) and init.lower().startswith(_WHOLE_WEIGHT_INITS):
            raise ValueError(
                f"init_lora_weights={init!r} builds the adapter from the base weight, of which this rank holds a "
                f"slice; use init_lora_weights=True or 'gaussian', or build the adapter before sharding"
            )
        sequence = getattr(base, "sequence_parallel", None) is not None
        reason = refusal_for(
            type(base), gather_output=getattr(base, "gather_output", False), sequence_parallel=sequence,
            variants=["use_dora"] if config.use_dora else [], bias=config.lora_bias, dropout=config.lora_dropout,
        )  # fmt: skip
        if reason is not None:
            raise ValueError(f"LoRA on {kwargs.get('target_name') or type(base).__name__} cannot be sharded: {reason}")
        # PEFT takes a layer's sizes from its in_features / out_features (the full sizes on ours): the
        # full adapter it builds is cut right after
        if (self.in_features, self.out_features) != (base.in_features, base.out_features):
            raise RuntimeError(
                f"PEFT sized the adapter of {type(base).__name__} {self.in_features} x {self.out_features}, not its full "
                f"{base.in_features} x {base.out_features}: this PEFT release reads a layer's sizes differently"
            )
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        cut_adapter(self, adapter_name, base.process_group)


def _create_new_module(original, lora_config, adapter_name, target, **kwargs):
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, _PARALLEL):
        if isinstance(base, VocabParallelEmbedding1D):
            raise ValueError(
                f"LoRA on {kwargs.get('target_name', 'the embedding')} (a vocab-parallel embedding) is not supported "
                f"under tensor parallelism; drop it from the LoraConfig's target_modules"
            )
        return ShardedLoraLinear(target, adapter_name, config=lora_config, **kwargs)
    return original(lora_config, adapter_name, target, **kwargs)


def _save_pretrained(original, self, save_directory, *args, **kwargs):
    """On a sharded model: the adapter gathered over tp, written by global rank 0 (collective)."""
    model = self.get_base_model()
    if not is_sharded(model):
        return original(self, save_directory, *args, **kwargs)
    bound = inspect.signature(original).bind(self, save_directory, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["self"]
    options = arguments.pop("kwargs", {})
    if options.pop("state_dict", None) is not None:  # Trainer passes state_dict=None
        raise ValueError(
            "save_pretrained(state_dict=...) on a sharded PEFT model would write this rank's slices; leave it "
            "out (the adapter is gathered from the model)"
        )
    group = sharding_of(model).tp_group
    state = self.state_dict()
    for name, param in self.named_parameters():
        spec = shard_spec(param)
        if spec is not None and "lora_" in name:
            state[name] = gather_tensor(param.detach(), spec, group)
    arguments["is_main_process"] &= not dist.is_initialized() or dist.get_rank() == 0
    result = original(self, **arguments, state_dict=state, **options)
    if dist.is_initialized():
        dist.barrier()  # the folder is written when any rank returns
    return result


def _all_linear(original, peft_config, model):
    """``target_modules="all-linear"``: PEFT picks the modules that are ``nn.Linear`` or Conv1D, which our
    parallel layers are not; on a sharded model they are picked too, as their originals would be (the
    vocab-parallel LM head stays out, as PEFT leaves out the output layer)."""
    target = getattr(peft_config, "target_modules", None)
    chosen = isinstance(target, str) and target.lower() == tuners_utils.INCLUDE_LINEAR_LAYERS_SHORTHAND
    sharded = any(is_sharded(m) for m in model.modules())
    if sharded:  # PEFT's first look at the model: refuse what it would get wrong, before it changes anything
        _refuse_whole_copies(peft_config, model)
    peft_config = original(peft_config, model)
    if not chosen or not sharded:
        return peft_config
    inside_adapters = {
        f"{prefix}.{suffix}"
        for prefix, module in model.named_modules()
        if isinstance(module, BaseTunerLayer)
        for suffix, _ in module.named_modules()
        if suffix
    }
    parallel = {
        name
        for name, module in model.named_modules()
        if isinstance(module, (Linear1D_Col, Linear1D_Row)) and not isinstance(module, VocabParallelLMHead1D)
    }
    peft_config.target_modules = set(peft_config.target_modules) | (parallel - inside_adapters)
    return peft_config


def _holds_slices(module) -> bool:
    return any(shard_spec(p) is not None for p in module.parameters()) or any(
        isinstance(m, _PARALLEL) for m in module.modules()
    )


def _refuse_whole_copies(peft_config, model) -> None:
    """``modules_to_save`` trains and saves a copy of a module, ``trainable_token_indices`` rows of an
    embedding: on a module tensor parallelism cuts, both would hold and write this rank's slice."""
    wanted = getattr(peft_config, "modules_to_save", None) or []
    for name, module in model.named_modules():
        hits = [key for key in wanted if name == key or name.endswith(f".{key}")]
        if hits and _holds_slices(module):
            raise ValueError(
                f"modules_to_save={hits} names {name} ({type(module).__name__}), which tensor parallelism cuts: "
                f"PEFT's trainable copy would hold and save this rank's slice; train it through LoRA "
                f"(target_modules) or leave it out of modules_to_save"
            )
    if getattr(peft_config, "trainable_token_indices", None) and any(
        isinstance(m, VocabParallelEmbedding1D) for m in model.modules()
    ):
        raise ValueError(
            "trainable_token_indices on a vocab-parallel embedding is not supported: each rank holds a slice of "
            "the vocabulary's rows; leave it out of the LoraConfig (or shard with tensor_parallel_size=1)"
        )


def install() -> None:
    """Teach PEFT's LoRA our parallel layers, and its save_pretrained our sharded models (once)."""
    if getattr(LoraModel._create_new_module, "shardformer", False):
        return
    create = functools.partial(_create_new_module, LoraModel._create_new_module)
    create.shardformer = True
    LoraModel._create_new_module = staticmethod(create)
    original_save = PeftModel.save_pretrained

    @functools.wraps(original_save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        return _save_pretrained(original_save, self, save_directory, *args, **kwargs)

    PeftModel.save_pretrained = save_pretrained
    tuners_utils._maybe_include_all_linear_layers = functools.partial(
        _all_linear, tuners_utils._maybe_include_all_linear_layers
    )
