"""Will the job fit? Bytes per rank of every pipeline stage against the GPU's memory.

``shardformer plan --gpu-memory 80GB`` adds up, for one rank of each pipeline stage: the model state
(`shardformer.tools.plan.model_state_bytes`: parameters, gradients, ZeRO's buffers, Adam and
the fp32 master, by ZeRO stage and precision), the activations the stage keeps at the given
micro-batch (`shardformer.tools.activation_estimate`, or measured on the real sharded stage
under ``--simulate``) times the micro-batches it has in flight, with and without activation
checkpointing, and the communication buffers this library allocates. It answers yes or no for the
fullest stage, with the headroom. Not counted: the CUDA context, NCCL's internal buffers and the
allocator's fragmentation; leave headroom for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shardformer.data_parallel.optimizer import DEFAULT_BUCKET_SIZE
from shardformer.tools.activation_estimate import estimate_activations
from shardformer.tools.plan import BYTES, Plan

GIB = 2**30
UNITS = {"": GIB, "k": 2**10, "m": 2**20, "g": GIB, "t": 2**40}  # GB and GiB alike, as GPU makers count
ZERO_IN_FLIGHT = 2  # ZeRO-1/2 buckets reduced or all-gathered at once (data_parallel.reducer)


def parse_memory(text: str) -> int:
    """``"80GB"``, ``"80GiB"``, ``"80g"``, ``"81920MiB"`` or ``"80"`` (GiB) -> bytes. GB means 2**30
    bytes here, as an "80 GB" GPU is counted."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"--gpu-memory {text!r} is not a memory size; write e.g. 80GB, 80GiB or 81920MiB")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def in_flight(stage: int, pp: int, microbatches: int, schedule: str) -> int:
    """Micro-batches whose activations a stage holds at once: all of them under GPipe; under 1F1B
    the first stage's warm-up forwards plus one (pipeline.schedule), fewer down the pipeline."""
    return min(pp - stage, microbatches) if schedule == "1f1b" else microbatches  # others: at most all of them


@dataclass
class StageFit:
    """One rank of one pipeline stage: bytes by part. ``activations``: variant -> bytes (empty: none known)."""

    stage: int
    layers: range
    numel: int
    state: dict[str, int]
    in_flight: int
    activations: dict[str, int] = field(default_factory=dict)
    comm: dict[str, int] = field(default_factory=dict)
    measured: bool = False  # state and plain activations read from a simulated rank

    def total(self, variant: str | None) -> int:
        act = self.activations[variant] if variant else 0
        return sum(self.state.values()) + act + sum(self.comm.values())


def variants(tp: int) -> dict[str, dict]:
    """The activation variants shown: checkpointing or not, and with sequence parallelism when tp > 1."""
    out = {"no checkpointing": {}, "activation checkpointing": {"checkpointing": True}}
    if tp > 1:
        out["sequence parallel"] = {"sequence_parallel": True}
        out["sequence parallel + checkpointing"] = {"sequence_parallel": True, "checkpointing": True}
    return out


