"""A tiny causal LM, its data and TrainingArguments shared by the Trainer and PEFT tests."""

import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration, TrainingArguments

VOCAB, SEQ, EXAMPLES = 62, 12, 32  # 62 does not divide by tp=4: the vocabulary gets padded


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def tiny_t5() -> T5ForConditionalGeneration:
    """An encoder-decoder (its sharded forward once hid input_ids from Trainer's column filter)."""
    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


def seq2seq_dataset() -> list[dict]:
    """Source and target of different lengths (targets padded with -100)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(EXAMPLES // 2):
        labels = torch.randint(2, VOCAB, (SEQ // 2,), generator=gen)
        labels[int(torch.randint(3, SEQ // 2, (1,), generator=gen)) :] = -100
        out.append({"input_ids": torch.randint(2, VOCAB, (SEQ,), generator=gen), "labels": labels})
    return out


def dataset() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(EXAMPLES):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        labels = ids.clone()
        labels[: int(torch.randint(1, 4, (1,), generator=gen))] = -100  # uneven token counts per example
        out.append({"input_ids": ids, "labels": labels})
    return out


def eval_dataset() -> list[dict]:
    """13 examples (odd: at dp=2 the last batch is padded, then trimmed), every token labelled, so an
    example's loss is a plain mean in every layout."""
    gen = torch.Generator().manual_seed(2)
    return [
        {"input_ids": (ids := torch.randint(0, VOCAB, (SEQ,), generator=gen)), "labels": ids.clone()} for _ in range(13)
    ]


def token_accuracy(prediction) -> dict:
    """compute_metrics: next-token accuracy from the logits (needs them over the whole vocabulary)."""
    logits, labels = prediction.predictions, prediction.label_ids
    return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean()), "examples": len(logits)}


def shared_dir() -> str:
    if not dist.is_initialized():
        return tempfile.mkdtemp(prefix="sf-trainer-")
    box = [tempfile.mkdtemp(prefix="sf-trainer-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# transformers 5.24 renamed TrainingArguments.gradient_checkpointing (the old name warns): the new one where it is
CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def training_args(output_dir: str, global_batch: int, dp: int, **overrides) -> TrainingArguments:
    """Four optimizer steps of two accumulated micro-batches, clipped, checkpointed every two steps."""
    options = dict(
        per_device_train_batch_size=global_batch // dp, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-2, max_grad_norm=0.3, logging_steps=1, save_strategy="steps", save_steps=2,
        report_to=[], use_cpu=True, seed=7, disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=1,
        per_device_eval_batch_size=1,
    )  # fmt: skip
    options.update(overrides)
    return TrainingArguments(output_dir, **options)


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]
