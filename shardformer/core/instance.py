"""The model the user passed, not only its class: what the instance adds, and a copy that has it too.

A proof on ``type(model)(small config)`` runs the class's code, but users run an instance: modules
swapped in, a ``forward`` patched on one module, hooks registered, an attention implementation
chosen at load time (``config._attn_implementation`` is not in ``config.to_dict()``), settings
changed by hand. `study_instance` lists what the instance adds to what its class builds from
its own config (compared with a meta-device build of the class: no memory); `Instance.reproduce`
puts each addition on the tiny copy, or raises `CannotReproduce` naming the module and what
cannot be rebuilt small. `Instance.key` holds everything a verdict depends on (the code of
every module class the model holds and of the functions their methods call, the additions, the
attention implementation, the dtype), so that no cached verdict covers a changed instance.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardformer.core import example_inputs
from shardformer.core.code_keys import class_key, code_key
from shardformer.core.reproduce import CannotReproduce, Extras, pattern, reproduce
from shardformer.core.study_memo import once_per_study, studied_once

__all__ = ["CannotReproduce", "Extras", "Instance", "pattern", "study_instance", "studied_once"]

HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_PLAIN = (bool, float, str, type(None))  # settings carried to the copy; an int is a width or a count


@dataclass
class Instance:
    """What ``model`` adds to its class (``extras``, by module path) and the key of everything a proof
    on it depends on."""

    extras: dict[str, Extras]
    attention: object  # the attention implementation its config names (None: no transformers config)
    key: tuple

    def describe(self, limit: int = 3) -> str:
        items = [f"{p or 'the model'}: {e.describe()}" for p, e in self.extras.items()]
        return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")

    def reproduce(self, user: nn.Module, tiny: nn.Module) -> None:
        """Give ``tiny`` (a small model of ``user``'s class) every addition of ``user``'s instance, each
        on the tiny module that stands for it (a stack's blocks: every distinct kind of block on one
        block of the copy); `CannotReproduce` when one cannot be."""
        reproduce(self.extras, user, tiny)


@once_per_study
def study_instance(model: nn.Module) -> Instance:
    """What ``model``'s instance adds to its class (compared with the class built from the model's own
    config on the meta device; a model with no transformers config is compared with nothing: every
    hook and instance method counts, and its copies are the instance itself, cut). Studied once per
    ``shard_model`` call (`shardformer.core.study_memo.studied_once`)."""
    return _study(model)


def _study(model: nn.Module) -> Instance:
    clean = _clean_modules(model)
    extras = _extras(model, clean)
    config = getattr(model, "config", None)
    attention = attention_of(config)
    param = next(model.parameters(), None)
    key = (
        tuple(sorted({class_key(type(m)) for m in model.modules()})),
        tuple((p, e.key()) for p, e in extras.items()),
        repr(attention),
        _attention_code(attention),
        str(param.dtype) if param is not None else "",
        _param_hooks(model),
        example_inputs.key(model),  # a verdict proven on other inputs is not this one's
    )
    return Instance(extras, attention, key)


def guard_attention(model: nn.Module) -> None:
    """A forward pre-hook on the sharded ``model``: its attention implementation stays the one it was
    sharded with (``model.set_attn_implementation`` afterwards would switch to code nothing proved)."""
    attention = attention_of(getattr(model, "config", None))
    if attention is None:
        return

    def check(module, args, kwargs):
        now = attention_of(module.config)
        if now != attention:
            raise ValueError(
                f"{type(module).__name__}'s attention implementation is {now!r}, but it was sharded and proven with "
                f"{attention!r}; set it back (model.set_attn_implementation({attention!r})), or shard a fresh model "
                f"loaded with attn_implementation={now!r}"
            )

    model.register_forward_pre_hook(check, with_kwargs=True)


# --- what the instance adds ------------------------------------------------------------------------


def _clean_modules(model: nn.Module) -> dict[str, nn.Module] | None:
    """The modules ``type(model)`` builds from the model's own config, by path, on the meta device
    (None: no transformers config, or the class cannot be built there)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return None
    key = (type(model), class_key(type(model)), json.dumps(config.to_dict(), sort_keys=True, default=str))
    key += (repr(attention_of(config)),)
    if key not in _CLEAN:
        try:
            with torch.device("meta"), transformers_quiet(), torch.random.fork_rng(devices=[]):
                _CLEAN[key] = dict(type(model)(copy.deepcopy(config)).named_modules())
        except Exception:  # noqa: BLE001 - a class that needs more than its config: compared with nothing
            _CLEAN[key] = None
    return _CLEAN[key]


