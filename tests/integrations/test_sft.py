"""TRL's SFTTrainer on sharded models: ShardedSFTTrainer against SFTTrainer on the unsharded model.

Text examples of different lengths (padded batches, TRL's own tokenisation and label building), 4
AdamW steps of 2 accumulated micro-batches, clipping active; full fine-tuning and LoRA through
``peft_config``. Every logged value is compared: loss, gradient norm, and the entropy, token accuracy
and token count TRL computes from the logits and the batch (logits over the whole vocabulary, each
token counted once). The reference runs TRL's default loss ("chunked_nll"); the sharded run gets
"nll", the same loss. One spawn of 4 ranks: tp=2 x dp=2.
"""

import functools

import datasets
import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from shardformer import ShardConfig, shard_model
from shardformer.tools.testing import run_on_ranks
from tests.helpers import PEFT_READS_A_DEPRECATED_PROPERTY, assert_close
from tests.integrations.common import CHECKPOINTING, SEQ, VOCAB, shared_dir, tiny_gpt2

LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


def tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="t0", eos_token="t1", unk_token="t2", pad_token="t3"
    )


def texts() -> datasets.Dataset:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(32):
        length = int(torch.randint(4, SEQ - 1, (1,), generator=gen))
        rows.append({"text": " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (length,), generator=gen))})
    return datasets.Dataset.from_list(rows)


def lora() -> LoraConfig:
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM",
        init_lora_weights="gaussian",
    )  # fmt: skip


def train(tp: int, use_lora: bool, **overrides) -> dict:
    dp = dist.get_world_size() // tp if tp else 1
    options = dict(
        per_device_train_batch_size=4 // dp, gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2,
        max_grad_norm=0.3, logging_steps=1, report_to=[], use_cpu=True, seed=7, save_strategy="no", max_length=SEQ,
        disable_tqdm=True, bf16=False,  # TRL turns bf16 autocast on by default: compare in fp32
        **{CHECKPOINTING: True},  # TRL's default, by transformers 5.24's name (its old one warns)
    )  # fmt: skip
    options.update(overrides)
    args = SFTConfig(shared_dir(), **options)
    if tp:
        from shardformer.integrations import ShardedSFTTrainer as trainer_class

        model = shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp))
    else:
        trainer_class, model = SFTTrainer, tiny_gpt2()
    torch.manual_seed(5)  # the LoRA adapter's draw
    trainer = trainer_class(
        model=model, args=args, train_dataset=texts(), processing_class=tokenizer(),
        peft_config=lora() if use_lora else None,
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {key: [h[key] for h in logs] for key in LOGGED}


@functools.cache
def reference(use_lora: bool) -> dict:
    return train(0, use_lora)


def _sharded(tp):
    result = {"full": train(tp, False), "lora": train(tp, True)}
    try:
        train(tp, False, loss_type="dft")
    except ValueError as e:
        result["dft"] = str(e)
    return result


@PEFT_READS_A_DEPRECATED_PROPERTY
def test_sft_trainer_at_tp2_dp2_matches_one_process():
    result = run_on_ranks(_sharded, 4, 2, timeout=300)[0]
    for kind, use_lora in (("full", False), ("lora", True)):
        ref = reference(use_lora)
        assert ref["grad_norm"][0] > 0.3, "clipping must be active for the test to mean something"
        for key in LOGGED:
            assert_close(torch.tensor(result[kind][key]), torch.tensor(ref[key]), what=f"{kind} {key}")
    assert "compute_loss_func" in result.get("dft", ""), result.get("dft")


def test_an_unproven_trl_release_is_refused(monkeypatch):
    import trl

    from shardformer.integrations.sft import ShardedSFTTrainer

    monkeypatch.setattr(trl, "__version__", "1.16.0")  # gave losses 15% off in the parity test above
    with pytest.raises(RuntimeError, match="this is TRL 1.16.0"):
        ShardedSFTTrainer(model=None)
