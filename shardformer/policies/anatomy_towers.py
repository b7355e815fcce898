"""Towers (vision, audio) that run before a language model's layer stack, for the anatomy's pipeline split.

The towers, their projector and the embeddings their output is merged into are the first stage's; the
language model's layers are split. Stages after the first are called without what only the towers read:
their merged output arrives in the hidden states. Which inputs those stages take is a rule proven on a
tiny copy with the split (`shardformer.policies.anatomy_pipeline`): first what the module holding the
language model's stack takes (ids, masks, positions), then every input but the towers' payloads
(Qwen2-VL's positions read its image grid on every stage).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch.nn as nn

from shardformer.pipeline.stage_view import own_forward

# the inputs only a tower reads (the first stage's), by name: what later stages need not be sent
PAYLOADS = ("pixel_", "input_features", "input_values", "audio_")


@dataclass(frozen=True)
class LaterInputs:
    """The inputs stages after the first are called with when towers run on the first: those ``keep``
    names (None: every one), less those ``drop`` names."""

    keep: frozenset[str] | None = None
    drop: frozenset[str] = frozenset()

    def takes(self, name: str) -> bool:
        return (self.keep is None or name in self.keep) and name not in self.drop


def tower_root(stack: str, language: str) -> str:
    """The module holding ``stack`` just below where its path parts from the language model's stack."""
    parts, other = stack.split("."), language.split(".")
    shared = next(i for i, (a, b) in enumerate(zip(parts, other)) if a != b)
    return ".".join(parts[: shared + 1])


def language_inputs(model: nn.Module, stack: str) -> frozenset[str] | None:
    """The inputs the stages after the first take when ``stack`` is a language model's, after towers whose
    output the first stage merges into its embeddings: what the module holding the stack takes (a VLM's
    ``language_model``: ids, masks, positions; not the pixels). None when that module takes no token ids."""
    parent = stack.rpartition(".")[0]
    holder = model.get_submodule(parent) if parent else model
    taken = set(inspect.signature(own_forward(holder)).parameters)
    return frozenset(taken) if "input_ids" in taken else None


def payloads(model: nn.Module) -> frozenset[str]:
    """The inputs of ``model``'s forward that only its towers read, by name (`PAYLOADS`)."""
    return frozenset(p for p in inspect.signature(own_forward(model)).parameters if p.startswith(PAYLOADS))
