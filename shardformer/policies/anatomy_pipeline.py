"""Pipeline specs from a model's anatomy: any model with one layer stack, any head, proven on a tiny copy.

The anatomy (`shardformer.policies.anatomy`) says which ``ModuleList`` is the layer stack and which
modules run before it (embeddings: the first stage) and after it (final norm, head: the last stage);
a module of the first tied to one of the last (input embeddings and the LM head) is on both.

Every stage runs the whole model's own forward on the micro-batch (labels on the last stage only),
while `shardformer.pipeline.stage_view.stage_view` fills its holes:

- after the first stage, the embeddings answer with the received hidden states (only their shape and
  dtype matter: masks are built from them), and the layer before this stage's first one returns the
  received hidden states as a layer returns them, so this stage's first layer reads exactly them;
  the other stages' earlier layers pass their input through;
- before the last stage, the layer after this stage's last one records what it is handed (the hidden
  states, as the model passes them on) and stops the forward there: the head never runs on a
  partial model.

An embedding whose output is not shaped as the hidden states (timm's ``patch_embed``: the class
token is put in front after it) answers with zeros of its shape instead, and a parameter the model
holds itself (``cls_token``, ``pos_embed``) sits on the stage whose forward reads it (the anatomy
finds where) and reads as zeros of its shape elsewhere. Several stacks, one in each item of one list
(Swin's stages of blocks of different widths), split between the items: they are the layers.

So masks, position ids, ALiBi biases and the head's pooling and loss are the model's own. What a
layer receives besides the hidden states must be computed from the inputs alone, not from the
embeddings' values, and layers must hand each other nothing but the hidden states: the split is
proven on a tiny copy (two stages, loss and every gradient against the unsplit copy) before it is
used, and refused otherwise, naming why.

An encoder-decoder (two stacks) splits anywhere in its layers, the encoder's output carried to the
decoder's stages (`shardformer.policies.encoder_decoder`); each kind of cut is proven apart.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn as nn

from shardformer.core.record import sharding_of
from shardformer.models import family_spec
from shardformer.pipeline.from_plan import spec_from_pp_plan
from shardformer.pipeline.spec import HEAD_INPUTS, PipelineSpec, stage_of
from shardformer.pipeline.spec_check import PipelineSpecError, check_pipeline_spec
from shardformer.pipeline.stage_view import Returns, own_forward, stage_view, taken_inputs
from shardformer.policies.anatomy import stacks
from shardformer.policies.anatomy_ends import AnatomyError, Ends, ends_of, own_ancestor, part, tiny_for
from shardformer.policies.anatomy_towers import LaterInputs, language_inputs, payloads, tower_root
from shardformer.policies.copies import copy_key
from shardformer.policies.derived.blocks import run_hooked
from shardformer.policies.encoder_decoder import EncoderDecoderStageForward, proof_splits
from shardformer.policies.pipeline_proof import failure_of, first_rank_answer, prove_split, route_verdict
from shardformer.policies.stage_parts import Capture, LayerPassThrough, Reached, SkeletonZeros, ZerosShaped


class AnatomyStageForward:
    """The stage forward of a `PipelineSpec` found from a model's anatomy (see the module doc).

    ``held``: {name: shape} of the parameters held directly by the model that only the first stage
    holds (timm's ``cls_token``): later stages read zeros of that shape in their place, as they read
    the received hidden states in place of the embeddings. Inputs the model's forward does not take
    (a ``loss_fn``'s targets) are not passed to it."""

    __name__ = "anatomy_stage_forward"

    def __init__(
        self, layers: str, entries: tuple[str, ...], layer_outputs: int, offsets=(), held=None, later_inputs=None
    ) -> None:
        self.layers, self.entries, self.layer_outputs = layers, entries, layer_outputs
        self.offsets, self.held = dict(offsets), held or {}
        self.later_inputs = later_inputs  # None: every input on every stage; else what stages after the first take
        self.towers: tuple[str, ...] = ()  # modules on the first stage that read other inputs (a vision tower)

    def __call__(self, model: nn.Module, hidden, inputs: dict):
        stage, num_stages = stage_of(model)
        kept = sharding_of(model).layers
        holes = [int(k) for k, v in model.get_submodule(self.layers)._modules.items() if v is None]
        stand_ins: dict[str, nn.Module | torch.Tensor] = {
            f"{self.layers}.{i}": LayerPassThrough(self.layer_outputs) for i in holes
        }
        if stage > 0:
            modules = [path for path in self.entries if path not in self.held]
            stand_ins |= {
                p: SkeletonZeros(hidden, ZerosShaped(hidden, self.offsets[p]) if p in self.offsets else Returns(hidden))
                for p in modules
            }
            stand_ins[f"{self.layers}.{kept[0] - 1}"] = LayerPassThrough(self.layer_outputs, hidden)
            stand_ins |= {name: hidden.new_zeros(shape) for name, shape in self.held.items()}
        last = stage == num_stages - 1
        if not last:
            stand_ins[f"{self.layers}.{kept[-1] + 1}"] = Capture()
        forward = own_forward(model)
        kwargs = {
            k: v for k, v in taken_inputs(forward, inputs).items() if v is not None and (last or k not in HEAD_INPUTS)
        }
        if stage > 0 and self.later_inputs is not None:  # a tower's inputs (pixels): its output is in `hidden`
            kwargs = {k: v for k, v in kwargs.items() if self.later_inputs.takes(k) or k in HEAD_INPUTS}
        if "use_cache" in inspect.signature(forward).parameters:
            kwargs["use_cache"] = False  # no KV cache in training: layers of other stages would never fill it
        with stage_view(model, stand_ins):
            if last:
                return forward(**kwargs)
            try:
                forward(**kwargs)
            except Reached as reached:
                return reached.hidden
        raise RuntimeError(
            f"pipeline stage {stage}: {type(model).__name__}'s forward never reached layer {kept[-1] + 1}"
        )


logger = logging.getLogger("shardformer")
FIX = "pass ParallelEngine(..., pipeline=PipelineSpec(layers=..., first=..., last=..., shared=..., stage_forward=...))"


def spec_from_anatomy(model: nn.Module) -> PipelineSpec:
    """The pipeline spec of ``model`` from its anatomy, proven on a tiny copy (cached per class and
    architecture); NotImplementedError naming why when there is none or it is not exact."""
    found = stacks(model)
    name = type(model).__name__
    if not found:
        reused = _reused_layer(model)
        if reused is not None:
            path, calls = reused
            raise NotImplementedError(
                f"{name} applies one layer's weights at every depth ({path} runs {calls} times in one forward of "
                f"a tiny copy), so it has no stack of layers to divide into pipeline stages: a split by application "
                f"(each stage holding the same layer and running its share of the depths, the layer's gradient "
                f"summed over the stages) would divide compute but none of the weights' memory, and is not built; "
                f"use pipeline_parallel_size=1: data parallelism and ZeRO train it (EngineConfig(dp=..., "
                f"zero_stage=1, 2 or 3))"
            )
        raise NotImplementedError(
            f"{name} has no repeated layer stack (a ModuleList of blocks of one class) to split into pipeline stages; "
            f"use pipeline_parallel_size=1 (tensor and data parallelism apply), or {FIX}"
        )
    encoder_decoder = len(found) == 2 and getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    stages = _stages_of(model, found) if len(found) > 1 and not encoder_decoder else None
    if stages is not None:
        found = (stages,)  # Swin: split between its stages, each a stack of blocks of its own width
    rules: list[LaterInputs | None] = [None]
    if len(found) > 1 and not encoder_decoder:  # towers (vision, audio) before a language model's stack
        language = language_inputs(model, found[-1])
        if language is None:
            raise NotImplementedError(
                f"{name} has {len(found)} layer stacks ({', '.join(found)}) that are not an encoder and a decoder, "
                f"nor one each in the items of one list (as Swin's stages are), nor towers before a language "
                f"model's stack: pipeline stages over them are not supported; use pipeline_parallel_size=1, or {FIX}"
            )
        towers = tuple(tower_root(stack, found[-1]) for stack in found[:-1])
        rules = [LaterInputs(keep=language), LaterInputs(drop=payloads(model))]  # the second: positions from a grid
        found = found[-1:]
    layers = found if encoder_decoder else found[0]
    try:
        ends = ends_of(model, layers)
    except AnatomyError as e:
        raise NotImplementedError(f"no pipeline split of {name}: {e}; use pipeline_parallel_size=1") from e
    for later_inputs in rules:  # the first rule proven exact
        spec = spec_from_ends(model, layers, ends, later_inputs)
        if later_inputs is not None:
            spec.stage_forward.towers = towers
        try:  # every parameter placed: the anatomy was read off a tiny copy, whose modules may differ
            check_pipeline_spec(spec, model, 2, _boundary(model, spec))
        except PipelineSpecError as e:  # the spec is the anatomy's, not the user's: say why it falls short
            raise NotImplementedError(
                f"no pipeline split of {name} from its anatomy: {_unseen(model, found) or e}; use "
                f"pipeline_parallel_size=1, or {FIX}"
            ) from e
        error, refusals = first_rank_answer(lambda r=later_inputs: _proof(model, layers, ends, r))  # for all ranks
        if error is None:
            break
    if encoder_decoder:
        spec.stage_forward.refusals = dict(refusals)  # the cuts inside the stacks that are not exact
    if error is not None:
        raise NotImplementedError(
            f"the pipeline split of {name} at its layers {layers!r} is not exact on a tiny copy ({error}); "
            f"use pipeline_parallel_size=1, or {FIX}"
        )
    return spec


def _reused_layer(model: nn.Module) -> tuple[str, int] | None:
    """(path, calls) of an item of a ModuleList or Sequential with weights that one forward of a tiny copy
    calls more than once (ALBERT's one layer group, applied at every depth), or None."""
    try:
        tiny, inputs = tiny_for(model)
    except AnatomyError:
        return None
    calls: dict[str, int] = {}
    handles = []
    for path, module in tiny.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for index, item in module.named_children():
                if any(True for _ in item.parameters()):
                    counted = f"{path}.{index}" if path else index
                    handles.append(
                        item.register_forward_hook(lambda *_, p=counted: calls.__setitem__(p, calls.get(p, 0) + 1))
                    )
    try:
        run_hooked(tiny, inputs, handles)
    except Exception:  # noqa: BLE001 - a copy that does not run: the plain refusal says what is missing
        return None
    reused = sorted((path.count("."), path, n) for path, n in calls.items() if n > 1)  # the outermost first
    return (reused[0][1], reused[0][2]) if reused else None


def _unseen(model: nn.Module, found: tuple[str, ...]) -> str | None:
    """The modules outside the stacks that hold parameters in ``model`` but are not in its tiny copy (the
    anatomy never saw where the forward reads them), said as a reason; None when the copy has them all."""
    tiny, _ = tiny_for(model)
    copied = {path for path, _ in tiny.named_modules()}
    missing = [
        path
        for path, module in model.named_modules()
        if path not in copied
        and not any(path == s or path.startswith(s + ".") for s in found)
        and any(True for _ in module.parameters(recurse=False))
    ]
    if not missing:
        return None
    return (
        f"its tiny copy (its config scaled down) has no {', '.join(missing[:3])}, so where its forward reads "
        f"{'them' if len(missing) > 1 else 'it'} was never seen"
    )


def _stages_of(model: nn.Module, found: tuple[str, ...]) -> str | None:
    """The list whose items each hold one of the stacks ``found`` (Swin's ``layers``: stages of blocks
    of one width, a patch merging between them), or None: its items are the layers of a split at
    stage boundaries."""
    places = set()
    for path in found:
        parts = path.split(".")
        at = next((i for i, name in enumerate(parts[:-1]) if name.isdigit() and i), None)
        if at is None:
            return None
        places.add((".".join(parts[:at]), parts[at]))
    parents = {parent for parent, _ in places}
    if len(parents) != 1 or len(places) != len(found):  # one list, one stack per item
        return None
    parent = parents.pop()
    items = model.get_submodule(parent)
    same = isinstance(items, (nn.ModuleList, nn.Sequential)) and len({type(m) for m in items}) == 1
    return parent if same else None


def _boundary(model: nn.Module, spec: PipelineSpec) -> list[int] | None:
    """Layers per stage of an encoder-decoder's two stages (None: one stack, any split)."""
    if spec.second_layers is None:
        return None
    return [len(model.get_submodule(spec.layers)), len(model.get_submodule(spec.second_layers))]


def spec_from_ends(model: nn.Module, layers: str | tuple[str, str], ends: Ends, later_inputs=None) -> PipelineSpec:
    """The spec: ``ends.before`` on the first stage, ``ends.after`` on the last, and the modules of the
    first that hold a weight tied to one of the last on both (``shared``). Two stacks (an encoder and a
    decoder): the modules of each of ``ends.sections`` with the layer next to them."""
    if not isinstance(layers, str):
        first, first_end, second_start, last = ends.sections
        stage = EncoderDecoderStageForward(own_ancestor(layers), layers, (first, second_start), ends.outputs)
        return PipelineSpec(
            layers[0], stage, first, last, second_layers=layers[1], first_end=first_end, second_start=second_start
        )
    after_ids = {id(p) for path in ends.after for p in _params(model, path)}
    tied = {id(p) for path in ends.before for p in _params(model, path) if id(p) in after_ids}
    first: list[str] = []
    shared: list[str] = []

    def place(path: str) -> None:
        module = part(model, path)
        ids = {id(p) for p in _params(model, path)}
        if not ids & tied:
            first.append(path)
        elif (
            isinstance(module, nn.Parameter)
            or any(True for _ in module.parameters(recurse=False))
            or not list(module.children())
        ):
            shared.append(path)
        else:
            for child, sub in module.named_children():
                if any(True for _ in sub.parameters()):
                    place(f"{path}.{child}")

    for path in ends.before:
        place(path)
    held = {id(part(model, p)) for p in shared}  # a module of both ends (under each of its names)
    shared += [p for p in ends.after if id(part(model, p)) in held and p not in shared]
    last = tuple(p for p in ends.after if p not in shared)
    tokens = {p: tuple(part(model, p).shape) for p in first if isinstance(part(model, p), nn.Parameter)}
    stage = AnatomyStageForward(layers, ends.before, ends.layer_outputs, ends.offsets, tokens, later_inputs)
    return PipelineSpec(layers, stage, first=tuple(first), last=last, shared=tuple(shared), every=ends.every)


def _params(model: nn.Module, path: str) -> list[nn.Parameter]:
    try:
        found = part(model, path)
    except AttributeError:
        return []
    return [found] if isinstance(found, nn.Parameter) else list(found.parameters())


_PROOFS: dict[tuple, tuple[str | None, dict[str, str]]] = {}


def _proof(model: nn.Module, layers, ends: Ends, later_inputs=None) -> tuple[str | None, dict[str, str]]:
    """(why two stages of a tiny copy do not compute what the copy computes (loss or output, every
    gradient), or None; for an encoder-decoder, {cut kind: why stages cut there are not exact}).
    Cached per stack under everything the verdict depends on (`shardformer.policies.copies.copy_key`)."""
    key = (copy_key(model, 1), str(layers), later_inputs)
    if key not in _PROOFS:
        try:
            _PROOFS[key] = _prove(model, layers, ends, later_inputs)
        except Exception as e:  # noqa: BLE001 - a split that crashes is not exact: say how
            _PROOFS[key] = (failure_of(e), {})
    return _PROOFS[key]


def _prove(model: nn.Module, layers, ends: Ends, later_inputs=None) -> tuple[str | None, dict[str, str]]:
    tiny, inputs = tiny_for(model)
    if isinstance(layers, str) and len(tiny.get_submodule(layers)) < 2:
        return f"the tiny copy has fewer than two layers in {layers}", {}
    tiny.eval()
    spec = spec_from_ends(tiny, layers, ends, later_inputs)
    error = prove_split(tiny, inputs, spec, _boundary(tiny, spec) or [1, len(spec.layer_paths(tiny)) - 1])
    if isinstance(layers, str) or error is not None:
        return error, {}

    if ends.outputs is None:
        why = f"the layers of {layers[0]} or {layers[1]} do not all return alike"
        return None, {kind: why for kind in ("encoder", "decoder", "mixed")}

    def refusal(split) -> str | None:
        try:
            return split if isinstance(split, str) else prove_split(tiny, inputs, spec, split)
        except Exception as e:  # noqa: BLE001 - a cut that crashes is not exact: say how
            return failure_of(e)

    # the mixed split cuts inside both stacks too: when it holds, so do they (T5, BART); else each apart
    splits = proof_splits(*_boundary(tiny, spec))
    mixed = refusal(splits.pop("mixed"))
    if mixed is None:
        return None, {}
    found = {kind: refusal(split) for kind, split in splits.items()}
    return None, {"mixed": mixed} | {kind: why for kind, why in found.items() if why is not None}


def pipeline_spec_for(model: nn.Module) -> PipelineSpec:
    """The pipeline spec of ``model``: the first route whose split is exact on a tiny copy of it, with its
    config values (`shardformer.policies.pipeline_proof`): its family's hand-written spec, transformers'
    ``base_model_pp_plan``, its anatomy (`spec_from_anatomy`). A route that does not prove passes to
    the next; where none does, NotImplementedError naming each route's reason."""
    reasons = []
    for route, spec_of in (("the family's pipeline spec", _family_route), ("transformers' pp plan", _plan_route)):
        spec, reason = spec_of(model)
        if spec is not None and reason is None:
            return spec
        if reason is not None:
            logger.info("%s: %s passed over: %s", type(model).__name__, route, reason)
            reasons.append((route, reason))
    try:
        return spec_from_anatomy(model)
    except NotImplementedError as e:
        if not reasons:
            raise
        said = [f"{route}: {'the same' if reason in str(e) else reason}" for route, reason in reasons]
        raise NotImplementedError(f"{e}. The other routes: {'; '.join(said)}") from None


def _family_route(model: nn.Module) -> tuple[PipelineSpec | None, str | None]:
    """(the family's spec, why it is not exact on a tiny copy or None); (None, None): no spec."""
    spec = family_spec(model)
    return (None, None) if spec is None else (spec, route_verdict(model, "family", family_spec))


def _plan_route(model: nn.Module) -> tuple[PipelineSpec | None, str | None]:
    """(the pp plan's spec, why it is not exact or None); (None, None): no plan. The plan's stages
    assume layers that hand each other the hidden states alone: a layer that returns more (GLM-MoE-DSA's
    hands its top-k indices to the next) is refused from the anatomy, before a proof whose stages would
    unpack a pass-through's bare tensor along the batch; Granite's stages skip its embedding multiplier,
    which the proof sees."""
    spec = spec_from_pp_plan(model)
    if spec is None:
        return None, None
    try:
        outputs = ends_of(model, spec.layers).layer_outputs
    except AnatomyError as e:
        return spec, str(e)
    if outputs:
        return spec, f"its layers return {outputs} values, not the hidden states alone as the plan's stages assume"
    return spec, route_verdict(model, "pp plan", spec_from_pp_plan)
