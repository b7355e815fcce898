"""The tp=2 checks of a row: what ``shardformer verify`` runs (the verify sweep, config flips, timm), and
the plan sweep's ``from_pretrained`` comparison in training mode (``shardformer.tools.pair_check``)."""

from __future__ import annotations

import functools
import re

from sweeps.rows import ERROR, FAILED, NOT_TESTED, PASSED, REFUSED, NotTested, reason_first, set_reason
from sweeps.zoo import build_tiny, tiny_config_of


def _max_diff(detail: str) -> float | None:
    m = re.search(r"max \|diff\| ([-+0-9.einfa]+)", detail)
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


def classify(row: dict, report) -> None:
    """Fill ``row`` from a merged VerifyReport: route, result, reason, max errors, the checks."""
    row["route"] = report.policy
    row["checks"] = [[c.name, c.ok, c.detail] for c in report.checks]
    checks = {c.name: c for c in report.checks}
    if "forward outputs" in checks:
        row["logits"] = _max_diff(checks["forward outputs"].detail)
    if "gradients" in checks:
        row["grad"] = _max_diff(checks["gradients"].detail)
    if "greedy generate" in checks:
        row["generate_equal"] = checks["greedy generate"].ok
    bad = [c for c in report.checks if not c.ok]
    error = report.error or ""
    if "sharding refused: " in error:
        set_reason(row, REFUSED, reason_first(error.split("sharding refused: ", 1)[1]))
    elif bad:
        reason = "; ".join(f"{c.name}: {c.detail}" for c in bad)
        if report.divergence is not None:
            reason += f"; first diverging module: {report.divergence}"
        if error:
            reason += f"; then {error}"
        set_reason(row, FAILED, reason, 400)
    elif error:
        set_reason(row, ERROR, error, 300)
    else:
        row.update(result=PASSED, reason="")


def verify(row: dict, build) -> None:
    """What ``shardformer verify`` runs on the model ``build()`` makes, at tp = the group size; fills ``row``."""
    import torch.distributed as dist

    from shardformer.tools.verify import verify_on_this_rank
    from shardformer.tools.verify_report import merge_reports

    report = verify_on_this_rank(build)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    classify(row, merge_reports(reports))


def verify_row(row: dict) -> None:
    """The verify sweep's check: the row's tiny class (with its ``flip``) through :func:`verify`."""
    verify(row, functools.partial(build_tiny, row["class"], row.get("flip")))


def plan_row(row: dict, impl: str, sequence_parallel: bool = False) -> None:
    """The plan sweep's check: ``tools.pair_check.compare`` on the row's causal LM (saved and reloaded with
    ``from_pretrained``, compared in training mode), with ``impl`` attention."""
    import transformers as tf

    from shardformer.tools.pair_check import NotTestedError, RefusedError, compare

    try:
        config = tiny_config_of(row["class"])  # the verify sweep's recipe: a tiny copy that runs
    except Exception as e:  # noqa: BLE001 - a config we cannot scale down is reported, not fatal
        raise NotTested(f"no tiny copy that runs: {type(e).__name__}: {e}") from e
    try:
        r = compare(getattr(tf, row["class"]), config, impl, sequence_parallel=sequence_parallel)
    except NotTestedError as e:
        set_reason(row, NOT_TESTED, str(e), 300)
        return
    except RefusedError as e:
        set_reason(row, REFUSED, str(e), 300)
        return
    row.update(
        result=PASSED if not r.failures else FAILED,
        logits=r.logits,
        loss=r.loss,
        grad=r.grad,
        generate_equal=r.generate_equal,
        vocab_parallel=r.vocab_parallel_logits,
        reason="; ".join(r.failures[:3]),
    )
