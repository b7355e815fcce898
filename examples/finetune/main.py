"""Fine-tune a sharded GPT-2 with transformers' Trainer (shardformer's ShardedTrainer), tp=2 on 2 CPU processes.

    shardformer run --nproc_per_node 2 examples/finetune/main.py [--output_dir DIR] [--lora] [--sft] [--moe]

A tiny GPT-2 is built from a config and saved, so the example needs no download; put your own
folder (with config.json and weights) in its place. With 4 processes the same script trains at
tp=2 x dp=2: batches are split over the two data-parallel replicas only.

--lora   trains PEFT LoRA adapters (cut like the layers they adapt) instead of the whole model; the
         saved folder is a standard adapter that plain PEFT loads on the unsharded model.
--sft    trains with TRL's SFTTrainer (ShardedSFTTrainer) on text, instead of Trainer on token ids.
--moe    trains a tiny Mixtral (8 experts) at expert_parallel_size=2 instead: each rank holds 4 experts
         and its own batch (dp=2), tokens travel to their experts and back.
"""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM, TrainingArguments

from shardformer import ShardConfig, init_distributed, shard_model

VOCAB, SEQ = 128, 32


def tiny_folder(path: str, moe: bool = False) -> str:
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        if moe:
            config = MixtralConfig(
                vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=SEQ, num_local_experts=8, num_experts_per_tok=2,
            )  # fmt: skip
            MixtralForCausalLM(config).save_pretrained(path)
        else:
            config = GPT2Config(
                vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1
            )
            GPT2LMHeadModel(config).save_pretrained(path)
    dist.barrier()
    return path


def token_patterns() -> list[dict]:
    """Shifted copies of one pattern: something a tiny model learns in a few steps."""
    gen = torch.Generator().manual_seed(1)
    pattern = torch.arange(SEQ) % 16
    data = [{"input_ids": (pattern + int(torch.randint(0, 8, (1,), generator=gen))) % VOCAB} for _ in range(64)]
    for example in data:
        example["labels"] = example["input_ids"].clone()
    return data


def word_tokenizer():
    """A word-level tokenizer over the words w0 .. w127 (SFTTrainer tokenises text itself)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="w0", eos_token="w1", unk_token="w2", pad_token="w3"
    )


def text_patterns():
    import datasets

    rows = [" ".join(f"w{int(i)}" for i in example["input_ids"][: SEQ - 1]) for example in token_patterns()]
    return datasets.Dataset.from_list([{"text": row} for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default=os.path.join(tempfile.gettempdir(), "shardformer-finetune"))
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters instead of the whole model")
    parser.add_argument("--sft", action="store_true", help="train with TRL's SFTTrainer on text")
    parser.add_argument("--moe", action="store_true", help="a tiny Mixtral at expert_parallel_size=2")
    options = parser.parse_args()
    if options.moe and (options.lora or options.sft):
        parser.error("--moe trains the whole Mixtral with Trainer: leave out --lora and --sft")
    out = options.output_dir
    init_distributed()
    if options.moe:
        model = MixtralForCausalLM.from_pretrained(tiny_folder(os.path.join(out, "base"), moe=True))
        model = shard_model(model, ShardConfig(expert_parallel_size=2))
    else:
        model = GPT2LMHeadModel.from_pretrained(tiny_folder(os.path.join(out, "base")))
        model = shard_model(model, ShardConfig(tensor_parallel_size=2))

    lora = None
    if options.lora:
        from peft import LoraConfig

        # c_attn (fused Q|K|V) and c_fc are column-parallel here: lora_B is cut like them, lora_A stays whole
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    dp = dist.get_world_size() // (1 if options.moe else 2)  # tp=2 ranks share a batch; ep ranks are dp ranks
    settings = dict(
        per_device_train_batch_size=8 // dp, max_steps=20, learning_rate=3e-2 if lora else 3e-3, logging_steps=5,
        save_strategy="steps", save_steps=10, report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    if options.sft:
        from trl import SFTConfig

        from shardformer.integrations import ShardedSFTTrainer

        # TRL defaults to checkpointing under transformers' deprecated name (a FutureWarning); the new name, same run
        args = SFTConfig(
            os.path.join(out, "run"), max_length=SEQ, bf16=False, activation_checkpointing=True, **settings
        )
        trainer = ShardedSFTTrainer(
            model=model, args=args, train_dataset=text_patterns(), processing_class=word_tokenizer(), peft_config=lora
        )
    else:
        from peft import get_peft_model

        from shardformer.integrations import ShardedTrainer

        model = get_peft_model(model, lora) if lora else model
        args = TrainingArguments(os.path.join(out, "run"), **settings)
        trainer = ShardedTrainer(model=model, args=args, train_dataset=token_patterns())
    trainer.train()
    # a plain HF folder (or, with --lora, a standard adapter): from_pretrained / PeftModel.from_pretrained load it
    trainer.save_model(os.path.join(out, "final"))
    if dist.get_rank() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
        with open(os.path.join(out, "metrics.json"), "w") as file:
            json.dump({"losses": losses}, file)
        print(f"losses {losses}; saved {os.path.join(out, 'final')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
