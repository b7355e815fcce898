"""Simulate a large job in this one process: each distinct kind of rank built for real on the meta device.

`simulate_job` starts PyTorch's fake process group (the ``"fake"`` backend: every collective
returns at once and moves nothing) with the job's whole world size, this process being one rank of
it, and runs the library's own path for that rank on a model built on the meta device (shapes, no
storage): `shardformer.ProcessMesh`, `shardformer.ParallelEngine` (``shard_model``,
the pipeline stage it keeps, `shardformer.data_parallel.ZeroOptimizer` over the dp group),
then two training steps of one micro-batch: the first creates Adam's state, the second is measured.
It does this for one rank of every kind of pipeline stage (first, last, and middle stages of each
layer count), at tp rank 0; the last tp rank is checked to hold the same shapes by sharding at its
rank through `shardformer.tools.plan.plan_model` (vocabulary padding and replicated key/value
heads could make them differ; a fake group cannot run a tp rank other than 0 for real, as the RNG
state tp rank 0 broadcasts never arrives). Data-parallel ranks hold equal padded shards by construction.

Bytes are read at the end of the measured backward, the peak of the model state: the parameters of
the rank's module tree, their ``.grad``, the ZeRO reducer's bucket buffers, and the optimizer's
master shards and states (its layout). Activations: the bytes autograd saves in the measured
step's forward and loss (given ``batch`` and ``seq``: one micro-batch of the rank's stage), with
attention run as a fused kernel keeps it (`shardformer.tools.rank_bytes`). Collectives are the ones the step issues through
`shardformer.core.comm`, recorded with their group (tp, dp, ep, ...). Pipeline sends and receives
are counted from the p2p schedule (a fake group delivers no data, so the receiving stage cannot
read an activation's shape header); they are marked as such.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardformer.core.comm import CollectiveCounter
from shardformer.core.config import EngineConfig
from shardformer.engine import ParallelEngine
from shardformer.expert_parallel.layout import is_expert_param
from shardformer.tools.model_source import build_model
from shardformer.tools.plan import BYTES, GATHERED, plan_model
from shardformer.tools.rank_bytes import step_bytes, zero3_bytes


@dataclass
class RankSimulation:
    """One simulated rank: its place, what it holds and what one training step sends."""

    rank: int
    coords: tuple[int, int, int]  # (pp, dp, tp)
    layers: tuple[int, ...]  # indices of the transformer layers this rank holds
    numel: int  # parameters on this rank
    measured: dict[str, int]  # bytes per category, read from the built rank at the end of backward
    formula: dict[str, int]  # plan's formula for this rank's parameters, every category
    collectives: dict[tuple[str, str], tuple[int, int]]  # (group, op) -> (calls, bytes), one step
    minimum: dict[str, int]  # Megatron's minimum calls per group for one micro-batch
    # ZeRO-3: FSDP2's layers gathered while they compute, from the formula (no step runs on meta)
    formula_only: dict[str, int] = field(default_factory=dict)
    activations: int = 0  # bytes autograd saved in one micro-batch's forward (+ loss) of this rank's stage
    experts: tuple[int, int, int] = (0, 0, 0)  # ep > 1: (experts per MoE layer here, of all, MoE layers here)
    expert_numel: int = 0  # ep > 1: parameters of this rank's experts (ZeRO steps them over dp / ep ranks)

    @property
    def total(self) -> int:
        return sum(self.measured.values()) + sum(self.formula_only.values())

    @property
    def apart(self) -> float:
        """Relative difference of the measured categories from the formula's for them."""
        measured = sum(self.measured.values())
        formula = sum(v for k, v in self.formula.items() if k not in self.formula_only)
        return abs(measured - formula) / max(measured, 1)

    def calls(self, group: str) -> int:
        return sum(n for (g, _), (n, _) in self.collectives.items() if g == group)


@dataclass
class JobSimulation:
    model: str
    tp: int
    pp: int
    dp: int
    zero: int
    precision: str
    ep: int = 1
    ranks: list[RankSimulation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan: object = None  # the formula's Plan of the same job (tools.plan)
    config: object = None  # the model's config
    batch: int = 1
    seq: int = 16

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def largest(self) -> RankSimulation:
        return max(self.ranks, key=lambda r: r.total)


def simulate_job(
    model,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    zero_stage: int = 1,
    precision: str = "bf16",
    *,
    model_class: str | None = None,
    batch: int = 1,
    seq: int = 16,
    ep: int = 1,
) -> JobSimulation:
    """Build every distinct kind of rank of a ``tp x pp x dp`` job for real, on the meta device, in one process.

    ``model``: a transformers config (``PretrainedConfig``), a model factory, or any name ``shardformer
    plan`` takes (a folder with config.json, a built-in name such as ``llama3-405b``). ``zero_stage``
    1 or 2 is simulated with two steps. 3 is built for real (FSDP2's ``fully_shard`` over the dp
    sub-mesh of the fake group) and its sharded parameters, gradients and AdamW state read, but runs
    no step: FSDP2 refuses to run forward on meta parameters. Its collectives are then those of the
    same rank at ZeRO-2 and the layers gathered during compute come from the formula (both marked).
    ``batch`` x ``seq``: the micro-batch of the simulated steps (meta: no compute, any size is free).
    The bytes autograd saves in the measured step's forward and loss are each rank's activations of
    one micro-batch (`saved_activations`). ``ep``: expert parallelism over ep of the dp ranks;
    on meta no router's choice can be read, so the experts' all-to-alls carry an even spread of the
    routed tokens (`shardformer.expert_parallel.experts.ExpertParallel`).

    Runs in this process when torch.distributed is not initialised (the fake group is destroyed
    afterwards), else in a fresh subprocess, so an existing default group is never touched.
    """
    args = (model, tp, pp, dp, zero_stage, precision, model_class, batch, seq, ep)
    if not dist.is_initialized():
        return _simulate(*args)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_simulate, args)


