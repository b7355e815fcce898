"""The docs site builds with `mkdocs build --strict` (what `make docs` runs): a broken link, a missing anchor
or an API reference that does not resolve fails the build; and a broken link does fail it (a site whose
check cannot fail would prove nothing). The dependency lists the docs give are pyproject.toml's."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(root))
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_docs_build_strict(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("shard_model") > 1


def test_a_broken_link_or_a_raw_sphinx_role_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy)
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "docs_hooks", copy / "docs_hooks")
    (copy / "docs" / "reference.md").write_text("# API reference\n")  # no package needed for this check
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    guide = copy / "docs" / "install.md"  # what a docstring written for Sphinx renders as
    guide.write_text(guide.read_text() + "\nBuilt by :class:`~shardformer.ParallelEngine`.\n")
    result = build(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr
    assert (
        "install.md shows a raw Sphinx role :class:<code>~shardformer.ParallelEngine" in result.stdout + result.stderr
    )


def _names(requirements) -> list[str]:
    return [Requirement(r).name for r in requirements]


def test_the_dependency_lists_are_pyprojects():
    """docs/install.md's table (and README's line on the hf extra) name what pyproject.toml installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {"(none)": _names(project["dependencies"])}
    wanted.update({f"`{extra}`": _names(reqs) for extra, reqs in project["optional-dependencies"].items()})
    section = (ROOT / "docs" / "install.md").read_text().split("## Dependencies", 1)[1]
    rows = re.findall(r"^\| (\(none\)|`[\w-]+`) \| ([^|]+) \|", section, re.M)
    listed = {extra: [name.strip() for name in names.split(",")] for extra, names in rows}
    assert listed == wanted, "docs/install.md's Dependencies table differs from pyproject.toml"
    line = re.search(r"`\[hf\]` adds ([\w, -]+?) \(", (ROOT / "README.md").read_text())
    assert line and re.split(r", | and ", line.group(1)) == wanted["`hf`"], "README's hf extra differs from pyproject"
