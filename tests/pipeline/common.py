"""Shared helpers of the pipeline tests: tiny 4-layer models, batches, the single-process reference."""

import torch
import torch.distributed as dist

from shardformer.data_parallel.fsdp import full_of
from shardformer.engine import split_batch
from shardformer.tensor_parallel.slicer import gather_tensor, shard_spec
from tests.policies import zoo

LAYERS = 4  # pp=4 needs one layer per stage
BATCH = 8
LR, MOMENTUM = 0.1, 0.9


def sgd(params):
    # SGD, not Adam: Adam maps rounding noise of gradients that are zero in theory to full steps.
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def config(name):
    cfg = zoo.config_for(name)
    for attr in ("n_layer", "num_hidden_layers"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, LAYERS)
    return cfg


def models(name):
    return zoo.load_twice(name, "eager", config=config(name))


def batches(name, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if name.startswith("ViT"):
            out.append(
                {
                    "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
                    "labels": torch.randint(0, 3, (BATCH,), generator=g),
                }
            )
            continue
        ids = torch.randint(3, zoo.VOCAB, (BATCH, zoo.SEQ), generator=g)
        drop = torch.rand(BATCH, zoo.SEQ, generator=g) < 0.4
        drop[:, 1] = False  # every sample keeps a label (GPT-2 shifts them: position 0 never counts)
        x = {"input_ids": ids, "labels": ids.masked_fill(drop, -100)}
        if name.startswith("Bert"):
            x["attention_mask"] = torch.ones(BATCH, zoo.SEQ, dtype=torch.long)
            x["attention_mask"][1::2, -2:] = 0
        out.append(x)
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def reference_run(model, steps, chunks, max_grad_norm=None, loss_fn=None, optimizer=sgd):
    """One process, the unsharded model: each step's loss is the mean over ``chunks`` equal chunks."""
    opt = optimizer(model.parameters())
    losses = []
    model.train()
    for batch in steps:
        opt.zero_grad()
        parts = split_batch(batch, chunks, "chunks")
        if loss_fn is None:
            loss = sum(model(**p).loss for p in parts) / chunks
        else:
            loss = sum(loss_fn(model(p["x"]), p) for p in parts) / chunks
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses


def names_of(model, param):
    """Every name ``param`` has in ``model`` (a tied weight has several)."""
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is param]


def gathered_weights(model, tp_group):
    """{name: full tensor} of every parameter on every rank (tp-gathered, then merged over ranks)."""
    mine = {}
    for name, p in model.named_parameters():
        p = full_of(p)  # a ZeRO-3 (DTensor) parameter gathered over dp first
        spec = shard_spec(p)
        value = full_of(p)  # a ZeRO-3 (DTensor) parameter gathered over dp first
        mine[name] = (value if spec is None else gather_tensor(value, spec, tp_group)).float().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {}
    for d in everyone:
        merged.update(d)
    return merged, set(mine)
