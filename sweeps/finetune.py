"""The engine sweep's fine-tuning checks: the class trained by ``ShardedTrainer`` (``trainer``), and its PEFT
LoRA adapters trained by it (``lora``), each against its unsharded copy trained by plain torch.

The layout (``FINETUNE_LAYOUTS``): tp=2 where ``shard_model`` cuts the class at tp=2 (both ranks see each
whole batch), else tp=1 x dp=2 (each rank half of each batch; ShardedTrainer averages the gradients over dp).
Trainer runs 2 steps of plain SGD (lr 0.1, constant schedule, no clipping, no weight decay: what
``engine.reference_steps`` does by hand), one batch a step in order, each step's loss the model's own
(Trainer's token-count scaling off). Compared: the 2 logged losses, then
every weight (``trainer``: gathered over tp) or every LoRA weight (``lora``: the adapter
``save_pretrained`` writes, gathered over tp, against PEFT's on the unsharded copy). LoRA's targets are
PEFT's defaults for the model type (``target_modules=None``), else ``"all-linear"`` where PEFT has no
default (every linear layer but the output layer); "n/a" where neither finds a layer. A head whose
batch has no labels returns no loss and Trainer cannot train it: "n/a".
"""

from __future__ import annotations

import os
import shutil
import tempfile

from sweeps.engine import (
    engine_batches,
    has_labels,
    judge_steps,
    random_in_training,
    reference_steps,
    train_technique,
)
from sweeps.rows import (
    FAILED,
    NOT_APPLICABLE,
    NOT_TESTED,
    PASSED,
    REFUSED,
    REFUSED_AT_STEP,
    reason_first,
    set_reason,
)
from sweeps.zoo import build_tiny

LR = 0.1


def check_technique(row: dict) -> None:
    """The engine sweep's check of one row: ``trainer`` and ``lora`` here, the ParallelEngine layouts in
    ``engine.train_technique``. A row that fails is run again in float64 (``Float64Everywhere``, as verify's
    rerun): weights that agree there to within ``ROUNDING_SHRINK`` of the float32 gap were float32
    rounding (ParakeetForCTC's Trainer row: a bias before a training-mode BatchNorm, whose exact gradient
    is 0, 2.9e-4 apart after 2 steps in float32, 2e-10 in float64); any other failure stays failed."""
    from shardformer.core.float64_mode import Float64Everywhere
    from shardformer.tools.verify_report import ROUNDING_SHRINK

    _check_technique(row)
    if _as_rank_0_finds(row.get("result") == FAILED):
        again = {k: row[k] for k in ("task", "model_type", "class", "kind", "technique", "flip") if k in row}
        with Float64Everywhere():
            _check_technique(again)
        shrank = again.get("result") == PASSED and (again.get("grad") or 0) <= (row.get("grad") or 0) * ROUNDING_SHRINK
        if _as_rank_0_finds(shrank):
            row.update(result=PASSED, reason=f"float32 rounding: {row['reason']} in float32; within "
                       f"{again.get('grad') or 0:.2g} in float64")  # fmt: skip


def _check_technique(row: dict) -> None:
    if row["technique"] in ("Trainer", "LoRA"):
        train_under_trainer(row, lora=row["technique"] == "LoRA")
    else:
        train_technique(row)


def _as_rank_0_finds(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (rank 0 holds the gathered weights and writes the row): every rank
    reruns, or none (the rerun has collectives)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(flag)])
    dist.broadcast(value, src=0)
    return bool(value.item())


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=LR)


