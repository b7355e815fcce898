"""Putting what the user's instance adds on a tiny copy of its class (`Instance.reproduce`): each
addition on the tiny module standing for the user's, a stack's blocks keeping one block of each kind;
a swapped module rebuilt small; hooks and methods rebound to the copy's modules."""

from __future__ import annotations

import functools
import inspect
import re
import types
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardformer.core.code_keys import class_key, code_key

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


class CannotReproduce(ValueError):
    """The tiny copy cannot be given what the user's instance has (the message names the module)."""


@dataclass
class Extras:
    """What one module of the user's instance has beyond what its class builds at that path."""

    cls: type | None = None  # the module is of another class than the one built there (None: same class)
    methods: dict[str, object] = field(default_factory=dict)  # callables set on the instance (a patched forward)
    hooks: list[tuple[str, object, dict]] = field(default_factory=list)  # (kind, hook, registration options)
    settings: dict[str, object] = field(default_factory=dict)  # plain values other than the class sets
    inside: dict[str, Extras] = field(default_factory=dict)  # below a swapped module: its own extras, by path

    def __bool__(self) -> bool:
        return bool(self.cls or self.methods or self.hooks or self.settings or self.inside)

    def key(self) -> tuple:
        return (
            class_key(self.cls) if self.cls else None,
            tuple((n, code_key(f)) for n, f in sorted(self.methods.items())),
            tuple((kind, code_key(h), tuple(sorted(o.items()))) for kind, h, o in self.hooks),
            tuple(sorted((n, repr(v)) for n, v in self.settings.items())),
            tuple((p, e.key()) for p, e in sorted(self.inside.items())),
        )

    def describe(self) -> str:
        said = [f"a {self.cls.__name__}"] if self.cls else []
        said += [f"its own {n}" for n in self.methods]
        said += [f"a {kind.strip('_').replace('_', ' ')[:-1]}" for kind, _, _ in self.hooks]
        said += [f"{n}={v!r}" for n, v in self.settings.items()]
        return ", ".join(said) or "changes below it"


def pattern(path: str) -> str:
    """``path`` with every index replaced by ``*`` (the blocks of a stack share one pattern)."""
    return _INDEX.sub("*", path)


def reproduce(extras: dict[str, Extras], user: nn.Module, tiny: nn.Module) -> None:
    """Give ``tiny`` (a small model of ``user``'s class) the ``extras`` of ``user``'s instance;
    `CannotReproduce` when one cannot be."""
    user_paths = [p for p, _ in user.named_modules()]
    placed = _place(extras, user_paths, {p for p, _ in tiny.named_modules()}, type(user).__name__)
    rebind = _rebinder(user, tiny)
    for path, what in placed.items():
        _apply(tiny, path, what, rebind)


def _place(extras: dict[str, Extras], user_paths: list[str], tiny_paths: set[str], name: str) -> dict[str, Extras]:
    """Which tiny module gets which additions: the module at the same path where the copy has it, and
    every distinct kind of block a stack holds (with additions, and plain where some block is plain)
    on some block of the copy."""
    placed: dict[str, Extras] = {}
    for pat in dict.fromkeys(pattern(p) for p in extras):
        paths = [p for p in user_paths if pattern(p) == pat]
        tiny = sorted((p for p in tiny_paths if pattern(p) == pat), key=_natural)
        added = [p for p in paths if p in extras]
        if not tiny:
            raise CannotReproduce(
                f"{added[0]} ({extras[added[0]].describe()}) has no counterpart in a tiny copy of {name}"
            )
        keys = {p: extras[p].key() if p in extras else None for p in paths}
        source = {keys[p]: extras[p] for p in reversed(added)}
        wanted = list(dict.fromkeys(keys.values()))
        assigned = {p: keys[p] for p in tiny if p in keys}
        for p in tiny:  # blocks of the copy the user's model has no block for: the kinds still missing first
            if p not in assigned:
                missing = [k for k in wanted if k not in assigned.values()]
                assigned[p] = missing[0] if missing else Counter(keys.values()).most_common(1)[0][0]
        for kind in wanted:
            if kind in assigned.values():
                continue
            counts = Counter(assigned.values())
            spare = next((p for p in reversed(tiny) if counts[assigned[p]] > 1), None)
            if spare is None:
                raise CannotReproduce(
                    f"the blocks at {pat} of {name} come in more kinds ({len(wanted)}) than a tiny copy has blocks "
                    f"({len(tiny)}): {', '.join(extras[p].describe() for p in added[:3])}"
                )
            assigned[spare] = kind
        placed.update({p: source[k] for p, k in assigned.items() if k is not None})
    return placed


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in path.split(".")]