def comm_buffers(plan: Plan, first: bool, last: bool, in_flight_: int, batch: int, seq: int, hidden: int) -> dict:
    """Buffers the library allocates to communicate: pipeline sends and receives (each micro-batch in
    flight keeps its received input and sent output until its backward, plus one gradient), and
    ZeRO-1/2's buckets in flight (fp32, at least one parameter each). ZeRO-3's gathered layers are in
    the model state."""
    out = {}
    if plan.pp > 1 and batch and hidden:  # hidden unknown (no transformers config): activations are unknown too
        act = batch * seq * hidden * BYTES[plan.precision]
        out["pipeline send/receive"] = in_flight_ * act * ((not first) + (not last)) + act
    if plan.zero in (1, 2) and plan.dp_shard > 1:
        bucket = max(DEFAULT_BUCKET_SIZE, -(-plan.largest_param // plan.dp_shard) * plan.dp_shard)
        out["ZeRO buckets in flight (fp32)"] = ZERO_IN_FLIGHT * 4 * bucket
    return out


def plan_stages(
    plan: Plan, config, batch: int | None, seq: int | None, microbatches: int = 1, schedule: str = "1f1b",
    device: str = "cpu",
) -> tuple[list[StageFit], str | None]:  # fmt: skip
    """Every stage's bytes from the plan's formula; the second value says why activations are missing."""
    layers_total = _num_layers(config)
    stages = plan.stages or [(range(layers_total), plan.rank_numel)]
    estimates, missing = {}, None
    if batch is not None:
        options = dict(dtype_bytes=BYTES[plan.precision], device=device)
        options.update(context_parallel_size=plan.cp, context_parallel_mode=plan.cp_mode)
        try:
            for name, extra in variants(plan.tp).items():
                estimates[name] = estimate_activations(config, batch, seq, plan.tp, **options, **extra)
        except NotImplementedError as e:
            estimates, missing = {}, str(e)
    else:
        missing = "give --batch and --seq to count activations"
    out = []
    for s, (layers, numel) in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        flight = in_flight(s, plan.pp, microbatches, schedule)
        fit = StageFit(s, layers, numel, plan.bytes_per_rank(numel), flight)
        for name, est in estimates.items():
            fit.activations[name] = est.stage(len(layers), first, last, flight)
        hidden = getattr(config, "hidden_size", None)
        fit.comm = comm_buffers(plan, first, last, flight, batch or 0, seq or 0, hidden)
        out.append(fit)
    return out, missing


def _num_layers(config) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return 0


def format_fit(stages: list[StageFit], gpu_memory: int, gpus: int, header: str, missing: str | None) -> str:
    gib = lambda b: f"{b / GIB:,.2f}"  # noqa: E731
    names = [f"stage {f.stage}" if len(stages) > 1 else "rank" for f in stages]
    width = max(12, *(len(n) + 2 for n in names))
    row = lambda label, values: f"  {label:<46}" + "".join(f"{v:>{width}}" for v in values)  # noqa: E731
    source = "formula"
    if stages[0].measured:
        source = "model state and plain activations measured on simulated ranks, the other activations by formula"
    lines = [header, f"per rank, GiB ({source}):"]
    lines.append(row("", names))
    if len(stages) > 1:
        lines.append(row("layers", [f"{f.layers.start}..{f.layers.stop - 1}" for f in stages]))
        lines.append(row("micro-batches in flight", [str(f.in_flight) for f in stages]))
    for part in dict.fromkeys(k for f in stages for k in f.state):
        lines.append(row(part, [gib(f.state.get(part, 0)) for f in stages]))
    for part in dict.fromkeys(k for f in stages for k in f.comm):
        lines.append(row(part, [gib(f.comm.get(part, 0)) for f in stages]))
    kinds = list(dict.fromkeys(k for f in stages for k in f.activations))
    for kind in kinds:
        lines.append(row(f"activations, {kind}", [gib(f.activations[kind]) for f in stages]))
    for kind in kinds or [None]:
        lines.append(row(f"total, {kind}" if kind else "total (no activations)", [gib(f.total(kind)) for f in stages]))
    lines += ["", f"fits on {gpus} x {gpu_memory / GIB:,.1f} GiB?"]
    for kind in kinds or [None]:
        totals = [f.total(kind) for f in stages]
        label = kind or "model state and buffers only"
        worst = max(range(len(stages)), key=lambda i: totals[i])
        where = f" on {names[worst]}" if len(stages) > 1 else ""
        spare = gpu_memory - totals[worst]
        if spare >= 0:
            lines.append(
                f"  {label}: yes, {totals[worst] / GIB:,.2f} GiB{where}, headroom {spare / GIB:,.2f} GiB "
                f"({spare / gpu_memory:.0%})"
            )
        else:
            lines.append(f"  {label}: no, needs {totals[worst] / GIB:,.2f} GiB{where}, {-spare / GIB:,.2f} GiB over")
    if missing:
        lines.append(f"  (activations not counted: {missing})")
    lines.append("  not counted: the CUDA context, NCCL's own buffers and allocator fragmentation; leave room for them")
    return "\n".join(lines)


def simulated_stages(
    job, batch: int | None, seq: int | None, microbatches: int = 1, schedule: str = "1f1b", device: str = "cpu"
) -> tuple[list[StageFit], str | None]:
    """The simulated ranks' bytes (``tools.simulate``): model state read from each built rank, the plain
    activations measured in its forward (given ``batch`` and ``seq``); the checkpointed and
    sequence-parallel variants from the formula at the rank's layers."""
    formula, missing = plan_stages(job.plan, job.config, batch, seq, microbatches, schedule, device)
    out = []
    for r in job.ranks:
        stage = r.coords[0]
        fit = formula[stage]
        fit.state, fit.numel, fit.measured = {**r.measured, **r.formula_only}, r.numel, True
        if batch is not None:
            fit.activations["no checkpointing"] = fit.in_flight * r.activations
        out.append(fit)
    return out, missing
