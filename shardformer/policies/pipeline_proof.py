"""The proof of a pipeline split: two stages of a tiny copy against the unsplit copy, one verdict per route.

Every route to a pipeline spec (a family's hand-written one, transformers' ``base_model_pp_plan``, the
model's anatomy) is a hypothesis. `prove_split` runs the stages of a tiny copy of the user's model
(built from its config: Granite's ``embedding_multiplier`` is in it) one after the other, as the engine
does, and compares the loss, what each stage hands on and the gradient sent back for it, and every
weight's gradient (summed over the stages holding it) with the unsplit copy. A route is used only where
its split is exact there; `route_verdict` caches the verdict under everything it depends on.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from shardformer.core.compare import ATOL, GRAD_ATOL, GRAD_RTOL, RTOL
from shardformer.pipeline.skeleton import READS
from shardformer.pipeline.spec import PipelineSpec
from shardformer.policies.anatomy_ends import tiny_for
from shardformer.policies.copies import copy_key
from shardformer.policies.stage_parts import hidden_of

T = TypeVar("T")
_VERDICTS: dict[tuple, str | None] = {}


_SHARED: list[bool] = []  # inside verdicts_from_first_rank(): every rank takes the first rank's verdicts


@contextlib.contextmanager
def verdicts_from_first_rank():
    """Within the block, every rank of the world takes the first rank's pipeline route verdicts (one
    broadcast each) instead of proving them itself: the proof runs in one process and would compute the
    same on every rank, so the others wait for its word rather than repeat it. Only where every rank
    chooses its spec in lockstep (ParallelEngine over the whole world does); the verdicts decide which
    route is asked next, so every rank asks the same questions."""
    # not on a fake process group (`shardformer plan --simulate`): its collectives carry nothing
    shared = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
    _SHARED.append(shared)
    try:
        yield
    finally:
        _SHARED.pop()


def first_rank_answer(answer: Callable[[], T]) -> T:
    """``answer()``, worked out on the first rank alone inside `verdicts_from_first_rank` and taken by
    every rank (the proofs run one process's tiny copy: every rank would compute the same), else here."""
    if _SHARED and _SHARED[-1]:
        box = [answer() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return answer()


def route_verdict(model: nn.Module, route: str, spec_of: Callable[[nn.Module], PipelineSpec | None]) -> str | None:
    """Why the spec ``spec_of`` gives a tiny copy of ``model`` is not exact at two stages there (None: it
    is); cached per route under its tiny copy's key (`shardformer.policies.copies.copy_key`)."""
    return first_rank_answer(lambda: _local_verdict(model, route, spec_of))


def _local_verdict(model: nn.Module, route: str, spec_of) -> str | None:
    key = (copy_key(model, 1), route)
    if key not in _VERDICTS:
        try:  # the training path is proven, whatever the caller's grad mode (an engine built under no_grad)
            with torch.inference_mode(False), torch.enable_grad():
                _VERDICTS[key] = _verdict(model, spec_of)
        except Exception as e:  # noqa: BLE001 - a split that crashes is not exact: say how
            _VERDICTS[key] = failure_of(e)
    return _VERDICTS[key]


def _verdict(model: nn.Module, spec_of) -> str | None:
    tiny, inputs = tiny_for(model)
    spec = spec_of(tiny)
    layers = None if spec is None else len(spec.layer_paths(tiny))
    if spec is None:
        return "it gives no spec for the tiny copy"
    if layers < 2:
        return f"the tiny copy has fewer than two layers in {spec.layers}"
    return prove_split(tiny.eval(), inputs, spec, [1, layers - 1])


def failure_of(e: Exception) -> str:
    """A failure of a proof, in one line: what was raised (and the dropped module a stage read)."""
    read = f" (a stage read {READS[0]}, of a module another stage holds)" if READS else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}{read}"


def _scalar(output) -> torch.Tensor:
    if torch.is_tensor(output):
        return output.float().pow(2).mean()
    loss = output.get("loss") if hasattr(output, "get") else None
    if loss is not None:
        return loss
    first = next(t for t in (output.values() if hasattr(output, "values") else [output]) if torch.is_tensor(t))
    return first.float().pow(2).mean()


def _parts(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _received(value):
    """What the next stage receives: detached copies of the tensors handed on, floating ones requiring grad."""
    parts = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _parts(value))
    return parts[0] if len(parts) == 1 else parts


def prove_split(tiny: nn.Module, inputs: dict, spec: PipelineSpec, counts: list[int]) -> str | None:
    """Why stages of ``counts`` layers of ``tiny`` do not compute what ``tiny`` computes, or None: the loss,
    what each stage hands on and the gradient sent back for it (the hidden states), every weight's gradient."""
    tiny.zero_grad(set_to_none=True)  # a copy split before: no gradient left from it
    READS.clear()
    stages = [spec.keep_stage(copy.deepcopy(tiny), s, len(counts), counts) for s in range(len(counts))]
    sent, received = [], [None]
    for s, stage in enumerate(stages):
        sent.append(spec.stage_forward(stage, received[-1], inputs))
        if s < len(stages) - 1:
            received.append(_received(sent[-1]))
    got = _scalar(sent[-1])
    got.backward()
    for s in reversed(range(len(stages) - 1)):
        pairs = zip(_parts(sent[s]), _parts(received[s + 1]))
        pairs = [(o, r.grad) for o, r in pairs if r.grad is not None and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    cuts = [sum(counts[: s + 1]) for s in range(len(counts) - 1)]
    handed, handles = _watch_hand_over(tiny, spec, cuts)
    try:
        expected = _scalar(tiny(**inputs))
    finally:
        for handle in handles:
            handle.remove()
    if any(not seen for seen in handed):
        return "the unsplit copy never computes what a stage hands on"
    for seen in handed:
        seen[0].retain_grad()
    expected.backward()
    if not torch.allclose(got, expected, atol=ATOL, rtol=RTOL):
        return f"the loss (or output) differs: {got.item():.6g} vs {expected.item():.6g}"
    # the hand-overs themselves, both ways: a small model's loss barely moves with them (weights of std 0.02)
    for cut, seen, value in zip(cuts, handed, received[1:]):
        hidden, there = _parts(value)[0], seen[0]
        if hidden.shape != there.shape or not torch.allclose(hidden, there, atol=ATOL, rtol=RTOL):
            return (
                f"what the stage ending before layer {cut} hands on differs from what the unsplit copy computes there"
            )
        scale = there.grad.abs().max().item() if there.grad is not None else 0.0
        if there.grad is None or not torch.allclose(hidden.grad, there.grad, atol=1e-4 * scale, rtol=RTOL):
            return f"the gradient sent back to the stage ending before layer {cut} differs from the unsplit copy's"
    names: dict[int, list[str]] = {}  # a tied weight's names (a stage without the module of one uses another)
    for name, p in tiny.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for name, p in tiny.named_parameters():
        if p.grad is None:
            continue
        found = [_grad_in(stage, names[id(p)]) for stage in stages]
        found = [g for g in found if g is not None]
        if not found:
            return f"no stage computes the gradient of {name}"
        total = torch.stack(found).sum(0)
        if not torch.allclose(total, p.grad, atol=GRAD_ATOL, rtol=GRAD_RTOL):
            return f"the gradient of {name} differs by {(total - p.grad).abs().max().item():.2e}"
    return None


def _watch_hand_over(tiny: nn.Module, spec: PipelineSpec, cuts: list[int]):
    """([[the activation]] per cut, hook handles): in a forward of the unsplit ``tiny``, the hidden states a
    stage that starts at layer ``cut`` receives (the encoder's output at an encoder-decoder's boundary)."""
    seen: list[list[torch.Tensor]] = [[] for _ in cuts]
    handles = []
    paths = spec.layer_paths(tiny)
    boundary = len(tiny.get_submodule(spec.layers)) if spec.second_layers is not None else None
    for cut, found in zip(cuts, seen):
        if cut == boundary:
            encoder = tiny.get_submodule(spec.stage_forward.encoder)
            handles.append(encoder.register_forward_hook(lambda _m, _a, out, f=found: f.append(_first(out))))
        elif boundary is not None:  # what the loop reads off the layer before (the stage's first layer's input)
            layer = tiny.get_submodule(paths[cut - 1])
            handles.append(layer.register_forward_hook(lambda _m, _a, out, f=found: f.append(_first(out))))
        else:
            layer = tiny.get_submodule(paths[cut])
            hook = lambda _m, a, k, f=found: f.append(hidden_of(a, k))  # noqa: E731
            handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def _first(output) -> torch.Tensor:
    return output if torch.is_tensor(output) else output[0]


def _grad_in(stage: nn.Module, names: list[str]) -> torch.Tensor | None:
    """The gradient a stage holds for the parameter known by ``names`` (None: not on this stage)."""
    params = dict(stage.named_parameters(remove_duplicate=False))
    held = next((params[n] for n in names if n in params), None)
    return None if held is None else held.grad
