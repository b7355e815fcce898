"""What ``shardformer plan --search`` prints: the top layouts, why the runner-up lost, the lines to run."""

from __future__ import annotations

from shardformer.tools.search import Candidate, SearchResult, size

PART_NAMES = {
    "compute": "compute",
    "recompute": "recomputation",
    "bubble": "pipeline bubble",
    "tp": "tp collectives",
    "cp": "cp exchanges",
    "ep": "ep all-to-alls",
    "dp": "dp / ZeRO traffic",
    "pp": "pipeline sends",
}


def format_search(result: SearchResult) -> str:
    r = result
    nodes = max(r.gpus // r.gpus_per_node, 1)
    lines = [
        f"search: {r.model} on {r.gpus} GPUs ({nodes} node(s) x {min(r.gpus, r.gpus_per_node)}) of "
        f"{size(r.gpu_memory)}, {size(r.usable)} usable ({r.headroom:.0%} headroom); "
        f"{r.global_batch} sequences x {r.seq} tokens per step, {r.precision}",
        f"cost model: {r.hardware.name}; {r.hardware.efficiency:.0%} of {r.hardware.peak_flops / 1e12:,.0f} TFLOP/s",
        "offered: " + "; ".join(f"{k}: {v}" for k, v in r.offered.items()),
        f"layouts: {r.enumerated:,} enumerated, {r.fit_closed_form:,} fit in closed form, {r.simulated} of those "
        f"checked on simulated ranks ({r.rank_builds} rank simulation(s); the rest ranked on the formula)",
        *r.notes,
        "",
    ]
    if not r.ranked:
        return "\n".join(lines + _nothing_fits(r))
    lines.append(f"  {'#':<3}{'layout':<48}{'per GPU':>11}{'step':>11}{'tokens/s':>13}  where the time goes")
    for i, c in enumerate(r.ranked, 1):
        mark = "" if c.simulated else "*"
        lines.append(
            f"  {i:<3}{c.layout.short():<48}{size(c.peak):>10}{mark:1}{seconds(c.cost.step):>11}"
            f"{c.cost.tokens_per_s:>13,.0f}  " + _parts(c)
        )
    if any(not c.simulated for c in r.ranked):
        lines.append("  (* memory from the formula, not simulated)")
    if len(r.ranked) > 1:
        lines += ["", why_lost(r.ranked[0], r.ranked[1])]
    best = r.ranked[0].layout
    fields = best.engine_fields(r.precision)
    lines += [
        "",
        "chosen layout:",
        "  EngineConfig(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")",
        f"  shardformer run --nnodes {nodes} --nproc_per_node {min(r.gpus, r.gpus_per_node)} train.py --config "
        f"config.py --mode train   # config.py: {_config_lines(fields)}",
    ]
    if r.proof:
        lines.append(f"  {r.proof}")
    return "\n".join(lines)


def seconds(s: float) -> str:
    return f"{s:,.2f} s" if s >= 1 else f"{s * 1e3:,.3g} ms"


def _parts(c: Candidate) -> str:
    total = sum(c.cost.parts.values()) or 1.0
    ranked = sorted(c.cost.parts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v / total:.0%}" for k, v in ranked if v / total >= 0.01)


def why_lost(best: Candidate, other: Candidate) -> str:
    """The parts of ``other``'s step that make it slower than ``best``'s, largest first."""
    slower = other.cost.step - best.cost.step
    keys = set(best.cost.parts) | set(other.cost.parts)
    diffs = {k: other.cost.parts.get(k, 0.0) - best.cost.parts.get(k, 0.0) for k in keys}
    small = 1e-3 * max(best.cost.step, 1e-12)
    worse = [f"+{seconds(d)} {PART_NAMES[k]}" for k, d in sorted(diffs.items(), key=lambda kv: -kv[1]) if d > small]
    better = [f"{seconds(-d)} {PART_NAMES[k]}" for k, d in sorted(diffs.items(), key=lambda kv: kv[1]) if d < -small]
    if not worse:  # a tie on the cost model: the order is the tie-break's
        return (f"why #2 lost: {other.layout.short()} ties on time; the winner sets fewer options away from "
                f"EngineConfig's defaults, or uses less memory")  # fmt: skip
    text = f"why #2 lost: {other.layout.short()} is {seconds(slower)} per step slower"
    text += ": " + ", ".join(worse) if worse else ""
    return text + (f" (it saves {', '.join(better)})" if better else "")


def _config_lines(fields: dict) -> str:
    """The chosen sizes as the config file's keys (``shardformer run`` reads ShardConfig's long names)."""
    long = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size",
            "cp": "context_parallel_size", "ep": "expert_parallel_size"}  # fmt: skip
    return ", ".join(f"{long.get(k, k)} = {v!r}" for k, v in fields.items())


def _nothing_fits(r: SearchResult) -> list[str]:
    out = [f"nothing fits on {r.gpus} x {size(r.gpu_memory)} ({size(r.usable)} usable)."]
    if r.closest is not None:
        c = r.closest
        need = c.peak / (1 - r.headroom)
        out.append(
            f"  smallest shortfall: {c.layout.short()} needs {size(c.peak)} per GPU, "
            f"{size(c.peak - r.usable)} over; it fits on GPUs of {size(need)} or more"
        )
    out.append(f"  would fit: {r.would_fit}" if r.would_fit else "  no layout fits on up to 64x the GPUs either")
    return out
