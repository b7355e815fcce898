"""Config flips: the conformance rows again with each config value the class's forward reads changed.

The conformance sweep runs every class on its default config, where a multiplier is 1.0, a softcap
off and a flag at its default: a cut that skips the code those values switch on passes there
(Granite's ``embedding_multiplier`` at pp=2). For each class this pass builds the tiny model once
with an attribute-access recording config (construction and one forward), keeps the values read
that are booleans, multipliers and scales, softcaps, rotary fractions, sliding windows and layer or
position-embedding types (:func:`flips`), and runs the class's row again with each one changed:
bool -> not; a multiplier or scale -> 2.0; a softcap -> a finite one that bites on tiny logits; the
rotary fraction in ``rope_parameters`` -> 0.5; a window -> 4 of the 8 tokens; layer types -> shifted
by one. At tp=2 the row is what ``shardformer verify`` runs (``sweeps.tp.verify_row``); at pp=2,
two SGD steps through ``ParallelEngine`` (``sweeps.engine.train_with``). A flip runs where the class's
default row passed at that technique. A row whose verdict changes is listed: passed -> failed is a
silently wrong result the default config hid; passed -> refused is a refusal the default did not need.

    .venv/bin/python sweeps/config_flips.py [--only granite,llama] [--dense] [--no-pp] [--save sweeps]

Rows: ``sweeps.zoo.task_rows`` (``--task``, default causal-lm) narrowed to classes whose config has a
``base_model_tp_plan`` unless ``--all``; each row runs through the sweeps' row runner (``sweeps/rows.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from sweeps.engine import train_with  # noqa: E402
from sweeps.rows import NOT_TESTED, add_budget_flags, run_rows  # noqa: E402
from sweeps.saved import save_sweep, versions  # noqa: E402
from sweeps.tables import show  # noqa: E402
from sweeps.tp import verify_row  # noqa: E402
from sweeps.zoo import add_filters, check_unsharded, chosen_rows, tiny_config_of  # noqa: E402

PIPELINE = {"pp": 2, "num_microbatches": 2}
# flags that choose what a forward returns or how it is called, not what it computes
CALLING = {
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript", "is_decoder",
    "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder", "use_return_dict", "output_router_logits",
}  # fmt: skip
SCALE = re.compile(r"multiplier|scal(e|ing|ar)|factor|coef")
TYPES = {"full_attention", "sliding_attention"}


def read_keys(class_name: str) -> tuple[dict, set[str]]:
    """The tiny config's values (its text config's ``to_dict``) and the names the class reads from its
    configs while it is built and runs one forward (a subclass of each config class whose
    ``__getattribute__`` records every public name asked for)."""
    import torch
    import transformers as tf

    from shardformer.models import inputs_for

    config = tiny_config_of(class_name)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = text.to_dict()
    seen: set[str] = set()
    kept = {id(c): (c, type(c)) for c in (config, text)}
    for held, cls in kept.values():

        def recorded(self, name, cls=cls):
            if not name.startswith("_"):
                seen.add(name)
            return cls.__getattribute__(self, name)

        held.__class__ = type(cls.__name__, (cls,), {"__getattribute__": recorded})
    try:
        torch.manual_seed(0)
        model = getattr(tf, class_name)(config).eval()
        with torch.no_grad():
            model(**inputs_for(model, 1))
    finally:
        for held, cls in kept.values():
            held.__class__ = cls
    return values, seen


def flips(values: dict, read: set[str]) -> list[dict]:
    """The changes to try, one dict of config values each, for the values read that decide what the
    forward computes."""
    found = []
    for key, value in sorted(values.items()):
        if key not in read or key in CALLING or key.startswith("initializer"):
            continue
        flip = _flipped(key, value, values)
        if flip is not None:
            found.append(flip)
    return found


def _flipped(key: str, value, values: dict) -> dict | None:
    if isinstance(value, bool):
        return {key: not value}
    if "softcap" in key and (value is None or isinstance(value, (int, float))):
        return {key: 1.0 if value is None else value / 10}  # tiny logits: a cap near them bites
    if key == "rope_parameters" and isinstance(value, dict) and "partial_rotary_factor" in value:
        return {key: value | {"partial_rotary_factor": 0.25 if value["partial_rotary_factor"] == 0.5 else 0.5}}
    if value is None and key.startswith("use_"):  # an optional flag left unset
        return {key: True}
    if SCALE.search(key) and isinstance(value, float):
        return {key: 12.0 if value == 2.0 else 2.0}
    if key == "query_pre_attn_scalar" and isinstance(value, int):
        return {key: 2 * value}
    if key == "sliding_window" and isinstance(value, int) and value > 4:
        return {key: 4}  # the tiny inputs' 8 tokens: a window that leaves some out
    if key == "layer_types" and isinstance(value, list) and set(value) <= TYPES and len(value) > 1:
        if len(set(value)) > 1:
            return {key: value[1:] + value[:1]}
        if "sliding_window" in values:  # all one type: every other layer the other, with a window that bites
            other = (TYPES - set(value)).pop()
            return {key: [other if i % 2 == 0 else value[0] for i in range(len(value))], "sliding_window": 4}
    if key == "position_embedding_type" and isinstance(value, str):
        return {key: "relative_key" if value == "absolute" else "absolute"}
    return None


def flip_row(row: dict) -> None:
    """The check of a (class, technique, flip) row: tp -> ``verify_row``, pp -> ``train_with``."""
    if row["technique"] == "pp":
        train_with(row, PIPELINE)
    else:
        verify_row(row)


def _label(flip: dict | None) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in (flip or {}).items()) or "default"


def changes(results: list[dict]) -> list[dict]:
    """Each flipped row whose verdict differs from its class's default row at the same technique."""
    default = {(r["class"], r["technique"]): r["result"] for r in results if not r.get("flip")}
    return [
        dict(r, default=default[(r["class"], r["technique"])])
        for r in results
        if r.get("flip") and r["result"] != default.get((r["class"], r["technique"]), r["result"])
    ]


