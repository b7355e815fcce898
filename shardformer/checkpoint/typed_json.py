"""JSON that gives back exactly what went in: int keys, tuples, Counters and sets survive.

Plain JSON turns ``{3: 1}`` into ``{"3": 1}`` and tuples into lists, so a resumed ``MultiStepLR``
(milestones are a ``Counter`` of ints) never decays. Here a value JSON cannot hold as itself is
written as ``{"$t": kind, "v": ...}``; a dict keeps plain JSON form only when its keys are all
strings and none is ``"$t"``. Anything else (a tensor, a function, an object) is refused on save,
naming where it sits, rather than written as something that loads back differently.
"""

from __future__ import annotations

import json
import os
from collections import Counter, OrderedDict

from shardformer.checkpoint.errors import CheckpointError

TAG = "$t"


def encode(value, where: str = "value"):
    """``value`` as plain JSON data (tagged where JSON alone would lose the type)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if type(value) in (int, float):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        data = [encode(v, f"{where}[{i}]") for i, v in enumerate(items)]
        return data if type(value) is list else {TAG: type(value).__name__, "v": data}
    if isinstance(value, dict):
        kind = {Counter: "Counter", OrderedDict: "OrderedDict", dict: "dict"}.get(type(value))
        if kind is None:
            raise CheckpointError(f"{where} is a {type(value).__name__}, which a checkpoint cannot store exactly")
        if kind == "dict" and all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        pairs = [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]
        return {TAG: kind, "v": pairs}
    raise CheckpointError(
        f"{where} holds {type(value).__name__} {value!r:.80}, which a checkpoint cannot store exactly; "
        "keep it to None, bool, int, float, str, list, tuple, set and dict"
    )


_SEQUENCES = {"tuple": tuple, "set": set, "frozenset": frozenset}
_MAPPINGS = {"dict": dict, "OrderedDict": OrderedDict, "Counter": Counter}


def decode(data):
    """The value `encode` was given."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if TAG not in data:
        return {k: decode(v) for k, v in data.items()}
    kind, items = data[TAG], data.get("v")
    if kind in _SEQUENCES and isinstance(items, list):
        return _SEQUENCES[kind](decode(v) for v in items)
    if kind in _MAPPINGS and isinstance(items, list) and all(isinstance(p, list) and len(p) == 2 for p in items):
        return _MAPPINGS[kind](dict((decode(k), decode(v)) for k, v in items))  # Counter(pairs) would count them
    raise ValueError(f"unknown tagged value {TAG}={kind!r}")


def dumps(value, where: str) -> bytes:
    return json.dumps(encode(value, where), indent=1, allow_nan=True).encode()


def _unreadable(file: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"{file}: not a readable checkpoint JSON file ({type(e).__name__}: {e})")


def decoded(data, file: str):
    """`decode`, with any damage reported naming the file."""
    try:
        return decode(data)
    except (ValueError, TypeError, RecursionError) as e:
        raise _unreadable(file, e) from None


def loads(raw: bytes, file: str, tagged: bool = True):
    """Decode a file's bytes (``tagged=False``: the plain JSON data, tags not decoded); any damage is
    reported naming the file."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError) as e:
        raise _unreadable(file, e) from None
    return decoded(data, file) if tagged else data


def load(file: str, tagged: bool = True):
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from None
    return loads(raw, file, tagged)


def write_atomic(file: str, data: bytes) -> None:
    """Write ``data`` to ``file`` through a temporary name and a rename, synced to disk first."""
    part = f"{file}.partial"
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, file)