def _with_lora(model, targets: str | None):
    """``model`` with PEFT LoRA on ``targets`` (None: PEFT's default targets for its model type; r=4,
    Gaussian ``B`` so that the adapters act from the first step), drawn from the same seed each time."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=targets))


def _lora_targets(model) -> tuple[object, str | None]:
    """(``model`` with LoRA, its targets): PEFT's defaults for the model type, else ``"all-linear"``
    (PEFT's rule: every linear layer but the output layer). ``ValueError`` where neither finds a layer."""
    try:
        return _with_lora(model, None), None
    except ValueError:  # PEFT's "Please specify `target_modules`": no default for this model type
        return _with_lora(model, "all-linear"), "all-linear"


def _sharded(row: dict, state: dict, lora: bool, targets: str | None):
    """(the tiny model with the weights ``state``, LoRA on ``targets`` added where ``lora``, sharded at
    tp=2, else at tp=1 over dp=2; its tp size)."""
    from shardformer import ShardConfig, shard_model

    def built():
        model = build_tiny(row["class"], row.get("flip"))
        model.load_state_dict(state)
        return _with_lora(model, targets) if lora else model

    try:
        return shard_model(built(), ShardConfig(tensor_parallel_size=2)), 2
    except (NotImplementedError, ValueError) as e:
        row["tp_refusal"] = reason_first(str(e))[:200]
    return shard_model(built(), ShardConfig(tensor_parallel_size=1)), 1  # anew: a refused cut may leave it half cut


def _trainer(model, items: list[dict], out: str):
    """ShardedTrainer over ``items``, one a step per dp rank, in order, with plain SGD."""
    from transformers import PrinterCallback, TrainingArguments

    from shardformer.integrations import ShardedTrainer

    args = TrainingArguments(
        out, per_device_train_batch_size=1, max_steps=2, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    trainer = ShardedTrainer(model=model, args=args, train_dataset=items, data_collator=lambda features: features[0])
    # each step's loss the model's own mean, as the reference's: Trainer would pass its own token count, which
    # counts the label that a causal LM's shift drops (its losses then (S-1)/S of the model's)
    trainer.model_accepts_loss_kwargs = False
    trainer.remove_callback(PrinterCallback)  # its log lines would drown the sweep's
    return trainer


def train_under_trainer(row: dict, lora: bool) -> None:
    """2 SGD steps of the class (or of its LoRA adapters) under ShardedTrainer in its layout against its
    unsharded copy's steps on the same batches: the logged losses, then the trained weights. Fills ``row``."""
    import torch
    import torch.distributed as dist

    from shardformer.engine import split_batch

    torch.manual_seed(0)
    ref = build_tiny(row["class"], row.get("flip"))
    batches = engine_batches(ref, row)
    if not has_labels(batches[0]):
        row.update(result=NOT_APPLICABLE, reason="no labels for this head: no loss for Trainer to train")
        return
    state = ref.state_dict()  # the initial weights (LoRA's adapters are drawn from their own seed)
    targets = None
    if lora:
        try:
            ref, targets = _lora_targets(ref)
        except ValueError as e:
            set_reason(row, NOT_APPLICABLE, f"PEFT finds no layer to adapt in {row['class']}: {e}")
            return
    try:
        model, tp = _sharded(row, state, lora, targets)
    except (NotImplementedError, ValueError, TypeError) as e:
        set_reason(row, REFUSED, f"{type(e).__name__}: {reason_first(str(e))}")
        return
    row["route"] = ("tp=2" if tp == 2 else "tp=1, dp=2") + (f", LoRA on {targets or 'PEFT defaults'}" if lora else "")
    chunks = 2 // tp
    try:
        items = [part for b in batches for part in split_batch(b, chunks, "chunks")] if chunks > 1 else batches
    except ValueError as e:  # the tensors of the batch do not share a batch size: no dp rank can get half
        set_reason(row, NOT_TESTED, f"the batch cannot be split over dp=2: {e}")
        return
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    out = tempfile.mkdtemp(prefix="sf-sweep-trainer-")
    try:
        trainer = _trainer(model, items, out)
        trainer.train()
    except (NotImplementedError, ValueError) as e:
        set_reason(row, REFUSED_AT_STEP, f"{type(e).__name__}: {reason_first(str(e))}")
        return
    finally:
        shutil.rmtree(out, ignore_errors=True)
    got = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    expected = reference_steps(ref, batches, chunks, _sgd)
    trained, wanted = _trained_weights(model, ref, lora)
    wanted = wanted if dist.get_rank() == 0 else {}
    judge_steps(row, got, expected, (trained, wanted, "is not in the trained model"),
                lambda: random_in_training(ref, initial, batches, chunks, _sgd))  # fmt: skip


def _trained_weights(model, ref, lora: bool) -> tuple[dict, dict]:
    """(the sharded run's trained weights, full size, on rank 0; the unsharded run's): every weight, or
    the LoRA adapter as ``save_pretrained`` writes it (collective: rank 0 writes the gathered adapter)."""
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from shardformer.checkpoint.gather import gather_full_state

    if not lora:
        return gather_full_state(model) or {}, {n: p.detach() for n, p in ref.named_parameters()}
    folder = [tempfile.mkdtemp(prefix="sf-sweep-lora-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    model.save_pretrained(folder[0], save_embedding_layers=False)  # an audio encoder has no input embeddings
    dist.barrier()
    trained = load_file(os.path.join(folder[0], "adapter_model.safetensors")) if dist.get_rank() == 0 else {}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    return trained, get_peft_model_state_dict(ref, save_embedding_layers=False)  # as saved above
