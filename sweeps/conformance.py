"""Conformance run: every transformers model class a tiny config can build, sharded at tp=2.

Walks transformers' auto mappings task by task (causal LM, masked LM, seq2seq LM, speech seq2seq,
sequence / token classification, question answering, image classification, base models of text and
vision encoders, image-text-to-text). For each class it scales the class's default config down
(``shardformer.core.tiny.tiny_copy_config``), and on 2 gloo ranks runs what ``shardformer verify``
runs (``shardformer.tools.verify.verify_on_this_rank``): the model sharded by whatever route
``shard_model`` takes (a family policy, the model's transformers tp plan: ``TpPlanPolicy``, or its
traced structure: ``DerivedPolicy``) against its unsharded copy on outputs, loss, every gathered
gradient, the weights and outputs after one SGD step and greedy ``generate``. One row per class:
passed (max errors), refused (sharding refused: why), failed (which check, and by how much), not
tested (the tiny model cannot be built, does not run unsharded, or its class cannot be imported: why;
no scaling of the recipe gave one that runs, ``shardformer.core.tiny_run``) or error (anything else).

``--plan-sweep`` (implied by ``--sdpa`` / ``--sequence-parallel``) runs the previous sweep instead:
the causal LMs that ship a ``base_model_tp_plan``, saved and reloaded with ``from_pretrained`` and
compared in training mode (``shardformer.tools.conformance``).

    make conformance          # or: .venv/bin/python sweeps/conformance.py [--task masked-lm,causal-lm]
                              #     [--only llama,bert] [--limit 20] [--json out.json] [--save sweeps]
    .venv/bin/python sweeps/conformance.py --plan-sweep [--dense] [--sdpa] [--sequence-parallel]
    .venv/bin/python sweeps/conformance.py --pp 2 [--task ...] [--only ...]
    .venv/bin/python sweeps/conformance.py --engine all --task causal-lm [--only ...] [--save sweeps]

``--pp 2`` trains each class at pp=2 through ``ParallelEngine`` (2 micro-batches, 2 SGD steps) on 2 ranks
against its unsharded copy (losses, every weight after the steps): passed, refused (the engine's reason:
no split, or one the tiny-copy proof found inexact), failed, not tested or error.

``--engine TECHNIQUES`` (comma-separated, or ``all``) trains each class through ``ParallelEngine`` on 2
ranks once per technique, in that technique's layout (``ENGINE_LAYOUTS``): ``pp`` (pp=2, 2
micro-batches), ``zero1`` / ``zero2`` / ``zero3`` (dp=2 at that ZeRO stage), ``checkpointing`` (dp=2,
ZeRO-1, activation checkpointing), ``cp`` (cp=2, 2 micro-batches) and ``ep`` (dp=2 with the experts
split over both ranks; "n/a" for a class without experts). Each run splits a step's batch into 2 equal
chunks, as its unsharded copy's reference step does; 2 SGD steps, then the losses and every weight
(gathered over ep, ZeRO-3 and the stages). One row per class and technique in the ``--jsonl`` file (one
technique that hangs costs only its own row); ``--save`` writes ``conformance-engine-<date>.md`` (one
column per technique, then the reason of every cell that did not pass) and the ``.json`` whose rows
carry ``techniques: {technique: {result, reason, logits (loss error), grad (weight error), ...}}``, from
which ``sweeps/matrix.py`` fills the matrix's columns.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import os
import re
import sys
import tempfile
import threading
import time

MOE_STYLES = ("moe_", "grouped_gemm", "ep_")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

# task: the auto mapping(s) of transformers' modeling_auto it sweeps, in the order of the table
TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "base-model": "MODEL_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}
# base models only of the encoders: model types that also have a masked-LM, an image-classification or
# a two-tower (zero-shot image classification) class
ENCODER_MAPPINGS = (
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
)
# what a row's result can be; "not tested": no tiny copy of the class builds and runs unsharded (a
# limit of the recipe, not a refusal of the library), counted apart from the library's refusals
NOT_TESTED = "not tested"
# "refused at step": refused with a reason, but by the first training step, not when the engine was built
REFUSED_AT_STEP = "refused at step"
# "random in training": the class draws random numbers in its training forward beyond dropout (PhiMoE's
# sampled routing): two unsharded runs from the same weights with other RNG seeds differ as well, so the
# comparison cannot decide (a "failed" that is not the library's)
RANDOM_IN_TRAINING = "random in training"
RESULTS = ("passed", "refused", REFUSED_AT_STEP, "failed", RANDOM_IN_TRAINING, NOT_TESTED, "error")
ROW_TIMEOUT_EXIT = 75  # a rank's exit code when its row ran past --row-timeout
ROWS_PER_SPAWN = 100


# -- which classes ------------------------------------------------------------------------------------


def _mapping(name: str) -> dict[str, tuple[str, ...]]:
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, name, {})
    return {k: (v,) if isinstance(v, str) else tuple(v) for k, v in names.items()}


def _kind(config_class) -> str:
    """ "moe" or "dense": from the tp plan's styles when there is one, else from the default config."""
    plan = getattr(config_class, "base_model_tp_plan", None)
    if plan:
        return "moe" if any(style.startswith(MOE_STYLES) for style in plan.values()) else "dense"
    try:
        config = config_class()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        values = text.to_dict()
    except Exception:  # noqa: BLE001 - reported when the row runs
        return "dense"
    return "moe" if any(isinstance(values.get(k), int) and values[k] > 1 for k in MOE_KEYS) else "dense"


