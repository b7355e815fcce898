"""What a stage keeps of the modules it drops: their skeletons, on the meta device.

A stage's model runs the model's own forward with stand-ins where other stages' modules were
(`shardformer.pipeline.stage_view`). Some forwards read more than a module's output: BigBird
calls ``layer.set_attention_type(...)`` on every layer, DeiT reads ``embeddings.patch_embeddings``'s
sizes, Swin a stage's ``downsample``. A stand-in answers such reads from the dropped module's
skeleton: a copy whose parameters and buffers live on the meta device (no memory), kept outside the
module tree (no stage's parameters, state dict or optimizer see it). What a forward then computes
from a skeleton is checked like everything else: the split is proven on a tiny copy before use.
"""

from __future__ import annotations

import torch
import torch.nn as nn

_SKELETONS = "_pipeline_skeletons"  # root.__dict__ key: {path: skeleton}
# the weights stand-ins read off skeletons (``path.name``), latest last: a proof that fails names them
READS: list[str] = []


def keep_skeleton(root: nn.Module, path: str, module: nn.Module | None) -> None:
    """Keep a meta-device copy of ``module`` (about to be dropped from ``root`` at ``path``)."""
    if module is not None:
        root.__dict__.setdefault(_SKELETONS, {})[path] = _skeleton(module)


def _skeleton(module: nn.Module) -> nn.Module:
    """``module``'s tree, each module a shallow copy (its plain attributes shared, process groups and
    configs included) whose parameters and buffers are empty meta tensors of the same shapes."""
    # copy.copy without the pickling protocol: a parametrized module (wav2vec2's weight-normed positional
    # convolution) refuses __getstate__; its weight stays a property computed from the meta originals
    clone = type(module).__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._parameters = {
        n: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), False)
        for n, p in module._parameters.items()
    }
    clone._buffers = {
        n: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta") for n, b in module._buffers.items()
    }
    clone._modules = {n: None if m is None else _skeleton(m) for n, m in module._modules.items()}
    return clone


def skeleton_of(root: nn.Module, path: str) -> nn.Module | None:
    return root.__dict__.get(_SKELETONS, {}).get(path)


class StandIn(nn.Module):
    """A module standing in for a dropped one: attributes it lacks are read from the dropped module's
    skeleton (set by `shardformer.pipeline.stage_view.stand_in`)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            skeleton = self.__dict__.get("skeleton")
            if skeleton is None or name.startswith("__"):
                raise
            value = getattr(skeleton, name)
            if torch.is_tensor(value) and len(READS) < 8:  # its values are not here: only its shape is
                READS.append(f"{self.__dict__.get('path', '?')}.{name}")
            return value


class Identity(StandIn):
    def forward(self, x, *args, **kwargs):
        return x