def table(results: list[dict], stamp: str) -> str:
    import transformers

    changed = changes(results)
    silent = [r for r in changed if r["default"] == "passed" and r["result"] == "failed"]
    flipped = [r for r in results if r.get("flip")]
    classes = sorted({r["class"] for r in results})
    lines = [
        f"config flips at tp=2 (verify) and pp=2 (ParallelEngine, 2 SGD steps), eager attention, transformers "
        f"{transformers.__version__}, {stamp} UTC",
        "",
        f"{len(classes)} classes, {len(flipped)} flipped rows ({sum(r['result'] == 'passed' for r in flipped)} passed); "
        f"verdicts changed: {len(changed)}, of which passed -> failed (silently wrong on the default config's "
        f"sweep): {len(silent)}",
        "",
        "## Passed on the default config, failed with the value flipped",
        "",
        *(
            [f"- **{r['class']} {r['technique']}**: {_label(r['flip'])}: {r.get('reason', '')}" for r in silent]
            or ["- none"]
        ),
        "",
        "## Every verdict that changed",
        "",
        "| class | technique | flip | default | flipped | reason |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['class']} | {r['technique']} | {_label(r['flip'])} | {r['default']} | {r['result']} | "
            f"{r.get('reason', '').replace('|', '/')[:300]} |"
            for r in changed
        ),
        "",
        "## Every row",
        "",
        "| class | technique | flip | result | max logits err | max grad err | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["class"], r["technique"], bool(r.get("flip")), _label(r.get("flip")))):
        errors = [f"{r[k]:.1e}" if isinstance(r.get(k), float) else "" for k in ("logits", "grad")]
        lines.append(
            f"| {r['class']} | {r['technique']} | {_label(r.get('flip'))} | {r['result']} | {errors[0]} | "
            f"{errors[1]} | {r.get('seconds', '')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_filters(parser, task="causal-lm")
    parser.add_argument("--all", action="store_true", help="also classes whose config has no base_model_tp_plan")
    parser.add_argument("--no-pp", action="store_true", help="tp=2 rows only")
    add_budget_flags(parser)
    parser.add_argument("--save", metavar="DIR", help="write DIR/config-flips-<date>.md and .json")
    args = parser.parse_args()
    import transformers as tf

    def keep(row: dict) -> bool:  # importable, and with a tp plan unless --all
        return "skip" not in row and (
            args.all or getattr(getattr(tf, row["class"]).config_class, "base_model_tp_plan", None)
        )

    classes = chosen_rows(args, parser, keep=keep)
    techniques = ["tp"] if args.no_pp else ["tp", "pp"]
    found: dict[str, list[dict]] = {}
    for row in classes:  # in this process: no ranks needed to read what a forward reads
        try:
            found[row["class"]] = flips(*read_keys(row["class"]))
        except Exception as e:  # noqa: BLE001 - the rows say it (not tested)
            found[row["class"]] = []
            print(f"{row['class']}: no flips read ({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        print(f"{row['class']}: {[_label(f) for f in found[row['class']]]}", file=sys.stderr, flush=True)
    defaults = run_rows([dict(r, technique=t) for r in classes for t in techniques], flip_row, check_unsharded,
                        budget=args.row_timeout, memory_gib=args.row_memory, progress=show)  # fmt: skip
    # flips run where the class's default row passed: the changes that matter start from passed
    passed = [{k: r[k] for k in ("task", "model_type", "class", "kind", "technique")} for r in defaults
              if r["result"] == "passed"]  # fmt: skip
    flipped = [dict(row, flip=flip) for row in passed for flip in found[row["class"]]]
    results = defaults + run_rows(
        flipped, flip_row, check_unsharded, budget=args.row_timeout, memory_gib=args.row_memory, progress=show
    )
    stamp = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}"
    text = table(results, stamp)
    print(text)
    if args.save:
        head = versions("transformers", "torch") | {"techniques": techniques}
        save_sweep(args.save, "config-flips", "config flips", text, head, results)
    print(f"not tested (a flipped tiny model that does not run unsharded): "
          f"{sum(r['result'] == NOT_TESTED for r in results if r.get('flip'))}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
