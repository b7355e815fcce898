"""Dropout masks of their own for each cp rank's tokens.

Functional dropout inside a forward (``F.dropout`` in a layer, attention-probability dropout in
eager or sdpa attention) draws from the global RNG, which every cp rank holds in the same state:
the chunks of different ranks would get the same masks. For the length of a split forward in
training, `RankStream` swaps the global RNG for a stream of this rank's own: seeded from one
draw of the caller's stream (the same on every rank, so tensor-parallel ranks keep agreeing and a
seed replays the masks) plus the cp rank. The caller's stream is restored after the forward,
advanced by that one draw. Activation checkpointing replays the masks: it saves the RNG state the
layer starts from, which is this stream's.

Dropout layers with their own generators (the tensor-parallel ``SeededDropout``) get a seed offset
by the cp rank where the model is sharded (`rank_seed`).
"""

from __future__ import annotations

import torch

_RANK_STRIDE = 2_147_483_647  # a prime, apart from tensor parallelism's stride: streams never collide


def rank_seed(seed: int, cp_rank: int) -> int:
    """The base seed of the dropout layers of cp rank ``cp_rank``."""
    return seed + _RANK_STRIDE * cp_rank


class RankStream:
    """The global RNG swapped for this cp rank's own stream between `enter` and `leave`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.saved = None  # (device, device module or None, CPU state, device state)

    def enter(self, training: bool, device: torch.device) -> None:
        self.leave()
        if not training:
            return
        seed = int(torch.randint(0, 2**62, (1,))) + _RANK_STRIDE * self.rank
        accel = None if device.type == "cpu" else torch.get_device_module(device.type)
        self.saved = (device, accel, torch.get_rng_state(), accel.get_rng_state(device) if accel else None)
        torch.default_generator.manual_seed(seed)
        if accel:  # this device's generator only
            accel.set_rng_state(torch.Generator(device=device).manual_seed(seed).get_state(), device)

    def leave(self) -> None:
        if self.saved is None:
            return
        device, accel, cpu, dev = self.saved
        torch.set_rng_state(cpu)
        if accel:
            accel.set_rng_state(dev, device)
        self.saved = None
