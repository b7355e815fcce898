"""``shardformer plan MODEL --gpus N --gpu-memory M --search``: which layout, of all the model admits?

1. `shardformer.tools.search_space` enumerates the layouts (tp, cp, pp with schedule and virtual
   stages, dp with ZeRO stage, ep, micro-batches, activation checkpointing, sequence parallelism).
2. Each is sized in closed form (`shardformer.tools.fit.plan_stages`: the plan's real rank shapes at
   that tp / pp / ep, the activation formula, every pipeline stage) and kept if its fullest stage fits
   in the GPU's memory less the headroom.
3. The survivors are ranked by `shardformer.tools.search_cost` (estimated step time).
4. In that order, survivors are simulated (`shardformer.tools.simulate`: one real rank of each stage
   kind built on the meta device in a fake process group of the whole world) until ``top`` of them
   are confirmed to fit on the simulator's numbers; a simulation is shared by the layouts that differ
   only in what it does not build (schedule, micro-batch count, checkpointing, sequence parallelism:
   those stay the formula's, on the simulated model state). Context-parallel layouts are not
   simulated (the simulator takes no cp) and say so.
5. The top layout's tensor-parallel route is proven on a tiny copy (`shardformer.tools.search_proof`).

Nothing fits: the layout with the smallest shortfall is reported, with the memory it needs and the
smallest GPU count (doublings, closed form) at which some layout fits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from shardformer.tools.fit import GIB, StageFit, plan_stages, simulated_stages
from shardformer.tools.plan import build_meta_model, plan_model
from shardformer.tools.search_cost import HARDWARE, Hardware, RankState, StepCost, step_cost
from shardformer.tools.search_proof import prove_route
from shardformer.tools.search_space import Layout, ModelShape, enumerate_layouts, model_shape
from shardformer.tools.simulate import simulate_job

PLAN_ERRORS = (ValueError, NotImplementedError)


@dataclass
class Candidate:
    layout: Layout
    peak: int  # bytes of the fullest pipeline stage's rank
    cost: StepCost
    simulated: bool = False  # peak read on simulated ranks (model state and plain activations)


@dataclass
class SearchResult:
    model: str
    gpus: int
    gpus_per_node: int
    gpu_memory: int
    headroom: float
    seq: int
    global_batch: int
    precision: str
    hardware: Hardware
    enumerated: int = 0
    fit_closed_form: int = 0
    simulated: int = 0  # candidates checked on simulated ranks
    rank_builds: int = 0  # distinct simulations run
    ranked: list[Candidate] = field(default_factory=list)  # the top layouts, fastest first
    closest: Candidate | None = None  # nothing fits: the smallest shortfall
    would_fit: str | None = None  # nothing fits: what would
    offered: dict[str, str] = field(default_factory=dict)  # technique -> what the model admits, or why not
    over: list[Candidate] = field(default_factory=list)  # keep_all: the layouts over the memory, with their cost
    notes: list[str] = field(default_factory=list)
    proof: str | None = None

    @property
    def usable(self) -> int:
        return int(self.gpu_memory * (1 - self.headroom))


def search(
    model: str, gpus: int, gpu_memory: int, *, seq: int, global_batch: int | None = None, gpus_per_node: int = 8,
    precision: str = "bf16", hardware: Hardware | str = "h100", headroom: float = 0.1, top: int = 3,
    simulate: bool = True, prove: bool = True, model_class: str | None = None, device: str = "cuda", schedules=None,
    keep_all: bool = False,
) -> SearchResult:  # fmt: skip
    """Search the layouts of ``model`` (any name ``shardformer plan`` takes) on ``gpus`` GPUs of
    ``gpu_memory`` bytes for ``global_batch`` sequences (default: ``gpus``) of ``seq`` tokens per step.
    ``schedules``: the pipeline schedules to try (default all); ``keep_all``: also return the layouts
    over the memory with their cost (``over``), to see where a given layout stands."""
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    global_batch = global_batch or gpus
    if gpus < 1 or gpus % min(gpus, gpus_per_node):
        raise ValueError(f"--gpus {gpus} is not a whole number of nodes of {gpus_per_node} GPUs; give --gpus-per-node")
    out = SearchResult(model, gpus, gpus_per_node, gpu_memory, headroom, seq, global_batch, precision, hw)
    sizer = _Sizer(model, model_class, precision, seq, device)
    out.offered = _offered(sizer.shape)
    found = _closed_form(sizer, gpus, gpus_per_node, global_batch, precision, out.usable, hw, schedules, keep_all)
    layouts, fitting, nearest = found
    out.over = [c for c in fitting if c.peak > out.usable]
    fitting = [c for c in fitting if c.peak <= out.usable]
    out.enumerated, out.fit_closed_form = len(layouts), len(fitting)
    if sizer.refused:
        out.notes += [f"tp={tp} not offered: {why}" for tp, why in sorted(sizer.refused.items())]
    fitting.sort(key=ranking)
    for candidate in fitting:
        if len(out.ranked) == top:
            break
        if simulate and candidate.layout.cp == 1:
            candidate.peak, candidate.simulated = sizer.simulated_peak(candidate.layout), True
            out.simulated += 1
            if candidate.peak > out.usable:  # the formula fit, the simulated ranks do not
                if nearest is None or candidate.peak < nearest.peak:
                    nearest = candidate
                continue
        out.ranked.append(candidate)
    out.rank_builds = sizer.simulations
    if any(c.layout.cp > 1 for c in out.ranked) and simulate:
        out.notes.append("context-parallel layouts are sized by the formula only: the simulator takes no cp")
    if not out.ranked:
        out.closest = nearest
        out.would_fit = _would_fit(sizer, gpus, gpus_per_node, global_batch, precision, out.usable, hw, schedules)
    elif prove:
        out.proof = prove_route(model, out.ranked[0].layout, model_class)
    return out


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def ranking(c: Candidate) -> tuple:
    """Fastest first; on a tie (to 6 digits) the layout closer to EngineConfig's defaults, then the smaller."""
    return float(f"{c.cost.step:.6g}"), len(c.layout.engine_fields("bf16")), c.peak


