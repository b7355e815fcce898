"""Attention-probability dropout with a per-rank RNG stream, for attention that never calls a dropout module.

transformers' attention functions (eager, sdpa, ...) take only the probability (``.p`` of the
module's dropout, or an ``attention_dropout`` float) and draw from the global RNG, so a
`DropoutForParallelInput` in its place is never called: with heads split over ranks, every
rank would drop the same positions of its different heads. Around the attention module's forward
(in training, with a probability > 0) the global RNG is swapped for the module's own stream, seeded
per rank from ``ShardConfig.seed``, and put back after: masks differ across ranks, the caller's RNG
stream is untouched and equal on every rank, a seed replays the same masks, and the stream's state
is saved and restored by training checkpoints (``get_rng_state`` / ``set_rng_state``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardformer.tensor_parallel.layers.dropout import SeededDropout


class AttentionDropoutRng:
    """Layer descriptor target: hooks the attention module (returned as it is) to draw its dropout
    from an `AttentionRngStream`. ``rate`` is the dotted path, from the attention module, to
    its dropout probability (a float, or a dropout module whose ``p`` is read)."""

    supports_sequence_parallel = True  # per-token, per-head or no-op: exact on sequence chunks
    rate = "attention_dropout"

    @classmethod
    def from_native(cls, module: nn.Module, process_group=None, seed: int = 0, **_) -> nn.Module:
        if isinstance(getattr(module, "shardformer_attention_rng", None), AttentionRngStream):
            return module  # hooked already (a policy naming it twice)
        stream = AttentionRngStream(seed, process_group, cls.rate)
        module.shardformer_attention_rng = stream
        module.register_forward_pre_hook(stream.enter, with_kwargs=True)
        module.register_forward_hook(stream.leave)
        return module


def attention_dropout_rng(rate: str) -> type[AttentionDropoutRng]:
    """An `AttentionDropoutRng` reading the probability at ``rate`` (e.g. ``"attn_dropout.p"``)."""
    return type("AttentionDropoutRng", (AttentionDropoutRng,), {"rate": rate})


def dropout_rate(module: nn.Module, path: str) -> float:
    value = module
    for name in path.split("."):
        value = getattr(value, name, 0.0)
    if isinstance(value, nn.Module):
        value = getattr(value, "p", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


class AttentionRngStream(SeededDropout):
    """The global CPU (and accelerator) RNG states an attention module draws its dropout from. A
    `SeededDropout` child without parameters, so activation checkpointing replays it like the
    other dropout layers."""

    parallel_input = True  # seeded per rank

    def __init__(self, seed: int = 0, process_group=None, rate: str = "attention_dropout") -> None:
        super().__init__(0.0, seed, process_group)
        self.rate = rate
        self.states: dict[torch.device, tuple] = {}  # device -> (CPU state, accelerator state or None)
        self.saved = None

    def rng_snapshot(self) -> dict:
        return dict(self.states)

    def rng_restore(self, snapshot: dict) -> None:
        self.states = dict(snapshot)

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        """The streams' states by name, for checkpoints: ``"cpu"``, or ``"<device>"`` and ``"<device>+cpu"``."""
        out = {}
        for device, (cpu, accel) in self.states.items():
            if accel is None:
                out[str(device)] = cpu
            else:
                out[str(device)], out[f"{device}+cpu"] = accel, cpu
        return out

    def set_rng_state(self, states: dict[str, torch.Tensor]) -> None:
        """Back to `get_rng_state`'s states (a device not listed starts again from the seed)."""
        self.states = {}
        for name, state in states.items():
            if name.endswith("+cpu"):
                continue
            if f"{name}+cpu" in states:
                self.states[torch.device(name)] = (states[f"{name}+cpu"], state)
            else:
                self.states[torch.device(name)] = (state, None)

    @staticmethod
    def _device(args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        return tensors[0].device if tensors else torch.device("cpu")

    def enter(self, module, args, kwargs):
        if not (module.training and dropout_rate(module, self.rate) > 0.0):
            return
        device = self._device(args, kwargs)
        accel = None if device.type == "cpu" else torch.get_device_module(device.type)
        self.saved = (device, accel, torch.get_rng_state(), accel.get_rng_state(device) if accel else None)
        if device not in self.states:
            cpu = torch.Generator().manual_seed(self.seed).get_state()
            dev = torch.Generator(device=device).manual_seed(self.seed).get_state() if accel else None
            self.states[device] = (cpu, dev)
        cpu, dev = self.states[device]
        torch.set_rng_state(cpu)
        if accel:
            accel.set_rng_state(dev, device)

    def leave(self, module, args, output):
        if self.saved is None:
            return
        device, accel, cpu, dev = self.saved
        self.states[device] = (torch.get_rng_state(), accel.get_rng_state(device) if accel else None)
        torch.set_rng_state(cpu)
        if accel:
            accel.set_rng_state(dev, device)
        self.saved = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # never called: the attention's hooks use the stream

    def extra_repr(self) -> str:
        return f"attention dropout stream at {self.rate}, seed={self.seed}"
