"""Conformance run: every transformers causal LM that ships a tensor-parallel plan, sharded at tp=2.

Walks the configuration classes of the installed transformers that have a ``base_model_tp_plan``
and a causal-LM class, builds a tiny random model from a scaled-down config
(``shardformer.models.tiny``), shards it with the derived policy on 2 gloo ranks and
compares logits, loss, every gathered gradient and greedy ``generate`` with the unsharded copy
(``shardformer.tools.conformance``). Prints one row per architecture: passed (max errors),
failed (what differs) or refused (why: the style or sizes that stop it, or a config a tiny model
cannot be built from).

    make conformance          # or: .venv/bin/python benchmarks/conformance.py [--only llama,phi3] [--sdpa]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

MOE_STYLES = ("moe_", "grouped_gemm", "ep_")


def architectures(only=None):
    """``[(model_type, config class name, causal LM class name, "dense" | "moe")]`` of the installed transformers."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for model_type, lm_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if only and model_type not in only:
            continue
        try:
            config_class = getattr(tf, lm_name).config_class  # the text config of a multimodal family
        except (AttributeError, ImportError, TypeError):
            continue
        config_name = config_class.__name__
        plan = getattr(config_class, "base_model_tp_plan", None)
        if not plan:
            continue
        kind = "moe" if any(style.startswith(MOE_STYLES) for style in plan.values()) else "dense"
        rows.append((model_type, config_name, lm_name, kind))
    return rows


def _rank_job(rows, impl, out_path, sequence_parallel=False):
    """On every rank: check each architecture in turn; rank 0 appends one JSON line per result."""
    import traceback

    import torch.distributed as dist
    import transformers as tf

    from shardformer.models.tiny import tiny_config
    from shardformer.tools.conformance import RefusedError, compare

    for model_type, _config, lm_name, kind in rows:
        row = {"model_type": model_type, "class": lm_name, "kind": kind}
        start = time.time()
        try:
            config = tiny_config(getattr(tf, lm_name).config_class)
        except Exception as e:  # noqa: BLE001 - a config we cannot scale down is reported, not fatal
            row.update(result="refused", reason=f"no tiny config: {type(e).__name__}: {str(e)[:160]}")
        else:
            try:
                r = compare(getattr(tf, lm_name), config, impl, sequence_parallel=sequence_parallel)
                row.update(
                    result="passed" if not r.failures else "failed",
                    logits=r.logits,
                    loss=r.loss,
                    grad=r.grad,
                    generate_equal=r.generate_equal,
                    vocab_parallel=r.vocab_parallel_logits,
                    reason="; ".join(r.failures[:3]),
                )
            except RefusedError as e:
                row.update(result="refused", reason=str(e)[:300])
            except Exception as e:  # noqa: BLE001
                last = traceback.format_exc().strip().splitlines()[-1]
                row.update(result="error", reason=f"{type(e).__name__}: {last[:300]}")
        row["seconds"] = round(time.time() - start, 1)
        dist.barrier()  # ranks stay in step: a rank that fails alone shows as a timeout here
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def run(rows, impl, sequence_parallel=False):
    """Results for ``rows``; a spawn that dies (a hang past the timeout) is restarted after its row."""
    from shardformer.tools.testing import run_on_ranks

    os.environ.setdefault("SHARDFORMER_TIMEOUT_S", "120")
    out_path = tempfile.mktemp(prefix="sf-conformance-", suffix=".jsonl")
    done: list[dict] = []
    remaining = list(rows)
    while remaining:
        try:
            run_on_ranks(_rank_job, 2, remaining, impl, out_path, sequence_parallel, timeout=60 * len(remaining) + 60)
        except Exception as e:  # noqa: BLE001
            crash = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        else:
            crash = None
        new = []
        if os.path.exists(out_path):
            with open(out_path) as f:
                new = [json.loads(line) for line in f]
            os.remove(out_path)
        done += new
        remaining = remaining[len(new) :]
        if crash and remaining:
            model_type, _, lm_name, kind = remaining.pop(0)
            done.append({"model_type": model_type, "class": lm_name, "kind": kind, "result": "error", "reason": crash})
    return done


def table(results, impl, sequence_parallel=False) -> str:
    lines = [
        f"conformance at tp=2{' with sequence parallelism' if sequence_parallel else ''}, {impl} attention, "
        f"transformers {_tf_version()}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "| architecture | class | kind | result | max logits err | max grad err | generate | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["kind"], r["model_type"])):
        errors = ("", "")
        if "logits" in r:
            errors = (f"{r['logits']:.1e}", f"{r['grad']:.1e}")
        generate = {True: "equal", False: "differs"}.get(r.get("generate_equal"), "")
        reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r['model_type']} | {r['class']} | {r['kind']} | {r['result']} | {errors[0]} | {errors[1]} "
            f"| {generate} | {reason} |"
        )
    for kind in ("dense", "moe"):
        rows = [r for r in results if r["kind"] == kind]
        counts = {k: sum(r["result"] == k for r in rows) for k in ("passed", "failed", "refused", "error")}
        lines.append(f"\n{kind}: {len(rows)} architectures: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return "\n".join(lines)


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--dense", action="store_true", help="dense architectures only")
    parser.add_argument("--sdpa", action="store_true", help="sdpa attention instead of eager")
    parser.add_argument("--sequence-parallel", action="store_true", help="shard with sequence_parallel=True")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    rows = [r for r in architectures(only) if not args.dense or r[3] == "dense"]
    impl = "sdpa" if args.sdpa else "eager"
    results = run(rows, impl, args.sequence_parallel)
    print(table(results, impl, args.sequence_parallel))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
