"""The docs site builds with `mkdocs build --strict` (what `make docs` runs): a broken link, a missing anchor
or an API reference that does not resolve fails the build; and a broken link does fail it (a site whose
check cannot fail would prove nothing)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy)
    shutil.copytree(ROOT / "docs", copy / "docs")
    (copy / "docs" / "reference.md").write_text("# API reference\n")  # no package needed for this check
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    result = build(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr
