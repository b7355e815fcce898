"""Models with no transformers config for the derived route, importable by spawned ranks: a
hand-written language model (plain ``nn.Module``s) and small random timm models."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


class PlainAttention(nn.Module):
    def __init__(self, dim: int, heads: int, mix_heads: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.mix_heads = heads, dim // heads, mix_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x)
        if self.mix_heads:  # every query feature depends on all heads': no cut over heads is exact
            q = q - q.mean(dim=-1, keepdim=True)
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, self.k(x), self.v(x)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mix_heads: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = PlainAttention(dim, heads, mix_heads)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainLM(nn.Module):
    """Embedding, a ModuleList of attention + MLP blocks, a final norm and a head: what a researcher writes."""

    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, depth: int = 3, mix_heads: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads, mix_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def plain_lm(mix_heads: bool = False) -> PlainLM:
    torch.manual_seed(0)
    return PlainLM(mix_heads=mix_heads)


class TorchEncoderLM(nn.Module):
    """Token embedding into torch's own nn.TransformerEncoder (MultiheadAttention inside), and a head."""

    def __init__(self, vocab: int = 96, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def torch_encoder_lm() -> TorchEncoderLM:
    torch.manual_seed(0)
    return TorchEncoderLM()


def linear_first() -> nn.Module:
    """Blocks with no token embedding in front, a Linear first: fed float features as wide as its input."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), *(PlainBlockNoEmbed(32) for _ in range(3)))


def bare_encoder() -> nn.TransformerEncoder:
    """torch's nn.TransformerEncoder alone: its first weights are nn.MultiheadAttention's own, so the layout of
    its input is not plain (sequence first unless batch_first): refused without example_inputs."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)  # sequence first, torch's default
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


class InvertedResidual(nn.Module):
    """MobileNet-V2 / EfficientNet's block: a 1x1 expansion, a depthwise 3x3, a per-channel scale, a
    squeeze-excitation gate, a 1x1 projection back onto the residual stream."""

    def __init__(self, dim: int, wide: int) -> None:
        super().__init__()
        self.expand, self.bn = nn.Conv2d(dim, wide, 1), nn.BatchNorm2d(wide)
        self.dw = nn.Conv2d(wide, wide, 3, padding=1, groups=wide)
        self.scale = nn.Parameter(torch.rand(wide, 1, 1) + 0.5)
        self.se_reduce, self.se_expand = nn.Conv2d(wide, 4, 1), nn.Conv2d(4, wide, 1)
        self.project = nn.Conv2d(wide, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.dw(F.silu(self.bn(self.expand(x))))) * self.scale
        gate = torch.sigmoid(self.se_expand(F.relu(self.se_reduce(h.mean((2, 3), keepdim=True)))))
        return x + self.project(h * gate)


def conv_net(cut: bool = True) -> nn.Module:
    """A small convolutional network: a stem, an inverted residual block, a pooled linear head; with
    ``cut=False``, a stem normalised in groups (across channels) and a 1x1 convolution the head reads:
    no channels to cut."""
    torch.manual_seed(0)
    if not cut:
        return nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 10),
        )  # fmt: skip
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), InvertedResidual(8, 16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip


class PlainBlockNoEmbed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


TIMM = {  # small random timm models: widths and depths a tp=2 cut and a quick run allow
    # EVA-02: rotary positions, SwiGLU MLP; q/k/v as separate projections (timm's fused qkv with a q/v
    # bias reads the weight through F.linear: refused, as "eva02_fused")
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=28, depth=3, embed_dim=48, num_heads=4, qkv_fused=False)),
    "eva02_fused": ("eva02_tiny_patch14_224", dict(img_size=28, depth=3, embed_dim=48, num_heads=4)),
    # EVA-02 base/large: a LayerNorm over the SwiGLU MLP's hidden features (scale_mlp), between fc1 and fc2
    "eva02_base": ("eva02_base_patch14_224", dict(img_size=28, depth=3, embed_dim=48, num_heads=4)),
    "beit": ("beit_base_patch16_224", dict(img_size=32, depth=3, embed_dim=32, num_heads=4)),
    "deit": ("deit_tiny_distilled_patch16_224", dict(img_size=32, depth=3, embed_dim=32, num_heads=4)),
    "swin": (
        "swin_tiny_patch4_window7_224",
        dict(img_size=32, depths=(2, 3), embed_dim=16, num_heads=(2, 4), window_size=4),
    ),
    "swinv2": (
        "swinv2_tiny_window8_256",
        dict(img_size=32, depths=(2, 3), embed_dim=16, num_heads=(2, 4), window_size=4),
    ),
    "cait": ("cait_xxs24_224", dict(img_size=32, depth=3, embed_dim=32, num_heads=4)),
    "vit_reg": ("vit_base_patch16_reg4_gap_256", dict(img_size=32, depth=3, embed_dim=32, num_heads=4)),
    # an attention pooling head (AttentionPoolLatent: a latent query, q, kv, proj, norm and an MLP) after the blocks
    "vit_map": (
        "vit_base_patch16_224",
        dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, global_pool="map"),
    ),
    # an MLP of nn.Linear on channels-last features beside depthwise convolutions (conv_mlp=False)
    "convnext": ("convnext_atto", dict(depths=(2, 2, 3, 2), dims=(8, 16, 32, 64), conv_mlp=False)),
}


def timm_model(name: str, **overrides) -> nn.Module:
    """A small random timm model; parameters timm starts at zero (BEiT's q/v biases and relative position
    table) random too, so that a wrong cut of them shows. ``overrides``: more ``timm.create_model`` options."""
    import timm

    arch, options = TIMM[name]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=10, **options, **overrides)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0, 0.2)
    return model


def mvit() -> nn.Module:
    """timm's MViT-v2 (pooled q/k/v attention, stages that change width and resolution), small."""
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    torch.manual_seed(0)
    return MultiScaleVit(MultiScaleVitCfg(depths=(1, 2, 2, 1), embed_dim=16, num_heads=2), img_size=32, num_classes=10)


def factory(name: str, **options):
    """A picklable factory for spawned ranks."""
    if name == "mvit":
        return mvit
    if name == "plain":
        return functools.partial(plain_lm, **options)
    if name == "torch_encoder":
        return torch_encoder_lm
    if name == "linear_first":
        return linear_first
    if name == "conv_net":
        return functools.partial(conv_net, **options)
    return functools.partial(timm_model, name)
