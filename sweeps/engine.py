"""The engine checks of a row: the class trained through ``ParallelEngine`` in a layout against its unsharded
copy (``--pp N``, ``--engine TECHNIQUES``, the config flips' pp rows).

Each technique is a layout of ParallelEngine on 2 ranks; every layout splits a step's batch into 2 equal
chunks (dp=2, or 2 micro-batches), as the unsharded reference step does. 2 SGD steps, then the losses and
every weight (gathered over tp, ep, ZeRO-3 and the stages).
"""

from __future__ import annotations

import inspect

from sweeps.rows import (
    FAILED,
    NOT_APPLICABLE,
    PASSED,
    RANDOM_IN_TRAINING,
    REFUSED,
    REFUSED_AT_STEP,
    reason_first,
    set_reason,
)
from sweeps.zoo import build_tiny

ENGINE_LAYOUTS = {
    "pp": {"pp": 2, "num_microbatches": 2},
    "ZeRO-1": {"zero_stage": 1},  # dp=2
    "ZeRO-2": {"zero_stage": 2},
    "ZeRO-3": {"zero_stage": 3},
    "checkpointing": {"zero_stage": 1, "activation_checkpointing": True},
    "cp": {"cp": 2, "num_microbatches": 2},
    "ep": {"ep": 2},  # dp=2, the experts split over both ranks; MoE classes only
}
# the fine-tuning techniques (sweeps/finetune.py): ShardedTrainer, and PEFT LoRA under it
FINETUNE_LAYOUTS = {
    "Trainer": "ShardedTrainer, SGD; tp=2 where the class shards at tp=2, else tp=1 x dp=2",
    "LoRA": "PEFT LoRA (r=4) on PEFT's default targets, else all-linear, under ShardedTrainer in the Trainer layout",
}
ENGINE_NAMES = {"pp": "pp", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "checkpointing": "checkpointing",
                "cp": "cp", "ep": "ep", "trainer": "Trainer", "lora": "LoRA"}  # fmt: skip


def layout_text(technique: str) -> str:
    """A technique's layout as the tables print it (``zero_stage=1, dp=2``)."""
    if technique in FINETUNE_LAYOUTS:
        return FINETUNE_LAYOUTS[technique]
    layout = ENGINE_LAYOUTS[technique]
    return ", ".join(f"{k}={v}" for k, v in layout.items()) + ("" if "pp" in layout or "cp" in layout else ", dp=2")


def train_technique(row: dict) -> None:
    """The engine sweep's check: the row's ``technique`` in its layout (``ENGINE_LAYOUTS``)."""
    if row["technique"] == "ep" and row["kind"] != "moe":
        row.update(result=NOT_APPLICABLE, reason="no experts (a dense class)")
        return
    train_with(row, ENGINE_LAYOUTS[row["technique"]])


def _scalar_loss(output, _batch=None):
    """The model's loss, else the mean square of its first output (a base model, a head without labels)."""
    import torch

    loss = output.get("loss") if hasattr(output, "get") else None
    if loss is not None:
        return loss
    values = output.values() if hasattr(output, "values") else [output]
    return next(t for t in values if torch.is_tensor(t) and t.is_floating_point()).float().pow(2).mean()


# tasks whose decoder-only classes learn the next token of their own input ids (labels = input_ids)
LANGUAGE_MODELS = ("causal-lm", "seq2seq-lm", "image-text-to-text")


def engine_batches(ref, row: dict) -> list[dict]:
    """The 2 batches of 4 a row trains on: the class's inputs, with labels where its head takes them."""
    import torch

    from shardformer.models import inputs_for

    batches = [inputs_for(ref, seed, batch=4) for seed in (1, 2)]
    takes = inspect.signature(ref.forward).parameters
    task = row.get("task")
    for seed, b in zip((1, 2), batches):
        g = torch.Generator().manual_seed(100 + seed)
        if task in LANGUAGE_MODELS and "labels" in takes and "input_ids" in b and "decoder_input_ids" not in b:
            b.setdefault("labels", b["input_ids"].clone())  # the model's own loss, also where the class's name
            # does not say it is a causal LM (BertGenerationDecoder, AudioFlamingo3)
        elif task == "sequence-classification" and "labels" in takes:  # an encoder-decoder's (BART) too
            b.setdefault("labels", torch.randint(0, ref.config.num_labels, (4,), generator=g))
        elif task == "question-answering" and "start_positions" in takes and "input_ids" in b:
            for key in ("start_positions", "end_positions"):  # a span inside the sequence
                b.setdefault(key, torch.randint(0, b["input_ids"].shape[-1], (4,), generator=g))
    return batches


def has_labels(batch: dict) -> bool:
    """Whether the batch holds what the head's own loss reads (labels, or a QA head's span)."""
    return "labels" in batch or "start_positions" in batch


