"""Positions on a split sequence: every cp rank must see the positions the model would give its
tokens in the whole sequence.

Position ids: a forward without them lets the model derive its own, and models differ (most count
0, 1, 2, ...; OPT counts the attended tokens of the attention mask; the RoBERTa family counts the
non-padding ids from ``padding_idx + 1``). A rank holding a head and a tail chunk cannot derive
them from its own tokens, so `position_rule` finds out, once per model, which rule the model
follows, by running a tiny copy of it (same class, its config scaled down) on a left-padded probe
with no position ids and with each known rule's: the rule whose output is the model's own is
applied to the whole batch before the split. A model following none is refused unless the caller
passes position_ids.

Rotary embeddings: a rotary whose frequencies depend on the sequence it is called with (dynamic NTK
scaling rescales from the largest position; LongRoPE picks its factors by length) would rotate
each rank's chunk differently. `hook_rotary` makes every rotary module compute its
cos/sin for the whole sequence's positions and hands each rank its own tokens' rows.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn as nn

from shardformer.core.tiny_run import tiny_copy

# how a position rule turns (input_ids, 2D mask as long, pad id) into position ids [batch, seq]
RULES = {
    "arange": lambda ids, mask, pad: torch.arange(mask.shape[1], device=mask.device).expand(mask.shape),
    "mask": lambda ids, mask, pad: mask.cumsum(1) * mask - 1,  # OPT, BioGPT: attended tokens counted
    "ids": lambda ids, mask, pad: (ids != pad).long().cumsum(1) * (ids != pad) + pad,  # RoBERTa family
}
_SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")  # frequencies chosen from the positions of the call


def takes_position_ids(model: nn.Module) -> bool:
    params = inspect.signature(model.forward).parameters
    return "position_ids" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _pad_id(config) -> int | None:
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else None


def position_rule(model: nn.Module) -> str | None:
    """The rule of `RULES` ``model`` follows for its position ids when given none (found on
    a tiny copy of it); None when it follows none of them or the copy cannot be run."""

    try:
        with torch.no_grad():
            tiny = tiny_copy(model, tp=1).float()  # the caller's RNG stream is untouched
            pad = _pad_id(tiny.config)
            pad = 0 if pad is None else pad
            ids = torch.tensor([t for t in range(10, 20) if t != pad][:8]).repeat(2, 1)  # no special token
            mask = torch.ones_like(ids)
            ids[0, :3], mask[0, :3] = pad, 0  # left padding
            extra = {"use_cache": False} if "use_cache" in inspect.signature(tiny.forward).parameters else {}

            def run(**kw):
                out = tiny(input_ids=ids, attention_mask=mask, **kw, **extra)
                return next(v for v in out.values() if torch.is_tensor(v))

            own = run()
            if torch.allclose(run(position_ids=2 * RULES["arange"](ids, mask, pad)), own):
                return None  # the positions it is given change nothing: it derives its own from the split tokens
            for name, rule in RULES.items():
                try:
                    if torch.allclose(run(position_ids=rule(ids, mask, pad)), own, rtol=0, atol=1e-6):
                        return name
                except (IndexError, RuntimeError):  # this rule's ids fall outside the model's position table
                    continue
    except Exception:  # noqa: BLE001 - no tiny copy of this model runs: the caller must pass position_ids
        return None
    return None


def pad_id(model: nn.Module) -> int | None:
    return _pad_id(model.config)


def whole_positions(rule: str | None, name: str, pad: int | None, ids, mask, batch: int, length: int, device):
    """The position ids ``[batch, length]`` model ``name`` would derive for the whole batch (rule:
    from `position_rule`, pad: `pad_id`); a clear refusal where they are not known."""
    if rule is None:
        raise ValueError(
            f"context parallelism: {name} derives its position ids itself by no rule known here (0, 1, 2, ...; "
            f"counted over the attention mask; from the ids and the padding index), so the tokens of a split forward "
            f"without position_ids would get wrong positions; pass position_ids (the positions the model gives the "
            f"whole sequence), or shard with context_parallel_size=1"
        )
    if rule == "ids" and (ids is None or pad is None):
        raise ValueError(
            f"context parallelism: {name} derives its position ids from input_ids and its pad_token_id, and this "
            f"forward has {'no input_ids' if ids is None else 'no pad_token_id'}; pass position_ids"
        )
    mask = torch.ones(batch, length, dtype=torch.long, device=device) if mask is None else mask.long()
    return RULES[rule](ids, mask, pad)


def hook_rotary(model: nn.Module, state) -> None:
    """Every rotary embedding of ``model`` (a module with ``inv_freq`` called with ``position_ids``)
    computes its cos/sin for the whole sequence in a split forward; each rank keeps its own rows."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and "position_ids" in inspect.signature(module.forward).parameters:
            module.register_forward_pre_hook(partial(_whole_sequence, state), with_kwargs=True)
            module.register_forward_hook(partial(_own_rows, state))


def _whole_sequence(state, module, args, kwargs):
    current = state.current
    if current is None:
        return None
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    if bound.get("position_ids") is current.positions:
        bound["position_ids"] = current.whole_positions
        current.rotary_whole.add(id(module))
        return (), bound
    rope = str(getattr(module, "rope_type", ""))
    if any(kind in rope for kind in _SEQUENCE_DEPENDENT_ROPE):
        raise ValueError(
            f"context parallelism: {type(module).__name__} (rope_type={rope!r}) chooses its frequencies from the "
            f"positions it is called with, and is called with positions other than the split's, so each rank would "
            f"rotate differently; shard with context_parallel_size=1"
        )
    return None


def _own_rows(state, module, _args, output):
    current = state.current
    if current is None or id(module) not in current.rotary_whole:
        return None
    current.rotary_whole.discard(id(module))
    layout = current.layout

    def own(t):  # cos/sin [batch, padded_len, dim] -> this rank's rows
        return layout.take(t) if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == layout.padded_len else t

    return tuple(own(t) for t in output) if isinstance(output, tuple) else own(output)
