"""What a refusal says first: the fix that helps its reason.

Every reason a route gives for not cutting a model is of a kind with its own fix: a cut shardformer
could not find or prove (your own Policy can give one), parts tensor parallelism cannot cut exactly
(convolutions, a mixer of no Mamba layout, a weight read by ``F.linear``, heads mixed with each other: data
parallelism and ZeRO), head counts ``tp`` does not divide (another ``tensor_parallel_size``), a
model the recipe cannot feed (a default for the forward's argument). A refusal's first line is
the fixes of its reasons, each once; the reasons follow, each once (a refusal that wraps another
takes its ``reason`` and ``fixes``, not its text).
"""

from __future__ import annotations

import torch.nn as nn

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
POLICY = (
    "write your own Policy subclass and pass it: shard_model(model, config, policy=MyPolicy()) "
    "(docs/writing-a-policy.md)"
)
DATA_PARALLEL = (
    "train it with data parallelism and ZeRO (EngineConfig(dp=..., zero_stage=1, 2 or 3)), which work for any model"
)
HEADS = (
    "use a tensor_parallel_size that divides the head counts named below, or data parallelism and ZeRO "
    "(EngineConfig(dp=..., zero_stage=1, 2 or 3))"
)


class Reason(str):
    """One reason a part of a model is not cut, as text, with the fix that helps it (``fix``)."""

    fix: str

    def __new__(cls, text: str, fix: str = POLICY) -> Reason:
        made = super().__new__(cls, text)
        made.fix = fix
        return made


def fix_of(reason: str) -> str:
    return getattr(reason, "fix", POLICY)


class Refusal(ValueError):
    """A model refused: ``fixes`` (what to do) on the first line, then ``reason`` (why)."""

    def __init__(self, reason: str, *fixes: str) -> None:
        self.reason = reason
        self.fixes = tuple(dict.fromkeys(fixes or (fix_of(reason),)))
        super().__init__(f"{first_line(self.fixes)}\n{reason}")


def first_line(fixes) -> str:
    text = "; or ".join(fixes)
    return text[:1].upper() + text[1:] + "."


def parts_of(error: BaseException) -> tuple[str, tuple[str, ...]]:
    """``(reason, fixes)`` of a route's error: a Refusal's own, any other error's text with the policy fix."""
    if isinstance(error, Refusal):
        return error.reason, error.fixes
    return str(error), (POLICY,)


def indent(text: str, by: str = "    ") -> str:
    """``text`` with every line after the first indented (a reason nested in a list of reasons)."""
    return text.replace("\n", "\n" + by)


def has_convolutions(module: nn.Module) -> bool:
    """Whether ``module`` holds a convolution (a convolutional network, a Mamba-style mixer's causal conv)."""
    return any(isinstance(m, CONVOLUTIONS) for m in module.modules())
