"""timm sweep: one small model of every timm architecture, sharded at tp=2 against the unsharded model.

For each module that defines timm models (``timm.list_modules()``: ``vision_transformer``, ``eva``,
``beit``, ``swin_transformer``, ``convnext``, ``resnet``, ...) the sweep takes its smallest model
(parameters counted on the meta device), plus a few named variants of the families the docs name
(:data:`EXTRA`: EVA-02, DeiT-III, ViT with registers, SigLIP's attention pooling, ...), built with
random weights (``pretrained=False``; parameters timm starts at zero drawn at random, so that a wrong
cut of them shows). On 2 gloo ranks it runs what ``shardformer verify timm:<name>`` runs
(``shardformer.tools.verify.verify_on_this_rank``): the model sharded by whatever route ``shard_model``
takes against its unsharded copy on outputs, loss (a fixed projection of the logits), every gathered
gradient, the weights and outputs after one SGD step. A model that passes is then planned as
``shardformer plan timm:<name> --tp 2`` plans it (the full-size model, on the meta device): the
fraction of its parameters each rank holds.

Images are made small where the model takes ``img_size`` (the first of :data:`IMAGE_SIZES` that
builds and runs unsharded; the cut does not depend on the image size, only the run time does); a
model still over ``--max-params`` parameters is shrunk by :data:`SHRINK`, else not tested. One row
per model: passed (max errors, fraction per rank), refused (the library's reason), failed (which
check, by how much, the first diverging module), not tested (why) or error (a crash: a defect, the
library should have refused).

    .venv/bin/python sweeps/timm_sweep.py [--only eva,beit] [--names eva02_tiny_patch14_224]
        [--row-timeout 300] [--save sweeps]     # sweeps/timm-<date>.md and .json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from sweeps.rows import NOT_TESTED, PASSED, RESULTS, add_budget_flags, run_rows, set_reason  # noqa: E402
from sweeps.saved import default_jsonl, recorder, resumed, save_sweep, versions  # noqa: E402
from sweeps.tp import verify  # noqa: E402

# named variants beside each module's smallest model: the families issue 38 names and what sets them apart
EXTRA = {
    "vision_transformer": [
        "vit_wee_patch16_reg1_gap_256",  # registers, global average pooling
        "vit_base_patch16_siglip_224",  # SigLIP: attention pooling (global_pool='map')
    ],
    "eva": ["eva02_tiny_patch14_224", "eva02_base_patch14_224"],  # EVA-02; base: LayerNorm in the SwiGLU MLP
    "deit": ["deit3_small_patch16_224", "deit_tiny_distilled_patch16_224"],  # DeiT-III (layer scale); distilled
    "swin_transformer_v2": ["swinv2_tiny_window8_256"],
}
IMAGE_SIZES = (64, 96, 128)  # tried in turn where the model takes img_size; else the model's own
# models over --max-params as built: the options that make them small (same code, fewer or narrower blocks)
SHRINK = {
    "deepseek_vit_412m": dict(depth=4),
    "gemma4_vit_167m": dict(depth=4),
    "vit_base_patch16_siglip_224": dict(depth=4),
    "eva02_base_patch14_224": dict(depth=4),
    "beit_base_patch16_224": dict(depth=4),
    "samvit_base_patch16_224": dict(depth=4),
    "naflexvit_base_patch16_parfac_gap": dict(depth=4),
    "qwen3_vit_88m": dict(depth=4),
}
ZERO_STD = 0.2  # parameters timm starts at zero (q/v biases, position tables, some heads): drawn at random


# -- which models ------------------------------------------------------------------------------------


def count_params(name: str) -> int | str:
    """Parameters of timm model ``name`` built on the meta device (nothing allocated), or why it fails."""
    import timm
    import torch

    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return f"{type(e).__name__}: {e}"
    return sum(p.numel() for p in model.parameters())


def sweep_rows(modules=None, names=None) -> list[dict]:
    """``[{module, name, params}]``: each timm module's smallest model and its :data:`EXTRA` names."""
    import timm

    rows = []
    for module in timm.list_modules():
        if modules and module not in modules:
            continue
        if names:  # the named models this module defines, instead of its smallest
            for name in sorted(set(names) & set(timm.list_models(module=module))):
                rows.append({"module": module, "name": name, "params": count_params(name)})
            continue
        counted = {n: count_params(n) for n in timm.list_models(module=module)}
        sizes = {n: c for n, c in counted.items() if isinstance(c, int)}
        picked = [min(sizes, key=lambda n: (sizes[n], n))] if sizes else []
        picked += [n for n in EXTRA.get(module, []) if n in counted and n not in picked]
        for name in picked:
            rows.append({"module": module, "name": name, "params": sizes.get(name)})
        if not sizes:
            first = next(iter(counted), "")
            rows.append({"module": module, "name": first, "skip": f"no model builds: {counted.get(first)}"})
    return rows


# -- on the ranks -------------------------------------------------------------------------------------


def build(name: str, options: dict):
    """The model the row verifies (module-level: ``functools.partial(build, name, options)`` pickles)."""
    import timm
    import torch

    options = dict(options)
    if "img_size" in options:  # the inputs verify makes read the size from the model's pretrained_cfg
        size = options["img_size"]
        options["pretrained_cfg_overlay"] = dict(input_size=(3, size, size))
    model = timm.create_model(name, pretrained=False, **options)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0, ZERO_STD)
    return model


