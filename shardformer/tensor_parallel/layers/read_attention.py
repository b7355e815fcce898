"""A module whose code hands its projections' weights to ``F.multi_head_attention_forward`` itself.

WavLM's attention never calls its ``q_proj``, ``k_proj``, ``v_proj`` or ``out_proj``: it passes their
weights (``q_proj_weight=self.q_proj.weight``, ...) and the whole head count to torch's function,
which checks them against the input's width and would refuse a rank's rows. The projections are cut
as any attention's are (q, k, v by their output features, ``out_proj`` by its input features); while
the module runs, a ``TorchFunctionMode`` follows the read: a call of the function with cut weights
computes this rank's heads (`.multihead.attend`), the per-head mask it is handed (``[batch x heads,
L, S]``, computed whole on every rank) cut to them, and ``out_proj``'s rows all-reduced.
"""

from __future__ import annotations

import inspect

import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardformer.core.comm import group_size, reduce_from_parallel
from shardformer.tensor_parallel.layers.multihead import Heads, attend

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def weights_read(args, kwargs) -> dict[str, object] | None:
    """``{"q", "k", "v", "out": weight}``, ``"out_bias"`` and ``"heads"`` of one ``F.multi_head_attention_forward`` call
    with separate q/k/v weights, or None (a packed ``in_proj_weight``: `nn.MultiheadAttention`'s)."""
    bound = _SIGNATURE.bind(*args, **kwargs).arguments
    if not bound.get("use_separate_proj_weight"):
        return None
    return {
        "q": bound["q_proj_weight"],
        "k": bound["k_proj_weight"],
        "v": bound["v_proj_weight"],
        "out": bound["out_proj_weight"],
        "out_bias": bound.get("out_proj_bias"),
        "heads": bound["num_heads"],
    }


def _on_rank_heads(call, process_group):
    """``F.multi_head_attention_forward``'s arguments, computed on the heads whose rows the weights hold."""
    a = _SIGNATURE.bind(*call[0], **call[1])
    a.apply_defaults()
    a = a.arguments
    tp = group_size(process_group)
    if a["bias_k"] is not None or a["add_zero_attn"] or a["static_k"] is not None or a["static_v"] is not None:
        raise NotImplementedError("a learned key/value bias or static keys of a tensor-parallel attention")
    heads = Heads(a["num_heads"] // tp, a["num_heads"], a["embed_dim_to_check"] // a["num_heads"], process_group)
    biases = a["in_proj_bias"].chunk(3) if a["in_proj_bias"] is not None else (None, None, None)

    def out_proj(x):  # the rows of out_proj this rank holds, summed over ranks, its bias added once
        out = reduce_from_parallel(F.linear(x, a["out_proj_weight"]), process_group)
        return out if a["out_proj_bias"] is None else out + a["out_proj_bias"]

    return attend(
        heads, (a["query"], a["key"], a["value"]), (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]),
        biases, out_proj, False, a["key_padding_mask"], a["attn_mask"],
        a["dropout_p"] if a["training"] else 0.0, a["need_weights"], a["average_attn_weights"], a["is_causal"],
    )  # fmt: skip


class _FollowRead(TorchFunctionMode):
    def __init__(self, process_group) -> None:
        super().__init__()
        self.process_group = process_group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and weights_read(args, kwargs) is not None:
            return _on_rank_heads((args, kwargs), self.process_group)
        return func(*args, **kwargs)


class ReadMultiheadAttention:
    """Marks a module whose code runs ``F.multi_head_attention_forward`` on its cut projections'
    weights: its forward runs under the mode that computes this rank's heads (see the module's text)."""

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, **_) -> nn.Module:
        if group_size(process_group) == 1:
            return module
        running: list[_FollowRead] = []  # one per forward running (a module called inside itself)

        def enter(_m, _args):
            running.append(_FollowRead(process_group))
            running[-1].__enter__()

        def leave(_m, _args, _out):  # always called, also when the forward raises
            running.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return module