def train_with(row: dict, layout: dict) -> None:
    """2 SGD steps of the class through ParallelEngine in ``layout`` (EngineConfig fields) and of its
    unsharded copy, each step's batch split in the same equal chunks: the losses, then every weight
    (gathered over tp, ep, ZeRO-3 and the stages). Fills ``row``."""
    import torch
    import torch.distributed as dist

    from shardformer import EngineConfig, ParallelEngine
    from shardformer.checkpoint.gather import gather_full_state

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    torch.manual_seed(0)
    ref = build_tiny(row["class"], row.get("flip"))
    model = build_tiny(row["class"], row.get("flip"))
    model.load_state_dict(ref.state_dict())
    batches = engine_batches(ref, row)
    # the model's own loss where the batch has labels (context parallelism refuses any other loss_fn)
    loss_fn = None if has_labels(batches[0]) else _scalar_loss
    try:
        engine = ParallelEngine(model, sgd, EngineConfig(**layout), loss_fn=loss_fn)
    except (NotImplementedError, ValueError, TypeError) as e:
        set_reason(row, REFUSED, f"{type(e).__name__}: {reason_first(str(e))}")
        return
    row["route"] = engine.model.shardformer.route
    try:
        got = [engine.train_step(b) for b in batches]
    except (NotImplementedError, ValueError) as e:  # a refusal the engine could not tell before the step
        set_reason(row, REFUSED_AT_STEP, f"{type(e).__name__}: {reason_first(str(e))}")
        return
    chunks = engine.mesh.dp_size * engine.config.num_microbatches
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    expected = reference_steps(ref, batches, chunks, sgd)
    merged = gather_full_state(engine.model)  # on rank 0, which writes the row (None elsewhere)
    wanted = dict(ref.named_parameters()) if dist.get_rank() == 0 else {}
    judge_steps(row, got, expected, (merged, wanted, "is on no stage"),
                lambda: random_in_training(ref, initial, batches, chunks, sgd))  # fmt: skip


def judge_steps(row: dict, got: list, expected: list, weights: tuple, rerun) -> None:
    """Fill ``row`` from a sharded run's losses against the unsharded run's, then its trained weights:
    ``weights`` = (trained by name, full size; wanted by name, on rank 0 only; what to say of a name missing
    from trained). Where something differs, ``rerun()`` (rank 0) says whether two unsharded runs under other
    RNG seeds differ too: then the row is "random in training", else failed."""
    import torch
    import torch.distributed as dist

    from shardformer.core.compare import GRAD_ATOL, GRAD_RTOL, max_error

    trained, wanted, missing = weights
    row["logits"], ok = max_error(torch.tensor(got), torch.tensor(expected))
    row["grad"] = 0.0  # in these sweeps: the largest weight error after the steps
    failures = [] if ok else [f"losses differ by {row['logits']:.2e}"]
    for name, p in wanted.items():
        if name not in trained:
            failures.append(f"{name} {missing}")
            continue
        error, good = max_error(trained[name], p, GRAD_ATOL, GRAD_RTOL)
        row["grad"] = max(row["grad"], error)
        if not good:
            failures.append(f"{name} differs by {error:.2e} after the steps")
    if failures and dist.get_rank() == 0 and rerun():
        set_reason(row, RANDOM_IN_TRAINING, "two unsharded runs with other RNG seeds differ too: " + failures[0], 400)
    elif failures:
        set_reason(row, FAILED, "; ".join(failures[:3]), 400)
    else:
        row.update(result=PASSED, reason="")


def reference_steps(ref, batches, chunks, optimizer) -> list[float]:
    """The unsharded model's training steps, each batch's loss the mean over ``chunks`` equal chunks."""
    from shardformer.engine import split_batch

    ref.train()
    opt = optimizer(ref.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        parts = split_batch(b, chunks, "chunks") if chunks > 1 else [b]  # whole: whatever its tensors' sizes
        loss = sum(_scalar_loss(ref(**part)) for part in parts) / chunks
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def random_in_training(ref, initial: dict, batches, chunks, optimizer) -> bool:
    """Whether the same steps from the same weights under another RNG seed end elsewhere than ``ref``."""
    import copy

    import torch

    from shardformer.core.compare import GRAD_ATOL, GRAD_RTOL, max_error

    again = copy.deepcopy(ref)
    again.load_state_dict(initial)
    kept = torch.random.get_rng_state()
    torch.manual_seed(12345)
    try:
        reference_steps(again, batches, chunks, optimizer)
    finally:
        torch.random.set_rng_state(kept)
    trained = dict(ref.named_parameters())
    return any(
        not max_error(p.detach(), trained[n].detach(), GRAD_ATOL, GRAD_RTOL)[1] for n, p in again.named_parameters()
    )


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
