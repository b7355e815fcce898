"""Several model chunks (virtual stages) per pipeline rank, for interleaved 1F1B, ZBV and DualPipeV.

The layer stack is cut into ``pp * V`` chunks, balanced as `shardformer.pipeline.spec.balanced_split`
cuts stages. Interleaved 1F1B places them in a loop (chunk ``c`` on rank ``c % pp``: rank ``r`` holds
``r, r+pp, ...``); ZBV and DualPipeV in a V (rank ``r`` holds ``r`` and ``2*pp-1-r``, so rank 0 holds
the first and the last chunk). A rank keeps one copy of the model with the layers of its chunks and
the end modules any of them needs (`keep_chunks`); nothing is copied.

A chunk runs the spec's own stage forward inside `chunk_view`: for that call the model's sharding
record says "stage ``c`` of ``pp * V``, these layers", and the rank's other chunks' layers are hidden
(set to None in the layer list, which `shardformer.pipeline.stage_view.stage_view` turns into
pass-throughs), so a stage forward written for one stage per rank runs a chunk unchanged: the modules
of the chunk's ends are those of stage ``c``, layer indices stay global. Autograd keeps what the
forward used, so the backward needs no view.

Out of a step, the record says the rank (stage ``pp_rank`` of ``pp``) holding the union of its chunks'
layers. `forward_only` runs ``eval_step`` / ``forward`` over the chunks on our own send/recv.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from shardformer.core import comm
from shardformer.core.record import ATTRIBUTE, ShardedModelInfo, attach, sharding_of, with_stage
from shardformer.pipeline.p2p import _empty, _header, _layout_of, pack, unpack
from shardformer.pipeline.spec import PipelineSpec, _set_none, check_split
from shardformer.pipeline.stage_view import stand_in

# how each schedule places its chunks on the ranks
PLACEMENT = {"interleaved_1f1b": "loop", "zbv": "v", "dualpipev": "v"}


def chunk_ranks(placement: str, pp: int, num_chunks: int) -> list[int]:
    """The pp rank of every chunk: looped (``c % pp``) or V-shaped (down the ranks, then back up)."""
    if placement == "loop":
        return [c % pp for c in range(num_chunks)]
    return [c % pp if (c // pp) % 2 == 0 else pp - 1 - c % pp for c in range(num_chunks)]


def chunk_layers(counts) -> list[tuple[int, ...]]:
    """The global layer indices of every chunk (or stage), from the layers each holds."""
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [tuple(range(start, start + count)) for start, count in zip(starts, counts)]


def check_virtual(
    schedule: str, pp: int, chunks_per_rank: int, num_microbatches: int, num_layers: int, layers_per_stage=None
):
    """Refuse, before any collective, what the schedule cannot run; returns the layers per chunk."""
    n, num_chunks = num_microbatches, pp * chunks_per_rank
    if schedule == "interleaved_1f1b":
        rounds = max(1, n // pp)  # torch's flexible interleaving: micro-batches in rounds of pp
        if n % rounds:
            raise ValueError(
                f"num_microbatches={n} with schedule='interleaved_1f1b' at pp={pp}: torch runs the micro-batches "
                f"in {rounds} rounds, which {n} does not divide into; use a multiple of pp ({rounds * pp})"
            )
    if schedule == "zbv" and n < 2 * pp - 1:  # fewer leave torch's ZBV order waiting on a missing micro-batch
        raise ValueError(
            f"num_microbatches={n} with schedule='zbv' at pp={pp}: ZBV needs at least 2*pp-1={2 * pp - 1} "
            f"micro-batches; use num_microbatches >= {2 * pp - 1}"
        )
    if schedule == "dualpipev" and (n < num_chunks):
        raise ValueError(
            f"num_microbatches={n} with schedule='dualpipev' at pp={pp}: DualPipeV needs at least as many "
            f"micro-batches as chunks (2*pp={num_chunks}); use num_microbatches >= {num_chunks}"
        )
    if layers_per_stage is None and num_layers < num_chunks:
        raise ValueError(
            f"schedule={schedule!r} at pp={pp} with {chunks_per_rank} chunks per rank cuts the layer stack into "
            f"{num_chunks} chunks, more than the model's {num_layers} layers; use fewer virtual_stages, a smaller "
            f"pp, or schedule='1f1b'"
        )
    if layers_per_stage is not None and len(layers_per_stage) != num_chunks:
        raise ValueError(
            f"layers_per_stage={list(layers_per_stage)} with schedule={schedule!r}: give one count per chunk, "
            f"pp * virtual_stages = {num_chunks} of them, in chunk order"
        )
    return check_split(num_layers, num_chunks, layers_per_stage)


@dataclass(frozen=True)
class Chunks:
    """This rank's chunks: their indices among ``num_chunks`` and the global layer indices of each."""

    indices: tuple[int, ...]
    num_chunks: int
    layers: tuple[tuple[int, ...], ...]
    ranks: tuple[int, ...]  # the pp rank of every chunk

    @property
    def last_rank(self) -> int:
        """The pp rank holding the last chunk (where the losses are)."""
        return self.ranks[-1]


