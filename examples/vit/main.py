"""Train a small Vision Transformer (transformers or timm) on generated shapes, tensor-parallel, then predict.

    shardformer run --nproc_per_node 2 examples/vit/main.py --config examples/vit/config.py --mode train
    shardformer run --nproc_per_node 2 examples/vit/main.py --config examples/vit/config.py --mode inference
    ... --set backbone=timm    (timm's VisionTransformer instead of transformers' ViTForImageClassification)

Train: build the model from the config's sizes, save it (``initial/``), load it back, shard it with
shard_model, train it on freshly generated images every step, save ``checkpoint/`` and a loss curve.
The HF model is saved as a plain HF folder; the timm model as model.safetensors + meta.json.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/common.py

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from shapes import CLASSES, make_images  # noqa: E402

from shardformer.cli import Key, parse_example_args  # noqa: E402

EXTRA_KEYS = {
    "backbone": Key(
        str, "hf", "hf: transformers ViTForImageClassification, timm: timm VisionTransformer", ("hf", "timm")
    ),
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 64,
    "depth": 2,
    "num_heads": 4,
    "num_test_images": 9,
    "compare_untrained": True,
}
TEST_SEED = 1_000_003  # test images come from a seed no training step uses


def build_model(cfg):
    """An untrained model of the config's sizes, and what rebuilds it (for the timm meta.json)."""
    if cfg.backbone == "hf":
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.depth,
            num_attention_heads=cfg.num_heads,
            intermediate_size=4 * cfg.hidden_size,
            num_labels=len(CLASSES),
            id2label=dict(enumerate(CLASSES)),
            label2id={name: i for i, name in enumerate(CLASSES)},
        )
        return ViTForImageClassification(config), None
    from timm.models.vision_transformer import VisionTransformer

    kwargs = dict(
        img_size=cfg.image_size,
        patch_size=cfg.patch_size,
        embed_dim=cfg.hidden_size,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        num_classes=len(CLASSES),
    )
    return VisionTransformer(**kwargs), kwargs


def make_initial_model(cfg, env, folder: str) -> None:
    def build() -> None:
        common.seed_everything(cfg.seed)
        model, kwargs = build_model(cfg)
        if kwargs is None:
            model.save_pretrained(folder)
        else:
            common.write_state_dict(model.state_dict(), {"timm_kwargs": kwargs}, folder)

    common.on_rank_zero(env, build)


def load_engine(folder: str, cfg, env, train: bool = False):
    if cfg.backbone == "hf":
        from transformers import ViTForImageClassification

        model = ViTForImageClassification.from_pretrained(folder, local_files_only=True)
    else:
        from timm.models.vision_transformer import VisionTransformer

        state, meta = common.load_state_dict(folder)
        model = VisionTransformer(**meta["timm_kwargs"])
        model.load_state_dict(state)
    return common.build_engine(model, cfg, env, train=train, loss_fn=None if cfg.backbone == "hf" else timm_loss)


def timm_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """timm models return logits: the engine gets the loss from here."""
    return F.cross_entropy(logits.float(), batch["labels"])


def images_batch(cfg, images: torch.Tensor, dtype: torch.dtype) -> dict:
    """The model's input: ``pixel_values`` for transformers, ``x`` for timm."""
    return {"pixel_values" if cfg.backbone == "hf" else "x": images.to(dtype)}


def train(cfg, env) -> None:
    paths = common.output_paths(cfg)
    make_initial_model(cfg, env, paths["initial"])
    engine = load_engine(paths["initial"], cfg, env, train=True)
    here = sum(p.numel() for p in engine.model.parameters())
    common.log(env, f"{env.mesh}, backbone={cfg.backbone}, {here:,} parameters here")

    def batch_of(step: int):
        # Every rank generates the same global batch; the engine gives each dp replica its slice.
        images, labels = make_images(cfg.batch_size, cfg.seed * 100_003 + step, cfg.image_size)
        return {**images_batch(cfg, images, env.dtype), "labels": labels}, len(labels)

    losses = common.train(env, cfg, engine, batch_of, unit="img")
    if cfg.backbone == "hf":
        common.save_model(engine.model, paths["checkpoint"])
    else:
        _, kwargs = build_model(cfg)
        common.save_state_dict(engine.model, paths["checkpoint"], {"timm_kwargs": kwargs})
    common.log(env, f"saved {paths['checkpoint']}")
    layout = f"tp={env.mesh.tp_size}, pp={env.mesh.pp_size}"
    common.report_training(env, cfg, losses, f"ViT ({cfg.backbone}) on generated shapes, {layout}")


@torch.no_grad()
def predict(folder: str, cfg, env) -> dict:
    engine = load_engine(folder, cfg, env)
    images, labels = make_images(cfg.num_test_images, TEST_SEED, cfg.image_size, balanced=True)
    probs = engine.forward(images_batch(cfg, images, env.dtype)).float().softmax(-1).cpu()
    rows = [
        {"true": CLASSES[t], "predicted": CLASSES[int(p.argmax())], "p": round(float(p.max()), 4)}
        for t, p in zip(labels.tolist(), probs)
    ]
    accuracy = sum(r["true"] == r["predicted"] for r in rows) / len(rows)
    return {"accuracy": accuracy, "images": rows}


def show(env, title: str, result: dict) -> None:
    common.log(env, f"{title} accuracy {result['accuracy']:.0%} on {len(result['images'])} new images")
    for i, r in enumerate(result["images"]):
        common.log(env, f"  image {i}: {r['true']:>10} -> predicted {r['predicted']:>10} (p={r['p']:.2f})")


def inference(cfg, env) -> None:
    common.run_inference(
        cfg,
        env,
        make_initial_model,
        run=lambda folder: predict(folder, cfg, env),
        show=lambda which, result: show(env, f"{which} model:", result),
    )


def main() -> None:
    cfg, mode = parse_example_args(extra_keys=EXTRA_KEYS, description=__doc__.splitlines()[0])
    # Each backbone gets its own folder under output_dir, so both can be trained side by side.
    cfg = cfg.replace(output_dir=os.path.join(cfg.output_dir, cfg.backbone))
    env = common.setup(cfg)
    train(cfg, env) if mode == "train" else inference(cfg, env)
    common.finish()


if __name__ == "__main__":
    main()
