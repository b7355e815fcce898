"""Size a job before starting it: shard a model built on the meta device, with no processes.

``plan_model`` applies the model's policy at a tensor-parallel size through a
`shardformer.core.mesh.VirtualGroup`, so the parameter shapes are exactly those a real
shard produces, and estimates bytes per rank for parameters, gradients and optimizer state, and,
given a batch and sequence length, activations (`shardformer.tools.activation_estimate`).
Context parallelism (``cp``) leaves every rank's parameters as tensor parallelism cuts them and
splits the sequence: it changes the activations and the number of processes (tp x cp x pp x dp).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn as nn

from shardformer.context_parallel.checks import check_context_parallel
from shardformer.core.comm import VirtualGroup
from shardformer.core.config import CP_MODES, PRECISIONS, ZERO_STAGES, ShardConfig, check_choice, check_expert_divides
from shardformer.core.mesh import resolve_sizes
from shardformer.core.study_memo import studied_once
from shardformer.expert_parallel.find import find_experts
from shardformer.expert_parallel.sizing import ExpertSizing, expert_sizing
from shardformer.pipeline.spec import PipelineSpec, check_split
from shardformer.pipeline.spec_check import check_pipeline_spec
from shardformer.policies.anatomy import layer_stack, stack_anatomy
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from shardformer.policies.routes import ROUTE_ERRORS, candidate_routes, no_route_error
from shardformer.tensor_parallel.policy import NoCut
from shardformer.tensor_parallel.sharder import ModelSharder
from shardformer.tensor_parallel.slicer import shard_spec
from shardformer.tools.activation_estimate import estimate_activations
from shardformer.tools.experts import expert_lines
from shardformer.tools.model_source import build_model

BYTES = {name: dtype.itemsize for name, dtype in PRECISIONS.items()}
# ZeRO-3's transient: two layers' gathered parameters and one layer's unsharded gradient (FSDP2)
GATHERED = "gathered layers (FSDP2)"


def build_meta_model(spec: str, model_class: str | None = None) -> nn.Module:
    """A model without weights, from anything `shardformer.tools.model_source.build_model` takes."""
    with torch.device("meta"):
        return build_model(spec, model_class, weights=False)


@dataclass
class Plan:
    tp: int
    pp: int
    dp: int
    zero: int
    precision: str
    replaced: list[tuple[str, str, str]] = field(default_factory=list)  # (path, from class, to class)
    params: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (name, full shape, rank shape)
    stages: list[tuple[range, int]] = field(default_factory=list)  # (layers, parameters per rank), pp > 1
    activations: list[str] = field(default_factory=list)  # lines of the activation estimate (batch and seq given)
    largest_layer: int = 0  # parameters per rank of the largest transformer layer (ZeRO-3's gathered unit)
    cp: int = 1
    cp_mode: str = "ring"
    experts: ExpertSizing | None = None  # a mixture of experts' experts, found before the model was cut
    ep: int = 1  # expert-parallel size: routed experts split over ep of the dp ranks
    tokens: int | None = None  # tokens per micro-batch and rank (batch x seq / cp), when given
    dp_replicate: int = 1  # hybrid sharding: ZeRO shards over dp / dp_replicate ranks (EngineConfig's)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_shard(self) -> int:
        """The ranks ZeRO shards over: the whole dp group, or hybrid sharding's shard group."""
        return self.dp // self.dp_replicate

    @property
    def rank_numel(self) -> int:
        return sum(_numel(local) for _, _, local in self.params)

    @property
    def largest_param(self) -> int:
        """Elements of the largest parameter on a rank (a ZeRO bucket holds at least one)."""
        return max((_numel(local) for _, _, local in self.params), default=0)

    @property
    def full_numel(self) -> int:
        return sum(_numel(full) for _, full, _ in self.params)

    def bytes_per_rank(self, numel: int | None = None, experts: int | None = None) -> dict[str, int]:
        """Bytes per rank for ``numel`` parameters (default: the largest pipeline stage's, or the model's),
        ``experts`` of them split by expert parallelism (default: the model's share of ``numel``)."""
        if numel is None:
            numel = max(n for _, n in self.stages) if self.stages else self.rank_numel
        if self.ep == 1:
            return model_state_bytes(numel, self.precision, self.dp_shard, self.zero, self.largest_layer)
        # split experts are stepped by ZeRO over the dp / ep ranks holding them (a stage is taken to hold
        # the model's share of them unless told)
        if experts is None:
            experts = round(numel * self.routed_numel / max(self.rank_numel, 1))
        dense = model_state_bytes(numel - experts, self.precision, self.dp_shard, self.zero, self.largest_layer)
        split = model_state_bytes(experts, self.precision, self.dp_shard // self.ep, self.zero)
        return {k: dense.get(k, 0) + split.get(k, 0) for k in {**dense, **split}}

    @property
    def routed_numel(self) -> int:
        """Routed experts' parameters on a rank (after tp and ep)."""
        if self.experts is None:
            return 0
        routed = tuple(path + "." for path in self.experts.paths)
        return sum(_numel(local) for name, _, local in self.params if name.startswith(routed))


def model_state_bytes(n: int, precision: str, dp: int, zero: int, largest_layer: int = 0) -> dict[str, int]:
    """Parameters, gradients and Adam state of ``n`` parameters on one rank, as this library lays them out.

    ZeRO-1 (`shardformer.data_parallel`): backward writes every ``param.grad`` in the model's
    dtype, kept until the next ``zero_grad``, and the reduction copies them into fp32 ``[dp, row]``
    bucket buffers kept between steps. ZeRO-2 frees each ``param.grad`` once copied into its bucket
    and each bucket once reduce-scattered: after backward it holds only its fp32 1/dp row (during
    backward, at most two buckets more are in flight). The fp32 master shard and Adam's two moments
    are 1/dp.
    An fp32 model is stepped in place (no master). ZeRO-3 (PyTorch FSDP2, fp32 shards, bf16
    all-gathers, fp32 reduce-scatter): parameters, gradients and Adam state all 1/dp, plus, while a
    layer computes, the gathered parameters of two layers (the one computing and the one prefetched)
    and one layer's unsharded gradient. zero=0: no ZeRO (every rank steps the whole model).
    """
    width = BYTES[precision]
    master = 4 if precision != "fp32" else 0
    shard = -(-n // dp)
    if zero == 3:
        return {
            "parameters": 4 * shard,
            "gradients": 4 * shard,
            "optimizer (Adam + master)": 8 * shard,
            GATHERED: 2 * width * largest_layer + 4 * largest_layer,
        }
    out = {"parameters": n * width, "gradients": n * width}
    if zero == 1:
        out["gradient buffers (fp32)"] = 4 * dp * shard
    elif zero == 2:  # at the end of backward: gradients released, only this rank's reduced row
        out["gradients"] = 0
        out["gradient buffers (fp32)"] = 4 * shard
    out["optimizer (Adam + master)"] = (8 + master) * (shard if zero >= 1 else n)
    return out


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


@studied_once()  # the stacks, blocks and instance are read several times below: worked out once
def plan_model(
    model: nn.Module,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    zero: int = 0,
    precision: str = "fp32",
    policy=None,
    pipeline: PipelineSpec | None = None,
    batch: int | None = None,
    seq: int | None = None,
    device: str = "cpu",
    tp_rank: int = 0,
    cp: int = 1,
    cp_mode: str = "ring",
    ep: int = 1,
) -> Plan:
    """Shard ``model`` (build it on the meta device) for tp rank ``tp_rank`` of ``tp`` and describe the result.

    ``policy`` / ``pipeline``: a custom Policy / PipelineSpec (default: the model family's).
    ``batch`` and ``seq`` (both or neither): estimate activation memory per rank too (``seq``: the
    whole sequence; with ``cp`` > 1 each rank holds its share). ``cp`` / ``cp_mode``: context
    parallelism, refused where the library refuses it (the same checks, before any collective)."""
    if (batch is None) != (seq is None):
        raise ValueError(f"batch={batch} and seq={seq}: give both (--batch and --seq) to estimate activations")
    check_choice("zero", zero, tuple(sorted({0, *ZERO_STAGES, 3})))  # 3: bytes by formula until it is merged
    check_choice("precision", precision, tuple(PRECISIONS))
    check_choice("cp_mode", cp_mode, CP_MODES)
    resolve_sizes(tp * cp * pp * dp, tp, pp, dp, cp)
    if cp > 1:
        sizes = SimpleNamespace(context_parallel_size=cp, context_parallel_mode=cp_mode, tensor_parallel_size=tp)
        check_context_parallel(model, sizes, stack_anatomy(model))
    if pp > 1:
        pipeline = pipeline or pipeline_spec_for(model)  # before sharding: an unknown family fails fast
    config = getattr(model, "config", None)
    plan_activations = (
        activation_lines(config, batch, seq, tp, precision, device, cp, cp_mode, pp) if batch is not None else []
    )  # before sharding: a bad size fails before the slow part
    check_expert_divides(ep, dp)
    experts = expert_sizing(model, ep)
    if ep > 1 and experts is None:
        find_experts(model, ep)  # raises, naming why the model's experts cannot be split
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    before = {name: type(m).__name__ for name, m in model.named_modules()}
    config = ShardConfig(tensor_parallel_process_group=VirtualGroup(tp_rank, tp), pipeline_parallel_size=1)
    policy = policy or first_resolving_policy(model, config)
    model = ModelSharder(model, policy, config, layers=layer_stack(model)).shard()
    tokens = batch * seq // cp if batch is not None else None
    plan = Plan(
        tp, pp, dp, zero, precision, activations=plan_activations, cp=cp, cp_mode=cp_mode, experts=experts, ep=ep,
        tokens=tokens,
    )  # fmt: skip
    for name, m in model.named_modules():
        if name in before and before[name] != type(m).__name__:
            plan.replaced.append((name, before[name], type(m).__name__))
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        local = tuple(p.shape) if spec else full_shapes[name]
        if experts is not None and ep > 1 and name.startswith(tuple(path + "." for path in experts.paths)):
            local = (local[0] // ep, *local[1:])  # this rank's experts
        plan.params.append((name, full_shapes[name], local))
    numels = {name: _numel(local) for name, _, local in plan.params}
    if pp > 1:
        plan.stages = stage_split(pipeline, model, pp, numels)
    plan.largest_layer = largest_layer(numels, layer_stack(model))
    return plan


def first_resolving_policy(model: nn.Module, config: ShardConfig):
    """The first candidate route's policy whose cut resolves against ``model``, as ``shard_model``
    tries them (unproven: a plan runs no proof): timm's ViTamin is a ``VisionTransformer`` whose MLP
    the built-in policy refuses, and the derived route cuts it."""
    routes = candidate_routes(model)
    whole = config.tensor_parallel_size == 1  # a model no route cuts is kept whole there, as shard_model keeps it
    if not routes and not whole:
        raise no_route_error(model)
    for route in routes if whole else routes[:-1]:
        try:
            ModelSharder(model, route.make(), config, layers=layer_stack(model)).plan()
        except ROUTE_ERRORS:
            continue
        return route.make()
    return NoCut() if whole else routes[-1].make()


def largest_layer(numels: dict[str, int], layers_path: str | None) -> int:
    """Parameters per rank of the largest layer of the stack at ``layers_path`` (0 without one)."""
    if layers_path is None:
        return 0
    per_layer: dict[str, int] = {}
    for name, n in numels.items():
        if name.startswith(layers_path + "."):
            index = name[len(layers_path) + 1 :].split(".")[0]
            per_layer[index] = per_layer.get(index, 0) + n
    return max(per_layer.values(), default=0)


def stage_split(spec: PipelineSpec, model: nn.Module, pp: int, numels: dict[str, int]) -> list[tuple[range, int]]:
    """(layer indices, parameters per tensor-parallel rank) of each pipeline stage, as the engine cuts."""
    layer_paths = spec.layer_paths(model)  # every stack's layers in one numbering (an encoder-decoder's two)
    counts = check_split(len(layer_paths), pp)
    check_pipeline_spec(spec, model, pp)
    starts = [sum(counts[:s]) for s in range(pp)]
    layer_stage = {i: s for s in range(pp) for i in range(starts[s], starts[s] + counts[s])}
    under = lambda name, paths: any(name == q or name.startswith(q + ".") for q in paths)  # noqa: E731
    ends = [path for paths, _ in spec.sections(model).values() for path in paths]
    aliases: dict[int, list[str]] = {}  # a tied weight is held wherever any of its names is
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    params = dict(model.named_parameters())
    per_stage = [0] * pp
    for s in range(pp):
        dropped = set(spec.dropped(model, range(starts[s], starts[s] + counts[s])))
        kept = [path for path in ends if path not in dropped]
        for name, n in numels.items():
            layer = next((i for i, p in enumerate(layer_paths) if name.startswith(p + ".")), None)
            names = aliases.get(id(params.get(name)), [name])
            if layer is not None:
                per_stage[s] += n if layer_stage[layer] == s else 0
            elif any(under(alias, kept) for alias in names) or not any(under(alias, ends) for alias in names):
                per_stage[s] += n  # an end module this stage holds, or a weight the spec does not name (everywhere)
    return [(range(starts[s], starts[s] + counts[s]), per_stage[s]) for s in range(pp)]


def activation_lines(
    config, batch: int, seq: int, tp: int, precision: str, device: str, cp: int = 1, cp_mode: str = "ring", pp: int = 1
) -> list[str]:
    """The activation estimate as printed lines: with and without checkpointing and sequence parallelism."""
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    split = f", the sequence split over cp={cp} ({cp_mode})" if cp > 1 else ""
    head = (
        f"activations per rank, batch {batch} x seq {seq}{split}, {impl} attention, {precision} "
        f"(kept for the backward):"
    )
    if pp > 1:  # the estimate is of one forward through every layer: say so, not a per-stage number
        head = (
            f"activations per tensor-parallel rank of the whole model (all layers, not one of the {pp} pipeline "
            f"stages; a stage keeps its layers' share for each micro-batch in flight), batch {batch} x seq {seq}{split}, "
            f"{impl} attention, {precision}:"
        )
    cp_options = {"context_parallel_size": cp, "context_parallel_mode": cp_mode}
    try:
        estimate = lambda **kw: estimate_activations(  # noqa: E731
            config, batch, seq, tp, dtype_bytes=BYTES[precision], device=device, **cp_options, **kw
        )
        plain = estimate()
    except NotImplementedError as e:
        return [head, f"  not estimated: {e}"]
    lines = [head, f"  {'':<22}{'no checkpointing':>18}  activation checkpointing (+ one layer while it recomputes)"]
    first = "tensor parallel" if tp > 1 else "unsharded"
    variants = [(first if cp == 1 else ("tensor + context par." if tp > 1 else "context parallel"), {})]
    if tp > 1:
        variants.append(("+ sequence parallel", {"sequence_parallel": True}))
        variants.append(("  (keep gathered)", {"sequence_parallel": True, "sequence_parallel_regather": False}))
    for name, options in variants:
        full, ckpt = estimate(**options), estimate(checkpointing=True, **options)
        lines.append(f"  {name:<22}{mib(full.total):>18}  {mib(ckpt.total)} (+ {mib(ckpt.recompute)})")
    lines.append("  of which: " + ", ".join(f"{k} {mib(v)}" for k, v in plain.parts.items()))
    return lines


def format_plan(plan: Plan, show_params: bool = True) -> str:
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    lines = [
        f"layout: tp={plan.tp} x "
        + (f"cp={plan.cp} ({plan.cp_mode}) x " if plan.cp > 1 else "")
        + f"pp={plan.pp} x dp={plan.dp}"
        + (f" ({plan.dp_replicate} replicas x {plan.dp_shard} shards)" if plan.dp_replicate > 1 else "")
        + f" = {plan.world} processes, zero stage {plan.zero}, {plan.precision}",
        "",
    ]
    if plan.tp == 1:  # the parallel forms are put in all the same; listing them would suggest a cut
        lines.append("nothing is cut at tp=1: every rank holds every layer whole")
    else:
        lines.append(f"replaced modules ({len(plan.replaced)}):")
    kinds: dict[tuple[str, str], list[str]] = {}
    for path, old, new in plan.replaced if plan.tp > 1 else ():
        kinds.setdefault((old, new), []).append(path)
    for (old, new), paths in kinds.items():
        lines.append(f"  {old} -> {new}: {len(paths)} (e.g. {paths[0] or 'the model itself'})")
    if show_params:
        lines += ["", "parameters of each tensor-parallel rank (full shape -> rank shape):"]
        for name, full, local in plan.params:
            mark = "" if full == local else "  [split]"
            lines.append(f"  {name}: {list(full)} -> {list(local)}{mark}")
    lines += [
        "",
        f"parameters: {plan.full_numel:,} unsharded, {plan.rank_numel:,} per tensor-parallel rank "
        f"({plan.rank_numel / plan.full_numel:.3f})" + (" (cp does not split parameters)" if plan.cp > 1 else ""),
    ]
    lines += expert_lines(plan.params, plan.experts, plan.tp, plan.tokens, BYTES[plan.precision])
    lines.append("estimated bytes per rank:")
    per_rank = plan.bytes_per_rank()
    for what, b in per_rank.items():
        lines.append(f"  {what}: {mib(b)}")
    lines.append(f"  total: {mib(sum(per_rank.values()))} (activations not included)")
    if plan.zero == 3:
        lines.append("  (ZeRO-3: a formula for PyTorch FSDP2's layout, not read from a built optimizer)")
    if plan.stages:
        lines += ["", f"pipeline stages (pp={plan.pp}; the bytes above are for the largest):"]
        for s, (layers, numel) in enumerate(plan.stages):
            lines.append(f"  stage {s}: layers {layers.start}..{layers.stop - 1}, {numel:,} parameters per rank")
    if plan.activations:
        lines += ["", *plan.activations]
    return "\n".join(lines)