def runs_unsharded(model) -> str | None:
    """What stops ``model`` forward and backward on the inputs verify makes, or None."""
    from shardformer.models import inputs_for

    try:
        model.eval()
        out = model(**inputs_for(model, 1))
        out = out if hasattr(out, "float") else next(iter(out.values() if hasattr(out, "values") else out))
        out.float().sum().backward()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def options_for(name: str, max_params: int) -> tuple[dict | None, str]:
    """The options to build ``name`` with (small images where it takes ``img_size``, :data:`SHRINK`
    where it is big), or None and why no option gives a model that runs unsharded."""
    import torch

    base = SHRINK.get(name, {})
    why = ""
    for options in [{**base, "img_size": s} for s in IMAGE_SIZES] + [base]:
        torch.manual_seed(0)
        try:
            model = build(name, options)
        except Exception as e:  # noqa: BLE001 - the model does not take these options
            why = f"cannot be built with {options}: {type(e).__name__}: {e}"
            continue
        params = sum(p.numel() for p in model.parameters())
        if params > max_params:
            return None, f"{params / 1e6:.0f}M parameters with {options}: over --max-params; add it to SHRINK"
        broken = runs_unsharded(model)
        if broken is None:
            return options, ""
        why = f"does not run unsharded with {options}: {broken}"
    return None, why


def per_rank_fraction(name: str) -> float:
    """The fraction of the full-size model's parameters rank 0 holds, as ``shardformer plan timm:<name>
    --tp 2`` computes it (meta device)."""
    from shardformer.tools.plan import build_meta_model, plan_model

    plan = plan_model(build_meta_model(f"timm:{name}"), tp=2)
    return plan.rank_numel / plan.full_numel


def check_options(row: dict, max_params: float) -> None:
    """The precheck: the options the model is built with, or the row "not tested" (too large, or it does
    not run unsharded)."""
    options, why = options_for(row["name"], max_params)
    if options is None:
        set_reason(row, NOT_TESTED, why)
    else:
        row["options"] = options


def verify_model(row: dict) -> None:
    """The check: what ``shardformer verify timm:<name>`` runs, at tp=2, and rank 0's share of the full-size
    model."""
    verify(row, functools.partial(build, row["name"], row["options"]))
    if row["result"] == PASSED:
        try:
            row["per_rank"] = per_rank_fraction(row["name"])
        except Exception as e:  # noqa: BLE001 - the plan's own failure, beside a passed verify
            row["reason"] = f"`shardformer plan` fails: {type(e).__name__}: {str(e)[:200]}"


# -- in the parent ------------------------------------------------------------------------------------


def show(row: dict) -> None:
    print(
        f"{row['module']} {row['name']} {row.get('route', '')}: {row['result']} ({row.get('seconds', '-')} s) "
        f"{row.get('reason', '')[:160]}",
        file=sys.stderr,
        flush=True,
    )


def table(results: list[dict]) -> str:
    release = versions("timm", "torch")
    lines = [
        f"timm sweep at tp=2 (2 gloo ranks, `shardformer verify timm:<name>`: outputs, loss, every gradient, weights "
        f"and outputs after one SGD step), timm {release['timm']}, torch {release['torch']}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "| module | model | parameters | built with | route | result | max output err | max grad err | per rank "
        "(plan, full size) | reason | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["module"], r["name"])):
        errors = [f"{r[k]:.1e}" if isinstance(r.get(k), float) else "" for k in ("logits", "grad")]
        params = f"{r['params'] / 1e6:.1f}M" if isinstance(r.get("params"), int) else ""
        options = ", ".join(f"{k}={v}" for k, v in (r.get("options") or {}).items())
        share = f"{r['per_rank']:.3f}" if isinstance(r.get("per_rank"), float) else ""
        reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r['module']} | `{r['name']}` | {params} | {options} | {r.get('route', '')} | {r['result']} "
            f"| {errors[0]} | {errors[1]} | {share} | {reason} | {r.get('seconds', '')} |"
        )
    counts = {k: sum(r["result"] == k for r in results) for k in RESULTS}
    lines.append(f"\n{len(results)} models: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated timm modules (default: all)")
    parser.add_argument("--names", default="", help="comma-separated timm model names (instead of the smallest)")
    add_budget_flags(parser)
    parser.add_argument("--max-params", type=float, default=100e6, help="largest model verified (default 100M)")
    parser.add_argument("--save", metavar="DIR", help="write DIR/timm-<date>.md and .json")
    parser.add_argument("--jsonl", help="per-row results, appended as rows finish; rows already in it are not rerun")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    names = list(filter(None, args.names.split(",")))
    rows = sweep_rows(only, names)
    jsonl = args.jsonl or default_jsonl("timm")
    earlier, rows = resumed(jsonl, rows, key=lambda r: r["name"])
    precheck = functools.partial(check_options, max_params=int(args.max_params))
    results = earlier + run_rows(
        rows,
        verify_model,
        precheck,
        budget=args.row_timeout,
        memory_gib=args.row_memory,
        progress=recorder(jsonl, show),
    )
    text = table(results)
    print(text)
    if args.save:
        head = versions("timm", "torch") | {"tp": 2}
        save_sweep(args.save, "timm", "timm", text, head, results)
    print(f"\nper-row results: {jsonl}", file=sys.stderr)


if __name__ == "__main__":
    main()
