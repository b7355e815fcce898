"""Which modules of a model hold its experts, and whether expert parallelism can split them.

Read from the model's ``base_model_ep_plan`` (its ``ep_dispatch_experts`` entries) where it has one,
found from the structure otherwise: a module with an integer ``num_experts`` whose parameters are all
split by expert and which is called in one of the ways `shardformer.expert_parallel.layout` knows.
Either way the answer is a hypothesis that the proof on a tiny copy
(`shardformer.expert_parallel.proof`) accepts or refuses.

Experts kept as one module each (Switch Transformers', NLLB-MoE's ``ModuleDict``), which the block's
own loop calls by index, are refused by name, with the capacity rule of their router where it has one.
"""

from __future__ import annotations

import re

import torch.nn as nn

from shardformer.expert_parallel.layout import one_module_per_expert, split_by_expert

# what a model's config may call its count of routed experts
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class ExpertParallelError(ValueError):
    """The model's experts cannot be split over the ep ranks exactly (raised before any collective)."""


def _plan_paths(model: nn.Module) -> list[str] | None:
    """The ``ep_dispatch_experts`` paths of the model's ep plan, resolved against its modules (None: no plan)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_ep_plan", None) or getattr(config, "base_model_ep_plan", None)
    if not plan:
        return None
    keys = [key for key, style in plan.items() if style == "ep_dispatch_experts"]
    patterns = [re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + "$") for key in keys]
    return [name for name, _ in model.named_modules() if any(p.search(name) for p in patterns)]


def expert_configs(config) -> list:
    """The configs that may state the routed-expert count: the text config and its sub-configs (DBRX
    keeps ``moe_num_experts`` in ``ffn_config``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    subs = [getattr(text, key, None) for key in getattr(text, "sub_configs", None) or {}]
    return [text, *(sub for sub in subs if hasattr(sub, "to_dict"))]


def declared_count(config) -> int | None:
    """The routed-expert count ``config`` states (None: not a mixture of experts)."""
    counts = [getattr(c, name, None) for c in expert_configs(config) for name in EXPERT_COUNTS]
    counts = [c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c > 1]
    return counts[0] if counts else None


def _unsplit(modules: dict[str, nn.Module], count: int) -> str:
    """Why a model whose config declares ``count`` experts has none to split: the module holding them
    one module per expert, and its router's capacity rule where it drops tokens."""
    holder = next(((name, m) for name, m in modules.items() if one_module_per_expert(m)), None)
    if holder is None:
        return (
            f"its config declares {count} experts but no module holds them split by expert (parameters [num_experts, "
            f"...] called with the routed tokens, or with rows grouped by expert)"
        )
    name, module = holder
    why = (
        f"{name} ({type(module).__name__}) holds its {module.num_experts} experts as one module each, which its "
        f"own forward calls one by one by index; "
        f"expert parallelism splits experts held as parameters split by expert"
    )
    router = next(((n, m) for n, m in modules.items() if hasattr(m, "expert_capacity")), None)
    if router is not None:
        n, m = router
        why += (
            f"; its router {n} ({type(m).__name__}) keeps at most expert_capacity={m.expert_capacity} tokens per "
            f"expert and drops the rest by their position among the tokens it routes together"
        )
    return why


def find_experts(model: nn.Module, ep: int) -> tuple[list[str], str]:
    """The paths of the stacked-experts modules to split over ``ep`` ranks and where they were read
    from ("ep plan" or "derived"); an ExpertParallelError naming the module and the reason otherwise."""
    modules = dict(model.named_modules())
    found = [name for name, module in modules.items() if split_by_expert(module)]
    found = [n for n in found if not any(n.startswith(f"{outer}.") for outer in found)]  # outermost only
    planned = _plan_paths(model)
    source = "derived"
    if planned:
        wrong = [p for p in planned if p not in found]
        if wrong:
            module = modules[wrong[0]]
            raise ExpertParallelError(
                f"the ep plan names {wrong[0]} ({type(module).__name__}), which is not stacked experts called with "
                f"the routed tokens (parameters {[(n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)]}); "
                f"expert parallelism cannot split it: use expert_parallel_size=1 (experts then follow tensor parallelism)"
            )
        found, source = planned, "ep plan"
    if not found:
        count = declared_count(getattr(model, "config", None))
        what = _unsplit(modules, count) if count else "it has no mixture-of-experts layer"
        raise ExpertParallelError(
            f"expert_parallel_size={ep}: {type(model).__name__} cannot be split by experts: {what}; use "
            f"expert_parallel_size=1"
        )
    for path in found:
        count = modules[path].num_experts
        if count % ep:
            raise ExpertParallelError(
                f"{path} holds {count} experts, which do not divide over expert_parallel_size={ep}; pick an ep that "
                f"divides {count}"
            )
    return found, source