def _offered(shape: ModelShape) -> dict[str, str]:
    out = {"cp": "offered (the model's attention takes it)" if shape.cp_refused is None else shape.cp_refused}
    out["ep"] = (
        f"offered ({shape.experts} routed experts per MoE layer)" if shape.experts else "a dense model: no experts"
    )
    return out


def _closed_form(sizer, gpus, gpus_per_node, global_batch, precision, usable, hw, schedules, keep_all=False):
    """(every layout, those that fit in closed form with their cost (``keep_all``: every one), the smallest
    shortfall's)."""
    layouts = enumerate_layouts(sizer.shape, gpus, gpus_per_node, global_batch, sizer.seq, precision, schedules)
    fitting, nearest = [], None
    for layout in layouts:
        peak, state = sizer.closed_form_peak(layout)
        if peak is None:
            continue
        if peak > usable and (nearest is None or peak < nearest.peak):
            nearest = Candidate(layout, peak, StepCost())
        if peak > usable and not keep_all:
            continue
        cost = step_cost(layout, sizer.shape, state, sizer.seq, precision, hw, gpus_per_node)
        fitting.append(Candidate(layout, peak, cost))
    if nearest is not None:
        state = sizer.closed_form_peak(nearest.layout)[1]
        nearest.cost = step_cost(nearest.layout, sizer.shape, state, sizer.seq, precision, hw, gpus_per_node)
    return layouts, fitting, nearest


def _would_fit(sizer, gpus, gpus_per_node, global_batch, precision, usable, hw, schedules) -> str | None:
    """The smallest doubling of the GPU count at which some layout fits (closed form), up to 64x."""
    for factor in (2, 4, 8, 16, 32, 64):
        more = gpus * factor
        _, fitting, _ = _closed_form(
            sizer, more, gpus_per_node, max(global_batch, more), precision, usable, hw, schedules
        )
        if fitting:
            best = min(fitting, key=ranking)
            return f"{more} GPUs of this memory: {best.layout.short()} at {size(best.peak)} per GPU"
    return None


