"""The releases shardformer was last tested on, and a warning when it runs on others.

``TESTED`` is the package's own record of the releases the test suite last passed with; the repository's
``constraints.txt`` pins the same ones for ``make test`` (tests/test_versions.py checks they agree).
pyproject.toml states ranges: a user may run any release in them.

transformers and timm ship every few weeks, and a release can change a tp plan, a forward or a helper a
route relies on. ``shard_model`` proves the cut it takes on a tiny copy before it cuts the user's model,
so a change that breaks a route gives a refusal, not a wrong number; the warning says that the releases
differ, once per process for each package and release. It fires at ``shard_model``, not at import: tools that import
shardformer without cutting a model (``shardformer plan``, ``--version``) have nothing to warn about.
Older releases than the tested ones are warned about too: the suite did not run on them either.
"""

from __future__ import annotations

import functools
import sys
import warnings

from packaging.version import InvalidVersion, Version

# The releases the suite passed with: keep equal to constraints.txt (move both together; docs/install.md:
# "Tested versions").
TESTED = {
    "torch": "2.14.1",
    "torchvision": "0.29.1",
    "transformers": "5.24.0",
    "timm": "1.0.31",
    "safetensors": "0.8.0",
    "accelerate": "1.15.0",
    "peft": "0.21.2",
    "trl": "1.13.0",
}

# The upstreams whose own code shardformer's routes read (plans, forwards, module layouts): a release
# of either other than the tested one gets the warning.
WATCHED = ("transformers", "timm")


class UntestedReleaseWarning(UserWarning):
    """shardformer runs on a transformers or timm release other than the one its suite passed with."""


def untested_release(name: str, installed: str) -> str | None:
    """Why ``installed`` (a release of ``name``) is not the tested one, or None when it is."""
    tested = TESTED[name]
    try:
        if Version(installed) == Version(tested):
            return None
        relation = "newer than the tested" if Version(installed) > Version(tested) else "older than the tested"
    except InvalidVersion:  # a local build with a version packaging cannot read
        relation = "not the tested"
    return (
        f"{name} {installed} is {relation} {tested}; shardformer proves each route on a tiny copy before use, so "
        f"results stay exact or refused; report problems with the output of `shardformer verify`, or install "
        f"the tested release (pip install {name}=={tested})"
    )


def warn_if_untested() -> None:
    """Warn (once per process and release) for each watched package that runs at an untested release.
    Reads the version of the imported module, which is the code that runs; a package not imported is
    not in use and gets no warning."""
    for name in WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            _warn_once(name, str(getattr(module, "__version__", "")))


@functools.cache
def _warn_once(name: str, installed: str) -> None:
    message = untested_release(name, installed)
    if message:
        warnings.warn(message, UntestedReleaseWarning, stacklevel=4)


def releases() -> tuple[tuple[str, str | None], ...]:
    """The releases of the code a proof runs (torch, transformers, timm where imported): part of every
    verdict's key, since a new release can change a plan, a forward or a helper."""
    return tuple((name, getattr(sys.modules.get(name), "__version__", None)) for name in ("torch", *WATCHED))