def keep_chunks(
    spec: PipelineSpec, model: nn.Module, schedule: str, pp_rank: int, pp: int, chunks_per_rank: int, counts
) -> Chunks:
    """Keep only rank ``pp_rank``'s chunks in ``model`` (in place): their layers, and the end modules
    that one of them needs (first, last, shared). ``counts``: layers per chunk (see `check_virtual`)."""
    num_chunks = pp * chunks_per_rank
    ranks = chunk_ranks(PLACEMENT[schedule], pp, num_chunks)
    mine = tuple(c for c in range(num_chunks) if ranks[c] == pp_rank)
    every = chunk_layers(counts)
    layers = tuple(every[c] for c in mine)
    held = {i for chunk in layers for i in chunk}
    for i, path in enumerate(spec.layer_paths(model)):  # every stack's layers, in one numbering
        if i not in held:
            _set_none(model, path)
    needed = [set(spec.dropped(model, chunk)) for chunk in layers]
    for path in sorted(set.intersection(*needed)):  # dropped by every chunk of this rank
        _set_none(model, path)
    if ATTRIBUTE not in model.__dict__:
        attach(model, ShardedModelInfo.unsharded())
    with_stage(model, pp_rank, pp, sorted(held), spec)
    return Chunks(mine, num_chunks, layers, tuple(ranks))


@contextmanager
def chunk_view(model: nn.Module, chunks: Chunks, chunk: int):
    """While it runs, ``model`` is stage ``chunk`` of ``chunks.num_chunks``: its record says so and the
    layers of this rank's other chunks are hidden (the stage view passes them through)."""
    info = sharding_of(model)
    layers = chunks.layers[chunks.indices.index(chunk)]
    others = {i for held in chunks.layers for i in held} - set(layers)
    paths = info.pipeline.layer_paths(model)
    hidden = {paths[i]: None for i in sorted(others)}
    object.__setattr__(model, ATTRIBUTE, replace(info, stage=chunk, num_stages=chunks.num_chunks, layers=layers))
    try:
        with stand_in(model, hidden):
            yield
    finally:
        object.__setattr__(model, ATTRIBUTE, info)


def in_chunk(stage_forward, chunks: Chunks, chunk: int):
    """``stage_forward`` run as chunk ``chunk`` (inside `chunk_view`)."""

    def run(model, hidden, inputs):
        with chunk_view(model, chunks, chunk):
            return stage_forward(model, hidden, inputs)

    run.__name__ = f"{getattr(stage_forward, '__name__', 'stage_forward')}_chunk{chunk}"
    return run


def forward_only(forwards: dict, chunks: Chunks, model, mesh, micro_batches, loss_of, device) -> tuple[list, list]:
    """``eval_step`` / ``forward`` over the chunks: every rank walks chunk by chunk, micro-batch by
    micro-batch, running its own chunks; a chunk's output goes to the next chunk's rank (or stays, on a
    V's turn). Sends do not block and each receive waits only on an earlier step of the walk, so no rank
    waits forever; between two ranks messages are sent and received in the walk's order. Returns
    ``(losses, outputs)`` on the last chunk's rank (``losses`` only with ``loss_of``), ``([], [])`` elsewhere."""
    me, ranks, last = mesh.pp_rank, chunks.ranks, chunks.num_chunks - 1
    group, sends, kept = mesh.pp_group, [], {}
    losses, outputs = [], []
    for c in range(chunks.num_chunks):
        if ranks[c] != me:
            continue
        for i, batch in enumerate(micro_batches):
            hidden = None
            if c > 0:
                hidden = (
                    kept.pop((c, i)) if ranks[c - 1] == me else _receive(mesh.stage_rank(ranks[c - 1]), group, device)
                )
            out = forwards[c](model, hidden, batch)
            if c < last:
                if ranks[c + 1] == me:
                    kept[(c + 1, i)] = out
                else:
                    sends += _send(out, mesh.stage_rank(ranks[c + 1]), group)
            elif loss_of is not None:
                losses.append(loss_of(out, batch).detach())
            else:
                outputs.append(out)
    for work, _ in sends:
        work.wait()
    return losses, outputs


def _send(value, dst: int, group) -> list:
    header, tensor = _header(value), pack(value).detach().contiguous()
    return [(comm.isend(t, dst, group), t) for t in (header, tensor)]


def _receive(src: int, group, device):
    header = torch.zeros_like(_header(torch.zeros(())), device=device)
    comm.irecv(header, src, group).wait()
    layout = _layout_of(header)
    out = _empty(layout, device)
    comm.irecv(out, src, group).wait()
    return unpack(out, layout)
