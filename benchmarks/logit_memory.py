"""Per-rank logit memory in training at tp=2: shardformer's derived Llama vs transformers' own TP.

The same Llama (built from a config with one seed, a 32k vocabulary so the logits dominate) is
loaded twice on 2 gloo ranks: ``from_pretrained(path, tp_plan="auto")`` (transformers' tensor
parallelism, needs ``accelerate``) and ``shard_model(from_pretrained(path))`` (ours). Each runs
one training step (forward with labels, backward) on the same batch. Reported per rank: the bytes
of the logits the forward returns, the peak RSS growth over the step (Linux high-water mark, reset
before it), the loss, and the max difference of the gathered logits from the unsharded model.

    PYTHONPATH=<dir with accelerate> .venv/bin/python benchmarks/logit_memory.py [--batch 4] [--seq 256]
"""

import argparse
import datetime
import platform

VOCAB = 32000


def _status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _job(path, batch, seq):
    import torch
    import torch.distributed as dist
    import transformers as tf

    from shardformer import ShardConfig, shard_model
    from shardformer.tensor_parallel.layers import gather_from_parallel

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    ref = tf.LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    del ref
    rows = {}
    for variant in ("transformers tp_plan=auto", "shardformer"):
        if variant == "shardformer":
            model = shard_model(tf.LlamaForCausalLM.from_pretrained(path), ShardConfig(tensor_parallel_size=2))
        else:
            model = tf.LlamaForCausalLM.from_pretrained(path, tp_plan="auto")
        model.train()
        for _ in range(2):  # the second step is measured (allocator warm)
            model.zero_grad(set_to_none=True)
            before = _reset_peak()
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            peak = _status_mib("VmHWM") - before
        logits = out.logits.detach()
        logits = logits.to_local() if hasattr(logits, "to_local") else logits
        full = logits if logits.shape[-1] == VOCAB else gather_from_parallel(logits, None, VOCAB)
        rows[variant] = {
            "logits_shape": tuple(logits.shape),
            "logits_mib": logits.numel() * logits.element_size() / 2**20,
            "peak_mib": peak,
            "loss": float(loss.full_tensor() if hasattr(loss := out.loss.detach(), "full_tensor") else loss),
            "max_diff": float((full - expected).abs().max()),
        }
        del model, out, logits, full
    dist.barrier()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    import tempfile

    import torch
    import transformers as tf

    from shardformer.tools.testing import run_on_ranks

    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=args.seq,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        tf.LlamaForCausalLM(config).save_pretrained(path)
        results = run_on_ranks(_job, 2, path, args.batch, args.seq, timeout=900)
    theirs, ours = results[0]["transformers tp_plan=auto"], results[0]["shardformer"]
    print(
        f"Llama (hidden 256, 2 layers, vocab {VOCAB}), batch {args.batch} x {args.seq}, tp=2 on 2 gloo ranks, "
        f"{platform.machine()}, torch {torch.__version__}, transformers {tf.__version__}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d} (rank 0 shown)\n"
    )
    print("| variant | logits per rank | logits MiB | peak RSS growth / step (MiB) | loss | max logits diff |")
    print("|---|---|---:|---:|---:|---:|")
    for name, r in results[0].items():
        print(
            f"| {name} | {list(r['logits_shape'])} | {r['logits_mib']:.1f} | {r['peak_mib']:.0f} | {r['loss']:.6f} "
            f"| {r['max_diff']:.1e} |"
        )
    print(
        f"\nratio ours / transformers: logits {ours['logits_mib'] / theirs['logits_mib']:.2f}, "
        f"peak step memory {ours['peak_mib'] / theirs['peak_mib']:.2f}"
    )


if __name__ == "__main__":
    main()
