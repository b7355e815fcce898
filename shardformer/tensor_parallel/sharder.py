"""ModelSharder: carries out a Policy on a model (``shardformer.shard_model`` is the one-liner around it).

It is given everything it needs: the policy, the config and, for sequence parallelism, the paths of
the model's layer stack and final norm (model anatomy, from its family record).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from shardformer.context_parallel import apply_context_parallel, check_context_parallel
from shardformer.context_parallel.anatomy import StackAnatomy
from shardformer.context_parallel.checks import ContextParallelPlan
from shardformer.context_parallel.model import splits
from shardformer.context_parallel.rng import rank_seed
from shardformer.core import forward_agreement, position_limit
from shardformer.core.config import ShardConfig
from shardformer.core.record import ShardedModelInfo, attach, build_mesh, is_sharded, sharding_of
from shardformer.core.rng import agree_on_rng
from shardformer.tensor_parallel.adapters import SeenThrough, adapter_wrappers
from shardformer.tensor_parallel.ddp_guard import refuse_ddp
from shardformer.tensor_parallel.detect import Detected, detect_from_model, keep_ties
from shardformer.tensor_parallel.layers import (
    DropoutForReplicatedInput,
    SharedInputCopy,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.tensor_parallel.layers.linear import is_conv1d
from shardformer.tensor_parallel.lm_head import adapt_class
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer
from shardformer.tensor_parallel.recompute import replay_in_hf_checkpointing
from shardformer.tensor_parallel.sequence_parallel import (
    SequenceParallel,
    SequenceParallelPlan,
    apply_sequence_parallel,
    plan_sequence_parallel,
)

logger = logging.getLogger("shardformer")


@dataclass
class ShardPlan:
    """What `ModelSharder.plan` resolved, checked before anything is cut: the policy's targets
    (path, module, Argument), the planned replacements, each target's shared input copy, what was
    detected in the model, and the sequence-parallel plan (None: plain tensor parallelism)."""

    targets: list[tuple[str, nn.Module, Argument]]
    replacements: list[Replacement]
    input_copies: list[tuple[nn.Module, SharedInputCopy]]
    detected: Detected
    sequence: SequenceParallelPlan | None
    attention: ContextParallelPlan | None = None  # what context parallelism needs (None: cp=1)


@dataclass
class Replacement:
    """One planned swap: the module at ``path`` becomes ``layer.replace_layer``. Column layers of
    one policy target share ``input_copy`` (one backward all-reduce for q/k/v)."""

    path: str
    layer: Layer
    module: nn.Module
    input_copy: SharedInputCopy


def _has(root: nn.Module, path: str) -> bool:
    """Whether ``path`` names a submodule, parameter or attribute below ``root``."""
    parent, _, name = path.rpartition(".")
    try:
        return hasattr(root.get_submodule(parent), name)
    except AttributeError:
        return False


def _get(root: nn.Module, path: str):
    parent, _, name = path.rpartition(".")
    return getattr(root.get_submodule(parent), name)


def _set(root: nn.Module, path: str, value) -> None:
    """Set a submodule, parameter or plain attribute (``set_submodule`` takes only modules)."""
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent), name, value)


class ModelSharder:
    """Shards ``model`` in place following ``policy``: inject_model, replace_layer, then ties kept as
    the model has them.

    Everything that can be wrong with the model, the policy or the sizes is checked by
    `plan` before the first process group is created, so a bad input never leaves ranks
    waiting on each other.
    """

    def __init__(
        self,
        model: nn.Module,
        policy: Policy,
        shard_config: ShardConfig,
        layers: str | None = None,
        adapters: SeenThrough | None = None,
        final_norm: str | None = None,
        stack_anatomy: StackAnatomy | None = None,
    ) -> None:
        self.model, self.policy, self.shard_config, self.layers = model, policy, shard_config, layers
        self.stack_anatomy = stack_anatomy  # what context parallelism checks (shard_model gives it at cp > 1)
        self.final_norm = final_norm  # where sequence parallelism ends (None: after the last layer)
        self.adapters = adapters  # adapter wrappers shard_model took out of the model, checked here

    def plan(self) -> ShardPlan:
        """Resolve the policy against the model; raise on anything that does not fit."""
        if is_sharded(self.model):
            done = sharding_of(self.model).shard_config
            raise ValueError(
                f"{type(self.model).__name__} is already sharded (tensor_parallel_size="
                f"{done.tensor_parallel_size}); shard the original model instead (load it again with "
                f"from_pretrained), or use the sharded one as it is"
            )
        _refuse_adapter_layers(self.model)
        config = getattr(self.model, "config", None)
        self.policy.set_model(self.model)
        arguments = self.policy.argument_policy(config, self.shard_config)
        self.shard_config.check_world()
        attention = None
        if self.shard_config.context_parallel_size > 1:
            attention = check_context_parallel(self.model, self.shard_config, self.stack_anatomy)
        targets = [(name, m, arguments[type(m)]) for name, m in self.model.named_modules() if type(m) in arguments]
        if arguments and not targets:
            raise ValueError(
                f"{type(self.policy).__name__} names the module classes {[c.__name__ for c in arguments]}, "
                f"but {type(self.model).__name__} contains none of them; check the policy's argument_policy keys"
            )
        replacements, input_copies = [], []
        for name, module, argument in targets:
            where = f"{type(module).__name__} ({name or 'the model'})"
            input_copy = SharedInputCopy()
            input_copies.append((module, input_copy))
            for attr in argument.attr_dict:
                if not _has(module, attr):
                    raise ValueError(f"attribute {attr!r} of the policy's attr_dict is not in {where}")
            for func in argument.param_funcs:
                for layer in func():
                    if not _has(module, layer.suffix):
                        if layer.ignore:
                            continue
                        raise ValueError(
                            f"suffix {layer.suffix!r} is not in {where}; fix the policy's suffix or mark the "
                            f"layer ignore=True if the module is optional"
                        )
                    replacements.append(self._check_layer(name, module, layer, where, input_copy))
        for replacement in replacements:
            _refuse_dropped(replacement.path, replacement.module)
        if self.adapters is not None:
            self.adapters.check(replacements, self.shard_config)
        detected = detect_from_model(self.model, config, self.shard_config, targets, replacements)
        sequence = None
        if self.shard_config.sequence_parallel and self.shard_config.tensor_parallel_size > 1:
            if self.layers is None:
                raise ValueError(
                    f"sequence_parallel=True needs {type(self.model).__name__}'s one stack of transformer layers, "
                    f"and its anatomy (family record, base_model_pp_plan, structure) finds none or several (an "
                    f"encoder-decoder, two towers); shard it with sequence_parallel=False"
                )
            entries = self.policy.sequence_parallel_entries()
            sequence = plan_sequence_parallel(self.model, self.layers, replacements, entries, self.final_norm)
        return ShardPlan(targets, replacements, input_copies, detected, sequence, attention)

    def _check_layer(self, parent_path: str, parent: nn.Module, layer: Layer, where: str, input_copy) -> Replacement:
        target = _get(parent, layer.suffix)
        path = f"{parent_path}.{layer.suffix}" if parent_path else layer.suffix
        if layer.replace_layer is None:
            raise ValueError(f"layer {layer.suffix!r} of {where} has no replace_layer")
        if isinstance(layer, (Col_Layer, Row_Layer)):
            for attr in (layer.weight, layer.bias):
                if attr is not None and not hasattr(target, attr):  # a bias that is None is fine
                    raise ValueError(
                        f"{path} ({type(target).__name__}) has no {attr!r}; set weight=/bias= in the policy "
                        f"(bias=None for a layer without bias)"
                    )
            conv1d = is_conv1d(target)
            if (isinstance(target, nn.Linear) or conv1d) and layer.reversed != conv1d:
                raise ValueError(
                    f"{path} is {type(target).__name__} (weight {'[in, out]' if conv1d else '[out, in]'}) "
                    f"but the policy says reversed={layer.reversed}; set reversed={conv1d}"
                )
        if isinstance(layer, Dropout_Layer) and not hasattr(target, layer.p):
            raise ValueError(f"{path} ({type(target).__name__}) has no dropout probability {layer.p!r}")
        return Replacement(path, layer, target, input_copy)

    def shard(self, plan: ShardPlan | None = None) -> nn.Module:
        """Cut the model by ``plan`` (what `plan` returned for this sharder; resolved here if None)."""
        plan = plan or self.plan()
        replacements = plan.replacements
        params_before, name = _numel(self.model), type(self.model).__name__
        mesh, group = build_mesh(self.shard_config)
        self.inject_model()
        for _, module, argument in plan.targets:
            for attr, value in argument.attr_dict.items():
                _set(module, attr, value)
        plan.detected.rewrite_attributes(self.model)
        sequence = None
        if plan.sequence is not None:
            sequence = SequenceParallel(group, plan.sequence, self.shard_config.sequence_parallel_regather)
        # each cp rank's tokens their own dropout masks
        seed = rank_seed(self.shard_config.seed, mesh.cp_rank if mesh is not None else 0)
        for index, replacement in enumerate(replacements):
            self.replace_layer(replacement, group, seed + index, sequence)
        for module, input_copy in plan.input_copies:
            module.register_forward_hook(_release_after_forward(input_copy))
        leftovers = self.replace_leftover_dropout(group, seed + len(replacements), sequence)
        if sequence is not None:
            apply_sequence_parallel(self.model, sequence)
        keep_ties(self.model, plan.detected.ties)  # found in the model: binding_policy() pairs are among them
        agree_on_rng(group)
        replay_in_hf_checkpointing(self.model)  # activation checkpointing replays the dropout masks
        adapt_class(self.model)  # generate() and transformers' LM losses on vocab-parallel logits
        context = None
        if plan.attention is not None:
            cfg = self.shard_config
            context = apply_context_parallel(
                self.model, mesh.cp_group, cfg.context_parallel_mode, plan.attention, cfg.gather_output
            )
        position_limit.install(self.model)  # ids past a position table: the input, the limit, the fix
        every = self.shard_config.forward_agreement_every
        agreement = forward_agreement.install(self.model, mesh, group, None if context is None else splits, every)
        info = ShardedModelInfo(
            self.shard_config, self.policy, mesh, group, sequence_parallel=sequence, context_parallel=context,
            forward_agreement=agreement,
        )  # fmt: skip
        attach(self.model, info)
        if self.shard_config.tensor_parallel_size > 1:
            refuse_ddp(self.model)
        if replacements and logger.isEnabledFor(logging.INFO) and (not dist.is_initialized() or dist.get_rank() == 0):
            kinds = Counter(r.layer.replace_layer.__name__ for r in replacements)
            kinds.update({"DropoutForReplicatedInput (leftover)": leftovers} if leftovers else {})
            here = _numel(self.model)
            tp = self.shard_config.tensor_parallel_size
            towers = list(getattr(self.policy, "towers", []))  # stacks the plan left whole, derived
            policy = type(self.policy).__name__ + (f" (derived and proven: {', '.join(towers)})" if towers else "")
            if tp == 1:  # the layers are swapped for their parallel forms all the same, but none is cut
                logger.info("sharded %s with %s at tp=1: nothing is cut, this rank holds all %s parameters",
                            name, policy, f"{here:,}")  # fmt: skip
            else:
                logger.info(
                    "sharded %s with %s at tp=%d: %s; parameters on this rank %s of %s (%.3f; 1/tp = %.3f)",
                    name,
                    policy,
                    tp,
                    ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                    f"{here:,}",
                    f"{params_before:,}",
                    here / max(1, params_before),
                    1 / tp,
                )
        return self.model

    def inject_model(self) -> None:
        """Instances of OriginModel become CustomModel (a subclass whose forward works on shards)."""
        pair = self.policy.inject_policy()
        if pair is None:
            return
        origin, custom = pair
        if not issubclass(custom, origin):
            raise TypeError(f"inject_policy: {custom.__name__} must subclass {origin.__name__}")
        for module in self.model.modules():
            if type(module) is origin:
                module.__class__ = custom

    def replace_layer(self, replacement: Replacement, group, seed: int = 0, sequence: SequenceParallel | None = None):
        """Build the parallel layer of ``replacement`` with every option it takes (none is set afterwards)."""
        layer, cfg = replacement.layer, self.shard_config
        cls = layer.replace_layer
        options: dict = {"seed": seed, "n_cast": layer.n_cast, "overlap_communication": cfg.overlap_communication}
        if sequence is not None:
            options.update(sequence.layer_options(replacement.path, cls))
        if isinstance(layer, Col_Layer):
            options["gather_output"] = layer.gather_output or (
                cfg.gather_output and issubclass(cls, VocabParallelLMHead1D)
            )
            options["input_copy"] = replacement.input_copy
            if layer.head_width is not None:
                options["head_width"] = layer.head_width
        if issubclass(cls, (VocabParallelLMHead1D, VocabParallelEmbedding1D)):
            options["pad_to_multiple"] = cfg.vocab_pad_multiple
        new = cls.from_native(replacement.module, group, **options)
        new.train(replacement.module.training)  # a model sharded in eval() stays in eval()
        carry_hooks(replacement.module, new)
        self.model.set_submodule(replacement.path, new)
        return new

    def replace_leftover_dropout(self, group, seed: int, sequence: SequenceParallel | None = None) -> int:
        """Dropout the policy did not name (classifier heads, ...) sits on replicated activations: give
        it the tensor-parallel RNG too, so ranks never drift apart through different global RNG states.
        Returns how many were replaced."""
        leftovers = [(name, m) for name, m in self.model.named_modules() if type(m) is nn.Dropout and m.p > 0]
        for index, (name, old) in enumerate(leftovers):
            options = {} if sequence is None else sequence.layer_options(name, DropoutForReplicatedInput)
            new = DropoutForReplicatedInput.from_native(old, group, seed + index, **options).train(old.training)
            carry_hooks(old, new)
            self.model.set_submodule(name, new)
        return len(leftovers)


# a module's hook tables (the options of each hook are kept in the tables keyed by the same handle ids)
HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """The hooks the user registered on ``old`` run on ``new``, the parallel layer in its place (the
    proof, whose copy carries them too, shows the result exact, or the route is refused). The tables
    themselves move, so the user's handles still remove them."""
    for table in HOOK_TABLES:
        theirs = getattr(old, table)
        theirs.update(getattr(new, table))  # the layer's own after the user's
        setattr(new, table, theirs)
    if old._backward_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook


