"""What context parallelism needs of the model's anatomy, and the checks it makes on it.

A split forward runs every module on this rank's tokens only. Attention sees the whole sequence
(through transformers' attention interface), the embeddings get the tokens' global positions
(`.positions`); everything else must compute each token from that token alone. The model's
anatomy (found once, in `shardformer.policies.anatomy`, which fills a `StackAnatomy`) says
where to look:

- the layer stacks: context parallelism splits the sequence of ONE stack (an encoder-decoder or two
  towers has several: refused);
- what runs after the stack (final norm, head, pooler): each such module of the user's model is
  proven per-token on a tiny copy of it, by moving its input at the first and at the last token and
  checking that no other token's output moves, and that it returns one output per token. A pooler
  (BERT's reads the first token) would give each cp rank the pooling of its own tokens: refused,
  naming the module. So is a model whose forward itself pools (CLIP's text model picks each row's
  end-of-text token): an output of one value per row, not per token, is refused by its name;
- inside the stack: attention must be the only thing that mixes tokens (`.mixing`, on the
  same tiny copy).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardformer.context_parallel.attention import MaskReadAsTensor
from shardformer.context_parallel.mixing import mixing_outside_attention, run_hooked


@dataclass(frozen=True)
class StackAnatomy:
    """The parts of a model's anatomy context parallelism reads (see the module doc)."""

    stacks: tuple[str, ...]  # paths of its repeated layer stacks
    after: Callable[[], tuple[str, ...]]  # the modules run after its one stack (ValueError: cannot be told)
    tiny: Callable[[], tuple[nn.Module, dict]]  # a tiny copy of the model and inputs for it
    key: Hashable  # the model's class and architecture (verdicts are cached per key)


_VERDICTS: dict[tuple, str | None] = {}


def anatomy_problem(model: nn.Module, anatomy: StackAnatomy) -> str | None:
    """Why ``model``'s sequence cannot be split, read from its ``anatomy``; None when it can."""
    found = anatomy.stacks
    if len(found) != 1:
        what = ", ".join(found) if found else "none"
        return (
            f"context parallelism splits the sequence of one layer stack, and its anatomy finds {len(found)} ({what}); "
            f"use context_parallel_size=1"
        )
    try:
        after = anatomy.after()
    except ValueError as e:
        return f"what runs after its layer stack {found[0]!r} cannot be told apart ({e}); use context_parallel_size=1"
    present = tuple(p for p in after if _module_at(model, p) is not None)  # BertModel(add_pooling_layer=False)
    key = (anatomy.key, present)
    if key not in _VERDICTS:
        absent = tuple(p for p in after if p not in present)
        try:
            _VERDICTS[key] = _not_per_token(anatomy.tiny, present, absent)
        except MaskReadAsTensor as e:
            _VERDICTS[key] = f"{e.reason} (on a tiny copy)"
        except Exception as e:  # noqa: BLE001 - a copy that does not run proves nothing: refused, said why
            _VERDICTS[key] = (
                f"a tiny copy of it, which proves what mixes tokens, does not run ({type(e).__name__}: {e})"
            )
    return _VERDICTS[key]


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:  # a module the class builds optionally, absent (None) here
        return None


def _not_per_token(make_tiny, paths: tuple[str, ...], absent: tuple[str, ...]) -> str | None:
    """The first of ``paths`` (after the layer stack) that does not compute each token from that token
    alone on a tiny copy, with why, or an output pooled per row; None when every one is per-token.
    ``absent``: modules the user's model leaves out (None), left out of the copy too."""
    tiny, inputs = make_tiny()
    tiny.eval()
    for path in absent:
        parent, _, name = path.rpartition(".")
        setattr(tiny.get_submodule(parent), name, None)
    calls: dict[str, tuple] = {}
    hooks = [(m, _recorder(calls, p)) for p in paths if (m := _module_at(tiny, p)) is not None]
    output = run_hooked(tiny, inputs, hooks)
    for path in paths:
        if path not in calls:
            continue  # never runs in a forward
        module = tiny.get_submodule(path)
        why = _token_mixing(module, *calls[path])
        if why is not None:
            return (
                f"{path} ({type(module).__name__}) {why}, and each cp rank holds other tokens of the sequence; load "
                f"the model without it (BertModel(config, add_pooling_layer=False) for a pooler)"
            )
    return _pooled_output(output, inputs) or mixing_outside_attention(tiny, inputs)


def _recorder(calls: dict, path: str):
    def record(_module, args, kwargs, output):
        calls.setdefault(path, (args, kwargs, output))

    return record


def _token_mixing(module: nn.Module, args, kwargs, output) -> str | None:
    """Why ``module`` (called with ``args``/``kwargs``, returning ``output``) is not per-token, or None."""
    hidden_in_args = bool(args) and torch.is_tensor(args[0])
    hidden = args[0] if hidden_in_args else kwargs.get("hidden_states")
    if not torch.is_tensor(hidden) or hidden.dim() < 3 or not hidden.is_floating_point():
        return None  # not called on the hidden states of the sequence
    out = _first(output)
    if out is None or out.dim() < 2 or out.shape[:2] != hidden.shape[:2]:
        shape = None if out is None else tuple(out.shape)
        return f"turns the hidden states {tuple(hidden.shape)} into {shape}, not one output per token (pooling)"
    for changed in (0, hidden.shape[1] - 1):
        moved = hidden.clone()
        moved[:, changed] += 1.0
        with torch.no_grad():
            if hidden_in_args:
                new = _first(module(moved, *args[1:], **kwargs))
            else:
                new = _first(module(*args, **kwargs | {"hidden_states": moved}))
        others = [t for t in range(hidden.shape[1]) if t != changed]
        if new is None or not torch.allclose(new[:, others], out[:, others], atol=1e-6, rtol=0):
            return f"computes other tokens' outputs from token {changed}"
    return None


def _pooled_output(output, inputs: dict) -> str | None:
    """An output of the forward with one value per row (batch first, no sequence dimension): pooled
    from this rank's tokens only under context parallelism."""
    ids = inputs.get("input_ids")
    if ids is None or not hasattr(output, "items"):
        return None
    batch, seq = ids.shape[:2]
    for name, value in output.items():
        if name == "loss" or not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != batch:
            continue
        if value.dim() < 2 or value.shape[1] != seq:
            return (
                f"its forward returns {name} {tuple(value.shape)}, one value per row rather than per token (pooled), "
                f"and each cp rank holds other tokens of the sequence; use context_parallel_size=1"
            )
    return None


def _first(output) -> torch.Tensor | None:
    if torch.is_tensor(output):
        return output
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if torch.is_tensor(v)), None)
