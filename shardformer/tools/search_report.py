"""What ``shardformer plan --search`` prints: the top layouts, why the runner-up lost, the lines to run."""

from __future__ import annotations

from shardformer.tools.fit import GIB
from shardformer.tools.search import Candidate, SearchResult

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
        f"{r.gpu_memory / GIB:,.1f} GiB, {r.usable / GIB:,.1f} GiB usable ({r.headroom:.0%} headroom); "
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
    lines.append(f"  {'#':<3}{'layout':<48}{'GiB/GPU':>9}{'step s':>9}{'tokens/s':>11}  where the time goes")
    for i, c in enumerate(r.ranked, 1):
        mark = "" if c.simulated else "*"
        lines.append(
            f"  {i:<3}{c.layout.short():<48}{c.peak / GIB:>8.1f}{mark:1}{c.cost.step:>9.2f}{c.cost.tokens_per_s:>11,.0f}  "
            + _parts(c)
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


def _parts(c: Candidate) -> str:
    total = sum(c.cost.parts.values()) or 1.0
    ranked = sorted(c.cost.parts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v / total:.0%}" for k, v in ranked if v / total >= 0.01)


def why_lost(best: Candidate, other: Candidate) -> str:
    """The parts of ``other``'s step that make it slower than ``best``'s, largest first."""
    slower = other.cost.step - best.cost.step
    keys = set(best.cost.parts) | set(other.cost.parts)
    diffs = {k: other.cost.parts.get(k, 0.0) - best.cost.parts.get(k, 0.0) for k in keys}
    worse = [f"+{d:.2f} s {PART_NAMES[k]}" for k, d in sorted(diffs.items(), key=lambda kv: -kv[1]) if d > 0.005]
    better = [f"{-d:.2f} s {PART_NAMES[k]}" for k, d in sorted(diffs.items(), key=lambda kv: kv[1]) if d < -0.005]
    text = f"why #2 lost: {other.layout.short()} is {slower:.2f} s per step slower"
    text += ": " + ", ".join(worse) if worse else ""
    return text + (f" (it saves {', '.join(better)})" if better else "")


def _config_lines(fields: dict) -> str:
    """The chosen sizes as the config file's keys (``shardformer run`` reads ShardConfig's long names)."""
    long = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size",
            "cp": "context_parallel_size", "ep": "expert_parallel_size"}  # fmt: skip
    return ", ".join(f"{long.get(k, k)} = {v!r}" for k, v in fields.items())


def _nothing_fits(r: SearchResult) -> list[str]:
    out = [f"nothing fits on {r.gpus} x {r.gpu_memory / GIB:,.1f} GiB ({r.usable / GIB:,.1f} GiB usable)."]
    if r.closest is not None:
        c = r.closest
        need = c.peak / (1 - r.headroom)
        out.append(
            f"  smallest shortfall: {c.layout.short()} needs {c.peak / GIB:,.1f} GiB per GPU, "
            f"{(c.peak - r.usable) / GIB:,.1f} GiB over; it fits on GPUs of {need / GIB:,.1f} GiB or more"
        )
    out.append(f"  would fit: {r.would_fit}" if r.would_fit else "  no layout fits on up to 64x the GPUs either")
    return out