def task_rows(tasks=None, only=None) -> list[dict]:
    """``[{task, model_type, class, kind}]`` of the installed transformers, each class once (under the
    first selected task that names it); a class that cannot be imported carries ``skip`` (the reason)."""
    import transformers as tf

    encoders = set().union(*(_mapping(m) for m in ENCODER_MAPPINGS))
    rows, seen = [], set()
    for task, mapping in TASKS.items():
        if tasks and task not in tasks:
            continue
        for model_type, class_names in _mapping(mapping).items():
            if task == "base-model" and model_type not in encoders:
                continue
            for class_name in class_names:
                if class_name in seen or (only and model_type not in only and class_name not in only):
                    continue
                seen.add(class_name)
                row = {"task": task, "model_type": model_type, "class": class_name, "kind": ""}
                try:
                    row["kind"] = _kind(getattr(tf, class_name).config_class)
                except Exception as e:  # noqa: BLE001 - a missing optional backend: reported as not tested
                    row["skip"] = f"class not importable: {type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
    return rows


def architectures(only=None):
    """The plan sweep's rows: every causal LM whose config has a ``base_model_tp_plan``."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for model_type, lm_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if only and model_type not in only:
            continue
        try:
            config_class = getattr(tf, lm_name).config_class  # the text config of a multimodal family
        except (AttributeError, ImportError, TypeError):
            continue
        plan = getattr(config_class, "base_model_tp_plan", None)
        if not plan:
            continue
        kind = "moe" if any(style.startswith(MOE_STYLES) for style in plan.values()) else "dense"
        rows.append(
            {"task": "causal-lm", "model_type": model_type, "class": lm_name, "kind": kind, "route": "TpPlanPolicy"}
        )
    return rows


# -- on the ranks -------------------------------------------------------------------------------------


class _Watchdog:
    """Ends this rank's process when a row runs past ``seconds`` (the parent restarts after the row)."""

    def __init__(self, seconds: float):
        self.timer = threading.Timer(seconds, os._exit, args=(ROW_TIMEOUT_EXIT,))
        self.timer.daemon = True

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


def tiny_config_of(class_name: str):
    """The class's default config scaled down for tp=2: the recipe's first scaling whose model runs
    (``shardformer.core.tiny_run``); ``TinyCopyError`` when none does."""
    import transformers as tf

    from shardformer.core.tiny import VOCAB
    from shardformer.core.tiny_run import runnable_tiny_config
    from shardformer.models import inputs_for

    model_class = getattr(tf, class_name)
    config = model_class.config_class()
    if hasattr(config, "num_query_tokens") and getattr(config, "image_token_index", 0) is None:
        config.image_token_index = VOCAB + 1  # BLIP-2's checkpoints set one; its default config (None) cannot run
    return runnable_tiny_config(model_class, config, 2, inputs=inputs_for)


class TinyBuildError(Exception):
    """The tiny model could not be constructed from its config (the same on every rank)."""


def build_tiny(class_name: str, flip: dict | None = None):
    """The factory handed to ``verify_on_this_rank`` (module-level: ``functools.partial(build_tiny, name)``);
    ``flip``: config values set on the tiny config before the model is built (``sweeps/config_flips.py``)."""
    import transformers as tf

    from shardformer.core.tiny import fill_zero_matrices

    config = tiny_config_of(class_name)
    for key, value in (flip or {}).items():  # on the config that holds the key (a text config's, else the top)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        setattr(text if key in text.to_dict() else config, key, value)
    try:
        model = getattr(tf, class_name)(config)
    except Exception as e:  # noqa: BLE001
        raise TinyBuildError(f"a tiny {class_name} cannot be built from this config: {type(e).__name__}: {e}") from e
    fill_zero_matrices(model)
    return model