def _factory(model, model_class):
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return lambda: _from_config(model, model_class)

    return lambda: build_model(model, model_class, weights=False)


def _from_config(config, model_class):
    import transformers as tf

    name = model_class or (config.architectures or [None])[0]
    if name is not None:
        return getattr(tf, name)(config)
    return tf.AutoModelForCausalLM.from_config(config)


def _simulate(model, tp, pp, dp, zero_stage, precision, model_class, batch, seq, ep) -> JobSimulation:
    factory = _factory(model, model_class)
    with torch.device("meta"):
        probe = factory()
    name = model if isinstance(model, str) else type(probe).__name__
    config = probe.config
    plan = plan_model(probe, tp, pp, dp, zero_stage, precision, ep=ep)  # also every size check, before any group
    del probe  # its meta tensors would count as another rank's
    job = JobSimulation(name, tp, pp, dp, zero_stage, precision, ep, plan=plan, config=config, batch=batch, seq=seq)
    if tp > 1:
        job.notes.append(_compare_tp_ranks(factory, plan, tp))
    for stage in _stage_kinds(plan, pp):
        rank = stage * dp * tp  # dp rank 0, tp rank 0
        job.ranks.append(_simulate_rank(factory, plan, rank, stage, zero_stage, batch, seq))
    if zero_stage == 3:
        job.notes.append(
            "ZeRO-3: shards read from the rank built with FSDP2's fully_shard on the fake group; FSDP2 runs no "
            "forward on meta parameters, so the layers it gathers while computing are the formula's, and the "
            "collectives are the same rank's at ZeRO-2 (ZeRO-3 gathers and reduce-scatters per layer over dp "
            "instead of per bucket, and gathers again in backward)"
        )
    if ep > 1:
        job.notes.append(
            "ep all-to-alls carry the routed tokens spread evenly over the ep ranks (a meta router's choices "
            "cannot be read): tokens x top-k / ep rows to each rank and back; their bytes are the tensors handed "
            "to the all-to-all, (ep - 1) / ep of which leave the rank; the exchange of the row counts before the "
            "tokens (ep integers) is not counted"
        )
    job.notes.append(
        "pp sends/receives are counted from the p2p schedule (a fake group delivers no shape header): each "
        "activation is a shape header and the tensor, each gradient the tensor alone"
    )
    return job


def _compare_tp_ranks(factory, plan, tp: int) -> str:
    """Whether the last tp rank holds tp rank 0's shapes, from the plan's sharding at that rank: where
    ranks differ (vocabulary padding, the last of replicated key/value heads) the last one differs.
    A fake group cannot run it for real: it would receive tp rank 0's RNG state, and gets no data."""
    with torch.device("meta"):
        last = plan_model(factory(), tp, 1, plan.ep, 0, plan.precision, tp_rank=tp - 1, ep=plan.ep)
    if [shape for _, _, shape in last.params] != [shape for _, _, shape in plan.params]:
        raise NotImplementedError(f"tp rank {tp - 1} holds other parameter shapes than tp rank 0")
    return f"tp rank {tp - 1} holds tp rank 0's parameter shapes (sharded at that rank)"


def _stage_kinds(plan, pp: int) -> list[int]:
    """One stage of each kind: first, last, and the first middle stage of each layer count."""
    if pp == 1:
        return [0]
    counts = [len(layers) for layers, _ in plan.stages]
    kinds: dict[tuple, int] = {}
    for s, count in enumerate(counts):
        kinds.setdefault((s == 0, s == pp - 1, count), s)
    return sorted(kinds.values())


