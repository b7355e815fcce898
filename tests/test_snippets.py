"""Every ```python block in README.md and docs/ runs, so a snippet cannot go stale.

A block runs on 2 gloo ranks (as `shardformer run --nproc_per_node 2` would start it; `init_distributed()`
inside returns at once), all of them in one spawn, each in a fresh namespace and its own working folder.
A block preceded by `<!-- not-run: reason -->` is an illustration (a fragment, pseudo-code, a file of the
package) and is skipped; the reason must be given. Snippets build tiny models: no download.

A snippet also runs clean: a warning it prints on any rank (Python's warnings, or a library's log record at
WARNING or above) fails it, as warnings-as-errors would, unless tests/helpers.py's EXPECTED_WARNINGS lists it
with the reason it stays.
They are recorded rather than raised, so a rank's peers are not left waiting in a collective.
"""

import logging
import os
import re
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

from shardformer.tools.testing import run_on_ranks
from tests.helpers import unexpected_warnings

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


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"log {record.name}: {record.getMessage()}")


@contextmanager
def printed_warnings():
    """The warnings and WARNING log records the block emits, as the messages a user would see."""
    handler = _Records()
    # the root logger, and those that do not pass records up to it (transformers' own)
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values()
        if isinstance(logger, logging.Logger) and not logger.propagate
    ]  # fmt: skip
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield handler.messages
            handler.messages += [f"{w.category.__name__}: {w.message}" for w in caught]
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def run_snippets(snippets, base):
    """On each rank: run every snippet in order, recording what it warns; stop at the first failure (its
    peers would wait in a collective it never reaches) and report the rest as not reached."""
    import torch.distributed as dist

    results, failed = {}, False
    for name, code in snippets:
        if failed:
            results[name] = ("not reached: an earlier snippet failed", [])
            continue
        folder = os.path.join(base, re.sub(r"\W", "_", name))
        os.makedirs(folder, exist_ok=True)
        os.chdir(folder)
        dist.barrier()
        error = None
        with printed_warnings() as printed:
            try:
                exec(compile(code, name, "exec"), {"__name__": "__snippet__"})
            except Exception:
                error = traceback.format_exc()
                failed = True
        results[name] = (error, printed)
    return results


ALL = snippets()
RUN = [(name, code) for name, code, reason in ALL if reason is None]
cache = {}


def results(tmp_path_factory):
    """{snippet: (the first rank's error or None, what any rank warned)}"""
    if "r" not in cache:
        os.environ.setdefault("SHARDFORMER_TIMEOUT_S", "60")  # a rank that fails alone stops its peer soon
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as `shardformer run` sets it (accelerate warns if unset)
        base = str(tmp_path_factory.mktemp("snippets"))
        by_rank = run_on_ranks(run_snippets, 2, RUN, base, timeout=240)
        cache["r"] = {
            name: (by_rank[0][name][0] or by_rank[1][name][0], sorted({*by_rank[0][name][1], *by_rank[1][name][1]}))
            for name, _ in RUN
        }
    return cache["r"]


def test_the_illustrations_are_few():
    skipped = [name for name, _, reason in ALL if reason is not None]
    assert len(skipped) <= len(ALL) // 2, f"most snippets are marked not-run: {skipped}"


@pytest.mark.parametrize("name", [name for name, _ in RUN])
def test_snippet_runs(name, tmp_path_factory):
    error, _ = results(tmp_path_factory)[name]
    if error is not None:
        pytest.fail(f"{name} failed:\n{error}", pytrace=False)


@pytest.mark.parametrize("name", [name for name, _ in RUN])
def test_snippet_warns_nothing_unexpected(name, tmp_path_factory):
    error, printed = results(tmp_path_factory)[name]
    if error is None and unexpected_warnings(printed):
        pytest.fail(
            f"{name} warned (fix it, or list it in EXPECTED_WARNINGS with the reason):\n"
            + "\n".join(unexpected_warnings(printed))
        )
