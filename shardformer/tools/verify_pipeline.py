"""``verify`` with pipeline stages: the training engine at tp x pp against one unsharded process.

Each rank builds the same model, keeps an unsharded copy, and hands the other to
`shardformer.ParallelEngine` (tp x pp, ZeRO stage 1 over dp=1, pp micro-batches, plain SGD).
One ``train_step`` is compared with the unsharded loss and SGD step: the loss, the weights this rank's
stage holds (gathered over tp), and the outputs after the step. Module-by-module divergence is left to
the tp-only run (``pp=1``), where every module runs in one process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from shardformer.core.compare import ATOL, RTOL, compare_params, gather_like, max_error
from shardformer.engine import EngineConfig, ParallelEngine
from shardformer.models import inputs_for
from shardformer.tools.model_source import build_model, load_policy
from shardformer.tools.verify_report import (
    LR,
    Check,
    VerifyReport,
    broadcast_weights,
    first_tensor,
    params_check,
    route_name,
)


def _keep_eval(model) -> None:
    """verify compares deterministic functions: the engine's train() must not switch dropout on."""
    model.eval()
    model.train = lambda mode=True: model


def verify_pipeline_on_this_rank(
    model, policy=None, model_class=None, seed: int = 0, pp: int = 2, pipeline=None
) -> VerifyReport:
    """``pipeline``: a PipelineSpec (default: the model family's built-in one)."""
    world = dist.get_world_size()
    tp = world // pp
    torch.manual_seed(seed)
    built = build_model(model, model_class)
    report = VerifyReport(type(built).__name__, "?", tp, pp=pp)
    broadcast_weights(built)
    built.eval()
    ref = copy.deepcopy(built)
    micro = pp  # as many micro-batches as stages (the torch schedules need it), two samples each
    inputs = inputs_for(ref, seed + 1, batch=2 * micro)
    ref_out = ref(inputs["x"]) if "x" in inputs else ref(**inputs)
    ref_loss, ref_main = (ref_out.get("loss") if isinstance(ref_out, dict) else None), first_tensor(ref_out)
    # one projection for every sample, so each micro-batch's loss is its own share; the engine averages them
    weights = torch.randn((1, *ref_main.shape[1:]), generator=torch.Generator().manual_seed(seed + 2))
    loss_fn = None
    if ref_loss is None:  # no loss of its own: a fixed random projection of the output, as pp=1
        ref_loss = (ref_main.float() * weights).sum() / micro
        loss_fn = lambda out, _batch: (first_tensor(out).float() * weights).sum()  # noqa: E731
    ref_loss.backward()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR).step()

    try:
        pol = load_policy(policy)
        report.policy = type(pol).__name__ if pol is not None else "the first route proven exact"
        engine = ParallelEngine(
            built,
            lambda params: torch.optim.SGD(params, lr=LR),
            EngineConfig(tp=tp, pp=pp, zero_stage=1, num_microbatches=micro),
            policy=pol,
            pipeline=pipeline,
            loss_fn=loss_fn,
        )
    except (ValueError, NotImplementedError, TypeError) as e:  # refused before any collective
        report.error = f"sharding refused: {e}"
        return report
    report.policy = route_name(engine.model)
    _keep_eval(engine.model)
    step, weights = "train step", None
    try:
        loss = engine.train_step(inputs)
        err, ok = max_error(torch.tensor(loss), ref_loss.detach(), ATOL, RTOL)
        detail = f"{loss:.6g} vs {ref_loss.item():.6g} (|diff| {err:.2g}; the last stage's, on every rank)"
        report.checks.append(Check("loss", ok, detail))
        group = engine.mesh.tp_group
        diffs = compare_params(ref, engine.model, group, grads=False)
        # one line per stage (each holds its own weights): ranks of one stage merge into its line
        stage = f"weights of stage {engine.mesh.pp_rank}"
        weights = params_check(stage, diffs, False, " after one step")  # listed last, stage by stage
        step = "forward after step"
        with torch.no_grad():
            expected = first_tensor(ref(inputs["x"]) if "x" in inputs else ref(**inputs))
        out = engine.forward({k: v for k, v in inputs.items() if k != "labels"})
        out = gather_like(out, expected.shape, group) if tp > 1 else out
        err, ok = max_error(out, expected, ATOL, RTOL) if out is not None else (float("inf"), False)
        report.checks.append(Check("outputs after step", ok, f"max |diff| {err:.2g} (the last stage's, on every rank)"))
    except Exception as e:  # noqa: BLE001 - reported
        report.error = f"{step} failed: {type(e).__name__}: {e}"
    if weights is not None:
        report.checks.append(weights)
    return report
