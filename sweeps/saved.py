"""What a sweep writes: its rows as JSON lines while it runs (so that a stopped sweep resumes), then the
dated table and JSON it saves beside the others (``sweeps/<name>-<date>.md`` and ``.json``; the JSON is
what ``sweeps/matrix.py`` reads)."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable


def append_line(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")  # one write: a reader of a growing file sees whole lines only


def default_jsonl(sweep: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"sf-{sweep}-{time.strftime('%Y-%m-%d-%H%M')}.jsonl")


def resumed(jsonl: str, rows: list[dict], key: Callable[[dict], object]) -> tuple[list[dict], list[dict]]:
    """(the rows already in ``jsonl`` from an earlier, stopped run; ``rows`` less those, by ``key``): a
    stopped sweep loses at most the row it was on."""
    earlier = []
    if os.path.exists(jsonl):
        with open(jsonl) as f:
            earlier = [json.loads(line) for line in f if line.strip()]
    done = {key(r) for r in earlier}
    left = [r for r in rows if key(r) not in done]
    print(f"{len(left)} rows to check ({len(earlier)} already in {jsonl})", file=sys.stderr, flush=True)
    return earlier, left


def recorder(jsonl: str, show: Callable[[dict], None]) -> Callable[[dict], None]:
    """A ``progress`` for ``rows.run_rows``: ``show(row)``, then the row appended to ``jsonl``."""

    def record(row: dict) -> None:
        show(row)
        append_line(jsonl, row)

    return record


def write_sweep(path: str, sweep: dict) -> None:
    """A sweep as JSON with one row per line (diffs between sweeps stay readable)."""
    head = {k: v for k, v in sweep.items() if k != "rows"}
    rows = ",\n".join(json.dumps(r) for r in sweep["rows"])
    with open(path, "w") as f:
        f.write(json.dumps(head)[:-1] + ', "rows": [\n' + rows + "\n]}\n")


def save_sweep(folder: str, name: str, kind: str, text: str, head: dict, rows: list[dict]) -> str:
    """``text`` as ``folder/<name>-<date>.md`` and ``{"sweep": kind, "date", **head, "rows"}`` as the
    ``.json`` beside it; returns the path without its suffix."""
    date = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
    stem = os.path.join(folder, f"{name}-{date}")
    with open(stem + ".md", "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    write_sweep(stem + ".json", {"sweep": kind, "date": date, **head, "rows": rows})
    print(f"written: {stem}.md, {stem}.json", file=sys.stderr)
    return stem


def versions(*packages: str) -> dict[str, str]:
    """The installed releases of ``packages`` (a local build's ``+suffix`` dropped), for a sweep's head."""
    return {p: importlib.import_module(p).__version__.split("+")[0] for p in packages}
