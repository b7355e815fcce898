"""The cost model ``shardformer plan --search`` ranks layouts by: one training step's time, by part.

- **Compute**: the step's FLOPs, ``6 x N`` per token for the ``N`` parameters a token runs through
  in matrix products (a MoE token: its top-k experts; the input embedding is a lookup) plus causal
  attention's ``6 x layers x seq x heads x head_dim`` (forward and backward), spread evenly over the
  ranks, at ``efficiency`` x ``peak_flops`` (`Hardware`). **Recompute** (activation checkpointing):
  one more forward, a third of the compute.
- **Communication**, each collective by the alpha-beta model on the links its group spans: ring
  all-reduce ``2(p-1) alpha + 2(p-1)/p x bytes / beta``, all-gather, reduce-scatter and all-to-all
  ``(p-1) alpha + (p-1)/p x bytes / beta``, a send ``alpha + bytes / beta``. A group is inside one
  node when the ranks it spans fit in ``gpus_per_node`` (the mesh's rank order: tp innermost, then
  cp, dp (ep is consecutive dp ranks), pp outermost): the node's alpha and beta. Across nodes (`Span`),
  with ``g`` of its ranks on each node: the inter-node alpha, and ``beta = min(intra, g x inter)``:
  every GPU has its own NIC (``inter`` is per GPU), the collective's rings cross between nodes
  through the group's ``g`` NICs of a node at once, and the bytes each rank moves also pass its
  fast link. A send between nodes goes through one NIC: ``beta = inter``.
  tp: per layer and micro-batch 2 all-reduces forward and 2 backward of ``micro-batch x seq / cp x
  hidden`` activations (sequence parallelism: the same bytes as all-gathers and reduce-scatters),
  1 more when the layer is recomputed (torch's checkpoint stops recomputing after the last tensor
  the backward needs, before the MLP's all-reduce); per micro-batch, outside the layers, the vocabulary-parallel
  embedding's and head's activation all-reduces and the loss's three fp32 ones per token. cp ring:
  ``cp - 1`` sends of the layer's keys and values forward, backward ``cp - 1`` again with the fp32
  key/value gradients and one more of those; cp all-to-all: 4 forward and 4 backward; once a step,
  the fp32 gradient all-reduced over the cp ranks (each computed its part of the sequences). ep: 2 all-to-alls of
  ``tokens x top-k x hidden`` forward and 2 backward per MoE layer. dp, once a step: ZeRO-2
  reduce-scatters the fp32 gradients, ZeRO-1 all-reduces them (written back to ``param.grad``), both
  all-gather the updated parameters; ZeRO-3 gathers each
  layer's parameters twice per micro-batch (forward, backward; a recomputed forward runs while the
  layer is gathered for its backward), the rest (embedding, head, norm: FSDP2's root, which it keeps
  for the backward) once per micro-batch, and reduce-scatters fp32 gradients once; experts over the expert-dp ranks. HSDP (replicate x shard): that traffic inside the shard
  group (its link: a node's when the shard group fits in one), ZeRO-3's gathers too, then an fp32
  all-reduce over the replicas on the link they span: of this rank's 1/shard of the gradient
  (ZeRO-2/3), of the whole gradient at ZeRO-1 (every row is written back to ``param.grad``). pp: one send of the activation forward and one
  of its gradient backward per micro-batch and chunk boundary. Nothing is counted as overlapped.
- **Pipeline bubble**: the schedule's own action list (`shardformer.pipeline.bubble.schedule_actions`)
  replayed with each action costing its compute and communication; the step is the last rank's end
  (GPipe and 1F1B in closed form, ``(m + pp - 1) x (F + B)``, which their replay equals: `pipeline_step`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from shardformer.core.config import SCHEDULES
from shardformer.pipeline.bubble import replay, schedule_actions
from shardformer.tools.plan import BYTES
from shardformer.tools.search_space import Layout, ModelShape


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Bandwidths are what a collective moves per GPU (bus bandwidth), bytes/s."""

    name: str
    peak_flops: float  # dense, in the training precision
    efficiency: float  # the fraction of peak the model's matrix products reach
    intra_bandwidth: float
    intra_latency: float  # seconds per message (alpha)
    inter_bandwidth: float
    inter_latency: float


