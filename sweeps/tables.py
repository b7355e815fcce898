"""The conformance sweep's tables and saved results: one row per class (the verify, plan and pipeline
sweeps), or one row per class and a column per technique (the engine sweep)."""

from __future__ import annotations

import datetime
import sys

from sweeps.engine import layout_text
from sweeps.rows import NOT_APPLICABLE, NOT_TESTED, PASSED, RESULTS
from sweeps.saved import save_sweep, versions
from sweeps.zoo import TASKS

TASK_ORDER = {t: i for i, t in enumerate(TASKS)}


def _now() -> str:
    return f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (TASK_ORDER.get(r.get("task"), 99), r["kind"], r["model_type"], r["class"]))


def show(row: dict) -> None:
    """A finished row on one line of stderr, as the sweep goes."""
    print(
        f"{row.get('task', '')} {row['model_type']} {row['class']} {row.get('technique', '')} "
        f"{row.get('route', '')}: {row['result']} "
        f"({row.get('seconds', '-')} s) {row.get('reason', '')[:120]}",
        file=sys.stderr,
        flush=True,
    )


def table(results, impl, sequence_parallel=False, plan_sweep=False, pp=1) -> str:
    """The verify, plan or pipeline sweep's table, then its counts per task."""
    what = "plan sweep (causal LMs with a tp plan, from_pretrained, train mode)" if plan_sweep else "verify sweep"
    if pp > 1:
        what = "ParallelEngine sweep (2 SGD steps; 'max grad err' column: largest weight error after them)"
    size = f"pp={pp}" if pp > 1 else "tp=2"
    lines = [
        f"conformance at {size}{' with sequence parallelism' if sequence_parallel else ''}, {impl} attention, "
        f"{what}, transformers {versions('transformers')['transformers']}, {_now()}",
        "",
        "| task | architecture | class | kind | route | result | max logits err | max grad err | generate | reason "
        "| s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    results = _sorted(results)
    for r in results:
        errors = [f"{r[k]:.1e}" if isinstance(r.get(k), float) else "" for k in ("logits", "grad")]
        generate = {True: "equal", False: "differs"}.get(r.get("generate_equal"), "")
        reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r.get('task', '')} | {r['model_type']} | {r['class']} | {r['kind']} | {r.get('route', '')} "
            f"| {r['result']} | {errors[0]} | {errors[1]} | {generate} | {reason} | {r.get('seconds', '')} |"
        )
    lines.append("")

    def counts(rows):
        c = {k: sum(r["result"] == k for r in rows) for k in RESULTS}
        return f"{len(rows)} classes: " + ", ".join(f"{v} {k}" for k, v in c.items())

    for task in sorted({r.get("task", "") for r in results}, key=lambda t: TASK_ORDER.get(t, 99)):
        rows = [r for r in results if r.get("task", "") == task]
        kinds = [k for k in ("dense", "moe") if any(r["kind"] == k for r in rows)]
        by_kind = "; ".join(f"{k}: {counts([r for r in rows if r['kind'] == k])}" for k in kinds)
        lines.append(f"- {task}: {counts(rows)}" + (f" ({by_kind})" if len(kinds) > 1 else ""))
    lines.append(f"\ntotal: {counts(results)}")
    return "\n".join(lines)


def engine_table(rows: list[dict], techniques: list[str]) -> str:
    """The engine sweep's table: one row per class, one column per technique, then the reason of every
    cell that did not pass."""
    layouts = "; ".join(f"{t}: {layout_text(t)}" for t in techniques)
    lines = [
        f"conformance of ParallelEngine layouts on 2 ranks, eager attention, engine sweep (2 SGD steps against the "
        f"unsharded copy: losses and every weight), transformers {versions('transformers')['transformers']}, "
        f"{_now()}",
        "",
        f"layouts (EngineConfig): {layouts}",
        "",
        "| task | architecture | class | kind | " + " | ".join(techniques) + " | s |",
        "|---|---|---|---|" + "---|" * len(techniques) + "---|",
    ]
    rows = _sorted(rows)
    notes = []
    for r in rows:
        cells = []
        for t in techniques:
            cell = r["techniques"].get(t, {"result": ""})
            cells.append(cell["result"])
            if cell["result"] not in (PASSED, NOT_APPLICABLE, NOT_TESTED, ""):
                notes.append(f"- {r['class']} {t}: {cell['result']}: {cell.get('reason', '')}")
        seconds = sum(c.get("seconds") or 0 for c in r["techniques"].values())
        lines.append(
            f"| {r['task']} | {r['model_type']} | {r['class']} | {r['kind']} | {' | '.join(cells)} | {seconds:.1f} |"
        )
    lines += ["", "Cells that did not pass (not tested: no tiny copy of the class runs unsharded):", "", *notes, ""]
    for t in techniques:
        cells = [r["techniques"][t] for r in rows if t in r["techniques"]]
        counts = {k: sum(c["result"] == k for c in cells) for k in (*RESULTS, NOT_APPLICABLE)}
        lines.append(
            f"- {t}: {len(cells)} classes: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v or k in RESULTS)
        )
    return "\n".join(lines)


def save_engine(folder: str, text: str, rows: list[dict], techniques: list[str], sample: str = "") -> str:
    """The engine sweep's table and rows as ``conformance-engine-<date>.md`` / ``.json``; ``sample``: how
    its classes were chosen, where a sample (``--per-task``)."""
    head = versions("transformers", "torch") | {
        "attention": "eager", "techniques": techniques, "layouts": {t: layout_text(t) for t in techniques},
    } | ({"sample": sample} if sample else {})  # fmt: skip
    return save_sweep(folder, "conformance-engine", "engine", text, head, rows)


def save(folder, text, results, impl, sequence_parallel, plan_sweep, pp=1) -> str:
    """The table as ``conformance[-plan][-sdpa][-sp][-ppN]-<date>.md`` and the rows with the sweep's
    settings, date and versions as the ``.json`` beside it; returns the path without its suffix."""
    tags = ("-plan" if plan_sweep else "") + ("-sdpa" if impl == "sdpa" else "") + ("-sp" if sequence_parallel else "")
    tags += f"-pp{pp}" if pp > 1 else ""
    kind = "pipeline" if pp > 1 else "plan" if plan_sweep else "verify"
    head = versions("transformers", "torch") | {
        "tp": 1 if pp > 1 else 2, "pp": pp, "attention": impl, "sequence_parallel": sequence_parallel,
    }  # fmt: skip
    return save_sweep(folder, f"conformance{tags}", kind, text, head, results)
