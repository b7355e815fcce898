"""A tiny copy that runs: the first of the recipe's scalings whose model builds and computes.

A config the class accepts can still give a model that does not run (a rotary width wider than the
tiny head, a pooler still at the full width, a schedule of layer indices past the tiny depth). Every
proof runs on a tiny copy, so a copy that does not run would refuse a model the library could
shard: each scaling of `shardformer.core.tiny.tiny_copy_configs` is tried in turn (built,
given the recipe's inputs, run forward once) and the first that runs is used. The choice is cached
per class, user config and tp: every rank and every later proof gets the same copy.
"""

from __future__ import annotations

import copy
import json

import torch

from shardformer.core.inputs import image_config, make_inputs
from shardformer.core.instance import set_attention, study_instance
from shardformer.core.tiny import fill_zero_matrices, tiny_copy_configs
from shardformer.core.tiny_norms import DEGENERATE, batch_norms, fewest_normalised, settle_batch_norms

MAX_PARAMS = 40_000_000  # the scalings that keep the user's widths or depth are used only while the copy stays small


class TinyCopyError(ValueError):
    """No scaling of the config gives a tiny model that builds and runs (each one's error is named)."""


_CHOSEN: dict[tuple, object] = {}


def tiny_copy(model, tp: int, seed: int = 0, heads: int | None = None):
    """A tiny random model of ``model``'s class and architecture that runs, with what ``model``'s instance
    adds to its class (swapped modules, hooks, patched methods, its attention implementation:
    `shardformer.core.instance`) put on it (the caller's RNG left as it was; `TinyCopyError`
    when no scaling of its config runs, `shardformer.core.instance.CannotReproduce` when an
    addition cannot be rebuilt small)."""
    instance = study_instance(model)
    config = runnable_tiny_config(type(model), model.config, tp, heads, attention=instance.attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tiny = type(model)(config)
        instance.reproduce(model, tiny)
        fill_zero_matrices(tiny)
    if batch_norms(tiny):  # their statistics as training would leave them: eval mode keeps the scale
        settle_batch_norms(tiny, make_inputs(tiny, seed))
    return name_default_loss(tiny).eval()


def name_default_loss(model):
    """``model`` with the loss transformers falls back to named: its ``loss_function`` property logs
    "`loss_type=None` was set in the config but it is unrecognized" (once a process) for a class whose
    name names no loss (``GPT2LMHeadModel``), then takes the causal-LM loss; a copy the library runs
    takes that same loss without printing the user a warning about a model they never ran."""
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def runnable_tiny_config(
    model_class, config, tp: int = 2, heads: int | None = None, inputs=make_inputs, attention=None
):
    """The config of the first tiny copy of ``model_class`` (from the user's ``config``, with the attention
    implementation ``attention`` where not None) that builds, takes ``inputs(model, seed)`` and runs
    forward; `TinyCopyError` when none does."""
    key = (model_class, tp, heads, json.dumps(config.to_dict(), sort_keys=True, default=str), repr(attention))
    if key not in _CHOSEN:
        _CHOSEN[key] = _first_that_runs(model_class, config, tp, heads, inputs, attention)
    found = _CHOSEN[key]
    if isinstance(found, TinyCopyError):
        raise found
    return copy.deepcopy(found)  # each caller's own: sharding a model may change its config


def _first_that_runs(model_class, config, tp, heads, inputs, attention):
    refused = []
    try:
        candidates = list(tiny_copy_configs(config, tp, heads, refused=refused))
    except Exception as e:  # noqa: BLE001 - no small config the class accepts
        return TinyCopyError(f"a tiny {model_class.__name__} cannot be configured: {type(e).__name__}: {_short(e)}")
    # the first scaling the config class refused is named too: when only copies that keep the widths are left,
    # their refusal (too large) hides why the scaled copy was not accepted
    tried = [f"{s}: refused: {type(e).__name__}: {_short(e)}" for s, e in refused[:1]]
    for scaling, tiny in candidates:
        set_attention(tiny, attention)
        # a copy that keeps the widths or every layer (Inkling's vision tower: 24 layers up to 24576 wide) may be huge
        error, fewest = trial(
            model_class, tiny, inputs, MAX_PARAMS if scaling.keep_widths or scaling.keep_depth else None
        )
        if error is None:
            return _wide_enough_images(model_class, tiny, inputs, fewest)
        tried.append(f"{scaling}: {error}")
    return TinyCopyError(f"a tiny {model_class.__name__} does not run ({'; '.join(tried)})")


def trial(model_class, config, inputs=make_inputs, max_params: int | None = None) -> tuple[str | None, int | None]:
    """Why ``model_class(config)`` cannot be built (or has more than ``max_params`` parameters) or run
    forward on ``inputs(model, seed)``, or None; with the fewest values any of its BatchNorms normalised
    per channel (`shardformer.core.tiny_norms.fewest_normalised`; None: it has none). The caller's RNG is
    left as it was."""
    step = "build"
    try:
        count = _meta_params(model_class, config) if max_params else 0
        if max_params and count is None:  # never built for real at the user's widths without a count
            return "its size cannot be counted on the meta device, and a copy that keeps the widths may be huge", None
        if max_params and count > max_params:
            return f"{count / 1e6:.0f}M parameters, more than a copy that keeps the widths or depth may have", None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = name_default_loss(model_class(config))
            fill_zero_matrices(model)
            model.eval()
            step = "inputs"
            batch = inputs(model, 0)
            step = "forward"
            return None, fewest_normalised(model, batch)
    except Exception as e:  # noqa: BLE001 - what the next scaling may avoid
        return f"{step}: {type(e).__name__}: {_short(e)}", None


def _wide_enough_images(model_class, config, inputs, fewest: int | None, doublings: int = 2):
    """``config`` with its images doubled (at most ``doublings`` times) while some BatchNorm of its model
    normalises ``fewest`` <= 2 values per channel, which training mode maps to -1 and +1 whatever they are
    (`shardformer.core.tiny_norms`), and a larger image that runs gives it more (not a norm over pooled
    features)."""
    for _ in range(doublings):
        size = getattr(image_config(config), "image_size", None)
        if fewest is None or fewest > DEGENERATE or type(size) is not int:
            break
        wider = copy.deepcopy(config)
        image_config(wider).image_size = 2 * size
        error, more = trial(model_class, wider, inputs)
        if error is not None or more is None or more <= fewest:
            break
        config, fewest = wider, more
    return config


def _meta_params(model_class, config) -> int | None:
    """The parameter count of ``model_class(config)``, built without memory (None when the class cannot
    be built on the meta device)."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in model_class(config).parameters())
    except Exception:  # noqa: BLE001
        return None


def _short(e: Exception, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "…"
