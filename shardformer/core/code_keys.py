"""What a callable computes, as a key: its code, defaults and captured values; a class's, its methods'
and the module functions they call. The verdict caches key on these, so that a class patched in place,
or a hook capturing another value, is proven again (`shardformer.core.instance`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import marshal
import types

import torch
import torch.nn as nn


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
    if isinstance(value, tuple) and depth < 4:
        return "(" + ",".join(_value_key(v, depth + 1) for v in value) + ")"
    if isinstance(value, (list, dict, set)):  # mutable: a cache or a registry filling up as the process runs
        return type(value).__qualname__
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}{value.dtype}:{float(value.detach().float().sum()) if value.numel() and value.device.type != 'meta' else 0}"
    if isinstance(value, nn.Module):
        return f"module:{type(value).__qualname__}"
    if callable(value):
        return code_key(value, depth)
    return type(value).__qualname__


def _plain_vars(obj) -> tuple:
    return tuple(
        sorted((k, v) for k, v in getattr(obj, "__dict__", {}).items() if isinstance(v, (bool, int, float, str)))
    )


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
