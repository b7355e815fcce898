"""What runs around a model's layer stack(s), read off one forward of a tiny copy (`ends_of`): the
embeddings before, the final norm and head after, what the layers are handed beside the hidden states,
and how an encoder-decoder's two stacks divide the rest. The pipeline split and the structural final
norm read it (`shardformer.policies.anatomy` finds the stacks themselves)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardformer.policies.copies import copy_key
from shardformer.policies.derived.tiny_inputs import tiny_with_inputs
from shardformer.policies.layer_reads import LayerReads, untied


class AnatomyError(ValueError):
    """What runs around the layer stack cannot be told apart (the reason names the module)."""


class HandOverError(AnatomyError):
    """A layer reads what the layer before it returned besides the hidden states: no stage boundary can
    pass it on."""


@dataclass(frozen=True)
class Ends:
    """What runs around one layer stack, by path in the model.

    before: the outermost modules with parameters that finish before the first layer starts (the
    embeddings), and the parameters held directly by the model (or a module above the stack: timm's
    ``cls_token``, ``pos_embed``) that the forward reads only then; after: those that start (are read)
    after the last layer finished (final norm, head) or never run; final_norm: the first of ``after``
    when it is a per-token norm fed the last layer's output; layer_outputs: how many values a layer
    returns (0: a bare tensor, n: a tuple whose first is the hidden states); offsets: ``(path, per-dim
    difference)`` of each module of ``before`` whose output is not shaped as the first layer's input
    (timm's ``patch_embed``: the class and register tokens are put in front of its output after it);
    sections (two stacks): the modules run before the first stack, after it under the encoder (its
    final norm), between the stacks elsewhere (the decoder's embeddings), and after the second (or
    never); outputs: per stack, which values of what its layers return are tensors (None: a bare
    tensor), the same for every layer, else None for the whole field; every (one stack): the modules whose
    output or weights the layers are handed beside the hidden states (`shardformer.policies.layer_reads`),
    in neither before nor after."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    final_norm: str | None
    layer_outputs: int
    offsets: tuple[tuple[str, tuple[int, ...]], ...] = ()
    sections: tuple[tuple[str, ...], ...] = ()
    outputs: tuple[tuple[bool, ...] | None, ...] | None = None
    every: tuple[str, ...] = ()


_ENDS: dict[tuple, Ends | AnatomyError] = {}


def ends_of(model: nn.Module, layers: str | tuple[str, ...]) -> Ends:
    """The `Ends` of the stack at ``layers`` (or of two stacks: `_trace_ends`), read off one forward of a tiny copy of ``model``
    (cached per class, architecture and stack); `AnatomyError` when it cannot be told."""
    key = (copy_key(model, 1), layers)
    if key not in _ENDS:
        try:
            _ENDS[key] = _trace_ends(model, layers)
        except AnatomyError as e:
            _ENDS[key] = e
    found = _ENDS[key]
    if isinstance(found, AnatomyError):
        raise found
    return found


def tiny_for(model: nn.Module):
    """A tiny copy of ``model`` and inputs for it (as the derived route builds them)."""

    try:
        return tiny_with_inputs(model, 1)
    except Exception as e:  # noqa: BLE001 - no copy to read the anatomy from: said, not raised raw
        raise AnatomyError(f"no tiny copy of {type(model).__name__} to find its anatomy on: {e}") from e


def _trace_ends(model: nn.Module, layers: str | tuple[str, ...]) -> Ends:
    """One stack: ``before`` runs before its first layer, ``after`` after its last. Two stacks (an
    encoder-decoder): ``before`` is what the encoder runs (embeddings, its final norm), ``after`` what
    the decoder runs (its embeddings, final norm and the head), a module both run in both; ``sections``
    tells the encoder's embeddings, its final norm, the decoder's embeddings and the rest apart."""
    stacks = (layers,) if isinstance(layers, str) else tuple(layers)
    tiny, inputs = tiny_for(model)
    order: list[str] = []  # the path of each start and end of a call (or read of a held parameter), in call order
    outputs: list = []
    shapes: dict[str, torch.Size | None] = {}  # each module's first output's shape (None: not a tensor)
    handles = []
    for path, module in tiny.named_modules():
        if any(_inside_layer(path, stack) for stack in stacks):
            continue  # inside a layer: only the layers themselves mark the stack
        handles.append(module.register_forward_pre_hook(lambda *_, p=path: order.append(p)))
        handles.append(module.register_forward_hook(lambda _m, _a, out, p=path: _mark_end(order, shapes, p, out)))
    first_stack = tiny.get_submodule(stacks[0])
    handles.append(first_stack[0].register_forward_hook(lambda _m, _a, out: outputs.append(out)))
    first_input: list = []  # what the first layer is handed
    handles.append(
        first_stack[0].register_forward_pre_hook(lambda _m, a, k: first_input.append(_hidden(a, k)), with_kwargs=True)
    )
    patterns: dict[str, set] = {stack: set() for stack in stacks}  # which values each stack's layers return
    for stack in stacks:
        for layer in tiny.get_submodule(stack):
            handles.append(layer.register_forward_hook(lambda _m, _a, out, s=stack: patterns[s].add(_pattern(out))))
    received: list = []  # what the second layer is called with
    if len(first_stack) > 1:
        handles.append(
            first_stack[1].register_forward_pre_hook(lambda _m, a, k: received.append((a, k)), with_kwargs=True)
        )
    reads = LayerReads(tiny, stacks)  # what the layers are handed from modules outside the stack
    try:
        with torch.no_grad(), _ReadsOf(held_params(tiny, stacks), order):
            tiny(inputs["x"]) if "x" in inputs else tiny(**inputs)
    except Exception as e:  # noqa: BLE001
        raise AnatomyError(f"a tiny {type(model).__name__} does not run: {type(e).__name__}: {e}") from e
    finally:
        reads.remove()
        for h in handles:
            h.remove()
    windows = []  # (first, last) call index of each stack
    for stack in stacks:
        seen = [i for i, p in enumerate(order) if p.startswith(stack + ".")]
        if not seen:
            raise AnatomyError(f"a forward of {type(model).__name__} never runs its layers {stack!r}")
        windows.append((seen[0], seen[-1]))
    if len(windows) == 2 and windows[0][1] > windows[1][0]:
        raise AnatomyError(f"the layers of {stacks[0]!r} and {stacks[1]!r} run interleaved")
    spans: dict[str, list[int]] = {}
    for i, p in enumerate(order):
        spans.setdefault(p, []).append(i)
    ancestors = {".".join(stack.split(".")[:n]) for stack in stacks for n in range(len(stack.split(".")))}
    own = own_ancestor(stacks)  # the encoder module: what runs between the stacks under it ends the encoder
    before, after, between = [], [], []
    sections: tuple[list[str], ...] = ([], [], [], [])

    def place(path: str, container: bool) -> None:
        places = {_window(i, windows) for i in spans.get(path, [len(order)])}
        if "in" in places:
            if not container:
                between.append(path)
            return
        if len(stacks) == 1 and places == {0, 1}:
            if not container:
                between.append(path)  # one stack: a module both before and after it has no one stage
            return
        under_own = own is not None and (path == own or path.startswith(own + "."))
        for where in places:  # first, the encoder's end, the decoder's start, last
            section = sections[{0: 0, 1: 1 if under_own else 2}.get(where, 3)]
            if path not in section:
                section.append(path)
        if 0 in places or 1 in places and under_own:
            before.append(path)
        if places - {0} - ({1} if under_own else set()):
            after.append(path)

    for path, module in tiny.named_modules():
        if path in ancestors or any(path == st or path.startswith(st + ".") for st in stacks):
            continue
        if any(path.startswith(b + ".") for b in before + after + between):
            continue
        if not any(True for _ in module.parameters()):
            continue  # no weights to place: it runs on every stage as the model calls it
        place(path, _holds_placed(module))
    for name in held_params(tiny, stacks):  # read where the forward reads them (timm's cls_token: before)
        place(name, False)
    if between:
        raise AnatomyError(
            f"{between[0]} runs (or is read) while the layers {', '.join(stacks)} of {type(model).__name__} run (or both before "
            f"and after them): no stage can hold it alone"
        )
    out = outputs[0] if outputs else None
    arity = 0 if torch.is_tensor(out) else len(out) if isinstance(out, tuple) else -1
    if arity < 0 or (arity and not torch.is_tensor(out[0])):
        raise AnatomyError(f"a layer of {stacks[0]!r} returns {type(out).__name__}, not the hidden states (first)")
    every: list[str] = []
    if len(stacks) == 1:
        _check_hand_over(out, received, stacks[0])
        if received:
            every = untied(tiny, reads.every(received[0], _hidden(*received[0]), before + after))
            before, after = [p for p in before if p not in every], [p for p in after if p not in every]
    after.sort(key=lambda p: min(spans.get(p, [len(order)])))  # in call order; never run: last
    norm = after[0] if len(stacks) == 1 and after and _is_norm(part(tiny, after[0])) else None
    offsets = _offsets(before, shapes, first_input[0].shape if first_input else None)
    found = tuple(tuple(sorted(patterns[stack])) for stack in stacks)
    outputs = tuple(p[0] for p in found) if all(len(p) == 1 for p in found) else None
    sorted_sections = tuple(tuple(sorted(sec, key=lambda p: min(spans.get(p, [len(order)])))) for sec in sections)
    return Ends(
        _with_aliases(tiny, before), _with_aliases(tiny, after), norm, arity, offsets,
        tuple(_with_aliases(tiny, list(sec)) for sec in sorted_sections) if len(stacks) == 2 else (), outputs,
        _with_aliases(tiny, every),
    )  # fmt: skip


def held_params(model: nn.Module, stacks: tuple[str, ...]) -> dict[str, nn.Parameter]:
    """Parameters held directly by ``model`` or by a module above one of its ``stacks`` (not by a
    submodule the anatomy places whole): timm's ``cls_token``, ``pos_embed``, ``reg_token``."""
    above = {".".join(stack.split(".")[:n]) for stack in stacks for n in range(len(stack.split(".")))}
    found = {}
    for path in sorted(above):
        for name, param in model.get_submodule(path).named_parameters(recurse=False):
            found[f"{path}.{name}" if path else name] = param
    return found


# what reads a tensor's metadata only (``.dtype``, ``.shape``: property getters): the zeros a stage
# without the parameter reads in its place have the same, so such a read places nothing
_METADATA = ("__get__", "size", "dim", "numel", "stride", "is_floating_point", "element_size")


class _ReadsOf(TorchFunctionMode):
    """Marks in ``order`` each torch call that reads one of ``params``' values (by its name)."""

    def __init__(self, params: dict[str, nn.Parameter], order: list[str]) -> None:
        super().__init__()
        self.names, self.order = {id(p): name for name, p in params.items()}, order

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.names and getattr(func, "__name__", "") not in _METADATA:
            self.order += [self.names[id(t)] for t in tree_leaves((args, kwargs)) if id(t) in self.names]
        return func(*args, **kwargs)


def _mark_end(order: list[str], shapes: dict, path: str, out) -> None:
    order.append(path)
    shapes.setdefault(path, out.shape if torch.is_tensor(out) else None)


def _hidden(args, kwargs):
    return args[0] if args and torch.is_tensor(args[0]) else kwargs.get("hidden_states")


def _offsets(before: list[str], shapes: dict, hidden: torch.Size | None) -> tuple:
    """(path, per-dim difference to the first layer's input) of each of ``before`` shaped otherwise, for
    the same samples (an output that broadcasts over the batch, GPT-2's position embeddings, is left
    out: the hidden states stand in for it, as for any other)."""
    found = []
    for path in before:
        shape = shapes.get(path)
        if hidden is None or shape is None or len(shape) != len(hidden) or shape[0] != hidden[0]:
            continue
        if shape != hidden:
            found.append((path, tuple(a - b for a, b in zip(shape, hidden, strict=True))))
    return tuple(found)


def part(model: nn.Module, path: str) -> nn.Module | nn.Parameter:
    """The module or the parameter at ``path``."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return model.get_parameter(path)


def _pattern(output) -> tuple[bool, ...] | None:
    """Which values of a layer's output are tensors (None: the output is a bare tensor)."""
    if torch.is_tensor(output):
        return None
    return tuple(torch.is_tensor(v) for v in output) if isinstance(output, tuple) else (False,)


def _inside_layer(path: str, stack: str) -> bool:
    return path.startswith(stack + ".") and path.count(".") > stack.count(".") + 1


def _window(index: int, windows: list[tuple[int, int]]) -> int | str:
    """0: before the first stack; then 1 after it (between the stacks, or after the one stack), 2 after
    the second; "in": while a stack runs."""
    for n, (start, end) in enumerate(windows):
        if index < start:
            return n
        if index <= end:
            return "in"
    return len(windows)


def own_ancestor(stacks: tuple[str, ...]) -> str | None:
    """The outermost module above the first stack that is not above the second (the encoder), or None."""
    if len(stacks) < 2:
        return None
    first, second = stacks[0].split("."), stacks[1].split(".")
    common = 0
    while common < min(len(first), len(second)) and first[common] == second[common]:
        common += 1
    return ".".join(first[: common + 1]) if common + 1 < len(first) else None


def _check_hand_over(first_output, received, layers: str) -> None:
    """Refuse layers that hand the next one more than the hidden states (T5's first layer returns the
    position bias it computed, and every later layer reads it): a stage that starts past the first
    layer cannot receive it."""
    if not received or torch.is_tensor(first_output):
        return
    extra = {id(t) for t in tree_leaves(first_output[1:]) if torch.is_tensor(t)}
    args, kwargs = received[0]
    names = [f"argument {i}" for i, t in enumerate(args) if id(t) in extra]
    names += [name for name, t in kwargs.items() if torch.is_tensor(t) and id(t) in extra]
    if names:
        raise HandOverError(
            f"layer 1 of {layers!r} reads {names[0]} from what layer 0 returned besides the hidden states: a "
            f"pipeline stage that starts past layer 0 cannot receive it"
        )


def _with_aliases(model: nn.Module, paths: list[str]) -> tuple[str, ...]:
    """``paths`` and every other path of the same modules (T5's ``shared`` is also ``encoder.embed_tokens``:
    a stage drops, and stands in for, the module under each name the forward may call it by)."""
    found = list(paths)
    chosen = {id(part(model, p)) for p in paths}
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in chosen and path not in found:
            found.append(path)
    return tuple(found)


def _holds_placed(module: nn.Module) -> bool:
    """A container whose children are placed one by one (the walk goes on into it)."""
    return bool(list(module.children())) and not any(True for _ in module.parameters(recurse=False))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
