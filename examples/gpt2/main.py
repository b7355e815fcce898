"""Train a small GPT-2 on a text file, then continue a prompt with it, tensor-parallel.

    shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode train
    shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode inference

Train: build GPT-2 from a small config, save it (``initial/``), load it back with from_pretrained,
shard it with shard_model, train it with AdamW (ZeRO over dp), save ``checkpoint/`` and a loss curve.
Inference: load ``checkpoint/`` with from_pretrained, shard it, generate greedily from the prompt.
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/common.py

import common  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from shardformer.cli import parse_example_args  # noqa: E402
from shardformer.tensor_parallel.layers import gather_from_parallel  # noqa: E402

EXTRA_KEYS = {
    "n_layer": 2,
    "n_embd": 96,
    "n_head": 4,
    "block_size": 64,
    "dropout": 0.0,
    "prompt": "The keeper",
    "max_new_tokens": 30,
    "compare_untrained": True,
}
VOCAB_FILE = "words.json"
END = "<|end|>"


class WordTokenizer:
    """One token per word or punctuation mark of the corpus: tiny, and the model's output reads as words."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.index = {w: i for i, w in enumerate(words)}

    @staticmethod
    def split(text: str) -> list[str]:
        return re.findall(r"\w+|[^\w\s]", text)

    @classmethod
    def from_text(cls, text: str) -> "WordTokenizer":
        return cls([END] + sorted(set(cls.split(text))))  # id 0: end of text (and padding)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(self.split(text)) - set(self.index))
        if unknown:
            raise ValueError(f"words {unknown} are not in the vocabulary (the words of {VOCAB_FILE})")
        return [self.index[w] for w in self.split(text)]

    def decode(self, ids) -> str:
        return re.sub(r" ([^\w\s])", r"\1", " ".join(self.words[i] for i in ids))

    def save(self, folder: str) -> None:
        with open(os.path.join(folder, VOCAB_FILE), "w") as file:
            json.dump(self.words, file)

    @classmethod
    def load(cls, folder: str) -> "WordTokenizer":
        with open(os.path.join(folder, VOCAB_FILE)) as file:
            return cls(json.load(file))


def make_initial_model(cfg, env, folder: str) -> WordTokenizer:
    """Rank 0 builds an untrained GPT-2 for the corpus' words and saves it to ``folder``."""
    with open(cfg.data_path, encoding="utf-8") as file:
        tokenizer = WordTokenizer.from_text(file.read())

    def build() -> None:
        config = GPT2Config(
            vocab_size=len(tokenizer.words),
            n_positions=max(128, cfg.block_size),
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        common.seed_everything(cfg.seed)
        GPT2LMHeadModel(config).save_pretrained(folder)
        tokenizer.save(folder)

    common.on_rank_zero(env, build)
    return tokenizer


def load_engine(folder: str, cfg, env, train: bool = False):
    model = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True)
    return common.build_engine(model, cfg, env, train=train)


def train(cfg, env) -> None:
    paths = common.output_paths(cfg)
    tokenizer = make_initial_model(cfg, env, paths["initial"])
    engine = load_engine(paths["initial"], cfg, env, train=True)
    with open(cfg.data_path, encoding="utf-8") as file:
        ids = torch.tensor(tokenizer.encode(file.read()))
    common.log(env, f"{env.mesh}, {sum(p.numel() for p in engine.model.parameters()):,} parameters on this rank")

    def batch_of(step: int):
        # Every rank draws the same global batch; the engine gives each dp replica its slice.
        generator = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
        starts = torch.randint(0, len(ids) - cfg.block_size, (cfg.batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + cfg.block_size] for s in starts.tolist()])
        return {"input_ids": batch, "labels": batch}, batch.numel()  # labels are shifted inside

    losses = common.train(env, cfg, engine, batch_of, unit="tok")
    common.save_model(engine.model, paths["checkpoint"])
    common.on_rank_zero(env, tokenizer.save, paths["checkpoint"])
    common.log(env, f"saved {paths['checkpoint']}")
    layout = f"tp={env.mesh.tp_size}, pp={env.mesh.pp_size}"
    common.report_training(env, cfg, losses, f"GPT-2 ({cfg.n_layer} layers, n_embd {cfg.n_embd}), {layout}")


@torch.no_grad()
def generate(folder: str, cfg, env) -> str:
    """Greedy continuation of the prompt: ``generate()`` (KV cache) on one stage; with pipeline
    stages, one forward through all of them per new token."""
    tokenizer = WordTokenizer.load(folder)
    engine = load_engine(folder, cfg, env)
    input_ids = torch.tensor([tokenizer.encode(cfg.prompt)], device=env.device)
    positions = engine.model.config.n_positions
    if input_ids.shape[1] + cfg.max_new_tokens > positions:
        raise ValueError(f"prompt + max_new_tokens exceeds the model's {positions} positions")
    if env.mesh.pp_size == 1:
        output = engine.model.eval().generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=cfg.max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return tokenizer.decode(output[0].tolist())
    vocab = engine.model.config.vocab_size
    for _ in range(cfg.max_new_tokens):
        logits = gather_from_parallel(engine.forward({"input_ids": input_ids})[:, -1:], env.mesh.tp_group, vocab)
        input_ids = torch.cat([input_ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokenizer.decode(input_ids[0].tolist())


def inference(cfg, env) -> None:
    common.run_inference(
        cfg,
        env,
        make_initial_model,
        run=lambda folder: generate(folder, cfg, env),
        show=lambda which, text: common.log(env, f"{which + ' model:':<16} {text!r}"),
        results={"prompt": cfg.prompt},
    )


def main() -> None:
    cfg, mode = parse_example_args(extra_keys=EXTRA_KEYS, description=__doc__.splitlines()[0])
    env = common.setup(cfg)
    train(cfg, env) if mode == "train" else inference(cfg, env)
    common.finish()


if __name__ == "__main__":
    main()
