"""The proof every route passes before it cuts the user's model.

A route (the family's hand-written policy, transformers' tensor-parallel plan, the derived cut) is a
hypothesis. On the ranks that will hold the model, a tiny copy of its class and architecture is
sharded with the route's policy and run against the unsharded tiny copy on the same inputs: outputs,
loss and every gradient (gathered) must match, each gradient against its own scale; with sequence
parallelism asked for, the copy runs with it. Every rank reaches the same verdict (one all-reduce).
The verdict is cached per route, model class, architecture, tp, sequence parallelism and library
versions (a new transformers release can change a plan, a forward or a helper).

The tiny copy is the user's config scaled down (`shardformer.core.tiny_run.tiny_copy`);
a model with no transformers config (timm) is copied with each repeated stack cut to two blocks
(same widths, same code).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Callable

import torch
import torch.nn as nn

from shardformer.core.comm import all_reduce, every_rank
from shardformer.core.compare import ATOL, RTOL, call_on_own_inputs, gradient_failures, max_error
from shardformer.core.config import ShardConfig
from shardformer.core.divergence import ActivationRecorder, first_divergence, first_tensor
from shardformer.core.float64_mode import Float64Everywhere
from shardformer.core.instance import transformers_quiet as _transformers_quiet
from shardformer.core.record import sharding_of
from shardformer.models import inputs_for
from shardformer.policies.anatomy import final_norm, layer_stack
from shardformer.policies.copies import copy_key, instance_copy, no_dropout
from shardformer.policies.tp_plan import model_tp_plan
from shardformer.tensor_parallel.policy import Policy
from shardformer.tensor_parallel.regions import gather_from_parallel
from shardformer.tensor_parallel.sharder import ModelSharder

logger = logging.getLogger("shardformer")

SCALE_RTOL = 1e-3  # rounding is ~1e-6 of a gradient's largest entry; a rank's missing part is far more
FLOOR_RTOL = 1e-6  # of the model's largest gradient entry
# A float32 copy that differs only by numbers (no error raised) is proven again in float64 with every
# tolerance this much tighter: rounding shrinks ~5e8-fold there, a wrong cut not at all (models that amplify
# rounding, a softmax over large logits or many layers, would otherwise be refused although the cut is exact).
FLOAT64_TIGHTER = 1e-4
_VERDICTS: dict[tuple, str | None] = {}  # None: proven; else why not


def prove(
    model: nn.Module, shard_config: ShardConfig, route: str, make_policy: Callable[[], Policy], heads: int | None = None
) -> str | None:
    """None when ``make_policy()`` shards a tiny copy of ``model`` exactly over the tp group
    ``shard_config`` names (its mesh's, or its process group), else why not (the same on every
    rank). ``heads``: the tiny copy's query heads where the route was found on a wider copy."""
    # the training path is proven, whatever the caller's grad mode (shard_model under no_grad)
    with torch.inference_mode(False), torch.enable_grad(), _transformers_quiet():
        return _proven(model, shard_config, route, make_policy, heads)


def _proven(model, shard_config, route, make_policy, heads) -> str | None:
    tp = shard_config.tensor_parallel_size
    try:
        tiny = _tiny(model, tp, heads)
    except Exception as e:  # noqa: BLE001 - a config the class refuses at small sizes: the same on every rank
        return f"a tiny copy of {type(model).__name__} cannot be built to prove it on: {type(e).__name__}: {e}"
    plan = model_tp_plan(model)
    if plan:  # the user's model's plan, as it is (changed by hand, or not): the one to prove
        tiny.tp_plan = plan
    sequence = tuple(_sequence_parallel(shard_config).items())
    # the copy (the instance's additions, attention, dtype and releases among it), the options, the plan as it is
    key = (route, copy_key(model, tp, heads), sequence, json.dumps(plan, sort_keys=True))
    if not every_rank(key in _VERDICTS, _tp_group(shard_config), device=_device(model)):
        _VERDICTS[key] = _prove(tiny, shard_config, make_policy, _device(model))
    return _VERDICTS[key]