def unsharded_failure(class_name: str, flip: dict | None = None) -> str | None:
    """What stops the tiny model unsharded (forward, backward, generate as verify runs them), or None."""
    import torch

    from shardformer.models import inputs_for
    from shardformer.tools.verify import _generate, _loss_and_output

    step = "build"
    try:
        torch.manual_seed(0)
        model = build_tiny(class_name, flip)
        model.eval()
        step = "forward"
        inputs = inputs_for(model, 1)
        loss, out = _loss_and_output(model, inputs, None, None, None)
        step = "backward"
        (loss if loss is not None else out.float().sum()).backward()
        step = "generate"
        if callable(getattr(model, "can_generate", None)) and model.can_generate():
            _generate(model, inputs)
    except Exception as e:  # noqa: BLE001
        return f"the tiny unsharded model fails in {step}: {type(e).__name__}: {e}"
    return None


def _max_diff(detail: str) -> float | None:
    m = re.search(r"max \|diff\| ([-+0-9.einfa]+)", detail)
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _reason(row: dict, result: str, text: str, limit: int = 200) -> None:
    """``result`` with its reason on one line: the first ``limit`` characters, the whole as ``detail``."""
    text = _one_line(text)
    row.update(result=result, reason=text[:limit])
    if len(text) > limit:
        row["detail"] = text[:4000]


def _reason_first(text: str) -> str:
    """A refusal as a row holds it: its reason, then its fix (the library prints the fix first)."""
    fix, newline, reason = text.partition("\n")
    return f"{reason} (fix: {fix})" if newline else text


def classify(row: dict, report) -> None:
    """Fill ``row`` from a merged VerifyReport: route, result, reason, max errors, the checks."""
    row["route"] = report.policy
    row["checks"] = [[c.name, c.ok, c.detail] for c in report.checks]
    checks = {c.name: c for c in report.checks}
    if "forward outputs" in checks:
        row["logits"] = _max_diff(checks["forward outputs"].detail)
    if "gradients" in checks:
        row["grad"] = _max_diff(checks["gradients"].detail)
    if "greedy generate" in checks:
        row["generate_equal"] = checks["greedy generate"].ok
    bad = [c for c in report.checks if not c.ok]
    error = report.error or ""
    if "sharding refused: " in error:
        _reason(row, "refused", _reason_first(error.split("sharding refused: ", 1)[1]))
    elif bad:
        reason = "; ".join(f"{c.name}: {c.detail}" for c in bad)
        if report.divergence is not None:
            reason += f"; first diverging module: {report.divergence}"
        if error:
            reason += f"; then {error}"
        _reason(row, "failed", reason, 400)
    elif error:
        _reason(row, "error", error, 300)
    else:
        row.update(result="passed", reason="")


_UNSHARDED: dict[str, dict] = {}  # (class, flip) -> what _check_unsharded found (a row per technique)


def _check_unsharded(row: dict) -> None:
    """Mark ``row`` not tested when no tiny copy of its class (with the row's ``flip``) runs unsharded."""
    name, flip = row["class"], row.get("flip")
    key = (name, json.dumps(flip, sort_keys=True))
    if key not in _UNSHARDED:
        found: dict = {}
        try:
            tiny_config_of(name)
        except Exception as e:  # noqa: BLE001 - a config we cannot scale down is reported, not fatal
            _reason(found, NOT_TESTED, f"no tiny copy that runs: {type(e).__name__}: {e}")
        else:
            broken = unsharded_failure(name, flip)  # the tiny model itself: nothing to shard
            if broken is not None:
                _reason(found, NOT_TESTED, broken)
        _UNSHARDED[key] = found
    row.update(_UNSHARDED[key])


def _verify_job(rows, out_path, row_timeout):
    """On every rank: verify each class in turn; rank 0 appends one JSON line per result."""
    _each_row(rows, out_path, row_timeout, _verify_row)


def _verify_row(row: dict) -> None:
    import functools

    import torch.distributed as dist

    from shardformer.tools.verify import verify_on_this_rank
    from shardformer.tools.verify_report import merge_reports

    report = verify_on_this_rank(functools.partial(build_tiny, row["class"], row.get("flip")))
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    classify(row, merge_reports(reports))