_CLEAN: dict[tuple, dict[str, nn.Module] | None] = {}


def _extras(model: nn.Module, clean: dict[str, nn.Module] | None) -> dict[str, Extras]:
    found: dict[str, Extras] = {}
    swapped: list[str] = []
    for path, module in model.named_modules():
        owner = next((s for s in swapped if path.startswith(s + ".") or not s), None)
        if owner is not None:  # inside a swapped module: rebuilt with it, its own additions carried
            inner = _own(module, None)
            if inner:
                found[owner].inside[path[len(owner) + 1 :] if owner else path] = inner
            continue
        reference = None if clean is None else clean.get(path)
        extras = _own(module, reference)
        if clean is not None and (reference is None or type(reference) is not type(module)):
            extras.cls = type(module)
            swapped.append(path)
        if extras:
            found[path] = extras
    return found


def _own(module: nn.Module, reference: nn.Module | None) -> Extras:
    """What ``module`` holds beyond ``reference`` (the module its class builds; None: beyond nothing)."""
    extras = Extras()
    theirs = {} if reference is None else vars(reference)
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, (nn.Module, torch.Tensor)):
            continue
        if callable(value) and not isinstance(value, type):
            if name not in theirs or code_key(theirs[name]) != code_key(value):
                extras.methods[name] = value
        elif (
            reference is not None
            and not name.startswith("_")
            and name != "training"
            and isinstance(value, _PLAIN)
            and name in theirs
            and theirs[name] != value
        ):
            extras.settings[name] = value
    known = {code_key(h) for kind in HOOKS for h in getattr(reference, kind, {}).values()}
    for kind in HOOKS:
        for hook_id, hook in getattr(module, kind).items():
            if code_key(hook) not in known:
                extras.hooks.append((kind, hook, _options(module, kind, hook_id)))
    return extras


def _options(module: nn.Module, kind: str, hook_id: int) -> dict:
    if kind == "_forward_hooks":
        return {
            "with_kwargs": hook_id in module._forward_hooks_with_kwargs,
            "always_call": hook_id in module._forward_hooks_always_called,
        }
    if kind == "_forward_pre_hooks":
        return {"with_kwargs": hook_id in module._forward_pre_hooks_with_kwargs}
    if kind == "_backward_hooks":
        return {"full": module._is_full_backward_hook is not False}
    return {}


def _param_hooks(model: nn.Module) -> tuple:
    """Hooks registered on parameters (``param.register_hook``): part of what a verdict depends on."""
    return tuple(
        (name, tuple(code_key(h) for h in (p._backward_hooks or {}).values()))
        for name, p in model.named_parameters()
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
    )


# --- attention ---------------------------------------------------------------------------------------


def attention_of(config) -> object:
    """The attention implementation ``config`` names (with its sub-configs' where they differ)."""
    if config is None or not hasattr(config, "to_dict"):
        return None
    subs = {k: attention_of(getattr(config, k, None)) for k in getattr(config, "sub_configs", {}) or {}}
    own = getattr(config, "_attn_implementation", None)
    subs = {k: v for k, v in subs.items() if v is not None and v != own}
    return (own, tuple(sorted(subs.items(), key=repr))) if subs else own


def _attention_code(attention) -> str:
    """The code registered under the implementation's name (a user may register their own)."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # pragma: no cover - transformers is a dependency
        return ""
    names = [attention] if isinstance(attention, str) else [a for a in _flatten(attention) if isinstance(a, str)]
    return ",".join(code_key(ALL_ATTENTION_FUNCTIONS[n]) for n in names if n in ALL_ATTENTION_FUNCTIONS)


def _flatten(value):
    if isinstance(value, tuple):
        for v in value:
            yield from _flatten(v)
    else:
        yield value


def set_attention(config, attention) -> None:
    """``config`` (a tiny copy's) set to the attention implementation(s) `study_instance` read."""
    if attention is None or config is None:
        return
    own, subs = (attention, ()) if not isinstance(attention, tuple) else attention
    config._attn_implementation = own  # transformers sets the sub-configs' with it
    for name, value in subs:
        sub = getattr(config, name, None)
        if sub is not None:
            sub._attn_implementation = value if not isinstance(value, tuple) else value[0]


@contextlib.contextmanager
def transformers_quiet():
    """transformers' warnings about a tiny copy or a meta build (not about the user's model) kept out of the log."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
