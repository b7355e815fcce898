"""ParallelEngine: one training API for every (tp, pp, dp, ZeRO) combination.

It composes the techniques: builds the process mesh, shards the model for tensor parallelism
(``shard_model`` with a policy), keeps this rank's pipeline stage (a pipeline spec), wraps the
optimizer in :class:`~shardformer.data_parallel.ZeroOptimizer` over the data-parallel group (at
``zero_stage=3``: FSDP2 over the dp group shards the model itself, and
:class:`~shardformer.data_parallel.fsdp_optimizer.FullyShardedOptimizer` steps), and runs a
pipeline schedule over micro-batches. Its settings, :class:`EngineConfig`, live with ShardConfig in
:mod:`shardformer.core.config` (imported here, so ``from shardformer.engine import EngineConfig`` works).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardformer.api import shard_before_split
from shardformer.context_parallel import context_parallel_stage_forward
from shardformer.core import comm
from shardformer.core.config import PRECISIONS, EngineConfig, check_expert_divides
from shardformer.core.mesh import ProcessMesh, resolve_sizes
from shardformer.core.record import sharding_of
from shardformer.core.step_agreement import batch_fingerprint, check_agreement
from shardformer.data_parallel import ZeroOptimizer
from shardformer.data_parallel.fsdp import fully_shard_model, local_numel, through_root
from shardformer.data_parallel.fsdp_optimizer import FullyShardedOptimizer
from shardformer.expert_parallel.optimizer import ExpertParallelOptimizer
from shardformer.models import family_spec
from shardformer.pipeline.schedule import run_pipeline
from shardformer.pipeline.spec import PipelineSpec, check_split
from shardformer.pipeline.spec_check import check_pipeline_spec
from shardformer.pipeline.stage_view import taken_inputs
from shardformer.pipeline.tied import tied_weights
from shardformer.pipeline.torch_schedule import TorchPipeline
from shardformer.pipeline.virtual import PLACEMENT, check_virtual, chunk_ranks, forward_only, in_chunk, keep_chunks
from shardformer.policies.anatomy import layer_stack
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from shardformer.policies.pipeline_proof import verdicts_from_first_rank
from shardformer.tensor_parallel.detect import call_optional
from shardformer.tensor_parallel.recompute import checkpoint_layers

logger = logging.getLogger("shardformer")


def _loss_from_output(output, micro_batch):
    loss = output.get("loss") if hasattr(output, "get") else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            "the model's output has no loss: put the labels in the batch, or give ParallelEngine a "
            "loss_fn(output, micro_batch)"
        )
    return loss


def split_batch(batch: dict, parts: int, what: str) -> list[dict]:
    """Split every tensor of ``batch`` along dim 0 into ``parts`` equal chunks (others are copied)."""
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.ndim > 0}
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors must share one batch size (dim 0); got sizes {sorted(sizes)}")
    size = sizes.pop()
    if size % parts != 0:
        raise ValueError(
            f"batch size {size} does not divide into {what}={parts}; use a batch size that is a multiple of {parts}"
        )
    step = size // parts
    return [
        {k: v[i * step : (i + 1) * step] if torch.is_tensor(v) and v.ndim > 0 else v for k, v in batch.items()}
        for i in range(parts)
    ]


def whole_model_forward(model: nn.Module, hidden, inputs: dict):
    """The stage forward of an unsplit model (pp=1) that has no pipeline spec: its own forward, given
    the inputs it takes (a timm model's ``x``, not the ``loss_fn``'s targets), in training without a KV
    cache (a recomputed layer would find its keys already in the cache: CpmAnt, GPT-NeoX-Japanese under
    activation checkpointing), as the pipeline stages run."""
    inputs = taken_inputs(type(model).forward, inputs)
    if model.training and "use_cache" not in inputs and "use_cache" in inspect.signature(model.forward).parameters:
        inputs = {**inputs, "use_cache": False}
    return model(**inputs)


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    parent, _, name = path.rpartition(".")
    return model.get_submodule(parent)._modules[name]


def _pipeline_for(model: nn.Module, pp: int, given: PipelineSpec | None) -> PipelineSpec | None:
    """The spec the model is cut by: the given one, else its family's (required only at pp > 1)."""
    if given is not None:
        return given
    return pipeline_spec_for(model) if pp > 1 else family_spec(model)