# Published peaks (dense bf16) and link speeds; efficiency and the achieved shares of the links are
# stated assumptions (40% of peak; NCCL's bus bandwidth at large messages ~80% of the link's).
HARDWARE = {
    "h100": Hardware("H100 SXM, NVLink 4 (450 GB/s), 400 Gb/s InfiniBand per GPU", 989e12, 0.40, 360e9, 5e-6,
                     40e9, 15e-6),
    "h200": Hardware("H200 SXM, NVLink 4 (450 GB/s), 400 Gb/s InfiniBand per GPU", 989e12, 0.40, 360e9, 5e-6,
                     40e9, 15e-6),
    "a100": Hardware("A100 SXM, NVLink 3 (300 GB/s), 200 Gb/s InfiniBand per GPU", 312e12, 0.40, 240e9, 5e-6,
                     20e9, 15e-6),
}  # fmt: skip


@dataclass
class StepCost:
    """Seconds of one step by part (the busiest rank's), and the step's length."""

    parts: dict[str, float] = field(default_factory=dict)
    step: float = 0.0
    tokens: int = 0  # tokens per step, the whole job

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step if self.step else 0.0


@dataclass(frozen=True)
class RankState:
    """What the dp traffic depends on: a rank's parameters (its fullest stage), of which routed experts,
    and its largest layer's (ZeRO-3 gathers one at a time)."""

    numel: int
    expert_numel: int
    layer_numel: int


@dataclass(frozen=True)
class Span:
    """Where a group's ranks sit: ``per_node`` of them on each of ``nodes`` nodes, and the links between
    them. A collective runs as rings (NCCL's channels), one crossing between nodes through each of the
    group's ``per_node`` NICs of a node, so the bytes a rank moves cross at the slower of its fast link
    and ``per_node`` x the per-GPU inter-node bandwidth; each ring step waits for the slowest hop."""

    per_node: int
    nodes: int
    hw: Hardware

    @property
    def alpha(self) -> float:
        return self.hw.intra_latency if self.nodes == 1 else self.hw.inter_latency

    @property
    def beta(self) -> float:
        if self.nodes == 1:
            return self.hw.intra_bandwidth
        return min(self.hw.intra_bandwidth, self.per_node * self.hw.inter_bandwidth)


def all_reduce(nbytes: float, p: int, link: Span) -> float:
    return 0.0 if p == 1 else 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes / link.beta


def one_way(nbytes: float, p: int, link: Span) -> float:
    """All-gather, reduce-scatter or all-to-all of ``nbytes`` (the whole gathered size)."""
    return 0.0 if p == 1 else (p - 1) * link.alpha + (p - 1) / p * nbytes / link.beta


def send(nbytes: float, link: Span) -> float:
    """One hop to the next rank of the group: between nodes through one NIC (the slowest hop sets the pace)."""
    return link.alpha + nbytes / (link.beta if link.nodes == 1 else min(link.beta, link.hw.inter_bandwidth))