def _each_row(rows, out_path, row_timeout, check, precheck=None) -> None:
    """On every rank: ``check(row)`` for each row ``precheck`` leaves without a result (default: each
    class whose tiny copy runs unsharded); ``check`` fills the row. Rank 0 appends one JSON line per row."""
    import traceback

    import torch.distributed as dist

    for row in rows:
        row = {k: v for k, v in row.items() if k != "skip"}
        start = time.time()
        with _Watchdog(row_timeout):
            (precheck or _check_unsharded)(row)
            if "result" not in row:
                try:
                    check(row)
                except TinyBuildError as e:
                    _reason(row, NOT_TESTED, str(e))
                except Exception as e:  # noqa: BLE001
                    last = traceback.format_exc().strip().splitlines()[-1]
                    _reason(row, "error", f"{type(e).__name__}: {last}", 300)
            row["seconds"] = round(time.time() - start, 1)
            dist.barrier()  # ranks stay in step: a rank that fails alone shows as a timeout here
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _plan_job(rows, out_path, row_timeout, impl, sequence_parallel=False):
    """The plan sweep on every rank: ``tools.conformance.compare`` on each causal LM with a tp plan."""
    import traceback

    import torch.distributed as dist
    import transformers as tf

    from shardformer.tools.conformance import NotTestedError, RefusedError, compare

    for row in rows:
        row = dict(row)
        lm_name = row["class"]
        start = time.time()
        with _Watchdog(row_timeout):
            try:
                config = tiny_config_of(lm_name)  # the verify sweep's recipe: a tiny copy that runs
            except Exception as e:  # noqa: BLE001 - a config we cannot scale down is reported, not fatal
                row.update(result=NOT_TESTED, reason=f"no tiny copy that runs: {type(e).__name__}: {str(e)[:300]}")
            else:
                try:
                    r = compare(getattr(tf, lm_name), config, impl, sequence_parallel=sequence_parallel)
                    row.update(
                        result="passed" if not r.failures else "failed",
                        logits=r.logits,
                        loss=r.loss,
                        grad=r.grad,
                        generate_equal=r.generate_equal,
                        vocab_parallel=r.vocab_parallel_logits,
                        reason="; ".join(r.failures[:3]),
                    )
                except NotTestedError as e:
                    row.update(result=NOT_TESTED, reason=str(e)[:300])
                except RefusedError as e:
                    row.update(result="refused", reason=str(e)[:300])
                except Exception as e:  # noqa: BLE001
                    last = traceback.format_exc().strip().splitlines()[-1]
                    row.update(result="error", reason=f"{type(e).__name__}: {last[:300]}")
            row["seconds"] = round(time.time() - start, 1)
            dist.barrier()
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _scalar_loss(output, _batch=None):
    """The model's loss, else the mean square of its first output (a base model, a head without labels)."""
    import torch

    loss = output.get("loss") if hasattr(output, "get") else None
    if loss is not None:
        return loss
    values = output.values() if hasattr(output, "values") else [output]
    return next(t for t in values if torch.is_tensor(t) and t.is_floating_point()).float().pow(2).mean()


# --engine: each technique a layout of ParallelEngine on 2 ranks, trained against the unsharded copy;
# every layout splits a step's batch into 2 equal chunks (dp=2, or 2 micro-batches), as the reference does
ENGINE_LAYOUTS = {
    "pp": {"pp": 2, "num_microbatches": 2},
    "ZeRO-1": {"zero_stage": 1},  # dp=2
    "ZeRO-2": {"zero_stage": 2},
    "ZeRO-3": {"zero_stage": 3},
    "checkpointing": {"zero_stage": 1, "activation_checkpointing": True},
    "cp": {"cp": 2, "num_microbatches": 2},
    "ep": {"ep": 2},  # dp=2, the experts split over both ranks; MoE classes only
}
ENGINE_NAMES = {"pp": "pp", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "checkpointing": "checkpointing",
                "cp": "cp", "ep": "ep"}  # fmt: skip
NOT_APPLICABLE = "n/a"


def _pipeline_job(rows, out_path, row_timeout, pp):
    """On every rank: each class at pp = the group size through ParallelEngine against its unsharded
    copy (:func:`_train_with`); rank 0 appends one JSON line per row."""
    layout = {"pp": pp, "num_microbatches": 2}
    _each_row(rows, out_path, row_timeout, functools.partial(_train_with, layout=layout))


def _engine_job(rows, out_path, row_timeout):
    """On every rank: each (class, technique) row trained in its technique's layout (``ENGINE_LAYOUTS``)."""
    _each_row(rows, out_path, row_timeout, _train_technique)


def _train_technique(row: dict) -> None:
    if row["technique"] == "ep" and row["kind"] != "moe":
        row.update(result=NOT_APPLICABLE, reason="no experts (a dense class)")
        return
    _train_with(row, ENGINE_LAYOUTS[row["technique"]])


