"""The model the user passed, not only its class: what the instance adds, and a copy that has it too.

A proof on ``type(model)(small config)`` runs the class's code, but users run an instance: modules
swapped in, a ``forward`` patched on one module, hooks registered, an attention implementation
chosen at load time (``config._attn_implementation`` is not in ``config.to_dict()``), settings
changed by hand. :func:`study_instance` lists what the instance adds to what its class builds from
its own config (compared with a meta-device build of the class: no memory); :meth:`Instance.reproduce`
puts each addition on the tiny copy, or raises :class:`CannotReproduce` naming the module and what
cannot be rebuilt small. :attr:`Instance.key` holds everything a verdict depends on (the code of
every module class the model holds and of the functions their methods call, the additions, the
attention implementation, the dtype), so that no cached verdict covers a changed instance.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import marshal
import re
import types
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_PLAIN = (bool, float, str, type(None))  # settings carried to the copy; an int is a width or a count
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
        block of the copy); :class:`CannotReproduce` when one cannot be."""
        user_paths = [p for p, _ in user.named_modules()]
        placed = _place(self.extras, user_paths, {p for p, _ in tiny.named_modules()}, type(user).__name__)
        for path, extras in placed.items():
            _apply(tiny, path, extras, _rebinder(user, tiny))


_STUDIES: list[dict] = []  # the studies of the calls under way (:func:`studied_once`), by model


@contextlib.contextmanager
def studied_once():
    """Within the block, :func:`study_instance` studies each model once (one ``shard_model`` call: the
    derivation, the proofs and the anatomy read one study); outside, every call studies anew, since the
    user may change the instance between calls."""
    _STUDIES.append({})
    try:
        yield
    finally:
        _STUDIES.pop()


def study_instance(model: nn.Module) -> Instance:
    """What ``model``'s instance adds to its class (compared with the class built from the model's own
    config on the meta device; a model with no transformers config is compared with nothing: every
    hook and instance method counts, and its copies are the instance itself, cut)."""
    if _STUDIES:
        seen = _STUDIES[0].get(id(model))
        if seen is not None and seen[0] is model:
            return seen[1]
    instance = _study(model)
    if _STUDIES:
        _STUDIES[0][id(model)] = (model, instance)
    return instance


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


def pattern(path: str) -> str:
    """``path`` with every index replaced by ``*`` (the blocks of a stack share one pattern)."""
    return _INDEX.sub("*", path)


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
            with torch.device("meta"), _quiet_transformers(), torch.random.fork_rng(devices=[]):
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


# --- code keys ---------------------------------------------------------------------------------------


def code_key(obj, depth: int = 0) -> str:
    """What a callable computes, as far as its code, defaults and captured values tell (two lambdas
    that scale by different captured numbers differ; one function is one key in every process)."""
    if depth > 3:  # a decorator's closure holds the function it wraps, which may hold it again
        return getattr(obj, "__qualname__", type(obj).__qualname__)
    deeper = functools.partial(_value_key, depth=depth + 1)
    if isinstance(obj, functools.partial):
        return f"partial({code_key(obj.func, depth + 1)}, {deeper(obj.args)}, {deeper(obj.keywords)})"
    if isinstance(obj, types.MethodType):
        return f"method({code_key(obj.__func__, depth + 1)})"
    code = getattr(obj, "__code__", None)
    if code is None:  # a callable object, a builtin
        call = vars(type(obj)).get("__call__")
        inner = code_key(call, depth + 1) if getattr(call, "__code__", None) is not None else ""
        return f"{type(obj).__module__}.{type(obj).__qualname__}({inner}, {deeper(_plain_vars(obj))})"
    digest = hashlib.sha1(marshal.dumps(code))
    digest.update(deeper(obj.__defaults__).encode())
    for cell in obj.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            digest.update(deeper(cell.cell_contents).encode())
    return f"{getattr(obj, '__qualname__', '?')}:{digest.hexdigest()[:16]}"


def _value_key(value, depth: int = 0) -> str:
    if isinstance(value, (bool, int, float, str, bytes, type(None))):
        return repr(value)
    if isinstance(value, (tuple, list)) and depth < 4:
        return "(" + ",".join(_value_key(v, depth + 1) for v in value) + ")"
    if isinstance(value, dict) and depth < 4:
        return "{" + ",".join(f"{k!r}:{_value_key(v, depth + 1)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}{value.dtype}:{float(value.detach().float().sum()) if value.numel() and value.device.type != 'meta' else 0}"
    if isinstance(value, nn.Module):
        return f"module:{type(value).__qualname__}"
    if callable(value):
        return code_key(value, depth)
    return type(value).__qualname__


def _plain_vars(obj) -> dict:
    return {k: v for k, v in getattr(obj, "__dict__", {}).items() if isinstance(v, (bool, int, float, str))}


def class_key(cls: type) -> str:
    """The code of ``cls`` (every method up its bases, short of ``nn.Module``) and of the functions
    of its module those methods call: a class patched in place (``LlamaMLP.forward = ...``, a kernel
    library swapping ``apply_rotary_pos_emb``) is another key."""
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for base in cls.__mro__:
        if base in (nn.Module, object) or base.__module__.startswith("torch.nn"):
            continue
        for name, value in sorted(vars(base).items()):
            func = getattr(value, "__func__", value)
            if inspect.isfunction(func):
                parts.append(f"{name}={code_key(func)}")
                parts += [f"{n}={code_key(g)}" for n, g in _called(func)]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]


def _called(func) -> list[tuple[str, object]]:
    """The module-level functions ``func`` names (one level: what a patch to its module would swap)."""
    return [
        (n, func.__globals__[n])
        for n in func.__code__.co_names
        if inspect.isfunction(func.__globals__.get(n)) and func.__globals__[n] is not func
    ]


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
    """``config`` (a tiny copy's) set to the attention implementation(s) :func:`study_instance` read."""
    if attention is None or config is None:
        return
    own, subs = (attention, ()) if not isinstance(attention, tuple) else attention
    config._attn_implementation = own  # transformers sets the sub-configs' with it
    for name, value in subs:
        sub = getattr(config, name, None)
        if sub is not None:
            sub._attn_implementation = value if not isinstance(value, tuple) else value[0]


@contextlib.contextmanager
def _quiet_transformers():
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


# --- putting the additions on a tiny copy ------------------------------------------------------------


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
