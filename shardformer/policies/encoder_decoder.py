"""Pipeline stages over an encoder-decoder's two layer stacks (T5, BART, Marian, Whisper), at any cut.

The layers of both stacks are numbered as one list (the encoder's, then the decoder's) and cut into
stages as a one-stack model's are. Every stage runs the model's own forward (as
`shardformer.policies.anatomy_pipeline` does for one stack); what a stage hands on depends on
where it ends:

- inside the encoder: what its last layer returned (the hidden states and whatever else the stack
  passes from layer to layer: T5's position bias, computed by the first layer, read by every other);
- at the end of the encoder: the encoder's output;
- inside the decoder: what its last layer returned, and the encoder's output, which every decoder
  stage cross-attends to (the gradients of all of them flow back to the encoder's stages).

A stage that starts inside a stack answers for the layer before its first with what it received (the
model's loop reads it as that layer's output), and for the stack's embeddings with the hidden states
(only their shape matters: masks are built from them); a stage past the encoder passes the encoder's
output as ``encoder_outputs`` and the model skips its encoder. Every stage gets the whole micro-batch
(the decoder's inputs are the labels shifted, as the model derives them); no stage but the last runs
the head. Which cuts are exact is proven on a tiny copy (`cut_refusals`), each kind apart: inside
the encoder, inside the decoder, a stage across the boundary.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from transformers.modeling_outputs import BaseModelOutput

from shardformer.core.record import sharding_of
from shardformer.pipeline.stage_view import Returns, own_forward, stage_view
from shardformer.policies.stage_parts import LayerPassThrough, Reached

CUTS = {
    "encoder": "a stage that starts inside the encoder",
    "decoder": "a stage that starts inside the decoder",
    "mixed": "a stage that holds the end of the encoder and the start of the decoder",
}


class HandOn(nn.Module):
    """Stands in for this stage's last layer: runs it (its own call: hooks, checkpointing) and ends the
    forward with what it returned."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        raise Reached(self.layer(*args, **kwargs))


class EncoderDecoderStageForward:
    """The stage forward of an encoder-decoder split anywhere in its two stacks (see the module doc)."""

    __name__ = "encoder_decoder_stage_forward"

    def __init__(self, encoder: str, stacks: tuple[str, str], entries: tuple[tuple[str, ...], ...], outputs) -> None:
        self.encoder, self.stacks = encoder, stacks
        self.entries = entries  # the encoder's embeddings, the decoder's: stood in on a stage past them
        self.outputs = outputs  # per stack: which values a layer returns are tensors (None: a bare tensor)
        self.refusals: dict[str, str] = {}  # cut kind -> why it is not exact (set by the proof)

    def split_refusal(self, counts: list[int], boundary: int) -> str | None:
        """Why stages of ``counts`` layers cannot run exactly (None: they can); ``boundary``: the
        decoder's first layer."""
        for start, count in zip([sum(counts[:i]) for i in range(len(counts))], counts):
            kinds = ["encoder"] if 0 < start < boundary else ["decoder"] if start > boundary else []
            kinds += ["mixed"] if start < boundary < start + count else []
            for kind in kinds:
                if kind in self.refusals:
                    fix = f"cut at the encoder/decoder boundary only (layers_per_stage={[boundary, sum(counts) - boundary]})"
                    if "decoder" not in self.refusals:
                        fix = f"keep the encoder's {boundary} layers on the first stage (layers_per_stage=[{boundary}, ...])"
                    return f"{CUTS[kind]} is not exact on a tiny copy ({self.refusals[kind]}); {fix}"
        return None

    def __call__(self, model: nn.Module, hidden, inputs: dict):
        info = sharding_of(model)
        paths = info.pipeline.layer_paths(model)
        boundary, first, last = len(model.get_submodule(self.stacks[0])), info.layers[0], info.layers[-1]
        parts = () if hidden is None else tuple(hidden) if isinstance(hidden, (tuple, list)) else (hidden,)
        stand_ins: dict[str, nn.Module] = {}
        for i, path in enumerate(paths):  # other stages' layers hand their input on, as a layer returns it
            parent, _, name = path.rpartition(".")
            if model.get_submodule(parent)._modules[name] is None:
                stand_ins[path] = LayerPassThrough(_arity(self.outputs, int(i >= boundary)))
        forward = own_forward(model)
        kwargs = {k: v for k, v in inputs.items() if v is not None}
        if "use_cache" in inspect.signature(forward).parameters:
            kwargs["use_cache"] = False
        encoder_output = parts[-1] if first >= boundary else None
        if encoder_output is not None:
            kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=encoder_output)
        if first not in (0, boundary):  # starts inside a stack: the received values stand in for the layer before
            stack = int(first > boundary)
            carried = parts[:-1] if stack else parts
            stand_ins |= {path: Returns(carried[0]) for path in self.entries[stack]}
            stand_ins[paths[first - 1]] = Returns(_rebuild(carried, self.outputs, stack))
        ends_stage = last == len(paths) - 1
        if not ends_stage and last != boundary - 1:
            stand_ins[paths[last]] = HandOn(model.get_submodule(paths[last]))
        seen: list[torch.Tensor] = []
        with stage_view(model, stand_ins):
            handle = None
            if first < boundary:  # the encoder runs here: its output is handed on (or carried past the decoder's start)
                hook = _raise_output if last == boundary - 1 else lambda _m, _a, out: seen.append(_first(out))
                handle = model.get_submodule(self.encoder).register_forward_hook(hook)
            try:
                if ends_stage:
                    return forward(**kwargs)
                forward(**kwargs)
            except Reached as reached:
                if last == boundary - 1:
                    return reached.hidden
                values = _values(reached.hidden, self.outputs, int(last >= boundary), paths[last])
                if last >= boundary:
                    values += (encoder_output if encoder_output is not None else seen[0],)
                return values[0] if len(values) == 1 else values
            finally:
                if handle is not None:
                    handle.remove()
        raise RuntimeError(f"pipeline stage {info.stage}: {type(model).__name__}'s forward never reached {paths[last]}")


