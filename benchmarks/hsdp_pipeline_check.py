"""Hybrid sharding under pipeline stages at a real split: pp=2 x (2 replicas x 2 shards) on 8 gloo ranks,
against the unsharded model. Run once by hand (8 ranks do not fit the test suite's time):

    .venv/bin/python benchmarks/hsdp_pipeline_check.py      # ~2 minutes on 2 cores

Each of ZeRO-1, ZeRO-2 and ZeRO-3 trains a tiny GPT-2 (tied embeddings, so the first and last stage sum
the tied gradient) through the same global batches with AdamW and clipping, 2 micro-batches per dp
rank on 1F1B; every step's loss must equal the unsharded model's, and the HF export after the steps
must hold its weights. The 4-rank test (tests/zero/test_hsdp.py) can only hold pp=2 x (2 x 1), where
the shard groups are single ranks; here every stage's dp ranks really split into shard x replicate.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

STEPS, BATCH, SEQ, CLIP = 3, 16, 16, 0.5


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=96, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def reference_losses(chunks: int) -> tuple[list[float], dict]:
    """The unsharded model: the loss of a step is the mean over the dp x micro-batch chunks."""
    from shardformer.engine import split_batch

    model = build_model().train()
    opt = adamw(model.parameters())
    losses = []
    for batch in batches():
        opt.zero_grad()
        loss = sum(model(**part).loss for part in split_batch(batch, chunks, "chunks")) / chunks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def run(folder: str) -> dict:
    from transformers import GPT2LMHeadModel

    from shardformer import EngineConfig, ParallelEngine
    from shardformer.checkpoint import save_pretrained

    expected, weights = reference_losses(4 * 2)
    worst = {}
    for stage in (1, 2, 3):
        cfg = EngineConfig(
            pp=2, dp=4, dp_replicate=2, zero_stage=stage, num_microbatches=2, max_grad_norm=CLIP,
            backend="torch", schedule="1f1b",
        )  # fmt: skip
        engine = ParallelEngine(build_model(), adamw, cfg)
        mesh = engine.mesh
        assert (mesh.dp_shard_size, mesh.dp_replicate_size) == (2, 2), mesh
        got = [engine.train_step(b) for b in batches()]
        diff = max(abs(a - b) for a, b in zip(got, expected))
        path = os.path.join(folder, f"zero{stage}")
        save_pretrained(engine.model, path)
        if dist.get_rank() == 0:
            exported = GPT2LMHeadModel.from_pretrained(path).state_dict()
            diff = max([diff] + [(exported[k] - v).abs().max().item() for k, v in weights.items()])
        worst[f"ZeRO-{stage}"] = diff
        dist.barrier()
    return worst


def main():
    from shardformer.tools.testing import run_on_ranks

    folder = tempfile.mkdtemp(prefix="sf-hsdp-pp-")
    try:
        worst = run_on_ranks(run, 8, folder, timeout=1200, threads_per_rank=1)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("pp=2 x (2 replicas x 2 shards), 8 gloo ranks: largest |difference| from the unsharded model")
    for name, diff in worst.items():
        print(f"  {name}: {diff:.2e} (losses of {STEPS} steps and the exported weights)")
    assert all(d < 1e-5 for d in worst.values()), worst


if __name__ == "__main__":
    main()
