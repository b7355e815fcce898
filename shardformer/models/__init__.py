"""Model families written by hand: one `ModelFamily` record each, in one file each.

A record says everything shardformer needs to know about a family: which policy cuts each of its
classes, its anatomy (the stack of repeated layers, which pipeline stages, sequence parallelism and
activation checkpointing all work on), how each trainable head splits into pipeline stages, how to
build a tiny copy and named sizes (``shardformer verify`` / ``plan``), and test inputs. Everything
that needs any of it reads the record: `family_of` finds it.

Adding a family is one file in this folder defining ``FAMILY = ModelFamily(...)``; it is found by
scanning the folder (a family's heavy imports, such as timm, are deferred until it is used).
Models without a record take the route derived from transformers' own plans
(`shardformer.policies.tp_plan`, `shardformer.pipeline.from_plan`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn as nn

from shardformer.core.inputs import make_inputs
from shardformer.core.study_memo import once_per_study
from shardformer.pipeline.spec import PipelineSpec


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    name: what README and errors call it. policies: ``{model class name: Policy class}``.
    layers: the repeated layer stack, a dotted path below the base model (``"h"`` for GPT-2; below
    the model itself when it has no ``base_model``). pipelines: ``{model class name: PipelineSpec}``
    for the heads that train in pipeline stages. builds: ``{name: () -> model}``, a tiny copy named
    ``<family>-tiny`` first, then full sizes by name. inputs: ``(model, seed, batch) -> batch dict``
    for checks (default: from the model's main input and head, `make_inputs`). final_norm: the
    norm the base model applies to the layer stack's output and nothing else before it (a path below
    the base model, like ``layers``; None: none): sequence parallelism runs it on the sequence chunk.
    """

    name: str
    policies: dict[str, Callable[[], object]]
    layers: str
    pipelines: dict[str, PipelineSpec] = field(default_factory=dict)
    builds: dict[str, Callable[[], nn.Module]] = field(default_factory=dict)
    inputs: Callable[..., dict] = make_inputs
    final_norm: str | None = None

    def layers_path(self, model: nn.Module) -> str:
        """The layer stack's path in ``model`` (below its base model, when it has one)."""
        return self._below_base(model, self.layers)

    def final_norm_path(self, model: nn.Module) -> str | None:
        return None if self.final_norm is None else self._below_base(model, self.final_norm)

    @staticmethod
    def _below_base(model: nn.Module, path: str) -> str:
        base = getattr(model, "base_model", model)
        prefix = getattr(model, "base_model_prefix", "") if base is not model else ""
        return f"{prefix}.{path}" if prefix else path


def families() -> tuple[ModelFamily, ...]:
    """Every ``FAMILY`` record defined in this folder (scanned on each call: a file added later counts;
    modules already imported are not imported again)."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        record = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(record, ModelFamily):
            found.append(record)
    return tuple(found)


def model_class_name(model: nn.Module) -> str:
    """The name a model's family knows it by: its class, or the class it was built as when sharding
    swapped in a subclass of ours (injected forwards, the vocab-parallel head) or FSDP2's."""
    for cls in type(model).__mro__:  # FSDP2's fully_shard also swaps in a class (FSDP<name>): skip it
        if not cls.__module__.startswith(("shardformer.", "torch.distributed.")):
            return cls.__name__
    return type(model).__name__


@once_per_study  # the routes, the anatomy and the inputs ask it: answered once per model
def family_of(model: nn.Module) -> ModelFamily | None:
    """The record whose policies name ``model``'s class, or None."""
    name = model_class_name(model)
    return next((f for f in families() if name in f.policies), None)


def supported_models() -> list[str]:
    return sorted(name for f in families() for name in f.policies)


def builds() -> dict[str, Callable[[], nn.Module]]:
    """Every named build of every family (``gpt2-tiny``, ``gpt2``, ``bert-base``, ...)."""
    return {name: build for f in families() for name, build in f.builds.items()}


def tiny_models() -> list[str]:
    """One tiny model per family (the first build of each)."""
    return sorted(next(iter(f.builds)) for f in families() if f.builds)


def family_spec(model: nn.Module) -> PipelineSpec | None:
    """The hand-written pipeline spec of ``model``'s class, if its family has one."""
    family = family_of(model)
    return family.pipelines.get(model_class_name(model)) if family is not None else None


def inputs_for(model: nn.Module, seed: int, batch: int = 2) -> dict:
    """Random inputs for ``model``: its family's, else the default from its main input and head."""
    family = family_of(model)
    return (family.inputs if family is not None else make_inputs)(model, seed, batch)
