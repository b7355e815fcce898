"""The proof context parallelism passes before the user's model is cut.

The static checks (`.checks`) and the probes (positions, `.mixing`) admit what they know;
this decides, as the tensor-parallel routes' proof does. On the ranks that will hold the model, the
tiny copy of the user's instance (`shardformer.policies.copies.instance_copy`: its swapped
modules, hooks, patched methods and attention implementation; dropout off) is cut with the chosen
route's policy at the user's tp and split over the sequence at the user's cp size and mode, through
the same `shardformer.tensor_parallel.sharder.ModelSharder` the model goes through, on the
mesh's own tp and cp groups: the tp x cp combination the model runs, not cp alone. It runs the recipe's
inputs (a causal LM with its labels) against the unsharded copy: outputs (gathered over cp and tp),
loss and every gradient must match (`shardformer.policies.proof.SCALE_RTOL` of its own scale);
what differs is named with the first diverging module. Every rank of the tp x cp block reaches the same
verdict (all-reduces over tp, then cp), cached per class, cp, mode, tp, route, architecture, the
instance's key and library versions.

What it does not cover: the pipeline's split of the stages (ParallelEngine at pp > 1 splits each
stage's micro-batch the same way, tested in tests/context_parallel/test_engine.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import torch
import torch.nn as nn

from shardformer.context_parallel.layout import gather_split, layout_for
from shardformer.core.comm import all_reduce, every_rank, group_rank
from shardformer.core.compare import gradient_failures, max_error
from shardformer.core.divergence import ActivationRecorder, first_divergence
from shardformer.core.record import build_mesh, sharding_of
from shardformer.models import inputs_for
from shardformer.policies.anatomy import final_norm, layer_stack
from shardformer.policies.copies import copy_key
from shardformer.policies.derived import NotProvenError
from shardformer.policies.proof import (
    FLOOR_RTOL,
    SCALE_RTOL,
    _device,
    _main_output,
    _quiet,
    _tiny,
    _transformers_quiet,
)
from shardformer.policies.tp_plan import model_tp_plan
from shardformer.tensor_parallel.regions import gather_from_parallel
from shardformer.tensor_parallel.sharder import ModelSharder

logger = logging.getLogger("shardformer")
_VERDICTS: dict[tuple, str | None] = {}  # None: proven; else why not


def with_mesh(shard_config):
    """``shard_config`` with the mesh the model will be cut over (built once: group creation is collective)."""
    if shard_config.mesh is not None or shard_config.tensor_parallel_process_group is not None:
        return shard_config
    return dataclasses.replace(shard_config, mesh=build_mesh(shard_config)[0])


def prove_context_parallel(model: nn.Module, shard_config, route: str, make_policy, heads: int | None) -> str | None:
    """None when a tiny copy of ``model`` cut by ``make_policy()`` at the config's tp and split at its cp
    (size and mode) over the config's mesh computes what the unsharded copy computes, else why not (the
    same on every rank). ``heads``: the tiny copy's query heads where the route was found on a wider copy."""
    tp, cp = shard_config.tensor_parallel_size, shard_config.context_parallel_size
    mode = shard_config.context_parallel_mode
    with torch.inference_mode(False), torch.enable_grad(), _transformers_quiet():
        copy_tp = tp * cp if mode == "all_to_all" and heads is None else tp
        try:  # all-to-all gives every rank whole heads: the copy has heads for tp x cp ranks
            tiny = _tiny(model, copy_tp, heads)
        except Exception as e:  # noqa: BLE001 - the same on every rank
            return f"a tiny copy of {type(model).__name__} cannot be built to prove it on: {type(e).__name__}: {e}"
        plan = model_tp_plan(model)
        if plan:  # the user's model's plan, as it is: the one the route cuts by
            tiny.tp_plan = plan
        device = _device(model)
        options = (shard_config.sequence_parallel, shard_config.sequence_parallel_regather, shard_config.seed)
        # the copy (the instance's additions, attention, dtype and releases among it), the split, the plan as it is
        key = (route, copy_key(model, copy_tp, heads), tp, cp, mode, options, json.dumps(plan, sort_keys=True), device)
        mesh = shard_config.mesh
        groups = (mesh.tp_group, mesh.cp_group) if mesh is not None else (None,)  # the tp x cp block together
        if not every_rank(key in _VERDICTS, *groups, device=device):
            _VERDICTS[key] = _prove(tiny, shard_config, make_policy, device)
        return _VERDICTS[key]


def _prove(tiny: nn.Module, shard_config, make_policy, device) -> str | None:
    ref = tiny.to(device)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs_for(ref, seed=1).items()}
    split = copy.deepcopy(ref)
    ref.train(), split.train()  # the training path (the recipe's dropout is 0)
    # the user's config as given (its gather_output too); experts are split after the cut, by their own proof
    stack = dict(layers=layer_stack(split), final_norm=final_norm(split)) if shard_config.sequence_parallel else {}
    failures: list[str] = []
    try:
        with _quiet():  # the tiny copy's "sharded ..." line would read like the user's model's
            split = ModelSharder(split, make_policy(), shard_config, **stack).shard()
    except Exception as e:  # noqa: BLE001 - the tiny copy cannot be split: the same on every rank
        return f"the tiny copy cannot be split: {type(e).__name__}: {str(e)[:300]}"
    info = sharding_of(split)
    try:
        _compare(ref, split, info, inputs, device, failures)
    except Exception as e:  # noqa: BLE001 - the split copy cannot run: every rank's copy fails alike
        failures.append(f"the split tiny copy fails: {type(e).__name__}: {str(e)[:300]}")
    verdict = torch.tensor([float(len(failures))], device=device)
    verdict = all_reduce(all_reduce(verdict, info.tp_group), info.mesh.cp_group)  # the whole tp x cp block
    if verdict.item() == 0:
        return None
    return "; ".join(failures[:3]) or f"another rank than {group_rank(None)} saw a difference"