def _train_with(row: dict, layout: dict) -> None:
    """2 SGD steps of the class through ParallelEngine in ``layout`` (EngineConfig fields) and of its
    unsharded copy, each step's batch split in the same equal chunks: the losses, then every weight
    (gathered over tp, ep, ZeRO-3 and the stages). Fills ``row``."""
    import torch
    import torch.distributed as dist

    from shardformer import EngineConfig, ParallelEngine
    from shardformer.checkpoint.gather import gather_full_state
    from shardformer.core.compare import GRAD_ATOL, GRAD_RTOL, max_error
    from shardformer.models import inputs_for

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    torch.manual_seed(0)
    ref = build_tiny(row["class"], row.get("flip"))
    model = build_tiny(row["class"], row.get("flip"))
    model.load_state_dict(ref.state_dict())
    batches = [inputs_for(ref, seed, batch=4) for seed in (1, 2)]
    if row.get("task") == "causal-lm" and "labels" in inspect.signature(ref.forward).parameters:
        for b in batches:  # the model's own loss, also where the class's name does not say it is a causal
            b.setdefault("labels", b["input_ids"].clone())  # LM (BertGenerationDecoder)
    # the model's own loss where the batch has labels (context parallelism refuses any other loss_fn)
    loss_fn = None if "labels" in batches[0] else _scalar_loss
    try:
        engine = ParallelEngine(model, sgd, EngineConfig(**layout), loss_fn=loss_fn)
    except (NotImplementedError, ValueError, TypeError) as e:
        _reason(row, "refused", f"{type(e).__name__}: {_reason_first(str(e))}")
        return
    row["route"] = engine.model.shardformer.route
    try:
        got = [engine.train_step(b) for b in batches]
    except (NotImplementedError, ValueError) as e:  # a refusal the engine could not tell before the step
        _reason(row, REFUSED_AT_STEP, f"{type(e).__name__}: {_reason_first(str(e))}")
        return
    chunks = engine.mesh.dp_size * engine.config.num_microbatches
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    expected = _reference_steps(ref, batches, chunks, sgd)
    row["logits"], ok = max_error(torch.tensor(got), torch.tensor(expected))
    merged = gather_full_state(engine.model)  # on rank 0, which writes the row (None elsewhere)
    row["grad"] = 0.0  # in this sweep: the largest weight error after the steps
    failures = [] if ok else [f"losses differ by {row['logits']:.2e}"]
    for name, p in ref.named_parameters() if dist.get_rank() == 0 else ():
        if name not in merged:
            failures.append(f"{name} is on no stage")
            continue
        error, good = max_error(merged[name].float(), p.detach(), GRAD_ATOL, GRAD_RTOL)
        row["grad"] = max(row["grad"], error)
        if not good:
            failures.append(f"{name} differs by {error:.2e} after the steps")
    if failures and dist.get_rank() == 0 and _random_in_training(ref, initial, batches, chunks, sgd):
        _reason(row, RANDOM_IN_TRAINING, "two unsharded runs with other RNG seeds differ too: " + failures[0], 400)
    elif failures:
        _reason(row, "failed", "; ".join(failures[:3]), 400)
    else:
        row.update(result="passed", reason="")


