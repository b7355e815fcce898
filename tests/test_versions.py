"""The tested releases: constraints.txt (what `make test` installs) and shardformer.core.versions.TESTED (the
package's own record) agree, pyproject's ranges admit every pin, and shard_model warns once per process on a
transformers or timm release other than the tested one (the version seen is monkeypatched, not installed)."""

import re
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import timm  # noqa: F401 - imported: in use, so shard_model checks its release too
import transformers as tf
from packaging.requirements import Requirement

from shardformer import ShardConfig, shard_model
from shardformer.core.versions import TESTED, WATCHED, UntestedReleaseWarning

ROOT = Path(__file__).resolve().parents[1]


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: Jinja2 / jinja2, huggingface_hub / huggingface-hub


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            found[_name(name)] = version
    return found


def test_constraints_pin_the_releases_the_package_records_as_tested():
    pinned = pins()
    assert {name: pinned.get(_name(name)) for name in TESTED} == TESTED
    assert set(WATCHED) <= set(TESTED)
    assert "shardformer" not in pinned  # the package itself is the editable install, never pinned


def test_pyproject_ranges_admit_every_pin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pinned = pins()
    for requirement in requirements:
        version = pinned.get(_name(requirement.name))
        assert version is not None, f"{requirement.name} (pyproject.toml) has no pin in constraints.txt"
        assert requirement.specifier.contains(version, prereleases=True), (
            f"constraints.txt pins {requirement.name}=={version}, outside pyproject's {requirement}"
        )


def tiny_gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16))


def seen(monkeypatch, **versions):
    """The version shardformer sees: the imported module's own (transformers swaps the module object in
    sys.modules while it loads, so that one is patched, not a name bound at import)."""
    for name in WATCHED:
        monkeypatch.setattr(sys.modules[name], "__version__", versions.get(name, TESTED[name]))


def untested_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, UntestedReleaseWarning)]


def test_a_newer_transformers_is_warned_about_once_per_process(monkeypatch):
    seen(monkeypatch, transformers="5.99.0")
    first = untested_warnings(lambda: shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=1)))
    assert first == [
        f"transformers 5.99.0 is newer than the tested {TESTED['transformers']}; shardformer proves each route on "
        f"a tiny copy before use, so results stay exact or refused; report problems with the output of "
        f"`shardformer verify`, or install the tested release (pip install transformers=={TESTED['transformers']})"
    ]
    assert untested_warnings(lambda: shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=1))) == []


@pytest.mark.parametrize(
    "name, version, relation",
    [("timm", "1.0.99", "newer than the tested"), ("transformers", "5.0.1", "older than the tested")],
)
def test_other_untested_releases_are_named(monkeypatch, name, version, relation):
    seen(monkeypatch, **{name: version})
    (message,) = untested_warnings(lambda: shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=1)))
    assert message.startswith(f"{name} {version} is {relation} {TESTED[name]};")


def test_the_tested_releases_are_not_warned_about(monkeypatch):
    seen(monkeypatch)
    assert untested_warnings(lambda: shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=1))) == []
