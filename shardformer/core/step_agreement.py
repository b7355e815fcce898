"""Ranks agree on the step they are in and on the batch they train on, checked at no extra round trip.

Tensor-parallel (and pipeline) peers must run the same batch: given different ones, their collectives
still pair up and a plausible loss comes out that no input gives. A rank that skipped a step pairs
its next one with its peers' previous one the same way. So every step, each rank adds three numbers
to the one small all-gather the step's loss travels in anyway: a fingerprint of the batch it was
given, how many steps it has run, and which kind (train or eval). Ranks that should hold the same
batch and differ, or any two ranks at different steps, make every rank raise the same error, naming
the ranks, before the optimizer changes anything.
"""

from __future__ import annotations

import torch

from shardformer.core import comm

_MOD = 65521  # a prime below 2**16: products of two residues summed over 2**31 elements fit in int64
_KINDS = {1: "train_step", 2: "eval_step"}
_CHUNK = 1 << 22  # elements per pass of the checksum: ~100 MB of temporaries at most


def batch_fingerprint(batch: dict) -> int:
    """A position-weighted checksum of every tensor in ``batch`` (float tensors by their bits), < 2**31."""
    return int(fingerprint_tensor(batch))


def fingerprint_tensor(batch: dict, device: torch.device | None = None) -> torch.Tensor:
    """`batch_fingerprint` as an int64 scalar on ``device`` (default: the tensors'), computed
    where the tensors are and never read on the host: no device sync. Large tensors (embeddings,
    pixels) are summed in chunks, so the temporaries stay small whatever the batch."""
    total = None
    for key in sorted(batch):
        value = batch[key]
        if not torch.is_tensor(value):
            continue
        flat = value.detach().reshape(-1)
        term = torch.zeros((), dtype=torch.int64, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start : start + _CHUNK]
            if part.is_floating_point():
                part = part.float().view(torch.int32)
            weights = torch.arange(start, start + part.numel(), device=part.device) % _MOD + 1
            term = term + (part.long() % _MOD * weights).sum()
        term = (term + len(key)).to(device or flat.device)
        total = term % 2**31 if total is None else (total * 31 + term) % 2**31
    return total if total is not None else torch.zeros((), dtype=torch.int64, device=device)


def _groups(values: dict[int, float]) -> str:
    by_value: dict[float, list[int]] = {}
    for rank, value in values.items():
        by_value.setdefault(value, []).append(rank)
    return "; ".join(f"ranks {', '.join(map(str, r))}" for r in sorted(by_value.values()))


def check_agreement(table: torch.Tensor, peers: list[list[int]]) -> None:
    """``table[rank] = (fingerprint, steps run, kind)`` of every rank; ``peers``: the groups of ranks
    that must hold the same batch. Raises the same error on every rank when they disagree."""
    rows = {rank: tuple(row.tolist()) for rank, row in enumerate(table)}
    steps = {rank: (row[1], row[2]) for rank, row in rows.items()}
    if len(set(steps.values())) > 1:
        where = ", ".join(
            f"rank {r} in {_KINDS.get(int(kind), 'a step')} #{int(n)}" for r, (n, kind) in sorted(steps.items())
        )
        raise RuntimeError(
            f"the ranks are not in the same step ({where}): a rank skipped or repeated a train_step or "
            "eval_step, so its collectives paired with another step's; call them on every rank, once per batch"
        )
    for group in peers:
        prints = {rank: rows[rank][0] for rank in group}
        if len(set(prints.values())) > 1:
            raise RuntimeError(
                f"ranks {', '.join(map(str, group))} must get the same batch (they are tensor-/pipeline-parallel "
                f"peers, or every rank gets the whole batch that the engine splits over dp), but got different "
                f"ones at step #{int(rows[group[0]][1])} ({_groups(prints)} hold one batch each): give every rank "
                "the same batch (one seeded data order), or with EngineConfig(split_batch=False) the same batch "
                "to every rank of a data-parallel replica"
            )


def batch_peers(mesh, split_batch: bool) -> list[list[int]]:
    """Groups of ranks given the same batch: all of them when the engine splits it over dp (``split_batch``)."""
    if split_batch or mesh.dp_size == 1:
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


def agreed_loss(
    losses: list[torch.Tensor], batch: dict, mesh, *, step: int, kind: int, loss_rank: int, split_batch: bool, device
) -> float:
    """The engine's loss of a step: the mean of the micro-batch ``losses`` of the last stage (pp rank
    ``loss_rank``), averaged over dp, on every rank. The same all-gather checks that every rank is in
    step number ``step`` of one ``kind`` (1: train, 2: eval) with the batches it must share."""
    local = torch.stack(losses).float().mean().item() if losses else 0.0
    row = [local, batch_fingerprint(batch), step, kind]
    table = torch.stack(comm.all_gather(torch.tensor(row, dtype=torch.float64, device=device), None)).cpu()
    check_agreement(table[:, 1:], batch_peers(mesh, split_batch))
    per_dp = [table[mesh.global_rank(loss_rank, d, mesh.tp_rank), 0] for d in range(mesh.dp_size)]
    return (torch.stack(per_dp).float().sum() / mesh.dp_size).item()
