"""Every ```python block in README.md and docs/ runs, so a snippet cannot go stale.

A block runs on 2 gloo ranks (as `shardformer run --nproc_per_node 2` would start it; `init_distributed()`
inside returns at once), all of them in one spawn, each in a fresh namespace and its own working folder.
A block preceded by `<!-- not-run: reason -->` is an illustration (a fragment, pseudo-code, a file of the
package) and is skipped; the reason must be given. Snippets build tiny models: no download.
"""

import os
import re
import traceback
from pathlib import Path

import pytest

from shardformer.tools.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- not-run: (?P<reason>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def snippets():
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start("code")].count("\n")
            name = f"{page.relative_to(ROOT)}:{line}"
            reason = match.group("reason")
            assert reason is None or reason.strip(), f"{name}: a not-run marker needs its reason"
            found.append((name, match.group("code"), reason))
    return found


def run_snippets(snippets, base):
    """On each rank: run every snippet in order; stop at the first failure (its peers would wait in a
    collective it never reaches) and report the rest as not reached."""
    import torch.distributed as dist

    results, failed = {}, False
    for name, code in snippets:
        if failed:
            results[name] = "not reached: an earlier snippet failed"
            continue
        folder = os.path.join(base, re.sub(r"\W", "_", name))
        os.makedirs(folder, exist_ok=True)
        os.chdir(folder)
        dist.barrier()
        try:
            exec(compile(code, name, "exec"), {"__name__": "__snippet__"})
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
            failed = True
    return results


ALL = snippets()
RUN = [(name, code) for name, code, reason in ALL if reason is None]
cache = {}


def results(tmp_path_factory):
    if "r" not in cache:
        os.environ.setdefault("SHARDFORMER_TIMEOUT_S", "60")  # a rank that fails alone stops its peer soon
        base = str(tmp_path_factory.mktemp("snippets"))
        by_rank = run_on_ranks(run_snippets, 2, RUN, base, timeout=240)
        cache["r"] = {name: by_rank[0][name] or by_rank[1][name] for name, _ in RUN}
    return cache["r"]


def test_the_illustrations_are_few():
    skipped = [name for name, _, reason in ALL if reason is not None]
    assert len(skipped) <= len(ALL) // 2, f"most snippets are marked not-run: {skipped}"


@pytest.mark.parametrize("name", [name for name, _ in RUN])
def test_snippet_runs(name, tmp_path_factory):
    error = results(tmp_path_factory)[name]
    if error is not None:
        pytest.fail(f"{name} failed:\n{error}", pytrace=False)