class ParallelEngine:
    """Train or run ``model`` with tensor, pipeline and ZeRO data parallelism.

    Args:
        model: an unsharded HF / timm model (sharded and split in place).
        optimizer: ``params -> torch.optim.Optimizer`` (built over this rank's stage shards), or None
            for an engine that only runs ``forward`` / ``eval_step`` (inference).
        config: an :class:`EngineConfig`.
        policy: a custom tensor-parallel Policy (default: the built-in one for the model's class).
        pipeline: a custom :class:`~shardformer.pipeline.PipelineSpec`, used as written (default at
            pp > 1: the first route proven exact on a tiny copy, ``pipeline_spec_for``; at pp=1 the
            family's, else the model's own forward).
        loss_fn: ``(last-stage output, micro_batch) -> loss``; default: the output's ``loss`` (refused
            with cp > 1, where each rank's output is its chunk of the sequence).
        mesh: an existing :class:`~shardformer.ProcessMesh` with the same sizes (default: built here).

    ``train_step(batch)`` returns the step's loss, the same on every rank: the mean over the
    ``dp * num_microbatches`` chunks of each chunk's loss (the usual gradient-accumulation mean).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer] | None,
        config: EngineConfig | None = None,
        *,
        policy=None,
        pipeline: PipelineSpec | None = None,
        loss_fn: Callable | None = None,
        mesh: ProcessMesh | None = None,
    ) -> None:
        cfg = self.config = config or EngineConfig()
        if optimizer is not None and (not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer)):
            raise TypeError(
                "optimizer must be a factory `params -> Optimizer` (e.g. lambda p: torch.optim.AdamW(p, lr=1e-4)): "
                "the parameters it steps exist only after sharding"
            )
        # Every check that can fail runs before the first collective.
        if cfg.cp > 1 and loss_fn is not None:  # the model's own loss is computed over the whole sequence
            raise ValueError(
                f"EngineConfig.cp={cfg.cp} with a loss_fn: each context-parallel rank's output holds its chunk of "
                "the sequence, so loss_fn would not see what the unsharded model outputs; put the labels in the "
                "batch (the model's own loss), or use cp=1"
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        _, dp, _ = resolve_sizes(world, cfg.tp, cfg.pp, cfg.dp, cfg.cp)
        check_expert_divides(cfg.ep, dp, "EngineConfig.ep")
        # the route proofs run on the first rank, every rank takes its verdicts (a mesh passed in may be a subset)
        with verdicts_from_first_rank() if mesh is None else contextlib.nullcontext():
            self.pipeline = _pipeline_for(model, cfg.pp, pipeline)
        num_chunks, chunk_counts = cfg.pp * cfg.chunks_per_rank, cfg.layers_per_stage
        if cfg.chunks_per_rank > 1:  # virtual stages: the schedule's needs, the layers per chunk
            layers = len(self.pipeline.layer_paths(model))  # every stack's (an encoder-decoder's two)
            chunk_counts = check_virtual(
                cfg.schedule, cfg.pp, cfg.chunks_per_rank, cfg.num_microbatches, layers, cfg.layers_per_stage
            )
        if cfg.pp > 1:  # the split's sizes, paths and ties, before any process waits
            check_pipeline_spec(self.pipeline, model, num_chunks, chunk_counts)
        if cfg.activation_checkpointing:
            self._checkpoint_activations(model, check_only=True)  # before any collective
        if mesh is not None and (
            (mesh.tp_size, mesh.pp_size, mesh.cp_size, mesh.ep_size) != (cfg.tp, cfg.pp, cfg.cp, cfg.ep)
            or cfg.dp not in (None, mesh.dp_size)
        ):
            raise ValueError(
                f"mesh {mesh} does not match tp={cfg.tp}, pp={cfg.pp}, cp={cfg.cp}, ep={cfg.ep}, dp={cfg.dp}"
            )
        self.mesh = mesh or ProcessMesh(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep)
        self.model = shard_before_split(model, cfg.shard_config(self.mesh), policy, self.pipeline)  # split below
        self.policy = sharding_of(self.model).policy  # the route's (proven) or the one passed
        self._forward_agreement = self.model.shardformer.forward_agreement
        if self._forward_agreement is not None:  # checked per step below: shapes (the step agreement: values)
            self._forward_agreement.in_forward = self._forward_agreement.compare_values = False
        self.chunks = None  # this rank's model chunks under a virtual-stage schedule
        tied = [] if cfg.pp == 1 else self._tied_weights(num_chunks, chunk_counts)
        if cfg.chunks_per_rank > 1:
            self.chunks = keep_chunks(
                self.pipeline, self.model, cfg.schedule, self.mesh.pp_rank, cfg.pp, cfg.chunks_per_rank, chunk_counts
            )
        elif cfg.pp > 1:
            self.pipeline.keep_stage(self.model, self.mesh.pp_rank, cfg.pp, cfg.layers_per_stage)
        # Context parallelism splits the sequence in the model's own forward at pp=1, in each stage's at pp > 1.
        whole = self.pipeline is None or (cfg.cp > 1 and cfg.pp == 1)
        self.stage_forward = whole_model_forward if whole else self.pipeline.stage_forward
        if cfg.cp > 1 and cfg.pp > 1:
            self.stage_forward = context_parallel_stage_forward(self.stage_forward)
        if cfg.compile:  # the stage forward, not the model: a spec's stage forward calls submodules directly
            self.stage_forward = torch.compile(self.stage_forward, backend=cfg.compile_backend)
        if cfg.activation_checkpointing:
            self._checkpoint_activations(self.model)
        chunk_forwards = {}  # {chunk: its stage forward} under a virtual-stage schedule
        if self.chunks is not None:
            chunk_forwards = {c: in_chunk(self.stage_forward, self.chunks, c) for c in self.chunks.indices}
        grad_hooks = []
        if cfg.zero_stage == 3:  # fp32 shards stay the master weights; FSDP2 casts them for compute
            device = next(self.model.parameters()).device
            grad_hooks = fully_shard_model(self.model, self._layer_list(self.model), self.mesh, device, cfg.precision)
            self.stage_forward = through_root(self.stage_forward, calls_the_model=whole)
            chunk_forwards = {c: through_root(f) for c, f in chunk_forwards.items()}  # the view inside the root call
        else:
            self.model.to(PRECISIONS[cfg.precision])
        self._chunk_forwards = chunk_forwards
        self._loss_rank = self.mesh.pp_size - 1  # the pp rank of the last stage (chunk): the losses are there
        if self.chunks is not None:
            self._loss_rank = self.chunks.last_rank
        # Weights several chunks hold (tied embeddings): summed over the ranks holding them after the backward;
        # two chunks of one rank (a V-shaped schedule's first and last) share one parameter, autograd adds up.
        # Groups are made on every rank, in one order (collective).
        me, held = self.mesh.pp_rank, [t for t in tied if t.chunks_here]
        groups = {ranks: self.mesh.stages_group(ranks) for ranks in sorted({t.ranks for t in tied if len(t.ranks) > 1})}
        self.shared = [(groups[t.ranks], t.param(self.model)) for t in held if len(t.ranks) > 1]
        late_grads = [t.param(self.model) for t in held]  # changed after backward, or by two chunks' backwards
        counted_elsewhere = [t.param(self.model) for t in held if me != t.ranks[0]]  # counted once in the norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = None
        if optimizer is not None and cfg.zero_stage == 3:
            self.optimizer = FullyShardedOptimizer(
                optimizer(params), self.model, self.mesh.dp_group, tp_group=self.mesh.tp_group,
                pp_group=self.mesh.pp_group, grad_hooks=grad_hooks, counted_elsewhere=counted_elsewhere,
            )  # fmt: skip
        elif optimizer is not None:
            zero_kwargs = dict(
                tp_group=self.mesh.tp_group,
                pp_group=self.mesh.pp_group,
                counted_elsewhere=counted_elsewhere,  # tied weights count once in the norm: the first holder's copy
                overlap_communication=cfg.overlap_grad_reduce,
                backwards_per_step=cfg.num_microbatches,  # one backward per micro-batch
                late_grads=late_grads,  # summed over the stages after backward (or used by two chunks)
                # cp ranks computed parts of the same sequences: ZeRO sums their gradients bucket by bucket
                sum_group=self.mesh.cp_group if cfg.cp > 1 else None,
                release_grads=cfg.zero_stage == 2,  # ZeRO-2 keeps only its 1/dp row of each reduced gradient
            )
            if self.mesh.ep_size > 1:  # dense parameters over dp, experts over the ranks holding the same ones
                self.optimizer = ExpertParallelOptimizer(optimizer, params, self.mesh, cfg.zero_stage, **zero_kwargs)
            else:
                self.optimizer = ZeroOptimizer(
                    optimizer(params), self.mesh.dp_group, cfg.zero_stage, model=self.model, **zero_kwargs
                )
            if cfg.cp > 1:
                self.model.shardformer.context_parallel.sum_grads_elsewhere(params)
        self.loss_fn = loss_fn or _loss_from_output
        self.device = params[0].device if params else torch.device("cpu")
        self.last_grad_norm: float | None = None
        self._steps_run = 0  # train and eval steps: every rank must be in the same one
        self._torch_pipeline = TorchPipeline(
            self.model, self.stage_forward, self.mesh, self.device, before_backward=self._before_backward,
            stage_forwards=chunk_forwards or None, num_stages=num_chunks, split_backward=self._split_backward_is_exact(),
        )  # fmt: skip
        if self.chunks is not None and self.mesh.rank == 0:
            split = self._torch_pipeline.split_backward and cfg.schedule in ("zbv", "dualpipev")
            logger.info(
                "ParallelEngine: %s over %d chunks of %s layers, rank 0 holds chunks %s; %s backward", cfg.schedule,
                num_chunks, chunk_counts, list(self.chunks.indices), "split (input, then weight)" if split else "whole",
            )  # fmt: skip
        if self.mesh.rank == 0:
            logger.info(
                "ParallelEngine: tp=%d cp=%d (%s) pp=%d dp=%d, ZeRO-%d, %s precision, %d micro-batch(es) (%s, backend %s); "
                "rank 0 holds %s and %s trainable parameters",
                cfg.tp, cfg.cp, cfg.cp_mode, cfg.pp, self.mesh.dp_size, cfg.zero_stage, cfg.precision, cfg.num_microbatches,
                cfg.schedule, cfg.backend,
                "every layer" if self.model.shardformer.layers is None else f"layers {list(self.model.shardformer.layers)}",
                f"{sum(local_numel(p) for p in params):,}",
            )  # fmt: skip

    def _split_backward_is_exact(self) -> bool:
        """ZBV / DualPipeV may use torch's weight step, which writes ``.grad`` outside autograd's
        accumulation, only where nothing hooks into it: no FSDP2 (ZeRO-3), no gradient hooks on the
        parameters (tensor-/context-parallel sums), no recompute in backward."""
        cfg = self.config
        if cfg.zero_stage == 3 or cfg.activation_checkpointing or cfg.tp > 1 or cfg.cp > 1:
            return False
        if self.pipeline is not None and self.pipeline.second_layers is not None:
            # an encoder-decoder's chunks hand on received tensors (the encoder's output, T5's position bias):
            # torch's weight step walks a graph its input step already freed there ("backward a second time")
            return False
        return not any(p._backward_hooks for p in self.model.parameters())

    def _layer_list(self, model: nn.Module) -> list | nn.Module | None:
        """The repeated layers (each is one FSDP2 unit at zero_stage=3): the pipeline spec's (every stack's:
        an encoder-decoder's two; None where another stage holds it), else the family's or transformers'
        plan's; None when neither names them (the model is one unit)."""
        if self.pipeline is not None:
            return [_module_at(model, path) for path in self.pipeline.layer_paths(model)]
        path = layer_stack(model)
        return model.get_submodule(path) if path is not None else None

    def _checkpoint_activations(self, model: nn.Module, check_only: bool = False) -> None:
        """transformers models use their own per-layer checkpointing (the sharder made it replay the
        dropout masks); other models get their layer stack wrapped (the given pipeline spec's, else the
        model family's)."""
        layers = self.pipeline.layers if self.pipeline is not None else layer_stack(model)
        if getattr(model, "supports_gradient_checkpointing", False):
            if not check_only:  # transformers 5.23 renamed gradient_checkpointing_enable
                enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
                if call_optional(model, "get_input_embeddings") is not None:
                    enable()
                    return
                # a later pipeline stage: no embedding to hook (transformers would log that it "does not
                # expose input embeddings"), and its input arrives from the previous stage requiring grad
                model.enable_input_require_grads = lambda: None
                try:
                    enable()
                finally:
                    del model.enable_input_require_grads
        elif layers is not None:
            if not check_only:
                checkpoint_layers(model.get_submodule(layers))
        else:
            raise ValueError(
                f"activation_checkpointing: {type(model).__name__} has no transformers checkpointing and no "
                f"pipeline spec naming its layers; pass pipeline=PipelineSpec(layers=..., ...) to ParallelEngine"
            )

    # -- steps ---------------------------------------------------------------------------------------

    def _forward_for(self, batch: dict):
        """The stage forward for ``batch``. A pipeline spec's forward embeds ``input_ids`` itself, so a
        batch of ``inputs_embeds`` runs the model's own forward (pp=1) or is refused (pp > 1)."""
        embeds = sorted(k for k, v in batch.items() if k.endswith("inputs_embeds") and v is not None)
        if not embeds:
            return self.stage_forward
        both = [k for k in embeds if batch.get(k.replace("inputs_embeds", "input_ids")) is not None]
        if both:
            ids = both[0].replace("inputs_embeds", "input_ids")
            raise ValueError(
                f"the batch holds both {ids} and {both[0]}; pass only one of them (the model itself refuses both)"
            )
        if self.mesh.pp_size > 1:
            raise ValueError(
                f"the batch holds {embeds[0]} at pipeline_parallel_size={self.mesh.pp_size}: the first stage "
                f"embeds input_ids itself; pass input_ids, or run at pipeline_parallel_size=1, where the model's "
                f"own forward takes {embeds[0]}"
            )
        return whole_model_forward

    def _local_batch(self, batch: dict) -> dict:
        if not self.config.split_batch or self.mesh.dp_size == 1:
            return batch
        return split_batch(batch, self.mesh.dp_size, "data_parallel_size")[self.mesh.dp_rank]

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _check_shapes(self, batch: dict) -> None:
        """tp/cp peers hold batches of the same shapes, compared before the forward's collectives (which
        abort on other sizes) before every step (core/forward_agreement.py)."""
        if self._forward_agreement is not None:
            self._forward_agreement.check_inputs(self.model, batch, split=self.mesh.cp_size > 1)

    def _agreed_loss(self, losses: list[torch.Tensor], batch: dict, kind: int) -> float:
        """Mean of the last stage's micro-batch losses, averaged over dp, on every rank; the same
        all-gather checks that the ranks are in the same step with the batches they must share."""
        mesh = self.mesh
        self._steps_run += 1
        local = torch.stack(losses).float().mean().item() if losses else 0.0
        row = [local, batch_fingerprint(batch), self._steps_run, kind]
        table = torch.stack(comm.all_gather(torch.tensor(row, dtype=torch.float64, device=self.device), None)).cpu()
        check_agreement(table[:, 1:], self._batch_peers())
        per_dp = [table[mesh.global_rank(self._loss_rank, d, mesh.tp_rank), 0] for d in range(mesh.dp_size)]
        return (torch.stack(per_dp).float().sum() / mesh.dp_size).item()

    def _batch_peers(self) -> list[list[int]]:
        """Groups of ranks given the same batch: all of them when the engine splits it over dp."""
        mesh = self.mesh
        if self.config.split_batch or mesh.dp_size == 1:
            return [list(range(mesh.world_size))]
        return [
            [
                mesh.global_rank(p, d, t, c)
                for p in range(mesh.pp_size)
                for c in range(mesh.cp_size)
                for t in range(mesh.tp_size)
            ]
            for d in range(mesh.dp_size)
        ]

    def train_step(self, batch: dict) -> float:
        """Forward and backward over the micro-batches, then one optimizer step; returns the loss."""
        cfg, mesh, zero = self.config, self.mesh, self.optimizer
        if zero is None:
            raise RuntimeError("this ParallelEngine was built without an optimizer (inference only); pass one to train")
        forward = self._forward_for(batch)
        local = self._to_device(self._local_batch(batch))
        self._check_shapes(local)
        micro = split_batch(local, cfg.num_microbatches, "num_microbatches")
        self.model.train()
        zero.zero_grad()
        scale = zero.loss_scale / cfg.num_microbatches
        if cfg.backend == "torch" and mesh.pp_size > 1:
            losses = self._torch_pipeline.step(micro, self.loss_fn, schedule=cfg.schedule, scale=scale)
        else:
            losses, _ = run_pipeline(
                self.model, forward, mesh, micro, self.loss_fn, schedule=cfg.schedule, scale=scale,
                device=self.device, overlap=cfg.overlap_p2p, before_backward=self._before_backward,
            )  # fmt: skip
        loss = self._agreed_loss(losses, batch, kind=1)  # before anything changes
        self._sum_shared_grads()
        if cfg.max_grad_norm is not None:
            self.last_grad_norm = zero.clip_grad_norm(cfg.max_grad_norm)
        zero.step()
        return loss

    @torch.no_grad()
    def eval_step(self, batch: dict) -> float:
        """The loss of ``batch`` without updating anything (same split and averaging as train_step)."""
        forward = self._forward_for(batch)
        local = self._to_device(self._local_batch(batch))
        self._check_shapes(local)
        micro = split_batch(local, self.config.num_microbatches, "num_microbatches")
        self.model.eval()
        losses, _ = self._forward_only(forward, micro, self.loss_fn)
        return self._agreed_loss(losses, batch, kind=2)

    def _forward_only(self, forward, micro, loss_of):
        """Forward passes of ``micro`` over the stages (our send/recv): ``(losses, outputs)`` on the rank of
        the last stage."""
        if self.chunks is not None:
            return forward_only(self._chunk_forwards, self.chunks, self.model, self.mesh, micro, loss_of, self.device)
        return run_pipeline(
            self.model, forward, self.mesh, micro, loss_of, backward=False, device=self.device,
            overlap=self.config.overlap_p2p,
        )  # fmt: skip

    @torch.no_grad()
    def forward(self, batch: dict):
        """Inference on the whole ``batch`` (not split over dp): the last stage's outputs per
        micro-batch, concatenated (``logits`` of a ModelOutput, or the tensor itself). Returned on
        every rank (sent from the last stage over the pipeline); vocab-parallel logits stay
        sharded over tp unless ``EngineConfig.gather_output`` is set."""
        forward = self._forward_for(batch)
        self._check_shapes(batch)
        micro = split_batch(self._to_device(batch), self._inference_chunks(batch), "num_microbatches")
        self.model.eval()
        _, outputs = self._forward_only(forward, micro, None)
        out = None
        if outputs:
            out = torch.cat([o if torch.is_tensor(o) else o["logits"] for o in outputs]).contiguous()
        if self.mesh.pp_size == 1:
            return out
        last = self._loss_rank  # the last stage's output, on every stage
        shape, dtype = comm.broadcast_object(
            None if out is None else (tuple(out.shape), out.dtype), self.mesh.pp_group, last
        )
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self.device)
        return comm.broadcast(out, self.mesh.pp_group, last)

    __call__ = forward

    def _inference_chunks(self, batch: dict) -> int:
        """Micro-batches for ``forward``: up to ``num_microbatches``, as many as divide the batch (in
        inference they only pipeline the stages; any count gives the same outputs)."""
        sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.ndim > 0}
        if len(sizes) != 1:
            return self.config.num_microbatches  # split_batch names the sizes
        size = sizes.pop()
        return max(n for n in range(1, min(size, self.config.num_microbatches) + 1) if size % n == 0)

    # -- gradients ----------------------------------------------------------------------------------

    def _before_backward(self, last: bool, stage: int | None = None) -> None:
        """ZeRO-3 with micro-batches: FSDP2 accumulates the unsharded gradients of all but the stage's
        last micro-batch and reduce-scatters once, in the last backward (ZeRO-1/2 count backward passes
        themselves: ``backwards_per_step``). With several chunks per rank (``stage``: the chunk whose
        backward comes), each chunk's layer units wait for that chunk's last backward; the root's own
        parameters (embedding, norm, head), which two chunks may share, are reduce-scattered in every
        backward that reaches them (exact: FSDP2 adds each reduced part to the sharded gradient)."""
        if self.config.zero_stage != 3 or self.config.num_microbatches == 1:
            return
        if self.chunks is None:
            self.model.set_requires_gradient_sync(last)
            return
        self.model.set_requires_gradient_sync(True, recurse=False)
        paths = self.pipeline.layer_paths(self.model)
        for i in self.chunks.layers[self.chunks.indices.index(stage)]:
            self.model.get_submodule(paths[i]).set_requires_gradient_sync(last)

    def _tied_weights(self, num_chunks: int, counts) -> list:
        """The weights several chunks hold, from the spec's placement of the model not yet split."""
        cfg, spec = self.config, self.pipeline
        counts = check_split(len(spec.layer_paths(self.model)), num_chunks, counts)
        starts = [sum(counts[:c]) for c in range(num_chunks)]
        layers = [tuple(range(starts[c], starts[c] + counts[c])) for c in range(num_chunks)]
        ranks = chunk_ranks(PLACEMENT[cfg.schedule], cfg.pp, num_chunks) if cfg.chunks_per_rank > 1 else range(cfg.pp)
        placement = [[layers[c] for c, r in enumerate(ranks) if r == pp_rank] for pp_rank in range(cfg.pp)]
        return tied_weights(spec, self.model, placement, self.mesh.pp_rank)

    def _sum_shared_grads(self) -> None:
        """Tied weights held by several stages: sum their gradients over the stages holding them."""
        for group, p in self.shared:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            # at ZeRO-3 the stages hold the same dp shard of the tied weight: sum the shards
            comm.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group)
