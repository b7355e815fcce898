"""The layouts a model's shapes admit on a cluster: what ``shardformer plan --search`` enumerates.

A `Layout` is one way to run a training step on ``gpus`` GPUs: tensor (tp), context (cp), pipeline
(pp, with its schedule and virtual stages) and data parallelism (dp, with a ZeRO stage; expert
parallelism ep drawn from it), the micro-batch size and count that make up the global batch,
activation checkpointing and sequence parallelism. `ModelShape` reads, once, what decides which of
them a model admits: tp divides the attention heads and the MLP width (key/value heads fewer than tp
are replicated, as the library does); pp and its chunks fit in the layer stack; ep divides the routed
experts (MoE models only); cp only where the library's context-parallel checks accept the model's
attention. Each layout is then checked by `EngineConfig` itself (what the engine refuses is not offered).

Hybrid sharded data parallelism (dp = replicate x shard, `EngineConfig.dp_replicate`) is enumerated
where a dp group spans nodes (`dp_splits`): ZeRO shards over dp / replicate ranks inside a node.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch.nn as nn

from shardformer.context_parallel.checks import check_context_parallel
from shardformer.core.config import ENGINE_ZERO_STAGES, SCHEDULES, VIRTUAL_SCHEDULES, EngineConfig
from shardformer.expert_parallel.sizing import expert_sizing
from shardformer.pipeline.spec import check_split
from shardformer.pipeline.virtual import check_virtual
from shardformer.policies.anatomy import stack_anatomy

POWERS = (1, 2, 4, 8, 16, 32, 64)
MICRO_BATCH_SIZES = (1, 2, 4, 8)
ZERO_CHOICES = ENGINE_ZERO_STAGES  # EngineConfig has no stage 0: at dp=1 stage 1 shards nothing


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    cp_mode: str = "ring"
    ep: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per pp rank
    micro_batch: int = 1  # sequences per micro-batch and dp rank
    microbatches: int = 1  # micro-batches per step and dp rank
    checkpointing: bool = False
    sequence_parallel: bool = False
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x (dp / dp_replicate), ZeRO sharded over the latter

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def engine_fields(self, precision: str) -> dict:
        """The EngineConfig fields of this layout that differ from EngineConfig's defaults."""
        wanted = {
            "tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "cp_mode": self.cp_mode, "ep": self.ep,
            "zero_stage": self.zero, "num_microbatches": self.microbatches, "schedule": self.schedule,
            "virtual_stages": self.virtual_stages if self.schedule in VIRTUAL_SCHEDULES and self.pp > 1 else None,
            "precision": precision, "activation_checkpointing": self.checkpointing,
            "sequence_parallel": self.sequence_parallel, "dp_replicate": self.dp_replicate,
        }  # fmt: skip
        if self.cp == 1:
            del wanted["cp_mode"]
        defaults = {f.name: f.default for f in fields(EngineConfig)}
        return {k: v for k, v in wanted.items() if k == "dp" or v != defaults[k]}

    def short(self) -> str:
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}({self.cp_mode})"] if self.cp > 1 else [])
        parts.append(f"pp{self.pp}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        hybrid = f"({self.dp_replicate}x{self.dp // self.dp_replicate})" if self.dp_replicate > 1 else ""
        parts += [f"dp{self.dp}{hybrid}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        text = " ".join(parts) + f" z{self.zero}"
        if self.pp > 1:
            text += f" {self.schedule}"
        text += f" mb{self.micro_batch}x{self.microbatches}"
        return text + (" ckpt" if self.checkpointing else "") + (" sp" if self.sequence_parallel else "")


@dataclass
class ModelShape:
    """What a model's shapes admit, read once from the model built on the meta device."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    numel: int  # parameters of the whole model
    active_numel: int  # parameters one token runs through (a MoE model's routed experts: top-k of them)
    experts: int = 0  # routed experts per MoE layer (0: dense)
    moe_layers: int = 0
    top_k: int = 0
    tied: bool = False  # the LM head is the input embedding (counted once in numel)
    cp_refused: str | None = None  # why context parallelism is not offered (None: it is)


def model_shape(model: nn.Module) -> ModelShape:
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    pick = lambda *names: next((getattr(text, n) for n in names if getattr(text, n, None)), 0)  # noqa: E731
    hidden = pick("hidden_size", "n_embd", "d_model")
    heads = pick("num_attention_heads", "n_head")
    numel = sum(p.numel() for p in model.parameters())
    shape = ModelShape(
        layers=pick("num_hidden_layers", "n_layer", "num_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=pick("num_key_value_heads") or heads,
        head_dim=pick("head_dim") or hidden // max(heads, 1),
        intermediate=pick("intermediate_size", "n_inner") or 4 * hidden,
        vocab=pick("vocab_size"),
        numel=numel,
        active_numel=numel,
    )
    shape.tied = _tied(model)
    experts = expert_sizing(model, 1)
    if experts is not None:
        shape.experts, shape.moe_layers, shape.top_k = experts.experts, len(experts.paths), experts.top_k
        shape.active_numel = numel - experts.expert_numel + experts.expert_numel * experts.top_k // experts.experts
    shape.cp_refused = _cp_refused(model)
    return shape


def _tied(model: nn.Module) -> bool:
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return embed is not None and head is not None and embed.weight is head.weight


def _cp_refused(model: nn.Module) -> str | None:
    """Why the library refuses context parallelism on this model (None: it takes it), at cp=2."""
    sizes = SimpleNamespace(context_parallel_size=2, context_parallel_mode="ring", tensor_parallel_size=1)
    try:
        check_context_parallel(model, sizes, stack_anatomy(model))
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return None


def tp_sizes(shape: ModelShape, most: int) -> list[int]:
    """tp sizes that divide the query heads and the MLP width, up to ``most`` (a node's GPUs)."""
    return [t for t in POWERS if t <= most and shape.heads % t == 0 and shape.intermediate % t == 0]


def dp_splits(dp: int, gpus_per_node: int, tp_cp: int) -> list[int]:
    """``dp_replicate`` values to try: plain dp (1), and where a dp group spans several nodes (its ranks
    are ``tp x cp`` apart) hybrid sharding whose shard groups are whole nodes' dp ranks: ``replicate``
    divides the number of nodes spanned, so ZeRO's gathers and reduce-scatters stay inside a node (or
    inside ``nodes / replicate`` of them) and only the replicas' all-reduce crosses. Not offered
    within one node, nor where a node holds a single dp rank (a shard of one would replicate the
    whole state: no memory saved)."""
    per_node, rest = divmod(gpus_per_node, tp_cp)
    if rest or per_node < 2 or dp <= per_node or dp % per_node:
        return [1]
    nodes = dp // per_node
    return [1] + [r for r in range(2, nodes + 1) if nodes % r == 0]


def enumerate_layouts(
    shape: ModelShape, gpus: int, gpus_per_node: int, global_batch: int, seq: int, precision: str, schedules=None
) -> list[Layout]:
    """Every layout of ``gpus`` GPUs the model's shapes and EngineConfig admit for ``global_batch``
    sequences of ``seq`` tokens per step."""
    out = []
    cps = [1] if shape.cp_refused else [c for c in POWERS if c <= gpus and (c == 1 or seq % (2 * c) == 0)]
    for tp in tp_sizes(shape, min(gpus, gpus_per_node)):
        for cp in cps:
            for pp in (p for p in POWERS if p <= shape.layers and gpus % (tp * cp * p) == 0):
                dp = gpus // (tp * cp * pp)
                for ep in (e for e in POWERS if dp % e == 0 and (e == 1 or (shape.experts and shape.experts % e == 0))):
                    base = Layout(tp, pp, dp, cp, ep=ep)
                    out += _variants(shape, base, global_batch, schedules, gpus_per_node, precision)
    return out


def _variants(shape, base: Layout, global_batch: int, schedules, gpus_per_node: int, precision: str) -> list[Layout]:
    """The schedule, ZeRO, micro-batch, checkpointing and sequence-parallel choices of one mesh."""
    if global_batch % base.dp:
        return []
    modes = ("ring", "all_to_all") if base.cp > 1 else ("ring",)
    pipes = [("1f1b", 1)]
    if base.pp > 1:
        pipes = [(s, 1) for s in SCHEDULES] + [(s, 2) for s in VIRTUAL_SCHEDULES]
        pipes = [(s, v) for s, v in pipes if schedules is None or s in schedules]
    per_rank = global_batch // base.dp
    out = []
    for mode, (schedule, virtual), zero in itertools.product(modes, pipes, ZERO_CHOICES):
        for b, replicate in itertools.product(
            (b for b in MICRO_BATCH_SIZES if per_rank % b == 0), dp_splits(base.dp, gpus_per_node, base.tp * base.cp)
        ):
            m = per_rank // b
            choices = (zero, schedule, virtual, m, shape.layers, precision, replicate)
            if not engine_admits(base.pp, base.cp, base.ep, base.dp, *choices):
                continue
            for ckpt, sp in itertools.product((False, True), (False, True) if base.tp > 1 else (False,)):
                out.append(
                    Layout(base.tp, base.pp, base.dp, base.cp, mode, base.ep, zero, schedule, virtual, b, m, ckpt,
                           sp, replicate)
                )  # fmt: skip
    return out


@functools.cache
def engine_admits(
    pp: int, cp: int, ep: int, dp: int, zero: int, schedule: str, virtual: int, microbatches: int, layers: int,
    precision: str, replicate: int = 1,
) -> bool:  # fmt: skip
    """Whether EngineConfig and the schedule take these choices (ZeRO-3 with cp, fp16 with ep or ZeRO-3, ep
    not dividing hybrid sharding's shard group, too few micro-batches or layers for a virtual schedule, ...):
    what the engine refuses is not offered."""
    try:
        config = EngineConfig(
            pp=pp, cp=cp, ep=ep, dp=dp, dp_replicate=replicate, zero_stage=zero, schedule=schedule, precision=precision, prove=False,
            virtual_stages=virtual if schedule in VIRTUAL_SCHEDULES and pp > 1 else None, num_microbatches=microbatches,
        )  # fmt: skip
        if config.chunks_per_rank > 1:
            check_virtual(schedule, pp, config.chunks_per_rank, microbatches, layers)
        if schedule == "1f1b" and pp > 1 and microbatches < pp and config.backend == "torch":
            return False  # torch's Schedule1F1B refuses fewer micro-batches than stages (at the first step)
        check_split(layers, pp)
    except ValueError:
        return False
    return True