class _Sizer:
    """Per-rank bytes of a layout: the plan's rank shapes once per (tp, pp, ep), the formula per layout,
    the simulator once per model-state kind."""

    def __init__(self, model: str, model_class: str | None, precision: str, seq: int, device: str):
        self.model, self.model_class, self.precision, self.seq, self.device = model, model_class, precision, seq, device
        meta = build_meta_model(model, model_class)
        self.config = getattr(meta, "config", None)
        self.shape = model_shape(meta)
        self.pipeline = None  # the pipeline route, proven on a tiny copy, found at the first pp > 1
        self.refused: dict[int, str] = {}
        self.simulations = 0

    @functools.cache  # noqa: B019 - one sizer per search; the cache is what makes it fast
    def plan(self, tp: int, pp: int, ep: int):
        if pp > 1 and self.pipeline is None:
            self.pipeline = pipeline_spec_for(build_meta_model(self.model, self.model_class))
        try:
            meta = build_meta_model(self.model, self.model_class)
            return plan_model(meta, tp, pp, ep, 1, self.precision, pipeline=self.pipeline, ep=ep)
        except PLAN_ERRORS as e:
            self.refused.setdefault(tp, str(e))
            return None

    @functools.cache  # noqa: B019
    def stages(self, layout: Layout) -> tuple[list[StageFit], RankState] | None:
        """The closed form's stages of a layout (checkpointing and sequence parallelism are variants in them)."""
        plan = self.plan(layout.tp, layout.pp, layout.ep)
        if plan is None:
            return None
        plan = replace(
            plan, dp=layout.dp, zero=layout.zero, cp=layout.cp, cp_mode=layout.cp_mode, dp_replicate=layout.dp_replicate
        )  # fmt: skip
        stages, _ = plan_stages(
            plan, self.config, layout.micro_batch, self.seq, layout.microbatches, layout.schedule, self.device
        )  # fmt: skip
        fullest = max(stages, key=lambda s: s.numel)
        experts = round(fullest.numel * plan.routed_numel / max(plan.rank_numel, 1))
        return stages, RankState(fullest.numel, experts, plan.largest_layer)

    def closed_form_peak(self, layout: Layout) -> tuple[int | None, RankState | None]:
        found = self.stages(_model_state_kind(layout))
        if found is None:
            return None, None
        stages, state = found
        return max(s.total(_variant(s, layout)) for s in stages), state

    @functools.cache  # noqa: B019
    def _simulation(self, tp: int, pp: int, dp: int, zero: int, ep: int, micro_batch: int):
        self.simulations += 1
        return simulate_job(
            self.model, tp, pp, dp, zero, self.precision, model_class=self.model_class, batch=micro_batch,
            seq=self.seq, ep=ep,
        )  # fmt: skip

    def simulated_peak(self, layout: Layout) -> int:
        # hybrid sharding: a rank holds what it holds at plain dp over its shard group (the replicas'
        # all-reduce adds no state), so the job simulated is the one of dp / dp_replicate ranks
        dp = layout.dp // layout.dp_replicate
        job = self._simulation(layout.tp, layout.pp, dp, layout.zero, layout.ep, layout.micro_batch)
        stages, _ = simulated_stages(
            job, layout.micro_batch, self.seq, layout.microbatches, layout.schedule, self.device
        )  # fmt: skip
        return max(s.total(_variant(s, layout)) for s in stages)


def _model_state_kind(layout: Layout) -> Layout:
    """The layout with the choices the closed form's stages hold as variants set to their first value."""
    return replace(layout, checkpointing=False, sequence_parallel=False)


def _variant(stage: StageFit, layout: Layout) -> str | None:
    """The activation variant of ``stage`` (`shardformer.tools.fit.variants`) this layout runs."""
    name = {
        (False, False): "no checkpointing",
        (True, False): "activation checkpointing",
        (False, True): "sequence parallel",
        (True, True): "sequence parallel + checkpointing",
    }[layout.checkpointing, layout.sequence_parallel]
    if name in stage.activations:
        return name
    return "no checkpointing" if "no checkpointing" in stage.activations else None  # measured only: an upper bound
