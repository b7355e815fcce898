"""Attention modules whose code reads the heads' width from the input's width, given one that reads it
from the module.

BLIP-2's and InstructBLIP's vision attention reshapes its fused ``qkv`` output into
``(3, num_heads, input width // num_heads)``. Under tensor parallelism the input stays whole while a
rank holds ``num_heads / tp`` heads, so that quotient is ``tp`` heads' width: no cut of the module as
written computes it. The forward given here is the same computation with the head width read from
the module (``head_dim``, which the cut leaves as it is). It is used only where the cut needs it (on
the sharded model and in the simulated ranks), never on a reference: the simulation and the proof
compare it, cut, against the module's own forward, whole.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch.nn as nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_IDIOM = "embed_dim // self.num_heads"  # the width read off the input (``bsz, tgt_len, embed_dim = ...size()``)


def reads_width_from_input(module: nn.Module) -> bool:
    """A fused-``qkv`` attention in the BLIP-2 shape whose code divides the input's width by its heads."""
    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in ("qkv", "projection")):
        return False
    if not all(hasattr(module, name) for name in ("num_heads", "head_dim", "scale", "attention_dropout", "config")):
        return False
    if not hasattr(sys.modules[type(module).__module__], "eager_attention_forward"):
        return False
    try:
        return _IDIOM in inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False


def _forward_with_module_width(self, hidden_states, **kwargs):
    batch, length, _ = hidden_states.shape
    qkv = self.qkv(hidden_states).reshape(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    eager = sys.modules[type(self).__module__].eager_attention_forward
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    out, weights = attention(
        self,
        qkv[0],
        qkv[1],
        qkv[2],
        attention_mask=None,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scale,
        **kwargs,
    )
    return self.projection(out.reshape(batch, length, -1).contiguous()), weights


def use_module_width(root: nn.Module) -> None:
    """Give every module under ``root`` (itself included) that reads its width from the input the
    forward that reads it from the module."""
    for module in root.modules():
        if reads_width_from_input(module):
            _rebind(module)


def _rebind(module: nn.Module) -> None:
    module.forward = types.MethodType(_forward_with_module_width, module)


class ModuleWidth:
    """A policy layer: the module keeps its weights and gets the forward above."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        _rebind(module)  # chosen by the policy, which checked the module (its qkv may be cut already)
        return module
