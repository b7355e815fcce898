"""What ``shardformer verify`` reports, and the pieces its tp-only and pipeline runs share.

`shardformer.tools.verify` (tp) and `shardformer.tools.verify_pipeline` (tp x pp) both
import this module; neither imports the other's internals.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from shardformer.core.compare import ParamDiff
from shardformer.core.divergence import Divergence, first_tensor  # noqa: F401 - re-exported
from shardformer.core.record import sharding_of

LR = 0.1  # the one SGD step both runs compare


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    error: float | None = None  # the largest difference, where the check measures one


# float32 rounding shrinks by ~5e8 in float64 (the ratio of their epsilons); a wrong cut does not shrink
# at all. Rounding amplified differently by the two runs still shrinks by far more than this.
ROUNDING_SHRINK = 1e-4


@dataclass
class VerifyReport:
    model: str
    policy: str
    tp: int
    checks: list[Check] = field(default_factory=list)
    pp: int = 1
    divergence: Divergence | None = None
    error: str | None = None  # sharding refused or a step failed
    training: bool = False  # checked in training mode, dropout 0: its backward refuses eval mode (Reformer)
    # the unsharded model's outputs after its step, kept on the rank only to measure its own rounding
    reference_after_step: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.checks)

    def format(self) -> str:
        layout = f"tp={self.tp}" + (f" x pp={self.pp}" if self.pp > 1 else "")
        lines = [
            f"shardformer verify: {self.model} with {self.policy} at {layout} ({self.tp * self.pp} gloo processes)"
        ]
        if self.training:
            lines.append("  (in training mode with dropout 0: its backward refuses eval mode)")
        lines += [f"  {'ok  ' if c.ok else 'FAIL'}  {c.name:<20} {c.detail}" for c in self.checks]
        if self.divergence is not None:
            lines.append(f"first diverging module: {self.divergence}")
        if self.error is not None:
            lines.append(f"error: {self.error}")
        lines.append("PASSED" if self.ok else "FAILED")
        return "\n".join(lines)


def merge_reports(reports: list[VerifyReport]) -> VerifyReport:
    """One report for all ranks: a check passes where it passed on every rank (pipeline stages hold
    different weights); the first failing rank's detail is kept."""
    merged = copy.deepcopy(reports[0])
    for rank, report in enumerate(reports[1:], start=1):
        if merged.error is None and report.error is not None:
            merged.error = f"rank {rank}: {report.error}"
        mine = {c.name: c for c in merged.checks}
        for check in report.checks:
            if check.name not in mine:
                merged.checks.append(check)
            elif mine[check.name].ok and not check.ok:
                mine[check.name].ok, mine[check.name].detail = False, f"rank {rank}: {check.detail}"
        merged.divergence = merged.divergence or report.divergence
    return merged


def excuse_rounding(report: VerifyReport, exact: VerifyReport) -> None:
    """Where ``exact`` (the same comparison in float64) passes every check and each of ``report``'s
    failing checks shrank there by ``ROUNDING_SHRINK`` or more, those failures were float32 rounding:
    they pass, their detail naming both runs, and a "float64 rerun" check records it. The outputs after the
    step, failing alone, also pass within the unsharded model's own float32-vs-float64 gap there (a model
    that computes parts in float32 whatever its dtype gains nothing from float64, and an SGD step on large
    gradients amplifies rounding past the step's tolerance). Otherwise ``report`` stays as it is (and says
    what the float64 run found)."""
    failing = [c for c in report.checks if not c.ok]
    noise = _own_rounding(report, exact)
    exact_checks = {c.name: c for c in exact.checks}

    def shrank(check: Check) -> bool:
        again = exact_checks.get(check.name)
        if again is None or not again.ok:
            return False
        if check.error is None or again.error is None:  # greedy tokens: equal in float64 is enough
            return check.name == "greedy generate"
        return again.error <= check.error * ROUNDING_SHRINK

    if exact.ok and failing and all(shrank(c) for c in failing):
        for check in failing:
            check.ok = True
            check.detail += f" in float32; {exact_checks[check.name].detail} in float64: rounding, not the cut"
        report.checks.append(Check("float64 rerun", True, f"{len(exact.checks)} checks pass in float64"))
        report.divergence = None
    elif [c.name for c in failing] == ["outputs after step"] and 0 < (failing[0].error or 0) <= noise:
        failing[0].ok = True
        failing[0].detail += (
            f" in float32, within the model's own float32 rounding: its unsharded float32 run differs from its "
            f"float64 run by {noise:.2g} after the same step"
        )
        report.checks.append(Check("float64 rerun", True, "the unsharded model's own rounding after the step"))
    elif exact.error is not None:
        report.checks.append(Check("float64 rerun", True, f"did not run: {exact.error}"))
    else:
        detail = "; ".join(f"{c.name}: {c.detail}" for c in exact.checks if c.name in {f.name for f in failing})
        report.checks.append(
            Check(
                "float64 rerun",
                True,
                f"not excused: in float64 {detail or 'another check fails'} (a wrong cut, or a part that rounds "
                "below float64 even where float32 casts are raised, as a cast to bfloat16 does)",
            )
        )


def _own_rounding(report: VerifyReport, exact: VerifyReport) -> float:
    """How far the unsharded model's outputs after its step lie from its float64 self's."""
    ours, exact_ref = report.reference_after_step, exact.reference_after_step
    if ours is None or exact_ref is None or ours.shape != exact_ref.shape:
        return 0.0
    return (ours.double() - exact_ref.double()).abs().max().item()


def params_check(name: str, diffs: list[ParamDiff], grads: bool, where: str = "") -> Check:
    """A check over `shardformer.core.compare.compare_params`' result: the first mismatch if
    any, else the count and the largest difference. ``where`` (" on stage 1") follows the count."""
    compared = [d for d in diffs if d.only_in is None]
    bad = next((d for d in diffs if not d.ok), None)
    if bad is not None:
        what = f"max |diff| {bad.error:.3g}"
        if bad.only_in is not None:
            what = f"{'gradient ' if grads else ''}present in only one model"
        return Check(name, False, f"first mismatch {bad.name}: {what} ({len(compared)} compared{where})", bad.error)
    worst, worst_name = 0.0, "-"
    for d in compared:
        if d.error > worst:
            worst, worst_name = d.error, d.name
    return Check(name, True, f"{len(compared)} parameters{where}, max |diff| {worst:.2g} ({worst_name})", worst)


def broadcast_weights(model: nn.Module) -> None:
    """Rank 0's weights everywhere, whatever the model's init did with the RNG."""
    with torch.no_grad():
        for t in list(model.state_dict(keep_vars=True).values()):
            if torch.is_tensor(t):
                dist.broadcast(t.data, src=0)


def route_name(model) -> str:
    """How the report names what cut ``model``: the policy class and, for an automatic route, the route."""
    info = sharding_of(model)
    proven = ", proven on a tiny copy" if info.proven else ""
    return f"{type(info.policy).__name__} ({info.route} route{proven})"
