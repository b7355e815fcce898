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