def _rebinder(user: nn.Module, tiny: nn.Module):
    """Maps what a hook or method captured of the user's model (a module, a bound method) to the same
    thing of the tiny copy, so that the copy's hooks act on the copy."""
    tiny_modules = dict(tiny.named_modules())
    mapping = {id(m): tiny_modules.get(p) for p, m in user.named_modules()}

    def rebind(value):
        if isinstance(value, nn.Module):
            return mapping.get(id(value)) or value
        if isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module):
            return types.MethodType(value.__func__, rebind(value.__self__))
        if isinstance(value, functools.partial):
            args = tuple(rebind(a) for a in value.args)
            return functools.partial(rebind(value.func), *args, **{k: rebind(v) for k, v in value.keywords.items()})
        if inspect.isfunction(value) and value.__closure__:
            cells = tuple(types.CellType(rebind(_contents(c))) for c in value.__closure__)
            if any(a is not _contents(b) for a, b in zip((_contents(c) for c in cells), value.__closure__)):
                fresh = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
                fresh.__kwdefaults__ = value.__kwdefaults__
                return fresh
        return value

    return rebind


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _apply(tiny: nn.Module, path: str, extras: Extras, rebind) -> None:
    module = tiny.get_submodule(path) if path else tiny
    if extras.cls is not None:
        module = _rebuilt(tiny, path, module, extras.cls)
        for inner, more in extras.inside.items():
            try:
                _apply(module, inner, more, rebind)
            except AttributeError as e:
                raise CannotReproduce(
                    f"{path}.{inner} ({more.describe()}) is not in {extras.cls.__name__} rebuilt small"
                ) from e
    for name, value in extras.methods.items():
        setattr(module, name, rebind(value))
    for name, value in extras.settings.items():
        setattr(module, name, value)
    for kind, hook, options in extras.hooks:
        hook = rebind(hook)
        if kind == "_forward_pre_hooks":
            module.register_forward_pre_hook(hook, **options)
        elif kind == "_forward_hooks":
            module.register_forward_hook(hook, **options)
        elif kind == "_backward_pre_hooks":
            module.register_full_backward_pre_hook(hook)
        elif options.get("full"):
            module.register_full_backward_hook(hook)
        else:
            module.register_backward_hook(hook)


def _rebuilt(tiny: nn.Module, path: str, original: nn.Module, cls: type) -> nn.Module:
    """A small ``cls`` in place of ``original`` (what the class builds at ``path``): built from the config
    the copy's module holds, or the copy's (with its layer index), or with no arguments."""
    config = getattr(original, "config", None) or getattr(tiny, "config", None)
    configs = [c for c in (config, getattr(config, "get_text_config", lambda: None)()) if c is not None]
    index = getattr(original, "layer_idx", None)
    attempts = [((c, index), {}) for c in configs if index is not None] + [((c,), {}) for c in configs] + [((), {})]
    errors = []
    for args, kwargs in attempts:
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                module = cls(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the next way of calling it
            errors.append(f"{type(e).__name__}: {e}")
            continue
        if path:
            tiny.set_submodule(path, module.train(original.training))
        return module
    raise CannotReproduce(
        f"{path or 'the model'} is a {cls.__name__}, which the class does not build there, and it cannot be built "
        f"small for the proof (from the copy's config, or with no arguments: {errors[-1] if errors else '?'})"
    )
