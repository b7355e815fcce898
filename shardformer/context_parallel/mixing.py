"""Proof, on a tiny copy, that attention is the only thing in a model that mixes tokens.

Context parallelism makes attention see the whole sequence; every other module of a split forward
sees this rank's tokens only. A convolution over the sequence, a recurrent state, a token shift or
a router with a capacity shared by the batch's tokens would silently compute something else. The
static checks (`.checks`) know the layer kinds transformers names; this finds the rest: with
attention made per-token (each query reads its own value: an attention function registered for the
probe), a tiny copy of the model must compute every token from that token alone. Changing the first
and then the last token's id must leave every other token's output where it was; the first module
whose output moves elsewhere is named.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from shardformer.context_parallel.attention import OpaqueMask

PROBE = "shardformer_token_probe"


def _own_value(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Each query attends to its own token only: the value of its position, for every query head."""
    out = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return out.transpose(1, 2).contiguous(), None


def _mask(**kwargs):
    # ignored by _own_value; opaque as a split forward's mask is: a model reading it as a tensor is found here
    return OpaqueMask()


def mixing_outside_attention(tiny: nn.Module, inputs: dict) -> str | None:
    """Why ``tiny`` (a tiny copy, with ``inputs``) mixes tokens outside attention, or None."""
    ids = inputs.get("input_ids")
    if ids is None or ids.dim() != 2 or ids.shape[1] < 3:
        return None  # nothing to move token by token
    ALL_ATTENTION_FUNCTIONS.register(PROBE, _own_value)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE, _mask)
    tiny = copy.deepcopy(tiny)  # its config too: the recipe's tiny configs are cached and shared
    tiny.set_attn_implementation(PROBE)
    for m in tiny.modules():  # modules holding their own copy of the config
        config = getattr(m, "config", None)
        if hasattr(config, "_attn_implementation") and config._attn_implementation != PROBE:
            config._attn_implementation = PROBE
    tiny.eval()
    pad = getattr(tiny.config.get_text_config(), "pad_token_id", None)
    kinds = sorted(set(ids.flatten().tolist()) - {pad})
    if len(kinds) < 2:
        return None
    base, outputs = _run(tiny, inputs)
    for changed in (0, ids.shape[1] - 1):
        moved_ids = ids.clone()
        moved_ids[:, changed] = torch.where(ids[:, changed] == kinds[0], kinds[1], kinds[0])
        moved, moved_outputs = _run(tiny, {**inputs, "input_ids": moved_ids})
        others = [t for t in range(ids.shape[1]) if t != changed]
        if not _same(base, moved, others):
            where = next((p for p in outputs if _mixes(outputs[p], moved_outputs.get(p), others)), None)
            module = f"{where} ({type(tiny.get_submodule(where)).__name__})" if where else "its forward"
            return (
                f"{module} mixes tokens outside attention (with attention made per-token on a tiny copy, changing "
                f"token {changed} moved other tokens' outputs), and each cp rank would run it on its own tokens"
            )
    return None


def _mixes(seen, moved_seen, others: list[int]) -> bool:
    """A module whose input stayed put at the other tokens while its output moved there."""
    if moved_seen is None:
        return False
    (x, y), (moved_x, moved_y) = seen, moved_seen
    return (x is None or _same(x, moved_x, others)) and not _same(y, moved_y, others)


def _run(tiny: nn.Module, inputs: dict):
    """The forward's per-token output, and each module's (input, output) by path in the order they finish."""
    batch, seq = inputs["input_ids"].shape
    outputs: dict[str, tuple] = {}
    hooks = [(m, _recorder(outputs, path, batch, seq)) for path, m in tiny.named_modules() if path]
    out = run_hooked(tiny, inputs, hooks)
    values = out.values() if hasattr(out, "values") else [out]
    main = next((v for v in values if _per_token(v, batch, seq)), None)
    return main, outputs


def _recorder(outputs: dict, path: str, batch: int, seq: int):
    def record(_module, args, _kwargs, output):
        first = output if torch.is_tensor(output) else output[0] if isinstance(output, tuple) and output else None
        if path not in outputs and _per_token(first, batch, seq):
            hidden = args[0] if args and _per_token(args[0], batch, seq) else None
            outputs[path] = (None if hidden is None else hidden.detach().clone(), first.detach().clone())

    return record


def run_hooked(tiny: nn.Module, inputs: dict, hooks: list[tuple[nn.Module, object]]):
    """One forward of ``tiny`` without autograd, each ``(module, hook)`` a forward hook (taking kwargs)
    for its length."""
    handles = [module.register_forward_hook(hook, with_kwargs=True) for module, hook in hooks]
    try:
        with torch.no_grad():
            return tiny(**inputs)
    finally:
        for h in handles:
            h.remove()


def _per_token(t, batch: int, seq: int) -> bool:
    return torch.is_tensor(t) and t.is_floating_point() and t.dim() >= 2 and tuple(t.shape[:2]) == (batch, seq)


def _same(a, b, others: list[int]) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return a is None and b is None
    x, y = a[:, others].float(), b[:, others].float()
    return torch.allclose(x, y, rtol=0, atol=1e-6 * max(1.0, x.abs().max().item()))
