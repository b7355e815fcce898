"""Load a Python file of settings (an example's ``config.py``) into a validated, read-only ``Config``.

A config file is plain Python; its module-level names are the settings, in lower or upper case::

    tensor_parallel_size = 2
    zero_stage = 1
    BATCH_SIZE = 8          # the same key as batch_size
    checkpoint_dir = os.path.join(os.path.dirname(__file__), "checkpoints")

Names starting with ``_``, imported modules, functions and classes are not settings. ColossalAI's
``parallel = dict(tensor=dict(size=2, mode="1d"), pipeline=1, data=1)`` is accepted as another
spelling of three ``*_parallel_size`` keys. The sizes and the context-parallel mode also go by
EngineConfig's short names (``tp``, ``pp``, ``dp``, ``cp``, ``cp_mode``). Every key must be in the
schema (``BASE_KEYS`` plus the caller's ``extra_keys``): an unknown key or a value of the wrong
type raises ``ConfigError`` naming the key, the value and what was expected.
"""

from __future__ import annotations

import difflib
import inspect
import os
import runpy
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardformer.core.config import CHOICES, SIZE_NAMES, EngineConfig


class ConfigError(ValueError):
    """A config file could not be read, or holds an unknown key or a bad value."""


@dataclass(frozen=True)
class Key:
    """One allowed setting: its type(s), default, and optional choices / lower bound.

    ``type`` may be a type or a tuple of types; ``object`` accepts anything. ``None`` is accepted
    when the default is ``None`` or ``optional`` is true. A ``float`` key accepts ints too.
    """

    type: type | tuple[type, ...]
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    optional: bool = False


# Short names (EngineConfig's fields) for the sizes and the cp mode, in a config file or on the
# command line (--set pp=2, --set cp_mode=all_to_all).
_ALIASES = {**SIZE_NAMES, "cp_mode": "context_parallel_mode"}
_FIELD_OF = {long: short for short, long in _ALIASES.items()}


def _engine_key(name: str, help: str, **bounds: Any) -> Key:
    """The key for EngineConfig's field ``name`` (a size by its long name): its type, default and choices."""
    field = _FIELD_OF.get(name, name)
    hint = typing.get_type_hints(EngineConfig)[field]
    kind = next(t for t in (*typing.get_args(hint), hint) if t is not type(None))  # `int | None` -> int
    return Key(kind, getattr(EngineConfig, field), help, choices=CHOICES.get(field), **bounds)


# The parallel and training keys are EngineConfig's fields; the rest are the examples' own.
BASE_KEYS: dict[str, Key] = {
    "tensor_parallel_size": _engine_key(
        "tensor_parallel_size", "processes that split each layer (Megatron 1D)", minimum=1
    ),
    "pipeline_parallel_size": _engine_key("pipeline_parallel_size", "pipeline stages", minimum=1),
    "data_parallel_size": _engine_key(
        "data_parallel_size", "data-parallel replicas; default: world // (tp * cp * pp)", minimum=1
    ),
    "dp_replicate": _engine_key(
        "dp_replicate",
        "hybrid sharding: dp ranks as this many replicas of ZeRO shard groups (1: shard over all)",
        minimum=1,
    ),
    "context_parallel_size": _engine_key(
        "context_parallel_size", "processes that split each sequence (context parallelism)", minimum=1
    ),
    "context_parallel_mode": _engine_key(
        "context_parallel_mode", "how attention spans the split sequence: 'ring' or 'all_to_all' (Ulysses)"
    ),
    "zero_stage": _engine_key(
        "zero_stage", "ZeRO stage: 1 shards optimizer state over dp, 2 also gradients, 3 also parameters (FSDP2)"
    ),
    "precision": _engine_key("precision", "parameter/compute precision"),
    "schedule": _engine_key("schedule", "pipeline schedule (pp > 1): 1f1b, gpipe, interleaved_1f1b, zbv, dualpipev"),
    "virtual_stages": _engine_key(
        "virtual_stages", "model chunks per pp rank for interleaved_1f1b (default 2; zbv/dualpipev: 2)", minimum=1
    ),
    "sequence_parallel": _engine_key("sequence_parallel", "Megatron sequence parallelism inside the tp group"),
    "activation_checkpointing": _engine_key(
        "activation_checkpointing", "recompute each layer's activations in backward (exact)"
    ),
    "seed": _engine_key("seed", "random seed, the same on every rank"),
    "batch_size": Key(int, 8, "global batch size per optimizer step", minimum=1),
    "micro_batch_size": Key(
        int, None, "rows per micro-batch on each dp rank (fills the pipeline); default: one micro-batch", minimum=1
    ),
    "steps": Key(int, 20, "optimizer steps to train", minimum=0),
    "lr": Key(float, 1e-3, "learning rate", minimum=0.0),
    "weight_decay": Key(float, 0.0, "AdamW weight decay", minimum=0.0),
    "max_grad_norm": _engine_key("max_grad_norm", "clip gradients to this global norm; None: no clipping", minimum=0.0),
    "log_every": Key(int, 1, "print a log line every N steps", minimum=1),
    "model_path": Key(str, None, "directory or hub name to load the model from"),
    "data_path": Key(str, None, "dataset file or directory"),
    "checkpoint_dir": Key(str, None, "where training saves and inference loads checkpoints"),
    "output_dir": Key(str, None, "where plots and other outputs go"),
}
_SIZE_KEYS = {"tensor": "tensor_parallel_size", "pipeline": "pipeline_parallel_size", "data": "data_parallel_size"}


