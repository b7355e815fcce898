"""The stand-ins a pipeline stage puts in place of another stage's layers and embeddings (see
`shardformer.policies.anatomy_pipeline`), shared by the one-stack and the encoder-decoder stage
forwards."""

from __future__ import annotations

import torch

from shardformer.pipeline.skeleton import StandIn


class LayerPassThrough(StandIn):
    """Another stage's layer: hands its input hidden states on, as a layer returns them (a tuple of
    ``outputs`` values with the hidden states first, or the bare tensor when ``outputs`` is 0)."""

    def __init__(self, outputs: int, value: torch.Tensor | None = None) -> None:
        super().__init__()
        self.outputs, self.value = outputs, value

    def forward(self, *args, **kwargs):
        hidden = self.value if self.value is not None else hidden_of(args, kwargs)
        return hidden if not self.outputs else (hidden,) + (None,) * (self.outputs - 1)


class Reached(Exception):
    """Raised by `Capture`: this stage's layers are done."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class Capture(StandIn):
    """The layer after this stage's last one: takes the hidden states this stage hands on and ends
    the forward (the rest of the model runs on later stages)."""

    def forward(self, *args, **kwargs):
        raise Reached(hidden_of(args, kwargs))


def hidden_of(args, kwargs) -> torch.Tensor:
    if args and torch.is_tensor(args[0]):
        return args[0]
    if torch.is_tensor(kwargs.get("hidden_states")):
        return kwargs["hidden_states"]
    raise RuntimeError("pipeline stage: a layer was called without its hidden states first (or as hidden_states=)")


class ZerosShaped(StandIn):
    """Stands in, on a later stage, for an embedding whose output is not shaped as the hidden states
    (timm's ``patch_embed``: the class token is put in front after it): zeros shaped as the hidden
    states plus ``offset`` per dimension (what follows only needs the shape; the layer before this
    stage's first one hands on the received hidden states instead)."""

    def __init__(self, hidden: torch.Tensor, offset: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = [n + d for n, d in zip(hidden.shape, offset, strict=True)]
        self.like = hidden

    def forward(self, *args, **kwargs):
        return self.like.new_zeros(self.shape)


class SkeletonZeros(StandIn):
    """Stands in, on a later stage, for a module the first stage runs before the layers (an embedding, a
    feature encoder, a projection): answers with zeros shaped as what the module returns for this call,
    found by running its skeleton (`shardformer.pipeline.skeleton`) on the meta device: no compute, no
    memory, the shapes of the user's widths (a tuple as a tuple: wav2vec2's feature projection returns two;
    fresh tensors, so the forward's in-place writes never touch the received hidden states). What follows
    only needs the shapes: the layer before this stage's first one hands on the received hidden states.
    Where the skeleton does not run on the meta device, ``fallback`` answers."""

    def __init__(self, like: torch.Tensor, fallback: StandIn) -> None:
        super().__init__()
        self.like, self.fallback = like, fallback

    def forward(self, *args, **kwargs):
        skeleton = self.__dict__.get("skeleton")
        if skeleton is not None:
            try:
                with torch.no_grad():
                    shapes = skeleton(*_on_meta(args), **_on_meta(kwargs))
                return _zeros(shapes, self.like)
            except Exception:  # noqa: BLE001 - an operation without a meta kernel: the shapes the anatomy read
                pass
        return self.fallback(*args, **kwargs)


def _on_meta(value):
    if torch.is_tensor(value):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    return value


def _zeros(value, like: torch.Tensor):
    """Zeros shaped as ``value`` on ``like``'s device; floating ones in ``like``'s dtype (the skeleton kept the
    dtype the model had when split, the stage may compute in another, as the received hidden states are)."""
    if torch.is_tensor(value):
        return like.new_zeros(value.shape, dtype=like.dtype if value.is_floating_point() else value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_zeros(v, like) for v in value)
    raise TypeError(f"a stand-in cannot rebuild a {type(value).__name__} of zeros")  # the fallback answers