def _compare(ref: nn.Module, split: nn.Module, info, inputs: dict, device, failures: list[str]) -> None:
    """Outputs, loss and every gradient of ``split`` against ``ref``; what differs goes to ``failures``
    (the first diverging module with the first failure)."""
    state, tp_group = info.context_parallel, info.tp_group
    rec_ref, rec_split = ActivationRecorder(ref), ActivationRecorder(split)
    with torch.random.fork_rng(devices=[]):
        ref_out, out = ref(**inputs), split(**inputs)
    rec_ref.remove(), rec_split.remove()
    (ref_main, ref_loss), (main, loss) = _main_output(ref_out), _main_output(out)
    seq = next(v for k, v in inputs.items() if k in ("input_ids", "inputs_embeds")).shape[1]
    if main.dim() > 1 and main.shape[1] != ref_main.shape[1]:  # not gathered (gather_output=False)
        main = state.gather(main, seq)  # this rank's tokens -> the whole sequence
    if main.shape != ref_main.shape:  # vocab-parallel logits
        main = gather_from_parallel(main, tp_group, ref_main.shape[-1])
    if ref_loss is None:  # a base model: a fixed random projection of its outputs
        weights = torch.randn(ref_main.shape, generator=torch.Generator().manual_seed(2)).to(device)
        ref_loss, loss = (ref_main.float() * weights).sum(), (main.float() * weights).sum()
    _whole_sequence(rec_ref, rec_split, seq, state.group)
    divergence = first_divergence(rec_ref, rec_split, tp_group)
    where = f"first diverging module: {divergence}" if divergence else "no single module diverges first"
    err, ok = max_error(main, ref_main)
    if not ok:
        failures.append(f"outputs differ by {err:.2e}; {where}")
    err, ok = max_error(loss, ref_loss)
    if not ok:
        failures.append(f"loss differs by {err:.2e}" + ("" if failures else f"; {where}"))
    ref_loss.backward(), loss.backward()  # the split copy's gradients are summed over cp by its hooks
    failures += gradient_failures(ref, split, tp_group, SCALE_RTOL, FLOOR_RTOL)


def _whole_sequence(ref: ActivationRecorder, split: ActivationRecorder, seq: int, group) -> None:
    """Each activation ``split`` recorded on this rank's tokens, gathered back into the whole sequence in
    order (the tp gathers are `first_divergence`'s). Every cp rank gathers the same calls: their
    shapes are the same on every rank."""
    layout = layout_for(seq, group)
    expected: dict[tuple[str, int], tuple] = {}  # (output, input) of each call, by module and call
    seen: dict[str, int] = {}
    for name, t, _, x in ref.calls:
        seen[name] = seen.get(name, -1) + 1
        expected[(name, seen[name])] = (t, x)
    seen.clear()

    def whole(t, like):
        if t is None or like is None or t.dim() < 2 or t.shape[0] != like.shape[0]:
            return t
        if t.shape[1] != layout.local_len or like.shape[1] != seq:
            return t
        return gather_split(t, layout, group)

    with torch.no_grad():
        for i, (name, t, n_cast, x) in enumerate(split.calls):
            seen[name] = seen.get(name, -1) + 1
            like, like_x = expected.get((name, seen[name]), (None, None))
            split.calls[i] = (name, whole(t, like), n_cast, whole(x, like_x))


def require_context_parallel(model: nn.Module, shard_config, route) -> bool:
    """Prove the split of ``model`` at the config's cp on top of ``route``'s cut at its tp before anything
    is cut (every rank of the mesh calls it); raise `NotProvenError` naming what differs. Whether it
    was proven (``ShardConfig(prove=False)``: not, with a warning)."""
    tp, cp, mode = (
        shard_config.tensor_parallel_size,
        shard_config.context_parallel_size,
        shard_config.context_parallel_mode,
    )
    name = type(model).__name__
    if not shard_config.prove:
        logger.warning("context parallelism on %s is not proven (ShardConfig(prove=False))", name)
        return False
    heads = route.heads(model, tp) if tp > 1 else None  # as the route's own proof built its copy
    why = prove_context_parallel(model, shard_config, route.name, route.make, heads)
    if why is not None:
        raise NotProvenError(
            f"context_parallel_size={cp} (context_parallel_mode={mode!r}) is not exact on {name}: shard it with "
            f"context_parallel_size=1, or take out of the model what reads the sequence's positions, length or other "
            f"tokens. Proven on a tiny copy of the instance (its hooks, patched methods and swapped modules), cut by "
            f"the {route.name} route at tensor_parallel_size={tp}: {why}"
        )
    if group_rank(None) == 0:
        logger.info("%s: context parallelism proven at cp=%d (%s) x tp=%d on a tiny copy (outputs, loss and every "
                    "gradient exact)", name, cp, mode, tp)  # fmt: skip
    return True