def _reference_steps(ref, batches, chunks, optimizer) -> list[float]:
    """The unsharded model's training steps, each batch's loss the mean over ``chunks`` equal chunks."""
    from shardformer.engine import split_batch

    ref.train()
    opt = optimizer(ref.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = sum(_scalar_loss(ref(**part)) for part in split_batch(b, chunks, "chunks")) / chunks
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _random_in_training(ref, initial: dict, batches, chunks, optimizer) -> bool:
    """Whether the same steps from the same weights under another RNG seed end elsewhere than ``ref``."""
    import copy

    import torch

    from shardformer.core.compare import GRAD_ATOL, GRAD_RTOL, max_error

    again = copy.deepcopy(ref)
    again.load_state_dict(initial)
    kept = torch.random.get_rng_state()
    torch.manual_seed(12345)
    try:
        _reference_steps(again, batches, chunks, optimizer)
    finally:
        torch.random.set_rng_state(kept)
    trained = dict(ref.named_parameters())
    return any(
        not max_error(p.detach(), trained[n].detach(), GRAD_ATOL, GRAD_RTOL)[1] for n, p in again.named_parameters()
    )


# -- in the parent ------------------------------------------------------------------------------------


def run(rows, job=_verify_job, *job_args, row_timeout=300.0, progress=None, world=2):
    """Results for ``rows``; a spawn that dies (a row past ``row_timeout``, a crash) is restarted after its row."""
    from shardformer.tools.testing import run_on_ranks

    os.environ.setdefault("SHARDFORMER_TIMEOUT_S", "120")
    done: list[dict] = []
    for row in rows:
        if "skip" in row:
            done.append({k: v for k, v in row.items() if k != "skip"} | {"result": NOT_TESTED, "reason": row["skip"]})
            if progress is not None:
                progress(done[-1])
    remaining = [r for r in rows if "skip" not in r]
    while remaining:
        out_path = tempfile.mktemp(prefix="sf-conformance-", suffix=".jsonl")
        chunk = remaining[:ROWS_PER_SPAWN]  # fresh processes now and then: hundreds of imported model
        try:  # families and their caches grow each rank past 10 GB over the whole zoo
            run_on_ranks(job, world, chunk, out_path, row_timeout, *job_args, timeout=row_timeout * len(chunk) + 120)
        except Exception as e:  # noqa: BLE001
            crash = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
            timed_out = f"exited with code {ROW_TIMEOUT_EXIT}" in str(e)
            if timed_out:
                crash = f"no result within {row_timeout:g} s (--row-timeout): the ranks were stopped"
        else:
            crash = None
        new = []
        if os.path.exists(out_path):
            with open(out_path) as f:
                new = [json.loads(line) for line in f]
            os.remove(out_path)
        if progress is not None:
            for r in new:
                progress(r)
        done += new
        remaining = remaining[len(new) :]
        if crash and remaining:
            row = dict(remaining.pop(0), result="error", reason=crash)
            if timed_out:
                row["seconds"] = row_timeout
            if progress is not None:
                progress(row)
            done.append(row)
    return done


def _progress(row: dict) -> None:
    print(
        f"{row.get('task', '')} {row['model_type']} {row['class']} {row.get('technique', '')} "
        f"{row.get('route', '')}: {row['result']} "
        f"({row.get('seconds', '-')} s) {row.get('reason', '')[:120]}",
        file=sys.stderr,
        flush=True,
    )


def table(results, impl, sequence_parallel=False, plan_sweep=False, pp=1) -> str:
    what = "plan sweep (causal LMs with a tp plan, from_pretrained, train mode)" if plan_sweep else "verify sweep"
    if pp > 1:
        what = "ParallelEngine sweep (2 SGD steps; 'max grad err' column: largest weight error after them)"
    size = f"pp={pp}" if pp > 1 else "tp=2"
    lines = [
        f"conformance at {size}{' with sequence parallelism' if sequence_parallel else ''}, {impl} attention, "
        f"{what}, transformers {_tf_version()}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "| task | architecture | class | kind | route | result | max logits err | max grad err | generate | reason "
        "| s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {t: i for i, t in enumerate(TASKS)}
    results = sorted(results, key=lambda r: (order.get(r.get("task"), 99), r["kind"], r["model_type"], r["class"]))
    for r in results:
        errors = [f"{r[k]:.1e}" if isinstance(r.get(k), float) else "" for k in ("logits", "grad")]
        generate = {True: "equal", False: "differs"}.get(r.get("generate_equal"), "")
        reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r.get('task', '')} | {r['model_type']} | {r['class']} | {r['kind']} | {r.get('route', '')} "
            f"| {r['result']} | {errors[0]} | {errors[1]} | {generate} | {reason} | {r.get('seconds', '')} |"
        )
    lines.append("")

    def counts(rows):
        c = {k: sum(r["result"] == k for r in rows) for k in RESULTS}
        return f"{len(rows)} classes: " + ", ".join(f"{v} {k}" for k, v in c.items())

    for task in sorted({r.get("task", "") for r in results}, key=lambda t: order.get(t, 99)):
        rows = [r for r in results if r.get("task", "") == task]
        kinds = [k for k in ("dense", "moe") if any(r["kind"] == k for r in rows)]
        by_kind = "; ".join(f"{k}: {counts([r for r in rows if r['kind'] == k])}" for k in kinds)
        lines.append(f"- {task}: {counts(rows)}" + (f" ({by_kind})" if len(kinds) > 1 else ""))
    lines.append(f"\ntotal: {counts(results)}")
    return "\n".join(lines)


def by_class(units: list[dict], techniques: list[str]) -> list[dict]:
    """The engine sweep's (class, technique) rows as one row per class: ``techniques`` maps each
    technique to its result, reason, loss error (``logits``), weight error (``grad``), route and seconds."""
    rows: dict[str, dict] = {}
    for u in units:
        row = rows.setdefault(
            u["class"], {k: u[k] for k in ("task", "model_type", "class", "kind")} | {"techniques": {}}
        )
        row["techniques"][u["technique"]] = {
            k: u[k] for k in ("result", "reason", "logits", "grad", "route", "seconds") if k in u
        }
    for row in rows.values():
        row["techniques"] = {t: row["techniques"][t] for t in techniques if t in row["techniques"]}
    return list(rows.values())


