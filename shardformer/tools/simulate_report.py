"""The report of a simulated job (`shardformer.tools.simulate.simulate_job`): per kind of rank, the bytes
it holds beside the formula's, its activations and the collectives of one training step."""

from __future__ import annotations

from shardformer.tools.plan import GATHERED
from shardformer.tools.simulate import JobSimulation

CATEGORIES = ("parameters", "gradients", "gradient buffers (fp32)", "optimizer (Adam + master)", GATHERED)


def format_simulation(job: JobSimulation) -> str:
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    lines = [
        f"simulated: {job.model} at tp={job.tp} x pp={job.pp} x dp={job.dp} = {job.world} ranks"
        f"{f' (ep={job.ep} of the dp ranks)' if job.ep > 1 else ''}, "
        f"ZeRO-{job.zero}, {job.precision} (fake process group, meta device; activations apart)",
    ]
    for r in job.ranks:
        pp_rank, _, tp_rank = r.coords
        lines += [
            "",
            f"rank {r.rank} (stage {pp_rank}, tp rank {tp_rank}; layers {r.layers[0]}..{r.layers[-1]}): "
            f"{r.numel:,} parameters",
            f"  {'':<28}{'simulated':>12}{'formula':>12}",
        ]
        for what in CATEGORIES:
            if what in r.formula_only:
                lines.append(f"  {what:<28}{'formula':>12}{gib(r.formula[what]):>12}")
            elif what in r.measured or what in r.formula:
                a, b = r.measured.get(what, 0), r.formula.get(what, 0)
                lines.append(f"  {what:<28}{gib(a):>12}{gib(b):>12}")
        lines.append(
            f"  {'total':<28}{gib(r.total):>12}{gib(sum(r.formula.values())):>12}  "
            f"({r.apart:.2%} apart{' where measured' if r.formula_only else ''})"
        )
        if r.experts[2]:
            local, total, layers = r.experts
            lines.append(f"  experts: {local} of {total} per MoE layer (ep={job.ep}), in {layers} MoE layers here")
        lines.append(
            f"  activations of one micro-batch ({job.batch} x {job.seq}), saved by its forward: {gib(r.activations)}"
        )
        per_group: dict[str, list[str]] = {}
        for (group, op), (n, nbytes) in r.collectives.items():
            per_group.setdefault(group, []).append(f"{n} {op} ({nbytes / 2**20:,.1f} MiB)")
        lines.append("  collectives of one training step (one micro-batch):")
        for group, ops in per_group.items():
            minimum = r.minimum.get(group)
            tail = f"  [Megatron minimum {minimum}]" if minimum is not None else ""
            lines.append(f"    {group}: {', '.join(ops)}{tail}")
    lines += ["", *job.notes]
    return "\n".join(lines)
