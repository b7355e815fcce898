"""timm VisionTransformer: one fused ``qkv`` Linear ([3*dim, dim]: n_cast=3), proj, and the MLP.

The family record: policy, the layer stack ``blocks``, the pipeline split and stage forward, and
the tiny build. timm itself is imported only when the policy or a build runs (importing it
registers every timm model)."""

from __future__ import annotations

import torch.nn as nn

from shardformer.models import ModelFamily
from shardformer.pipeline.spec import PipelineSpec, local_layers, stage_of
from shardformer.pipeline.stage_view import own_forward, stage_view
from shardformer.tensor_parallel.layers.attention_dropout import attention_dropout_rng
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, divide


class TimmViTPolicy(Policy):
    """``timm.create_model("vit_...")``: blocks of Attention + Mlp. timm models carry no config, so
    head counts are read off the model's first block."""

    def argument_policy(self, model_config, shard_config):
        from timm.models.vision_transformer import Block

        tp = shard_config.tensor_parallel_size
        attn = self.model.blocks[0].attn
        for name in ("norm",):
            if not isinstance(getattr(attn, name, nn.Identity()), nn.Identity):
                raise NotImplementedError(f"timm Attention with scale_norm ({name}) has no built-in policy yet")
        if getattr(attn, "gate", None) is not None:
            raise NotImplementedError("timm Attention with gated=True has no built-in policy yet")
        if not isinstance(getattr(self.model.blocks[0].mlp, "norm", nn.Identity()), nn.Identity):
            raise NotImplementedError("timm Mlp with scale_mlp_norm has no built-in policy yet")
        heads = divide(attn.num_heads, tp, "num_heads")
        divide(self.model.blocks[0].mlp.fc1.out_features, tp, "mlp hidden features")
        return {
            Block: Argument(
                # Attention reshapes qkv with num_heads and its output with attn_dim: both become local.
                {"attn.num_heads": heads, "attn.attn_dim": heads * attn.head_dim},
                [self.attn_in, self.attn_out, self.mlp_in, self.mlp_out],
            ),
            type(self.model): Argument({}, [self.embedding]),
        }

    @staticmethod
    def attn_in():
        return [
            Col_Layer("attn.qkv", n_cast=3),
            Dropout_Layer("attn.attn_drop", parallel_input=True),
            # the fused (sdpa) path reads only attn_drop.p: the per-rank stream around the attention
            Layer("attn", replace_layer=attention_dropout_rng("attn_drop.p")),
        ]

    @staticmethod
    def attn_out():
        return [Row_Layer("attn.proj"), Dropout_Layer("attn.proj_drop")]

    @staticmethod
    def mlp_in():
        return [Col_Layer("mlp.fc1"), Dropout_Layer("mlp.drop1", parallel_input=True)]

    @staticmethod
    def mlp_out():
        return [Row_Layer("mlp.fc2"), Dropout_Layer("mlp.drop2")]

    @staticmethod
    def embedding():
        return [Dropout_Layer("pos_drop")]


def timm_vit_stage_forward(model, hidden, inputs):
    """One pipeline stage of timm's VisionTransformer (input ``x``); returns logits: the engine needs
    a loss_fn. The first stage runs the model's own ``forward_features`` (patch and position
    embeddings, its blocks); later stages their blocks, and the last ``norm`` and ``forward_head``."""
    stage, num_stages = stage_of(model)
    if stage == 0:
        with stage_view(model):
            return own_forward(model)(inputs["x"]) if num_stages == 1 else model.forward_features(inputs["x"])
    for block in local_layers(model, model.blocks):
        hidden = block(hidden)
    if stage < num_stages - 1:
        return hidden
    return model.forward_head(model.norm(hidden))


def _tiny_timm_vit():
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4,
        num_classes=3,
    )  # fmt: skip


FAMILY = ModelFamily(
    name="timm ViT",
    policies={"VisionTransformer": TimmViTPolicy},
    layers="blocks",
    final_norm="norm",
    pipelines={
        "VisionTransformer": PipelineSpec(
            layers="blocks",
            stage_forward=timm_vit_stage_forward,
            first=("patch_embed", "cls_token", "reg_token", "pos_embed", "pos_drop", "patch_drop", "norm_pre"),
            last=("norm", "attn_pool", "fc_norm", "head_drop", "head"),
        ),
    },
    builds={"timm-vit-tiny": _tiny_timm_vit},
)
