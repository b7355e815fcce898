"""Settings that make a block's code call a projection whose weight it otherwise reads itself.

timm's BEiT, EVA and Swin-V2 attention add their q/v biases in one ``F.linear(x, self.qkv.weight,
bias=cat(q_bias, k_bias, v_bias))``: the ``qkv`` module is never called, so no cut layer can stand in
for it (its input would miss the all-reduce of its gradient). The same modules hold a flag
(``qkv_bias_separate``) under which they call ``self.qkv(x)`` and add the biases after: the same
product. Here every bool setting the owner's code reads is tried flipped on the tiny copy; one is
kept when, flipped, the projection is called and the copy's output is what it was. The sharded model
gets the flipped setting (a per-rank attribute); the proof compares it, cut, with the model as written.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardformer.core.compare import max_error
from shardformer.core.divergence import first_tensor
from shardformer.policies.derived.trace import trace
from shardformer.tensor_parallel.detect import attributes_read


def bool_settings(module: nn.Module) -> list[str]:
    """The bool attributes of ``module`` its code reads (``training`` aside)."""
    read = attributes_read(type(module))
    return [
        name
        for name, value in vars(module).items()
        if isinstance(value, bool) and name[0] != "_" and name != "training" and (read is None or name in read)
    ]


def _output(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return first_tensor(model(**inputs))


def calling_settings(tiny: nn.Module, inputs: dict, bypassed: dict[str, list[str]]) -> dict[type, dict[str, bool]]:
    """``{block class: {setting path relative to the block: value}}`` that make the forward of ``tiny``
    call each bypassed projection (``{block path: [projection paths relative to it]}``) and leave its
    output as it was. The settings found stay applied on ``tiny``; a projection no setting fixes stays
    bypassed (the caller refuses it)."""
    found: dict[type, dict[str, bool]] = {}
    fixed: set[tuple[type, str]] = set()  # (block class, owner) whose projections a setting made called
    expected = _output(tiny, inputs)
    for block, rels in bypassed.items():
        cls = type(tiny.get_submodule(block))
        for rel in rels:
            owner = rel.rpartition(".")[0]
            if (cls, owner) in fixed:  # on an earlier block of this class
                continue
            for name in bool_settings(tiny.get_submodule(block).get_submodule(owner)):
                setting = f"{owner}.{name}" if owner else name
                value = not getattr(tiny.get_submodule(block).get_submodule(owner), name)
                before = _apply(tiny, cls, setting, value)
                if rel in _called(tiny, inputs, block) and max_error(_output(tiny, inputs), expected)[1]:
                    found.setdefault(cls, {})[setting] = value
                    fixed.add((cls, owner))
                    break
                for target, previous in before:
                    setattr(target, name, previous)
    return found


def _apply(tiny: nn.Module, cls: type, setting: str, value) -> list[tuple[nn.Module, object]]:
    """Set ``setting`` (relative to each block of class ``cls``) to ``value``; each module's value before."""
    owner, _, name = setting.rpartition(".")
    before = []
    for module in tiny.modules():
        if type(module) is cls:
            try:  # a block of the class without this submodule or setting (stacks of unlike blocks) keeps its own
                target = module.get_submodule(owner) if owner else module
            except AttributeError:
                continue
            if not hasattr(target, name):
                continue
            before.append((target, getattr(target, name)))
            setattr(target, name, value)
    return before


def _called(tiny: nn.Module, inputs: dict, block: str) -> set[str]:
    return set(trace(tiny, inputs).reads.get(block, {}))