class _Links:
    """The `Span` of a group of ``size`` ranks ``stride`` apart in the mesh's rank order. Every rank has
    its own NIC (the node's inter-node bandwidth is ``gpus_per_node`` x ``inter_bandwidth``), and the
    node's other ranks run their own copies of the group's collective at the same time, so a group
    with ``per_node`` ranks on a node has ``per_node`` NICs of it."""

    def __init__(self, hw: Hardware, gpus_per_node: int):
        self.hw, self.gpus_per_node = hw, gpus_per_node

    def __call__(self, stride: int, size: int) -> Span:
        if stride * size <= self.gpus_per_node:
            return Span(size, 1, self.hw)
        per_node = max(1, min(size, self.gpus_per_node // stride))
        return Span(per_node, -(-size // per_node), self.hw)


def step_cost(
    layout: Layout, shape: ModelShape, state: RankState, seq: int, precision: str, hw: Hardware, gpus_per_node: int
) -> StepCost:
    """One step of ``layout`` (see the module doc)."""
    w, L = BYTES[precision], _Links(hw, gpus_per_node)
    tp, cp, pp, dp, ep, v = layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.virtual_stages
    b, m, n = layout.micro_batch, layout.microbatches, seq // cp
    layers = shape.layers / (pp * v)  # per chunk
    tokens = b * seq
    matmul = shape.active_numel - (0 if shape.tied else shape.vocab * shape.hidden)
    flops = tokens * (2 * matmul + 2 * shape.layers * seq * shape.heads * shape.head_dim)  # forward, causal
    f = flops / (tp * cp * pp * v) / (hw.peak_flops * hw.efficiency)  # one chunk's forward of one micro-batch
    recompute = f if layout.checkpointing else 0.0
    act = b * n * shape.hidden * w
    tp_link, cp_link = L(1, tp), L(tp, cp)
    tp_fwd = layers * 2 * all_reduce(act, tp, tp_link)
    cp_fwd, cp_bwd = (layers * x for x in _cp_exchange(layout, shape, b * n, w, cp_link))
    ep_fwd = 0.0
    if ep > 1:
        moe = shape.moe_layers / (pp * v)
        ep_fwd = moe * 2 * one_way(b * n * shape.top_k * shape.hidden * w * ep, ep, L(tp * cp, ep))
    gather = 0.0  # ZeRO-3: a layer's parameters gathered forward and again backward (HSDP: in the shard group)
    if layout.zero == 3:
        shard = dp // layout.dp_replicate
        gather = layers * one_way(state.layer_numel * w, shard, L(tp * cp, shard))
    p2p = 0.0
    if pp > 1:
        p2p = send(act, L(tp * cp * dp, pp))
    chunk = {
        "compute": (f, 2 * f),
        "recompute": (0.0, recompute),
        # recomputed: torch's checkpoint stops after the last tensor backward needs, before the MLP's all-reduce
        "tp": (tp_fwd, tp_fwd * (1.5 if layout.checkpointing else 1)),
        "cp": (cp_fwd, cp_bwd + (cp_fwd if layout.checkpointing else 0.0)),
        "ep": (ep_fwd, ep_fwd * (2 if layout.checkpointing else 1)),
        "dp": (gather, gather),
        "pp": (p2p, p2p),
    }
    forward = sum(x for x, _ in chunk.values())
    backward = sum(y for _, y in chunk.values())
    scale = pipeline_step(layout.schedule, pp, m, v, forward, backward)
    parts = {k: m * v * (x + y) for k, (x, y) in chunk.items()}
    parts["bubble"] = scale - sum(parts.values()) if pp > 1 else 0.0
    once = {"tp": m * _tp_ends(layout, b * n, act, tp_link), "dp": _dp_step(layout, state, w, L),
            "cp": all_reduce(state.numel * 4, cp, cp_link)}  # fmt: skip
    if layout.zero == 3:  # the root unit (embedding, head, norm): gathered once per micro-batch, kept for backward
        shard = dp // layout.dp_replicate
        root = max(state.numel - round(shape.layers / pp) * state.layer_numel, 0)
        once["dp"] += m * one_way(root * w, shard, L(tp * cp, shard))
    for k, x in once.items():
        parts[k] += x
    return StepCost({k: x for k, x in parts.items() if x > 0}, scale + sum(once.values()), tokens * m * dp)


def _tp_ends(layout: Layout, local_tokens: int, act: float, link: Span) -> float:
    """One micro-batch's tensor-parallel traffic outside the layers: the vocabulary-parallel embedding's
    output all-reduce (first stage), the head's input-gradient all-reduce and the vocabulary-parallel
    loss's three fp32 all-reduces per token (last stage; pp > 1: the busier end only)."""
    if layout.tp == 1:
        return 0.0
    return (1 if layout.pp > 1 else 2) * all_reduce(act, layout.tp, link) + 3 * all_reduce(
        local_tokens * 4, layout.tp, link
    )


def _cp_exchange(layout: Layout, shape: ModelShape, local_tokens: int, w: int, link) -> tuple[float, float]:
    """One layer's context-parallel exchange, forward and backward. The ring (`context_parallel.ring`):
    keys and values move ``cp - 1`` times forward; backward they move ``cp - 1`` times again, each
    shift with the fp32 key/value gradients, which make the full turn (``cp`` shifts)."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return 0.0, 0.0
    if layout.cp_mode == "ring":
        kv_heads = max(shape.kv_heads // tp, 1)
        kv = 2 * local_tokens * kv_heads * shape.head_dim * w
        grads = kv * 4 / w
        return (cp - 1) * send(kv, link), (cp - 1) * send(kv + grads, link) + send(grads, link)
    heads = local_tokens * (shape.heads // tp) * shape.head_dim * w
    return 4 * one_way(heads * cp, cp, link), 4 * one_way(heads * cp, cp, link)


def _dp_step(layout: Layout, state: RankState, w: int, L) -> float:
    """The once-a-step data-parallel traffic (module doc): dense parameters over dp, experts over dp / ep."""
    dp, ep, r = layout.dp, layout.ep, layout.dp_replicate
    dense, experts = state.numel - state.expert_numel, state.expert_numel
    total = 0.0
    for numel, ranks, stride in ((dense, dp, 1), (experts, dp // ep, ep)):
        if not numel or ranks == 1:
            continue
        shard = ranks // r
        inner = L(layout.tp * layout.cp * stride, shard)
        # fp32 gradients: reduce-scattered (ZeRO-2/3); ZeRO-1 all-reduces them (written back to param.grad)
        grads = (all_reduce if layout.zero == 1 else one_way)(numel * 4, shard, inner)
        if layout.zero < 3:
            grads += one_way(numel * w, shard, inner)  # the updated parameters gathered
        if r > 1:  # HSDP: the reduced gradients all-reduced over the replicas (ZeRO-1: every row, written back)
            across = L(layout.tp * layout.cp * stride * shard, r)
            grads += all_reduce(numel * 4 / (1 if layout.zero == 1 else shard), r, across)
        total += grads
    return total


def pipeline_step(schedule: str, pp: int, microbatches: int, chunks: int, forward: float, backward: float) -> float:
    """Seconds of the schedule's step with each chunk's forward and backward of one micro-batch costing
    ``forward`` and ``backward`` (whole; ZBV / DualPipeV run it in their ``I`` step, ``W`` empty).
    GPipe and 1F1B in closed form: their action lists replay to ``(m + pp - 1) x (F + B)`` for equal
    stages (tests/test_search.py checks the two agree), and a replay at 2,048 micro-batches and 64 stages
    would take seconds for each of thousands of layouts. The virtual schedules are replayed, the
    backward's cost rounded to 1% of the forward's so that one replay serves many layouts."""
    if pp == 1:
        return microbatches * chunks * (forward + backward)
    if schedule in SCHEDULES:
        return (microbatches + pp - 1) * (forward + backward)
    return forward * _replayed(schedule, pp, microbatches, chunks, round(backward / forward * 100)) / 100


@functools.cache
def _replayed(schedule: str, pp: int, microbatches: int, chunks: int, backward: int) -> float:
    """Step units of the schedule's action list replayed with a forward of 100 units."""
    cost = {"F": 100.0, "B": float(backward), "I": float(backward), "W": 0.0}
    return replay(_actions(schedule, pp, microbatches, chunks), cost)[1]


@functools.cache
def _actions(schedule: str, pp: int, microbatches: int, chunks: int) -> dict:
    """The schedule's action lists, built once (torch builds a virtual schedule's order for every rank)."""
    return schedule_actions(schedule, pp, microbatches, chunks)