def _tp_group(shard_config: ShardConfig):
    """The tp group alone: the copy has no cp, pp or dp of its own."""
    group = shard_config.tensor_parallel_process_group
    if group is None and shard_config.mesh is not None:
        group = shard_config.mesh.tp_group
    return group


def _sequence_parallel(shard_config: ShardConfig) -> dict:
    """The sequence-parallel options the user asked for: proven with the route (a model that reshapes
    its hidden states inside a layer, as OPT before fc1, cannot be run with its sequence split)."""
    if not shard_config.sequence_parallel:
        return {}
    return {"sequence_parallel": True, "sequence_parallel_regather": shard_config.sequence_parallel_regather}


def _tiny(model: nn.Module, tp: int, heads: int | None) -> nn.Module:
    """A small model of ``model``'s class and architecture with everything its instance adds
    (`shardformer.policies.copies.instance_copy`), dropout off."""
    if not hasattr(getattr(model, "config", None), "to_dict") and any(
        p.device.type == "meta" for p in model.parameters()
    ):
        raise ValueError("the model is on the meta device and has no transformers config to build a copy from")
    tiny = instance_copy(model, tp, seed=1, heads=heads)
    no_dropout(tiny)
    return tiny


@contextlib.contextmanager
def _running(model: nn.Module):
    """The paths of ``model``'s modules whose forward has begun and not returned, the innermost last: where
    an error raised in its forward was raised (named in the refusal)."""
    paths = {module: path for path, module in model.named_modules()}
    running: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda m, _: running.append(paths[m])) for m in paths]
    hooks += [m.register_forward_hook(lambda m, *_: _returned(running, paths[m])) for m in paths]
    try:
        yield running
    finally:
        for hook in hooks:
            hook.remove()


def _returned(running: list[str], path: str) -> None:
    """``path`` returned: off the list, with any module inside it whose error its code caught."""
    while running and running.pop() != path:
        pass


@contextlib.contextmanager
def _quiet():
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None or param.device.type == "meta" else param.device


def _main_output(out):
    return first_tensor(out), (out.get("loss") if isinstance(out, dict) else None)