def engine_table(rows: list[dict], techniques: list[str]) -> str:
    """The engine sweep's table: one row per class, one column per technique, then the reason of every
    cell that did not pass."""
    layouts = "; ".join(f"{t}: {_layout(t)}" for t in techniques)
    lines = [
        f"conformance of ParallelEngine layouts on 2 ranks, eager attention, engine sweep (2 SGD steps against the "
        f"unsharded copy: losses and every weight), transformers {_tf_version()}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"layouts (EngineConfig): {layouts}",
        "",
        "| task | architecture | class | kind | " + " | ".join(techniques) + " | s |",
        "|---|---|---|---|" + "---|" * len(techniques) + "---|",
    ]
    order = {t: i for i, t in enumerate(TASKS)}
    rows = sorted(rows, key=lambda r: (order.get(r["task"], 99), r["kind"], r["model_type"], r["class"]))
    notes = []
    for r in rows:
        cells = []
        for t in techniques:
            cell = r["techniques"].get(t, {"result": ""})
            cells.append(cell["result"])
            if cell["result"] not in ("passed", NOT_APPLICABLE, NOT_TESTED, ""):
                notes.append(f"- {r['class']} {t}: {cell['result']}: {cell.get('reason', '')}")
        seconds = sum(c.get("seconds") or 0 for c in r["techniques"].values())
        lines.append(
            f"| {r['task']} | {r['model_type']} | {r['class']} | {r['kind']} | {' | '.join(cells)} | {seconds:.1f} |"
        )
    lines += ["", "Cells that did not pass (not tested: no tiny copy of the class runs unsharded):", "", *notes, ""]
    for t in techniques:
        cells = [r["techniques"][t] for r in rows if t in r["techniques"]]
        counts = {k: sum(c["result"] == k for c in cells) for k in (*RESULTS, NOT_APPLICABLE)}
        lines.append(
            f"- {t}: {len(cells)} classes: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v or k in RESULTS)
        )
    return "\n".join(lines)


def _layout(technique: str) -> str:
    return ", ".join(f"{k}={v}" for k, v in ENGINE_LAYOUTS[technique].items()) + (
        "" if "pp" in ENGINE_LAYOUTS[technique] or "cp" in ENGINE_LAYOUTS[technique] else ", dp=2"
    )


def save_engine(folder: str, text: str, rows: list[dict], techniques: list[str]) -> str:
    """The engine sweep's table and rows as ``conformance-engine-<date>.md`` / ``.json``."""
    import torch

    now = datetime.datetime.now(datetime.UTC)
    stem = os.path.join(folder, f"conformance-engine-{now:%Y-%m-%d}")
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    sweep = {
        "sweep": "engine", "date": f"{now:%Y-%m-%d}", "transformers": _tf_version(),
        "torch": torch.__version__.split("+")[0], "attention": "eager", "techniques": techniques,
        "layouts": {t: _layout(t) for t in techniques}, "rows": rows,
    }  # fmt: skip
    write_sweep(stem + ".json", sweep)
    print(f"written: {stem}.md, {stem}.json", file=sys.stderr)
    return stem


def save(folder, text, results, impl, sequence_parallel, plan_sweep, pp=1) -> str:
    """The table as ``conformance[-plan][-sdpa][-sp][-ppN]-<date>.md`` and the rows with the sweep's
    settings, date and versions as the ``.json`` beside it; returns the path without its suffix."""
    import torch

    now = datetime.datetime.now(datetime.UTC)
    tags = ("-plan" if plan_sweep else "") + ("-sdpa" if impl == "sdpa" else "") + ("-sp" if sequence_parallel else "")
    tags += f"-pp{pp}" if pp > 1 else ""
    stem = os.path.join(folder, f"conformance{tags}-{now:%Y-%m-%d}")
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    sweep = {
        "sweep": "pipeline" if pp > 1 else "plan" if plan_sweep else "verify",
        "date": f"{now:%Y-%m-%d}",
        "transformers": _tf_version(),
        "torch": torch.__version__.split("+")[0],
        "tp": 1 if pp > 1 else 2,
        "pp": pp,
        "attention": impl,
        "sequence_parallel": sequence_parallel,
        "rows": results,
    }
    write_sweep(stem + ".json", sweep)
    print(f"written: {stem}.md, {stem}.json", file=sys.stderr)
    return stem


