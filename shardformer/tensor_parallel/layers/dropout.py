"""Dropout with its own RNG, so masks are right for tensor parallelism and reproducible.

On replicated activations every tensor-parallel rank must drop the same elements (or the copies
drift apart); on parallel activations (each rank holds different heads or features) the masks must
differ. Each layer draws from its own ``torch.Generator`` seeded from one seed (plus the tp rank for
parallel input), so the caller's global RNG stream is untouched and a seed replays the same masks.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardformer.core.comm import group_rank

_RANK_STRIDE = 1_000_003  # a prime: seeds of different ranks never collide for sane seeds


class SeededDropout(nn.Module):
    parallel_input: bool
    supports_sequence_parallel = True

    def __init__(self, p: float = 0.5, seed: int = 0, process_group=None, sequence_parallel=None) -> None:
        super().__init__()
        # in the sequence-split region: the model's SequenceParallel state (draws the full mask, keeps its chunk)
        self.sequence_parallel = sequence_parallel
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1)")
        self.p, self.process_group = p, process_group
        rank = group_rank(process_group) if self.parallel_input else 0
        self.seed = seed + _RANK_STRIDE * rank
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, seed: int = 0, sequence_parallel=None, **_):
        return cls(module.p, seed, process_group, sequence_parallel)

    def generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {str(d): g.get_state() for d, g in self._generators.items()}

    def set_rng_state(self, states: dict[str, torch.Tensor]) -> None:
        """Back to `get_rng_state`'s states (a device not listed starts again from the seed)."""
        self._generators.clear()
        for device, state in states.items():
            self.generator(torch.device(device)).set_state(state)

    def rng_snapshot(self) -> dict[torch.device, torch.Tensor]:
        """The generators' states now (a generator not made yet is not listed: it would start at the seed)."""
        return {d: g.get_state() for d, g in self._generators.items()}

    def rng_restore(self, snapshot: dict[torch.device, torch.Tensor]) -> None:
        """Back to the states of `rng_snapshot` (activation recompute replays the same masks)."""
        for device in list(self._generators):
            if device not in snapshot:
                del self._generators[device]
        for device, state in snapshot.items():
            self.generator(device).set_state(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        sp = self.sequence_parallel
        if sp is not None and sp.is_split(x):
            # the mask plain tp draws for the whole sequence, cut to this rank's chunk: exact, and
            # chunks of one sequence never share a mask
            full = torch.rand(sp.full_shape(x), generator=self.generator(x.device), device=x.device)
            noise = sp.own_chunk(full)
        else:
            noise = torch.rand(x.shape, generator=self.generator(x.device), device=x.device)
        return x.masked_fill(noise < self.p, 0.0) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}"


class DropoutForReplicatedInput(SeededDropout):
    """Same mask on every tensor-parallel rank (input identical across ranks)."""

    parallel_input = False


class DropoutForParallelInput(SeededDropout):
    """A different mask on each tensor-parallel rank (input split across ranks)."""

    parallel_input = True
