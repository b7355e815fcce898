"""Which modules of a model are its stacked experts, and whether expert parallelism can split them.

Read from the model's ``base_model_ep_plan`` (its ``ep_dispatch_experts`` entries) where it has one,
found from the structure otherwise: a module with an integer ``num_experts`` whose own parameters are
all stacked by expert (leading dimension ``num_experts``) and which is called with the routed tokens
(``hidden_states, top_k_index, top_k_weights``). Either way the answer is a hypothesis that the proof
on a tiny copy (`shardformer.expert_parallel.proof`) accepts or refuses.
"""

from __future__ import annotations

import inspect
import re

import torch.nn as nn

from shardformer.expert_parallel.experts import expert_params

# what a model's config may call its count of routed experts
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


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


def _routed_call(module: nn.Module) -> bool:
    """Called with the routed tokens: (hidden_states, indices, weights) and nothing it must have else."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 and all(p.default is not p.empty for p in positional[3:])


def stacked_experts(module: nn.Module) -> bool:
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        return False
    own = dict(module.named_parameters(recurse=False))
    return bool(own) and len(expert_params(module)) == len(own) and _routed_call(module)


def declared_experts(model: nn.Module) -> int | None:
    """The routed-expert count the model's config states (None: not a mixture of experts)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    counts = [getattr(text, name, None) for name in _EXPERT_COUNTS]
    counts = [c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c > 1]
    return counts[0] if counts else None


def find_experts(model: nn.Module, ep: int) -> tuple[list[str], str]:
    """The paths of the stacked-experts modules to split over ``ep`` ranks and where they were read
    from ("ep plan" or "derived"); an ExpertParallelError naming the module and the reason otherwise."""
    modules = dict(model.named_modules())
    found = [name for name, module in modules.items() if stacked_experts(module)]
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
        count = declared_experts(model)
        what = (
            f"its config declares {count} experts but no module holds them stacked ([num_experts, ...] parameters "
            f"called with (hidden_states, top_k_index, top_k_weights)): per-expert modules are called one by one by "
            f"the block's own forward"
            if count
            else "it has no mixture-of-experts layer"
        )
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