def _other_outputs(ref_out, out, ref_main) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(reference, sharded)`` pairs of the other float tensors a model without a loss returns beside its
    main output, of one shape on both (SiglipVisionModel's ``pooler_output``, which its attention pooling
    head computes): the proof covers every part that runs."""

    def tensors(o):
        values = o.values() if isinstance(o, dict) else o if isinstance(o, (tuple, list)) else ()
        return [v for v in values if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]

    pairs = [(a, b) for a, b in zip(tensors(ref_out), tensors(out)) if a is not ref_main]
    return [(a, b) for a, b in pairs if a.shape == b.shape] if len(tensors(ref_out)) == len(tensors(out)) else []


def _prove(tiny: nn.Module, shard_config: ShardConfig, make_policy, device, tighter: float = 1.0) -> str | None:
    tp = shard_config.tensor_parallel_size
    ref = tiny.to(device)
    float64_copy = copy.deepcopy(ref) if tighter == 1.0 and _dtype(ref) == torch.float32 else None
    inputs = inputs_for(ref, seed=1)
    if tighter != 1.0:  # the float64 run: its float inputs too
        inputs = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    sharded = copy.deepcopy(ref)
    ref.train(), sharded.train()  # the training path (the recipe's dropout is 0)
    group = _tp_group(shard_config)
    sequence = _sequence_parallel(shard_config)
    config = ShardConfig(
        tensor_parallel_size=tp, tensor_parallel_process_group=group, seed=shard_config.seed, **sequence
    )
    stack = dict(layers=layer_stack(sharded), final_norm=final_norm(sharded)) if sequence else {}
    failures: list[str] = []
    try:
        with _quiet():  # the tiny copy's "sharded ..." line would read like the user's model's
            sharded = ModelSharder(sharded, make_policy(), config, **stack).shard()
    except Exception as e:  # noqa: BLE001 - the route cannot cut the tiny copy: the same on every rank
        failures.append(f"the tiny copy cannot be cut: {type(e).__name__}: {str(e)[:300]}")
    if not failures:
        group = sharding_of(sharded).tp_group
        hard = 0.0  # a failure no precision explains: an error, or nothing cut
        if sum(p.numel() for p in sharded.parameters()) >= sum(p.numel() for p in ref.parameters()):
            failures.append("the tiny copy was not sharded")
            hard = 1.0
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        try:
            with _running(sharded) as running:
                _compare(ref, sharded, group, inputs, device, failures, tighter)
        except Exception as e:  # noqa: BLE001 - the cut copy cannot run: every rank's copy fails alike
            # nothing running: the error came after the forward (its backward), so no module is named
            where = (
                f" in {running[-1] or 'the model'} ({type(sharded.get_submodule(running[-1])).__name__})"
                if running
                else ""
            )
            failures.append(f"the sharded tiny copy fails{where}: {type(e).__name__}: {str(e)[:300]}")
            hard = 1.0
        verdict = all_reduce(torch.tensor([float(len(failures)), hard], device=device), group)
        if verdict[0].item() == 0:  # every rank refuses, or none
            return None
        if verdict[1].item() == 0 and float64_copy is not None:  # numbers only, on every rank: rounding?
            with Float64Everywhere():  # float32 the model asks for (norms' .float()) too
                again = _prove(float64_copy.double(), shard_config, make_policy, device, FLOAT64_TIGHTER)
            if again is None:
                logger.debug("the float32 copy differed (%s); exact in float64: rounding", "; ".join(failures[:3]))
                return None
            failures.append(f"in float64 too, at tolerances {1 / FLOAT64_TIGHTER:g}x tighter: {again}")
    return "; ".join(failures[:3] + failures[-1:] if len(failures) > 3 else failures) or "another rank saw a difference"


def _dtype(model: nn.Module) -> torch.dtype | None:
    param = next(model.parameters(), None)
    return None if param is None else param.dtype


def _compare(ref: nn.Module, sharded: nn.Module, group, inputs: dict, device, failures: list[str], tighter=1.0):
    """Outputs, loss and every gradient of ``sharded`` against ``ref``, every tolerance times ``tighter``;
    what differs goes to ``failures`` (the first diverging module with the first failure)."""
    rec_ref, rec_sh = ActivationRecorder(ref), ActivationRecorder(sharded)
    with torch.random.fork_rng(devices=[]):
        ref_out, out = call_on_own_inputs(ref, inputs), call_on_own_inputs(sharded, inputs)
    ref_main, ref_loss = _main_output(ref_out)
    main, loss = _main_output(out)
    rec_ref.remove(), rec_sh.remove()
    if main.shape != ref_main.shape:
        main = gather_from_parallel(main, group, ref_main.shape[-1])
    wide = torch.float64 if ref_main.dtype == torch.float64 else torch.float32
    weights = torch.randn(ref_main.shape, generator=torch.Generator().manual_seed(2)).to(device, wide)
    extras = [] if ref_loss is not None else _other_outputs(ref_out, out, ref_main)
    if ref_loss is None:  # no loss of its own: a fixed random projection of the outputs
        ref_loss, loss = (ref_main.to(wide) * weights).sum(), (main.to(wide) * weights).sum()
        for i, (a, b) in enumerate(extras):
            w = torch.randn(a.shape, generator=torch.Generator().manual_seed(3 + i)).to(device, wide)
            ref_loss, loss = ref_loss + (a.to(wide) * w).sum(), loss + (b.to(wide) * w).sum()
    divergence = first_divergence(rec_ref, rec_sh, group)
    where = f"first diverging module: {divergence}" if divergence else "no single module diverges first"
    tol = {"atol": ATOL * tighter, "rtol": RTOL * tighter}
    err, ok = max_error(main, ref_main, **tol)
    for a, b in extras:
        err, ok = max(err, max_error(b, a, **tol)[0]), ok and max_error(b, a, **tol)[1]
    if not ok:
        failures.append(f"outputs differ by {err:.2e}; {where}")
    err, ok = max_error(loss, ref_loss, **tol)
    if not ok:
        failures.append(f"loss differs by {err:.2e}" + ("" if failures else f"; {where}"))
    ref_loss.backward(), loss.backward()
    failures += gradient_failures(ref, sharded, group, SCALE_RTOL * tighter, FLOOR_RTOL * tighter, tighter)