def _simulate_rank(factory, plan, rank, stage, zero_stage, batch, seq) -> RankSimulation:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tp, pp, dp = plan.tp, plan.pp, plan.dp
    excepthook = sys.excepthook  # init_process_group wraps it to prefix tracebacks with the rank
    dist.init_process_group("fake", rank=rank, world_size=tp * pp * dp, store=FakeStore())
    shardformer_logs = logging.getLogger("shardformer")
    level = shardformer_logs.level
    shardformer_logs.setLevel(logging.ERROR)  # the "sharded WITHOUT proof" warning: see prove=False below
    try:
        with torch.device("meta"):
            model = factory()
        # prove=False: a fake group delivers no data, so no proof can run on it; the numbers simulated
        # here are bytes and calls, which do not depend on the route being exact
        config = EngineConfig(
            tp=tp, pp=pp, dp=dp, ep=plan.ep, zero_stage=min(zero_stage, 2), precision=plan.precision, prove=False
        )
        engine = ParallelEngine(model, lambda p: torch.optim.AdamW(p, lr=1e-4), config)
        hidden_size = model.config.hidden_size
        step_bytes(engine, batch, seq, hidden_size)  # Adam creates its state in the first step
        engine.optimizer.zero_grad()
        with CollectiveCounter() as counter:
            measured, activations = step_bytes(engine, batch, seq, hidden_size)
        mesh = engine.mesh
        names = {id(mesh.tp_group): "tp", id(mesh.dp_group): "dp", id(mesh.pp_group): "pp"}
        names[id(mesh.embedding_group)] = "embedding"
        if plan.ep > 1:
            names |= {id(mesh.ep_group): "ep", id(mesh.expert_dp_group): "expert-dp"}
        collectives: Counter = Counter()
        volume: Counter = Counter()
        for (op, _, nbytes), group in zip(counter.calls, counter.groups):
            key = (names.get(id(group), "world" if group is None else "other"), op)
            collectives[key] += 1
            volume[key] += nbytes
        numel = sum(p.numel() for p in engine.model.parameters())
        split = [p for p in engine.model.parameters() if is_expert_param(p)]
        experts = (split[0].expert_spec.local, split[0].expert_spec.num_experts) if split else (0, 0)
        moe_layers = sum(getattr(m, "ep_spec", None) is not None for m in engine.model.modules())
        layers = engine.model.shardformer.layers
        if layers is None:  # pp=1: every layer (of every stack: an encoder-decoder has two)
            layers = range(sum(len(engine.model.get_submodule(s)) for s in engine.study.stacks))
        layers = tuple(layers)
        first, last = stage == 0, stage == pp - 1
        for key, (n, nbytes) in _pipeline_messages(first, last, batch, seq, hidden_size, plan.precision).items():
            collectives[key], volume[key] = n, nbytes
        expert_numel = sum(p.numel() for p in split)
        formula = plan.bytes_per_rank(numel, experts=expert_numel)
        formula_only = {}
        if zero_stage == 3:
            zero3 = EngineConfig(tp=tp, pp=pp, dp=dp, ep=plan.ep, zero_stage=3, precision=plan.precision, prove=False)
            measured = zero3_bytes(factory, zero3)
            formula_only = {GATHERED: formula[GATHERED]}
        return RankSimulation(
            rank=rank,
            coords=mesh.coords,
            layers=layers,
            numel=numel,
            measured=measured,
            formula=formula,
            collectives={k: (collectives[k], volume[k]) for k in sorted(collectives)},
            minimum=_megatron_minimum(len(layers), first, last, tp, pp),
            formula_only=formula_only,
            activations=activations,
            experts=(*experts, moe_layers),
            expert_numel=expert_numel,
        )
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        shardformer_logs.setLevel(level)


def _pipeline_messages(first, last, batch, seq, hidden, precision) -> dict[tuple[str, str], tuple[int, int]]:
    """Sends and receives of one micro-batch under the p2p schedule: (calls, bytes) per op."""
    act = batch * seq * hidden * BYTES[precision]
    header = 10 * 8  # int64 [ndim, dtype, up to 8 sizes]
    sends = recvs = (0, 0)
    if not last:  # the activation forward (header + tensor), its gradient back
        sends, recvs = (2, header + act), (1, act)
    if not first:  # the activation in (header + tensor), its gradient out
        recvs = (recvs[0] + 2, recvs[1] + header + act)
        sends = (sends[0] + 1, sends[1] + act)
    out = {}
    if sends[0]:
        out[("pp", "send")] = sends
    if recvs[0]:
        out[("pp", "recv")] = recvs
    return out


def _megatron_minimum(layers: int, first: bool, last: bool, tp: int, pp: int) -> dict[str, int]:
    """Megatron's collectives for one micro-batch: per layer 2 all-reduces forward (attention and MLP
    outputs) and 2 backward (their inputs); the vocab-parallel embedding 1 forward, the LM head's
    input 1 backward and the vocab-parallel loss 3 forward; one send and one receive per neighbour."""
    out = {}
    if tp > 1:
        out["tp"] = 4 * layers + (1 if first else 0) + (4 if last else 0)
    if pp > 1:
        out["pp"] = 2 * ((not first) + (not last))
    return out
