"""Conformance run: every transformers model class a tiny config can build, sharded at tp=2.

Walks transformers' auto mappings task by task (causal LM, masked LM, seq2seq LM, speech seq2seq, CTC,
sequence / token / audio classification, question answering, image classification, base models of text and
vision encoders, image-text-to-text). For each class it scales the class's default config down
(``shardformer.core.tiny.tiny_copy_config``), and on 2 gloo ranks runs what ``shardformer verify``
runs (``shardformer.tools.verify.verify_on_this_rank``): the model sharded by whatever route
``shard_model`` takes (a family policy, the model's transformers tp plan: ``TpPlanPolicy``, or its
traced structure: ``DerivedPolicy``) against its unsharded copy on outputs, loss, every gathered
gradient, the weights and outputs after one SGD step and greedy ``generate``. One row per class:
passed (max errors), refused (sharding refused: why), failed (which check, and by how much), not
tested (the tiny model cannot be built, does not run unsharded, or its class cannot be imported: why;
no scaling of the recipe gave one that runs, ``shardformer.core.tiny_run``) or error (anything else).

``--plan-sweep`` (implied by ``--sdpa`` / ``--sequence-parallel``) runs the previous sweep instead:
the causal LMs that ship a ``base_model_tp_plan``, saved and reloaded with ``from_pretrained`` and
compared in training mode (``shardformer.tools.pair_check``).

    make conformance          # or: .venv/bin/python sweeps/conformance.py [--task masked-lm,causal-lm]
                              #     [--only llama,bert] [--limit 20] [--json out.json] [--save sweeps]
    .venv/bin/python sweeps/conformance.py --plan-sweep [--dense] [--sdpa] [--sequence-parallel]
    .venv/bin/python sweeps/conformance.py --pp 2 [--task ...] [--only ...]
    .venv/bin/python sweeps/conformance.py --engine all --task causal-lm [--only ...] [--save sweeps]
    .venv/bin/python sweeps/conformance.py --engine all --per-task 5 --sample-also headline --save sweeps
        # a stratified sample: the first 5 classes of each task that passed at tp=2 in the newest verify
        # sweep, and README's headline classes

``--pp 2`` trains each class at pp=2 through ``ParallelEngine`` (2 micro-batches, 2 SGD steps) on 2 ranks
against its unsharded copy (losses, every weight after the steps): passed, refused (the engine's reason:
no split, or one the tiny-copy proof found inexact), failed, not tested or error.

``--engine TECHNIQUES`` (comma-separated, or ``all``) trains each class through ``ParallelEngine`` on 2
ranks once per technique, in that technique's layout (``ENGINE_LAYOUTS``): ``pp`` (pp=2, 2
micro-batches), ``zero1`` / ``zero2`` / ``zero3`` (dp=2 at that ZeRO stage), ``checkpointing`` (dp=2,
ZeRO-1, activation checkpointing), ``cp`` (cp=2, 2 micro-batches), ``ep`` (dp=2 with the experts
split over both ranks; "n/a" for a class without experts), and the fine-tuning tools (``sweeps/finetune.py``):
``trainer`` (``ShardedTrainer`` at tp=2 where the class shards at tp=2, else tp=1 x dp=2) and ``lora``
(PEFT LoRA on PEFT's default targets, else "all-linear", under ``ShardedTrainer``; both "n/a" for a head
whose batch has no labels: no loss to train). Every task's classes, each batch with the labels its head
takes. Each run splits a step's batch into 2 equal
chunks, as its unsharded copy's reference step does; 2 SGD steps, then the losses and every weight
(gathered over ep, ZeRO-3 and the stages). One row per class and technique in the ``--jsonl`` file (one
technique that hangs costs only its own row); ``--save`` writes ``conformance-engine-<date>.md`` (one
column per technique, then the reason of every cell that did not pass) and the ``.json`` whose rows
carry ``techniques: {technique: {result, reason, logits (loss error), grad (weight error), ...}}``, from
which ``sweeps/matrix.py`` fills the matrix's columns.

Every row runs through ``sweeps/rows.py`` (one spawn of ranks for many rows; a row past ``--row-timeout``
has its ranks killed and becomes an error row naming the budget). The rows: ``sweeps/zoo.py``; the tp=2
checks: ``sweeps/tp.py``; the engine checks: ``sweeps/engine.py``; the tables: ``sweeps/tables.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from sweeps.engine import ENGINE_NAMES, by_class, train_with  # noqa: E402
from sweeps.finetune import check_technique  # noqa: E402
from sweeps.matrix import HEADLINE  # noqa: E402
from sweeps.rows import add_budget_flags, run_rows  # noqa: E402
from sweeps.saved import default_jsonl, recorder, resumed  # noqa: E402
from sweeps.tables import engine_table, save, save_engine, show, table  # noqa: E402
from sweeps.tp import plan_row, verify_row  # noqa: E402
from sweeps.zoo import add_filters, architectures, check_unsharded, chosen_rows, newest_verify_sweep, per_task  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_filters(parser)
    add_budget_flags(parser)
    parser.add_argument("--plan-sweep", action="store_true", help="the causal-LM tp-plan sweep (tools.pair_check)")
    parser.add_argument("--sdpa", action="store_true", help="sdpa attention instead of eager (plan sweep)")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="shard with sequence_parallel=True (plan sweep)"
    )
    parser.add_argument(
        "--pp", type=int, default=1, help="train each class at this pipeline size through ParallelEngine (on pp ranks)"
    )
    parser.add_argument(
        "--engine",
        default="",
        metavar="TECHNIQUES",
        help="train each class through ParallelEngine on 2 ranks in each technique's layout, against its "
        f"unsharded copy: comma-separated {','.join(ENGINE_NAMES)} or 'all' (ep: MoE classes only)",
    )
    parser.add_argument(
        "--per-task",
        type=int,
        default=0,
        metavar="N",
        help="a stratified sample: the first N classes of each task that passed at tp=2 in --sample-from",
    )
    parser.add_argument(
        "--sample-from",
        metavar="JSON",
        help="the verify sweep --per-task samples from (default: the newest sweeps/conformance-<date>.json)",
    )
    parser.add_argument(
        "--sample-also",
        default="",
        metavar="CLASSES",
        help="comma-separated classes --per-task adds to its sample ('headline': README's headline classes)",
    )
    parser.add_argument("--json", help="also write the results here (a list of rows)")
    parser.add_argument(
        "--save",
        metavar="DIR",
        help="write the table and the results beside it: DIR/conformance[-plan][-sdpa][-sp][-ppN]-<date>.md and "
        ".json (the .json, with the sweep's date and versions, is what sweeps/matrix.py reads)",
    )
    parser.add_argument(
        "--jsonl",
        help="the per-row JSON lines file, appended as rows finish; rows already in it are not run again "
        "(default: $TMPDIR/sf-conformance-<date>.jsonl)",
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    impl = "sdpa" if args.sdpa else "eager"
    plan_sweep = args.plan_sweep or args.sdpa or args.sequence_parallel
    techniques = list(ENGINE_NAMES.values()) if args.engine == "all" else []
    for name in filter(None, args.engine.split(",")) if args.engine != "all" else ():
        if name not in ENGINE_NAMES:
            parser.error(f"unknown --engine technique {name!r}; known: {', '.join(ENGINE_NAMES)}, all")
        techniques.append(ENGINE_NAMES[name])
    precheck = check_unsharded
    if techniques:
        rows = [dict(r, technique=t) for r in chosen_rows(args, parser) for t in techniques]
        check = check_technique
    elif args.pp > 1:
        rows = chosen_rows(args, parser)
        check = functools.partial(train_with, layout={"pp": args.pp, "num_microbatches": 2})
    elif plan_sweep:
        rows, precheck = chosen_rows(args, parser, rows_of=lambda _, only: architectures(only)), None
        check = functools.partial(plan_row, impl=impl, sequence_parallel=args.sequence_parallel)
    else:
        rows, check = chosen_rows(args, parser), verify_row
    sample = ""
    if args.per_task:
        source = args.sample_from or newest_verify_sweep(os.path.dirname(os.path.abspath(__file__)))
        headline = args.sample_also == "headline"
        also = frozenset(HEADLINE if headline else filter(None, args.sample_also.split(",")))
        rows = per_task(rows, args.per_task, source, also)
        sample = f"the first {args.per_task} classes of each task that passed at tp=2 in {os.path.basename(source)}"
        if also:
            sample += ", and README's headline classes" if headline else f", and {', '.join(sorted(also))}"
    jsonl = args.jsonl or default_jsonl("conformance")
    earlier, rows = resumed(jsonl, rows, key=lambda r: (r["class"], r.get("technique")))
    progress = recorder(jsonl, show)
    world = max(2, args.pp)
    results = earlier + run_rows(
        rows, check, precheck, world=world, budget=args.row_timeout, memory_gib=args.row_memory, progress=progress
    )
    if techniques:
        results = by_class(results, techniques)
        text = engine_table(results, techniques)
    else:
        text = table(results, impl, args.sequence_parallel, plan_sweep, args.pp)
    print(text)
    if args.save and techniques:
        save_engine(args.save, text, results, techniques, sample)
    elif args.save:
        save(args.save, text, results, impl, args.sequence_parallel, plan_sweep, args.pp)
    print(f"\nper-row results: {jsonl}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
