"""The proof a derived policy passes before it cuts the user's model.

On the ranks that will hold the model, a tiny copy of its class and architecture is sharded with
the derived policy and run against the unsharded tiny copy on the same inputs: outputs, loss and
every gradient (gathered) must match within the one tolerance table. Every rank reaches the same
verdict (one all-reduce), and the verdict is cached per model class, architecture and tp. A policy
that is not exact is refused, naming the first module whose output diverges.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn as nn

from shardformer.core.comm import all_reduce, gather_from_parallel
from shardformer.core.compare import compare_params, max_error
from shardformer.core.config import ShardConfig
from shardformer.core.divergence import ActivationRecorder, first_divergence, first_tensor
from shardformer.core.record import sharding_of
from shardformer.policies.derived.derive import NotDerivableError, _key, derive, tiny_with_inputs
from shardformer.policies.derived.policy import HOW_TO, DerivedPolicy
from shardformer.tensor_parallel.sharder import ModelSharder

logger = logging.getLogger("shardformer")

SCALE_RTOL = 1e-3  # rounding is ~1e-6 of a gradient's largest entry; a rank's missing part is far more
FLOOR_RTOL = 1e-6  # of the model's largest gradient entry
_VERDICTS: dict[tuple, str | None] = {}  # None: proven; else why not


class NotProvenError(NotDerivableError):
    """The derived policy ran on the tiny copy and was not exact."""


def prove(model: nn.Module, shard_config: ShardConfig, tower: str = "") -> None:
    """Raise :class:`NotProvenError` on every rank unless the derived policy for ``model`` (for its
    sub-model at ``tower``) is exact on a tiny copy, sharded over the tp group ``shard_config`` names
    (its mesh's, or its process group)."""
    tp = shard_config.tensor_parallel_size
    key = _key(model, tp, tower)
    if key not in _VERDICTS:
        _VERDICTS[key] = _prove(model, shard_config, tower)
        if _VERDICTS[key] is None:
            logger.info(
                "derived policy for %s proven at tp=%d on a tiny copy: outputs, loss and gradients exact",
                type(model.get_submodule(tower)).__name__,
                tp,
            )
    if _VERDICTS[key] is not None:
        raise NotProvenError(_VERDICTS[key])


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None or param.device.type == "meta" else param.device


def _main_output(out):
    return first_tensor(out), (out.get("loss") if isinstance(out, dict) else None)


def _prove(model: nn.Module, shard_config: ShardConfig, tower: str) -> str | None:
    device, tp = _device(model), shard_config.tensor_parallel_size
    heads = derive(model, tp, tower).heads
    ref, inputs = tiny_with_inputs(model, tp, tower, heads, seed=1)  # the copy the cut was derived on
    ref = ref.to(device)
    tiny = copy.deepcopy(ref)
    ref.train(), tiny.train()  # the training path, dropout already 0 in the tiny copy
    config = ShardConfig(
        tensor_parallel_size=tp,
        tensor_parallel_process_group=shard_config.tensor_parallel_process_group,
        mesh=shard_config.mesh,
    )
    policy = DerivedPolicy()
    policy.tower_of = (model, tower)
    sharded = ModelSharder(tiny, policy, config).shard()
    group = sharding_of(sharded).tp_group
    failures: list[str] = []
    if sum(p.numel() for p in sharded.parameters()) >= sum(p.numel() for p in ref.parameters()):
        failures.append("the tiny copy was not sharded")
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    try:
        _compare(ref, sharded, group, inputs, device, failures)
    except Exception as e:  # noqa: BLE001 - the cut copy cannot run: every rank's copy fails alike
        failures.append(f"the sharded tiny copy fails: {type(e).__name__}: {str(e)[:300]}")
    verdict = torch.tensor([float(len(failures))], device=device)
    verdict = all_reduce(verdict, group)  # every rank refuses, or none
    if verdict.item() == 0:
        return None
    listed = "; ".join(failures[:3]) or "another rank saw a difference"
    return (
        f"the derived policy for {type(ref).__name__} is not exact on a tiny copy at tensor_parallel_size={tp} "
        f"({listed}). shardformer refuses to shard it this way; {HOW_TO}"
    )


def _compare(ref: nn.Module, sharded: nn.Module, group, inputs: dict, device, failures: list[str]) -> None:
    """Outputs, loss and every gradient of ``sharded`` against ``ref``; what differs goes to ``failures``
    (the first diverging module with the first failure)."""
    rec_ref, rec_sh = ActivationRecorder(ref), ActivationRecorder(sharded)
    with torch.random.fork_rng(devices=[]):
        ref_main, ref_loss = _main_output(ref(**inputs))
        main, loss = _main_output(sharded(**inputs))
    rec_ref.remove(), rec_sh.remove()
    if main.shape != ref_main.shape:
        main = gather_from_parallel(main, group, ref_main.shape[-1])
    weights = torch.randn(ref_main.shape, generator=torch.Generator().manual_seed(2)).to(device)
    if ref_loss is None:  # no loss of its own: a fixed random projection of the output
        ref_loss, loss = (ref_main.float() * weights).sum(), (main.float() * weights).sum()
    divergence = first_divergence(rec_ref, rec_sh, group)
    where = f"first diverging module: {divergence}" if divergence else "no single module diverges first"
    err, ok = max_error(main, ref_main)
    if not ok:
        failures.append(f"outputs differ by {err:.2e}; {where}")
    err, ok = max_error(loss, ref_loss)
    if not ok:
        failures.append(f"loss differs by {err:.2e}" + ("" if failures else f"; {where}"))
    ref_loss.backward(), loss.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    largest = max((g.abs().max().item() for g in ref_grads.values() if g is not None and g.numel()), default=0.0)
    floor = FLOOR_RTOL * largest  # gradients that are zero in exact arithmetic (a key bias) are rounding only
    for diff in compare_params(ref, sharded, group, grads=True):
        # also relative to the gradient's own scale: a tiny copy's small gradients (a per-head scale
        # before a near-uniform softmax) would hide a missing rank's part inside an absolute tolerance
        scale = ref_grads[diff.name].abs().max().item() if ref_grads.get(diff.name) is not None else 0.0
        if diff.only_in is not None or not diff.ok or diff.error > SCALE_RTOL * scale + floor:
            failures.append(f"gradient of {diff.name} differs" + ("" if diff.only_in else f" by {diff.error:.2e}"))
