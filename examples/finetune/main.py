"""Fine-tune a sharded GPT-2 with transformers' Trainer (shardformer's ShardedTrainer), tp=2 on 2 CPU processes.

    shardformer run --nproc_per_node 2 examples/finetune/main.py [--output_dir DIR]

A tiny GPT-2 is built from a config and saved, so the example needs no download; put your own
folder (with config.json and weights) in its place. With 4 processes the same script trains at
tp=2 x dp=2: batches are split over the two data-parallel replicas only.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from shardformer import ShardConfig, init_distributed, shard_model
from shardformer.integrations import ShardedTrainer


def tiny_folder(path: str) -> str:
    if dist.get_rank() == 0:
        config = GPT2Config(
            vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1
        )
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(path)
    dist.barrier()
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default=os.path.join(tempfile.gettempdir(), "shardformer-finetune"))
    out = parser.parse_args().output_dir
    init_distributed()
    model = GPT2LMHeadModel.from_pretrained(tiny_folder(os.path.join(out, "base")))
    model = shard_model(model, ShardConfig(tensor_parallel_size=2))

    gen = torch.Generator().manual_seed(1)
    pattern = torch.arange(32) % 16  # something learnable
    data = [{"input_ids": (pattern + int(torch.randint(0, 8, (1,), generator=gen))) % 128} for _ in range(64)]
    for example in data:
        example["labels"] = example["input_ids"].clone()

    args = TrainingArguments(
        os.path.join(out, "run"), per_device_train_batch_size=8 // (dist.get_world_size() // 2), max_steps=20,
        learning_rate=3e-3, logging_steps=5, save_strategy="steps", save_steps=10, report_to=[], use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = ShardedTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))  # a plain HF folder: GPT2LMHeadModel.from_pretrained loads it
    if dist.get_rank() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"losses {losses}; saved {os.path.join(out, 'final')}")


if __name__ == "__main__":
    main()