def write_sweep(path: str, sweep: dict) -> None:
    """A sweep as JSON with one row per line (diffs between sweeps stay readable)."""
    head = {k: v for k, v in sweep.items() if k != "rows"}
    rows = ",\n".join(json.dumps(r) for r in sweep["rows"])
    with open(path, "w") as f:
        f.write(json.dumps(head)[:-1] + ', "rows": [\n' + rows + "\n]}\n")


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="", help=f"comma-separated tasks (default: all): {','.join(TASKS)}")
    parser.add_argument("--only", default="", help="comma-separated model types or class names (default: all)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many classes (after the filters)")
    parser.add_argument("--dense", action="store_true", help="dense architectures only")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds one class may take (default 300)")
    parser.add_argument("--plan-sweep", action="store_true", help="the causal-LM tp-plan sweep (tools.conformance)")
    parser.add_argument("--sdpa", action="store_true", help="sdpa attention instead of eager (plan sweep)")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="shard with sequence_parallel=True (plan sweep)"
    )
    parser.add_argument(
        "--pp", type=int, default=1, help="train each class at this pipeline size through ParallelEngine (on pp ranks)"
    )
    parser.add_argument(
        "--engine",
        default="",
        metavar="TECHNIQUES",
        help="train each class through ParallelEngine on 2 ranks in each technique's layout, against its "
        f"unsharded copy: comma-separated {','.join(ENGINE_NAMES)} or 'all' (ep: MoE classes only)",
    )
    parser.add_argument("--json", help="also write the results here (a list of rows)")
    parser.add_argument(
        "--save",
        metavar="DIR",
        help="write the table and the results beside it: DIR/conformance[-plan][-sdpa][-sp][-ppN]-<date>.md and "
        ".json (the .json, with the sweep's date and versions, is what sweeps/matrix.py reads)",
    )
    parser.add_argument(
        "--jsonl",
        help="the per-row JSON lines file, appended as rows finish; rows already in it are not run again "
        "(default: $TMPDIR/sf-conformance-<date>.jsonl)",
    )
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    tasks = set(filter(None, args.task.split(",")))
    if unknown := tasks - set(TASKS):
        parser.error(f"unknown task(s) {', '.join(sorted(unknown))}; known: {', '.join(TASKS)}")
    impl = "sdpa" if args.sdpa else "eager"
    plan_sweep = args.plan_sweep or args.sdpa or args.sequence_parallel
    techniques = [ENGINE_NAMES[t] for t in ENGINE_NAMES] if args.engine == "all" else []
    for name in filter(None, args.engine.split(",")) if args.engine != "all" else ():
        if name not in ENGINE_NAMES:
            parser.error(f"unknown --engine technique {name!r}; known: {', '.join(ENGINE_NAMES)}, all")
        techniques.append(ENGINE_NAMES[name])
    if techniques:
        rows = [dict(r, technique=t) for r in task_rows(tasks, only) for t in techniques]
        job, job_args = _engine_job, ()
    elif args.pp > 1:
        rows, job, job_args = task_rows(tasks, only), _pipeline_job, (args.pp,)
    elif plan_sweep:
        rows, job, job_args = architectures(only), _plan_job, (impl, args.sequence_parallel)
    else:
        rows, job, job_args = task_rows(tasks, only), _verify_job, ()
    rows = [r for r in rows if not args.dense or r["kind"] == "dense"]
    if args.limit:
        rows = rows[: args.limit]
    stamp = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d-%H%M}"
    jsonl = args.jsonl or os.path.join(tempfile.gettempdir(), f"sf-conformance-{stamp}.jsonl")
    # rows already in --jsonl (an interrupted sweep) are kept and not run again; new rows are appended
    # as they finish, so a stopped sweep loses at most the row it was on
    earlier = []
    if os.path.exists(jsonl):
        with open(jsonl) as f:
            earlier = [json.loads(line) for line in f if line.strip()]
    done = {(r["class"], r.get("technique")) for r in earlier}
    rows = [r for r in rows if (r["class"], r.get("technique")) not in done]
    print(f"{len(rows)} classes to check ({len(earlier)} already in {jsonl})", file=sys.stderr, flush=True)

    def progress(row: dict) -> None:
        _progress(row)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")

    world = max(2, args.pp)
    results = earlier + run(rows, job, *job_args, row_timeout=args.row_timeout, progress=progress, world=world)
    if techniques:
        results = by_class(results, techniques)
        text = engine_table(results, techniques)
    else:
        text = table(results, impl, args.sequence_parallel, plan_sweep, args.pp)
    print(text)
    if args.save and techniques:
        save_engine(args.save, text, results, techniques)
    elif args.save:
        save(args.save, text, results, impl, args.sequence_parallel, plan_sweep, args.pp)
    print(f"\nper-row results: {jsonl}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