def _refuse_dropped(path: str, module: nn.Module) -> None:
    """What a replaced module holds that its parallel layer cannot: a method set on the instance (a
    patched ``forward``) or a hook on one of its weights, which the cut splits into new tensors."""
    own = [name for name, value in vars(module).items() if callable(value) and not isinstance(value, (type, nn.Module))]
    if own:
        raise ValueError(
            f"{path} ({type(module).__name__}) has its own {', '.join(own)} set on the instance; tensor "
            f"parallelism replaces this module with a parallel layer, which would drop it. Remove it before "
            f"sharding, or register it as a forward hook (hooks move to the parallel layer, and the proof checks "
            f"them), or keep the module whole with a Policy subclass that does not name it"
        )
    hooked = [
        name
        for name, p in module.named_parameters()
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
    ]
    if hooked:
        raise ValueError(
            f"{path}.{hooked[0]} has a hook registered on the tensor (register_hook / "
            f"register_post_accumulate_grad_hook); tensor parallelism splits this weight into a new tensor per "
            f"rank, which the hook is not on. Register it after shard_model, on the parallel layer's weight"
        )


def _refuse_adapter_layers(model: nn.Module) -> None:
    """Adapter layers (PEFT's LoRA around a ``base_layer``) hide the projection from the policy; only
    ``shard_model`` takes them out while it plans and puts them back cut (ModelSharder on its own would
    leave those projections whole, or cut them without their adapters)."""
    wrapped = [path for path, _, _ in adapter_wrappers(model)]
    if wrapped:
        raise ValueError(
            f"{type(model).__name__} holds adapter layers ({', '.join(wrapped[:3])}"
            f"{', ...' if len(wrapped) > 3 else ''}); shard it with shard_model(model, shard_config), which cuts "
            f"LoRA adapters with their base layers"
        )


def _release_after_forward(input_copy: SharedInputCopy):
    """A forward hook: once the target's forward is over, its shared input copy holds nothing (the
    copy's output would otherwise keep a hidden-sized tensor alive per layer under activation
    checkpointing, which saves nothing else of the layer)."""

    def release(_module, _args, _output):
        if not torch.compiler.is_compiling():  # compiled forwards do not use the cache
            input_copy.release()

    return release


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied tensor once
