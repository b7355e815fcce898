"""The proof expert parallelism passes before it splits the user's model's experts.

On the ep group, each rank builds the same tiny copy of the model (its config scaled down, the router's
auxiliary loss on where the config has one, the expert count a multiple of ep), splits its experts and
runs *its own* batch through it, as the ep ranks of a job do. Every rank also runs the unsharded copy
on every rank's batch, so it knows what each of its parameters should get:

- outputs and loss: the unsharded copy's on this rank's batch;
- every gradient outside the experts (the router's included): the unsharded copy's on this rank's batch;
- each expert's gradient: the sum over all ranks' batches (the tokens of every rank reached it).

The verdict is the same on every rank (one all-reduce) and cached per class, architecture, ep and
library versions, as the tensor-parallel routes' proofs are.
"""

from __future__ import annotations

import copy
import json

import torch
import torch.nn as nn

from shardformer.core.comm import all_reduce, every_rank, group_rank, group_size
from shardformer.core.compare import max_error
from shardformer.core.divergence import first_tensor
from shardformer.core.instance import CannotReproduce, set_attention, study_instance
from shardformer.core.tiny_run import runnable_tiny_config
from shardformer.expert_parallel.experts import make_expert_parallel
from shardformer.expert_parallel.find import EXPERT_COUNTS, expert_configs, find_experts
from shardformer.models import inputs_for
from shardformer.policies.copies import copy_key, no_dropout
from shardformer.policies.proof import FLOOR_RTOL, SCALE_RTOL, _device, _transformers_quiet

_VERDICTS: dict[tuple, str | None] = {}


def prove_expert_parallel(model: nn.Module, group) -> str | None:
    """None when splitting a tiny copy of ``model``'s experts over ``group`` is exact, else why not."""
    ep = group_size(group)
    with torch.inference_mode(False), torch.enable_grad(), _transformers_quiet():
        try:
            config = _tiny_config(model, ep)
        except Exception as e:  # noqa: BLE001 - the same on every rank
            return f"a tiny copy of {type(model).__name__} cannot be built to prove it on: {type(e).__name__}: {e}"
        device = _device(model)
        instance = study_instance(model)  # the user's modules, hooks and attention, not only the class
        # the copy (the instance's additions, attention, dtype and releases among it) with its experts for ep
        key = (copy_key(model, 1), ep, json.dumps(config.to_dict(), sort_keys=True, default=str), device)
        if not every_rank(key in _VERDICTS, group, device=device):
            _VERDICTS[key] = _prove(model, config, group, device, instance)
        return _VERDICTS[key]


def _tiny_config(model: nn.Module, ep: int):
    config = copy.deepcopy(runnable_tiny_config(type(model), model.config, 1))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for holder in expert_configs(config):
        for name in EXPERT_COUNTS:
            count = getattr(holder, name, None)
            if isinstance(count, int) and not isinstance(count, bool) and count > 1 and count % ep:
                setattr(holder, name, 2 * ep)
    if hasattr(text, "output_router_logits"):
        text.output_router_logits = True  # the load-balancing loss joins the loss: the router's gradient is checked
    return config


def _prove(model, config, group, device, instance) -> str | None:
    ep, rank = group_size(group), group_rank(group)
    set_attention(config, instance.attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        ref = type(model)(config)
        try:
            instance.reproduce(model, ref)
        except CannotReproduce as e:
            return str(e)
        ref = ref.to(device)
    no_dropout(ref)
    ref.train()
    failures: list[str] = []
    sharded = copy.deepcopy(ref)
    try:
        paths, _ = find_experts(sharded, ep)
        for path in paths:
            make_expert_parallel(sharded.get_submodule(path), group)
    except Exception as e:  # noqa: BLE001 - the tiny copy cannot be split: the same on every rank
        failures.append(f"the tiny copy cannot be split: {type(e).__name__}: {str(e)[:300]}")
    if not failures:
        try:
            _compare(ref, sharded, group, ep, rank, device, failures)
        except Exception as e:  # noqa: BLE001 - the split copy fails on every rank alike
            failures.append(f"the split tiny copy fails: {type(e).__name__}: {str(e)[:300]}")
    verdict = torch.tensor([float(len(failures))], device=device)
    if all_reduce(verdict, group).item() == 0:
        return None
    return "; ".join(failures[:3]) or "another ep rank saw a difference"


def _loss(out, weights: torch.Tensor) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else None
    return loss if loss is not None else (first_tensor(out).float() * weights).sum()


def _compare(ref, sharded, group, ep: int, rank: int, device, failures: list[str]) -> None:
    batches = [  # rank r's own batch, known to every rank
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs_for(ref, seed=100 + r).items()}
        for r in range(ep)
    ]
    out = sharded(**batches[rank])
    main = first_tensor(out)
    weights = torch.randn(main.shape, generator=torch.Generator().manual_seed(2)).to(device)
    loss = _loss(out, weights)
    loss.backward()
    own: dict[str, torch.Tensor] = {}
    total: dict[str, torch.Tensor] = {}
    for r, batch in enumerate(batches):
        ref.zero_grad(set_to_none=True)
        ref_out = ref(**batch)
        ref_loss = _loss(ref_out, weights)
        ref_loss.backward()
        for name, p in ref.named_parameters():
            if p.grad is not None:
                total[name] = total.get(name, 0) + p.grad
        if r == rank:
            own = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
            err, ok = max_error(main, first_tensor(ref_out))
            if not ok:
                failures.append(f"outputs differ by {err:.2e}")
            err, ok = max_error(loss, ref_loss)
            if not ok:
                failures.append(f"loss differs by {err:.2e}")
    largest = max((g.abs().max().item() for g in total.values() if g.numel()), default=0.0)
    for name, p in sharded.named_parameters():
        spec = getattr(p, "expert_spec", None)
        expected = total.get(name) if spec is not None else own.get(name)
        if expected is not None and spec is not None:
            expected = spec.local_part(expected)
        if expected is None:
            if p.grad is not None and p.grad.abs().max().item() > 0:
                failures.append(f"gradient of {name} is nonzero where the unsharded copy has none")
            continue
        if p.grad is None:
            failures.append(f"gradient of {name} is missing")
            continue
        err = (p.grad - expected).abs().max().item() if p.grad.shape == expected.shape else float("inf")
        if err > SCALE_RTOL * expected.abs().max().item() + FLOOR_RTOL * largest:
            failures.append(f"gradient of {name} differs by {err:.2e}")
