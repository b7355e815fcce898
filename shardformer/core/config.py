"""The one schema of settings: ``ShardConfig`` says how to shard a model; ``EngineConfig`` how to train
one with the engine (it builds the engine's ``ShardConfig``, and the CLI's config-file keys for the
same settings take their types, defaults and choices from it).

Each field is checked here with the small checkers of `shardformer.core.checkers`; the values a
setting may take are in `shardformer.core.choices`, the parallel sizes against the world in
`shardformer.core.sizes`, and the combinations not proven exact are refused, technique by
technique, in `shardformer.core.config_refusals`. This module re-exports them all: one import path
for the settings and their checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardformer.core.checkers import (
    check_bool,
    check_choice,
    check_example_inputs,
    check_fields,
    check_int,
    check_positive_int,
    is_positive_int,
)
from shardformer.core.choices import (
    BACKENDS,
    CP_MODES,
    DEFAULT_SEED,
    ENGINE_ZERO_STAGES,
    PRECISIONS,
    SCHEDULES,
    SIZE_NAMES,
    VIRTUAL_SCHEDULES,
    ZERO_STAGES,
)
from shardformer.core.comm import group_size
from shardformer.core.config_refusals import (
    check_virtual_stages,
    refuse_context_parallel,
    refuse_expert_parallel,
    refuse_without_mesh,
    refuse_zero3,
)
from shardformer.core.sizes import check_expert_divides, check_replicate_divides, resolve_sizes

__all__ = [
    "BACKENDS",
    "CHOICES",
    "CP_MODES",
    "DEFAULT_SEED",
    "ENGINE_ZERO_STAGES",
    "PRECISIONS",
    "SCHEDULES",
    "SHARD_FIELDS",
    "SIZE_NAMES",
    "VIRTUAL_SCHEDULES",
    "ZERO_STAGES",
    "EngineConfig",
    "ShardConfig",
    "check_bool",
    "check_choice",
    "check_expert_divides",
    "check_int",
    "check_positive_int",
    "check_replicate_divides",
    "is_positive_int",
    "resolve_sizes",
]


@dataclass
class ShardConfig:
    """How to shard a model.

    tensor_parallel_size, pipeline_parallel_size, data_parallel_size:
        parallel sizes; ``data_parallel_size`` defaults to world // (tp * cp * pp).
    tensor_parallel_process_group:
        use this group for tensor parallelism instead of building a mesh (its size is the tp size).
    gather_output:
        gather the vocab-parallel LM head's logits to the full (true) vocabulary. Off by default so
        training never holds full-vocabulary logits; ``generate()`` gathers on its own either way.
    vocab_pad_multiple:
        pad the vocabulary to a multiple of ``vocab_pad_multiple * tp`` (1: just enough to divide).
    seed:
        base seed of the tensor-parallel dropout layers (each layer adds its index).
    context_parallel_size:
        split every sequence over this many ranks (each holds ``1/cp`` of every activation); every
        cp rank passes the same full batch and the library splits it (load-balanced for causal
        attention). Attention runs over the whole sequence through transformers' attention
        interface (see `shardformer.context_parallel`); the loss is the full-sequence loss.
    context_parallel_mode:
        "ring" (keys and values passed around the cp ranks, blockwise attention with an online
        softmax: any head count) or "all_to_all" (Ulysses: the sequence-split activations become
        head-split for attention and back: heads must divide by tp * cp).
    sequence_parallel:
        Megatron sequence parallelism: between attention and MLP blocks each tp rank keeps its
        ``1/tp`` of the sequence (norms, dropout, residuals), for less activation memory at the
        same communication volume. Needs a model whose layer stack is known (the built-in
        families and models with transformers' plans); a no-op at tp=1.
    sequence_parallel_regather:
        with ``sequence_parallel``, the column-parallel layers keep only this rank's chunk of their
        all-gathered input for the backward and all-gather it again there, as Megatron-LM does (the
        default: the gathered inputs take ``1/tp`` of the memory, for one more all-gather per
        attention / MLP block and step). False keeps the gathered inputs: plain tp's communication
        volume, more memory (measured in benchmarks/long_context.py).
    overlap_communication:
        a column-parallel layer's backward starts its input-gradient all-reduce and computes its
        weight gradient meanwhile (same result; False runs them one after the other, for comparison).
    mesh:
        an existing `shardformer.ProcessMesh` to shard over (its tp group); default: one is
        built from the sizes when the model is sharded.
    prove:
        prove the route's cut on a tiny copy of the model before cutting it (the default; about a
        second once per model class, architecture and tp). False uses the first route that resolves,
        unproven, with a warning: only for a model you have checked with ``shardformer verify``.
    expert_parallel_size:
        mixture-of-experts models: each of this many ranks holds ``1/ep`` of every MoE layer's experts,
        and tokens travel to the experts they are routed to (all-to-all) and back. The ep ranks are
        data-parallel ranks (each passes its own batch); ep must divide the data-parallel size.
    forward_agreement_every:
        tp and cp peers must run the same batch; the sharded model's forward compares their inputs
        (shapes, dtypes, a checksum of the values) before its first collective and raises on every rank
        when they differ. 1 (the default): on every forward, for one small all-gather and, on a GPU, one
        device sync per forward (benchmarks/forward_agreement_bench.py). N > 1: on every N-th forward
        that returned; a forward not compared that got another batch than its peers returns a loss no
        batch gives, or aborts the job inside the collective library when the lengths differ. A trade
        for a data path you have checked, not a default to copy.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int | None = None
    tensor_parallel_process_group: Any = None
    gather_output: bool = False
    vocab_pad_multiple: int = 1
    seed: int = DEFAULT_SEED
    sequence_parallel: bool = False
    sequence_parallel_regather: bool = True
    overlap_communication: bool = True
    prove: bool = True
    context_parallel_size: int = 1
    context_parallel_mode: str = "ring"
    expert_parallel_size: int = 1
    forward_agreement_every: int = 1
    mesh: Any = field(default=None, repr=False)
    example_inputs: Any = field(default=None, repr=False, compare=False)  # tensors: never compared as a setting

    def __post_init__(self) -> None:
        group = self.tensor_parallel_process_group
        if group is not None:
            size = group_size(group)
            if self.tensor_parallel_size not in (1, size):
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} disagrees with the size {size} of "
                    f"tensor_parallel_process_group; leave tensor_parallel_size out or make them equal"
                )
            self.tensor_parallel_size = size
        check_fields(
            self,
            check_positive_int,
            ("tensor_parallel_size", "pipeline_parallel_size", "vocab_pad_multiple", "context_parallel_size",
             "expert_parallel_size", "forward_agreement_every"),
        )  # fmt: skip
        check_positive_int("ShardConfig.data_parallel_size", self.data_parallel_size, optional=True)
        check_fields(
            self,
            check_bool,
            ("gather_output", "sequence_parallel", "sequence_parallel_regather", "overlap_communication", "prove"),
        )
        check_int("ShardConfig.seed", self.seed)
        check_choice("ShardConfig.context_parallel_mode", self.context_parallel_mode, CP_MODES)
        refuse_without_mesh(self)
        check_example_inputs("ShardConfig.example_inputs", self.example_inputs)

    def check_world(self) -> None:
        """Raise (before any collective) if the sizes do not fit the processes that were started."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.tensor_parallel_process_group is not None:
            return
        cp = self.context_parallel_size
        if not dist.is_initialized() and self.tensor_parallel_size * self.pipeline_parallel_size * cp > 1:
            raise RuntimeError(
                f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                f"{self.pipeline_parallel_size} x context_parallel_size={cp} needs that many processes, but "
                f"torch.distributed is not initialised; start the script with `shardformer run "
                f"--nproc_per_node N` and call shardformer.init_distributed()"
            )
        _, dp, _ = resolve_sizes(
            world, self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size, cp
        )
        ep = self.expert_parallel_size
        check_expert_divides(ep, dp)
        mesh = self.mesh
        if mesh is not None and mesh.ep_size != ep:
            raise ValueError(f"ShardConfig.mesh {mesh} has ep_size={mesh.ep_size}, not expert_parallel_size={ep}")
        if mesh is not None and (mesh.tp_size, mesh.pp_size, mesh.cp_size) != (
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            cp,
        ):
            raise ValueError(
                f"ShardConfig.mesh {mesh} does not match tensor_parallel_size={self.tensor_parallel_size}, "
                f"pipeline_parallel_size={self.pipeline_parallel_size}, context_parallel_size={cp}; give the "
                f"mesh's sizes or leave mesh out"
            )


# The EngineConfig fields with a fixed set of values, and those values.
CHOICES = {
    "zero_stage": ENGINE_ZERO_STAGES,
    "schedule": SCHEDULES + VIRTUAL_SCHEDULES,
    "precision": tuple(PRECISIONS),
    "backend": BACKENDS,
    "cp_mode": CP_MODES,
}
# The fields EngineConfig hands to ShardConfig under the same name.
SHARD_FIELDS = (
    "gather_output",
    "vocab_pad_multiple",
    "seed",
    "sequence_parallel",
    "sequence_parallel_regather",
    "overlap_communication",
    "prove",
    "example_inputs",
)


@dataclass
class EngineConfig:
    """How to train (and run) a model with `shardformer.ParallelEngine`.

    tp, pp, dp: tensor / pipeline / data parallel sizes (dp defaults to world // (tp * cp * pp)).
    dp_replicate: hybrid sharded data parallelism (HSDP): the dp ranks as ``dp_replicate`` replicas of
    ``dp_shard = dp // dp_replicate`` consecutive ranks; ZeRO (any stage) shards inside each group of
    ``dp_shard`` ranks and gradients are averaged across the replicas too. 1 (default): shard over all dp.
    cp, cp_mode: context parallelism (as ShardConfig's context_parallel_size / _mode): every cp rank
    gets the same batch and the sequence is split over them.
    ep: expert parallelism (as ShardConfig.expert_parallel_size): the experts of every MoE layer are
    split over ep of the dp ranks; expert gradients are summed over the ranks holding the same experts.
    zero_stage: 1 or 2 (our ZeRO over the dp ranks: optimizer states, then also gradients), or 3
    (parameters too: each transformer layer on PyTorch FSDP2 over the dp ranks; precision "fp32" or
    "bf16", no compile). num_microbatches: micro-batches per step and
    dp rank (gradient accumulation; also what fills the pipeline). schedule: "1f1b" or "gpipe", or
    one with ``virtual_stages`` model chunks per pp rank (backend "torch"): "interleaved_1f1b"
    (chunks r, r+pp, ... on rank r; virtual_stages >= 2, default 2), "zbv" or "dualpipev" (V-shaped:
    chunks r and 2*pp-1-r; virtual_stages 2). See docs/guides/pipeline.md for how to choose.
    precision: "fp32", "bf16" or "fp16" (fp32 master weights in the optimizer; fp16 adds dynamic
    loss scaling). max_grad_norm: clip the global gradient norm (None: no clipping).
    layers_per_stage: explicit split (one count per stage; default balanced).
    seed: base seed of the tensor-parallel dropout layers (as ShardConfig.seed).
    activation_checkpointing: recompute each transformer layer's activations in backward instead of
    keeping them (dropout masks replayed: losses and gradients are those of the run without it).
    sequence_parallel: Megatron sequence parallelism inside the tp group (as ShardConfig.sequence_parallel;
    ``sequence_parallel_regather`` as ShardConfig's).
    split_batch: ``train_step`` gets the global batch and each dp rank takes its 1/dp slice
    (False: each rank passes its own dp-local batch).
    backend: how training steps run the schedule when pp > 1: "torch" (torch.distributed.pipelining's
    PipelineStage, ScheduleGPipe / Schedule1F1B) or "p2p" (the same schedules on our own
    send/recv). ``eval_step`` and ``forward`` always use "p2p" (forward only).
    compile: run each stage's forward under ``torch.compile`` (``compile_backend``: "inductor", or
    "aot_eager" / "eager" to trace without generating code); the pipeline's sends and receives stay
    outside the compiled graph.
    overlap_grad_reduce: ZeRO reduces each gradient bucket during the backward of the last
    micro-batch, as soon as its gradients are final (exact either way; False: all at the step).
    overlap_p2p: the "p2p" schedules post each receive one schedule step early, so activations and
    gradients arrive while the stage computes (every micro-batch of a step must give one shape).
    gather_output, vocab_pad_multiple, overlap_communication, prove, example_inputs: as ShardConfig's (same defaults);
    `shard_config` passes them, with the sizes, seed and sequence_parallel, to the model's sharding.
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    dp_replicate: int = 1
    cp: int = ShardConfig.context_parallel_size
    cp_mode: str = ShardConfig.context_parallel_mode
    ep: int = ShardConfig.expert_parallel_size
    zero_stage: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int | None = None  # model chunks per pp rank; None: 2 for VIRTUAL_SCHEDULES, else 1
    precision: str = "fp32"
    max_grad_norm: float | None = None
    layers_per_stage: list[int] | None = None
    split_batch: bool = True
    backend: str = "torch"
    seed: int = ShardConfig.seed
    activation_checkpointing: bool = False
    sequence_parallel: bool = ShardConfig.sequence_parallel
    sequence_parallel_regather: bool = ShardConfig.sequence_parallel_regather
    compile: bool = False
    compile_backend: str = "inductor"
    overlap_grad_reduce: bool = True
    overlap_p2p: bool = True
    gather_output: bool = ShardConfig.gather_output
    vocab_pad_multiple: int = ShardConfig.vocab_pad_multiple
    overlap_communication: bool = ShardConfig.overlap_communication
    prove: bool = ShardConfig.prove
    example_inputs: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_fields(self, check_positive_int, ("tp", "pp", "cp", "ep", "num_microbatches", "vocab_pad_multiple"))
        check_positive_int("EngineConfig.dp", self.dp, optional=True)
        check_positive_int("EngineConfig.dp_replicate", self.dp_replicate)
        if self.dp is not None:
            check_replicate_divides(self.dp_replicate, self.dp, ep=self.ep)
        check_example_inputs("EngineConfig.example_inputs", self.example_inputs)
        for name, choices in CHOICES.items():
            check_choice(f"EngineConfig.{name}", getattr(self, name), choices)
        check_fields(
            self,
            check_bool,
            ("activation_checkpointing", "sequence_parallel", "sequence_parallel_regather", "compile",
             "overlap_grad_reduce", "overlap_p2p", "gather_output", "overlap_communication", "prove"),
        )  # fmt: skip
        backends = torch._dynamo.list_backends(None)
        if not isinstance(self.compile_backend, str) or self.compile_backend not in backends:
            raise ValueError(
                f"EngineConfig.compile_backend={self.compile_backend!r} is not a torch.compile backend; "
                f"use one of {backends}"
            )
        check_int("EngineConfig.seed", self.seed)
        refuse_context_parallel(self)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"EngineConfig.max_grad_norm={self.max_grad_norm!r} must be positive or None")
        check_positive_int("EngineConfig.virtual_stages", self.virtual_stages, optional=True)
        check_virtual_stages(self)
        refuse_zero3(self)
        refuse_expert_parallel(self)

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks (virtual stages) each pp rank holds: 1 but for the virtual schedules at pp > 1."""
        if self.pp == 1 or self.schedule not in VIRTUAL_SCHEDULES:
            return 1
        return self.virtual_stages or 2

    def shard_config(self, mesh: Any) -> ShardConfig:
        """The ShardConfig that shards the model over ``mesh`` (a ProcessMesh with these sizes)."""
        shared = {name: getattr(self, name) for name in SHARD_FIELDS}
        return ShardConfig(
            tensor_parallel_size=self.tp,
            pipeline_parallel_size=self.pp,
            data_parallel_size=mesh.dp_size,
            context_parallel_size=self.cp,
            context_parallel_mode=self.cp_mode,
            expert_parallel_size=self.ep,
            mesh=mesh,
            **shared,
        )