def _raise_output(_module, _args, output):
    raise Reached(_first(output))


def _first(output) -> torch.Tensor:
    return output if torch.is_tensor(output) else output[0]


def _arity(outputs, stack: int) -> int:
    pattern = outputs[stack] if outputs is not None else None
    return 0 if pattern is None else len(pattern)


def _values(output, outputs, stack: int, path: str) -> tuple[torch.Tensor, ...]:
    """The tensors of a layer's output, in order (what the next stage receives)."""
    pattern = outputs[stack] if outputs is not None else None
    if pattern is None and torch.is_tensor(output):
        return (output,)
    got = tuple(torch.is_tensor(v) for v in output) if isinstance(output, tuple) else None
    if got != pattern:
        raise RuntimeError(
            f"pipeline stage: {path} returned {got if got is not None else type(output).__name__} where the tiny copy's "
            f"layers returned {pattern} (tensors and Nones): it cannot be handed on exactly"
        )
    return tuple(v for v in output if torch.is_tensor(v))


def _rebuild(carried: tuple, outputs, stack: int):
    """A layer's output from the tensors a stage received (the inverse of `_values`)."""
    pattern = outputs[stack] if outputs is not None else None
    if pattern is None:
        return carried[0]
    values = iter(carried)
    return tuple(next(values) if is_tensor else None for is_tensor in pattern)


def proof_splits(encoder_layers: int, decoder_layers: int) -> dict[str, list[int] | str]:
    """{cut kind: the split of a tiny copy that proves it, or why there is none}."""
    splits: dict[str, list[int] | str] = {}
    few = "the tiny copy has fewer than two layers in its {}"
    splits["encoder"] = [1, encoder_layers - 1, decoder_layers] if encoder_layers > 1 else few.format("encoder")
    splits["decoder"] = [encoder_layers, 1, decoder_layers - 1] if decoder_layers > 1 else few.format("decoder")
    if encoder_layers > 1 and decoder_layers > 1:
        splits["mixed"] = [1, encoder_layers, decoder_layers - 1]
    else:
        splits["mixed"] = few.format("encoder" if encoder_layers < 2 else "decoder")
    return splits