class Config(Mapping[str, Any]):
    """Read-only settings with attribute access: ``cfg.batch_size``, ``cfg["lr"]``, ``cfg.get("x", 0)``.

    Holds every schema key (defaults filled in); ``source`` is the file it came from, if any.
    """

    def __init__(self, values: Mapping[str, Any], source: str | None = None) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "source", source)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"config has no key {name!r}{_suggest(name, values)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"config is read-only (tried to set {name!r}); use cfg.replace({name}=...)")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def replace(self, **changes: Any) -> Config:
        """A copy with some keys changed (they must already exist; values are not re-validated)."""
        unknown = [k for k in changes if k not in self._values]
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r}{_suggest(unknown[0], self._values)}")
        return Config({**self._values, **changes}, self.source)

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"Config({body})"


def _suggest(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_name(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(t.__name__ for t in types)


def check_value(name: str, value: Any, key: Key, where: str = "config") -> Any:
    """Return ``value`` (floats widened, paths as str) if it fits ``key``, else raise ``ConfigError``."""
    if value is None:
        if key.default is None or key.optional:
            return None
        raise ConfigError(f"{where}: {name}=None, but {name} needs a {_type_name(key.type)}")
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if str in types and isinstance(value, os.PathLike):
        value = os.fspath(value)
    # bool is an int subclass, but `steps = True` is a mistake, not 1.
    bool_for_number = isinstance(value, bool) and bool not in types
    if object not in types and (bool_for_number or not isinstance(value, types)):
        raise ConfigError(
            f"{where}: {name}={value!r} has type {type(value).__name__}, expected {_type_name(key.type)}"
            + (f" ({name}: {key.help})" if key.help else "")
        )
    if key.choices is not None and value not in key.choices:
        options = ", ".join(repr(c) for c in key.choices)
        raise ConfigError(f"{where}: {name}={value!r} is not one of {options}")
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{where}: {name}={value!r} must be at least {key.minimum}")
    return value


def _normalize_extra(extra_keys: Mapping[str, Any] | None) -> dict[str, Key]:
    """Extra keys come as ``Key`` objects or as plain defaults (the type is the default's type)."""
    keys: dict[str, Key] = {}
    for name, spec in (extra_keys or {}).items():
        if name.startswith("_") or hasattr(Config, name) or name == "source":
            raise ConfigError(f"extra key {name!r} would hide Config.{name}; choose another name")
        if not isinstance(spec, Key):
            spec = Key(object if spec is None else type(spec), spec)
        keys[name.lower()] = spec
    return keys


def _expand_parallel(parallel: Any, where: str) -> dict[str, Any]:
    """ColossalAI's ``parallel = dict(tensor=dict(size=2, mode="1d"), pipeline=2, data=1)``."""
    if not isinstance(parallel, Mapping):
        raise ConfigError(f"{where}: parallel={parallel!r} must be a dict like dict(tensor=2, pipeline=1)")
    sizes: dict[str, Any] = {}
    for axis, spec in parallel.items():
        if axis not in _SIZE_KEYS:
            raise ConfigError(
                f"{where}: parallel has unknown axis {axis!r}{_suggest(axis, _SIZE_KEYS)}; "
                f"known: {', '.join(_SIZE_KEYS)}"
            )
        if isinstance(spec, Mapping):
            mode = spec.get("mode", "1d")
            if mode not in ("1d", None):
                raise ConfigError(f"{where}: parallel.{axis} mode={mode!r}: only '1d' tensor parallelism exists")
            extra = set(spec) - {"size", "mode"}
            if extra:
                raise ConfigError(f"{where}: parallel.{axis} has unknown entries {sorted(extra)}; use size=N")
            spec = spec.get("size", 1)
        sizes[_SIZE_KEYS[axis]] = spec
    return sizes


def _settings(namespace: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The module-level names of an executed config file that are settings, lower-cased."""
    found: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw, value in namespace.items():
        if raw.startswith("_") or inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value):
            continue
        name = raw.lower()
        if name in spelled:
            raise ConfigError(f"{where}: {spelled[name]!r} and {raw!r} are the same key; keep one")
        spelled[name] = raw
        found[name] = value
    if "parallel" in found:
        for name, size in _expand_parallel(found.pop("parallel"), where).items():
            if name in found:
                raise ConfigError(f"{where}: both parallel= and {name}= set the {name}; keep one")
            found[name] = size
    return found


def _check_settings(
    settings: Mapping[str, Any], schema: Mapping[str, Key], where: str, allow_unknown: bool
) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for name, value in settings.items():
        long = _ALIASES.get(name)
        if long is not None and name not in schema:
            if long in settings:
                raise ConfigError(f"{where}: both {name}= and {long}= are set; keep one")
            name = long
        key = schema.get(name)
        if key is not None:
            checked[name] = check_value(name, value, key, where)
        elif allow_unknown:
            checked[name] = value
        else:
            raise ConfigError(
                f"{where}: unknown key {name!r}{_suggest(name, schema)}\n  known keys: {', '.join(sorted(schema))}"
            )
    return checked


def build_config(
    settings: Mapping[str, Any],
    extra_keys: Mapping[str, Any] | None = None,
    *,
    source: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    allow_unknown: bool = False,
) -> Config:
    """Validate ``settings`` (then ``overrides``) against ``BASE_KEYS`` + ``extra_keys``; fill in defaults.

    With ``allow_unknown`` keys outside the schema are kept unchecked (the launcher uses this: it
    does not know an example's own keys, the example checks them).
    """
    schema = {**BASE_KEYS, **_normalize_extra(extra_keys)}
    values = {name: key.default for name, key in schema.items()}
    values.update(_check_settings(settings, schema, source or "config", allow_unknown))
    overrides = {k.lower(): v for k, v in (overrides or {}).items()}
    values.update(_check_settings(overrides, schema, "--set", allow_unknown))
    return Config(values, source)


def load_config(
    path: str | os.PathLike,
    extra_keys: Mapping[str, Any] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    allow_unknown: bool = False,
) -> Config:
    """Execute the Python file at ``path`` and return its settings as a validated ``Config``.

    ``extra_keys`` adds keys for one script: ``{"prompt": "Hello", "max_new_tokens": 20}`` (type
    taken from the default) or ``{"prompt": Key(str, "Hello", "text to continue")}``.
    ``overrides`` (e.g. from ``--set steps=2``) replace the file's values before validation.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found (working directory: {os.getcwd()})")
    try:
        namespace = runpy.run_path(path, run_name="__shardformer_config__")
    except SystemExit as exc:  # not an Exception: without this the launcher would exit silently
        raise ConfigError(
            f"{path}: the config file called sys.exit({exc.code!r}); a config file only sets values, "
            "remove the exit (or raise an error saying what is wrong)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any error in the user's file becomes one clear message
        raise ConfigError(f"{path}: could not execute the config file: {type(exc).__name__}: {exc}") from exc
    settings = _settings(namespace, path)
    return build_config(settings, extra_keys, source=path, overrides=overrides, allow_unknown=allow_unknown)
