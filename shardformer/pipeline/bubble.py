"""The pipeline bubble: the fraction of a step a rank sits idle, from a formula or from a schedule's actions.

`bubble_fraction` is the textbook figure for equal stages (``pp`` ranks, ``m`` micro-batches,
``V`` chunks per rank) that ``shardformer plan`` reports. `simulate` replays a schedule's
per-rank action lists (``(stage, kind, micro-batch)``, kind ``F``, ``B`` (whole backward), ``I``
(input part), ``W`` (weight part)) with given costs, each action as soon as its rank is free and its
input exists, and returns every rank's idle fraction of the step; the schedule benchmark
(``benchmarks/pipeline_schedules.py``) compares it with what it times.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

from shardformer.core.config import SCHEDULES
from shardformer.pipeline.schedule import order
from shardformer.pipeline.torch_schedule import MULTI_SCHEDULES
from shardformer.pipeline.virtual import PLACEMENT, check_virtual, chunk_ranks

# Costs of the actions: a backward is twice a forward. ZBV and DualPipeV split it into equal input and
# weight halves, or, where gradient hooks must run (tp, cp, ZeRO-3, checkpointing), run the whole
# backward in their input step and leave the weight step empty (shardformer.pipeline.torch_schedule).
SPLIT_BACKWARD = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
WHOLE_BACKWARD = {"F": 1.0, "B": 2.0, "I": 2.0, "W": 0.0}


def bubble_fraction(schedule: str, pp: int, num_microbatches: int, chunks_per_rank: int = 1) -> float:
    """Idle fraction of a step for equal stages, no communication: ``(pp-1) / (V*m + pp-1)``, with
    ``V`` chunks per rank (1 for GPipe and 1F1B, whose bubbles are the same). For the V-shaped ZBV and
    DualPipeV (2 chunks) this is the bound with the whole backward in the input step; their split
    backward fills most of it (``benchmarks/pipeline_schedules.py`` counts both)."""
    if pp <= 1:
        return 0.0
    v = chunks_per_rank if schedule == "interleaved_1f1b" else 2 if schedule in ("zbv", "dualpipev") else 1
    return (pp - 1) / (v * num_microbatches + pp - 1)


def simulate(
    order: dict[int, Iterable[tuple[int, str, int]]], cost: dict[str, float] = SPLIT_BACKWARD
) -> dict[int, float]:
    """Every rank's idle fraction of the step when it runs ``order[rank]`` in turn (see the module doc)."""
    busy, step = replay(order, cost)
    return {rank: 1.0 - busy[rank] / step for rank in busy}


def replay(
    order: dict[int, Iterable[tuple[int, str, int]]], cost: dict[str, float] = SPLIT_BACKWARD
) -> tuple[dict[int, float], float]:
    """Each rank's busy time and the step's length when it runs ``order[rank]`` in turn, each action as
    soon as its rank is free and its input exists."""
    todo = {rank: list(actions) for rank, actions in order.items()}
    last_stage = max(s for actions in todo.values() for s, _, _ in actions)
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B" | "W", stage, micro-batch) -> end time
    free = dict.fromkeys(todo, 0.0)
    busy = dict.fromkeys(todo, 0.0)

    def needs(stage, kind, mb):
        if kind == "F":
            return ("F", stage - 1, mb) if stage > 0 else None
        if kind == "W":
            return ("B", stage, mb)
        return ("B", stage + 1, mb) if stage < last_stage else ("F", stage, mb)

    while any(todo.values()):
        progressed = False
        for rank, actions in todo.items():
            while actions:
                stage, kind, mb = actions[0]
                need = needs(stage, kind, mb)
                if need is not None and need not in done:
                    break
                start = max(free[rank], done[need] if need is not None else 0.0)
                free[rank] = start + cost[kind]
                busy[rank] += cost[kind]
                done[("B" if kind == "I" else kind, stage, mb)] = free[rank]
                actions.pop(0)
                progressed = True
        if not progressed:
            raise ValueError(f"the schedule waits forever: next actions {[a[:1] for a in todo.values() if a]}")
    return busy, max(free.values())


def schedule_actions(schedule: str, pp: int, num_microbatches: int, chunks_per_rank: int = 1) -> dict:
    """``{rank: [(stage, kind, micro-batch), ...]}``: the compute actions each pp rank runs, in order.
    GPipe and 1F1B: the order both backends run (`shardformer.pipeline.schedule.order`); the virtual
    schedules: the ``pipeline_order`` torch.distributed.pipelining's own class computes (read from an
    instance built on stand-in stages: it needs only their places, and no process group), so the
    bubble counted is the one of the schedule that runs."""
    if schedule in SCHEDULES:
        return {r: [(r, kind, i) for kind, i in order(schedule, num_microbatches, r, pp)] for r in range(pp)}
    total = pp * chunks_per_rank
    places = chunk_ranks(PLACEMENT[schedule], pp, total)
    stand_ins = [
        SimpleNamespace(group_size=pp, group_rank=0, stage_index=c, num_stages=total, is_first=c == 0,
                        is_last=c == total - 1, submod=None, stage_index_to_group_rank={})
        for c in range(total) if places[c] == 0
    ]  # fmt: skip
    built = MULTI_SCHEDULES[schedule](stand_ins, num_microbatches)
    out = {}
    for rank, actions in built.pipeline_order.items():
        flat = [sub for a in actions if a is not None for sub in (a.sub_actions or [a])]
        kinds = [(sub.stage_index, sub.computation_type.value, sub.microbatch_index) for sub in flat]
        out[rank] = [a for a in kinds if a[1] in ("F", "B", "I", "W")]
    return out


def bubble_report(schedule: str, pp: int, num_microbatches: int, chunks_per_rank: int, num_layers: int) -> str:
    """The line ``shardformer plan`` prints for a pipeline job: the schedule's bubble (its checks first)."""

    if chunks_per_rank > 1:
        check_virtual(schedule, pp, chunks_per_rank, num_microbatches, num_layers)
    fraction = bubble_fraction(schedule, pp, num_microbatches, chunks_per_rank)
    chunks = f", {chunks_per_rank} chunks per rank" if chunks_per_rank > 1 else ""
    split = (
        " with the whole backward; the split backward (tp=1, ZeRO-1/2) fills most of it"
        if chunks_per_rank == 2 and schedule in ("zbv", "dualpipev")
        else ""
    )
    return (
        f"pipeline bubble: {fraction:.1%} of each step idle per rank ({schedule}{chunks}, {num_microbatches} "
        f"micro-batch(es): (pp-1) / (chunks*m + pp-1) for equal stages{split}; more micro-batches or chunks "
        f"shrink it)"
    )
