"""Pipeline specs derived from transformers' own ``base_model_pp_plan``.

The plan lists the base model's children in order (``embed_tokens``, maybe a dropout, ``layers``,
``norm``) and the head class adds ``lm_head``: what comes before the layer list goes on the first
stage, what comes after on the last, an input embedding tied to the head on both.

A stage runs the model's own forward: the base model with ``inputs_embeds`` after the first stage,
so rotary position embeddings and the causal (or sliding-window) masks are built on every stage as
the model builds them; while it runs, the layers of other stages are pass-throughs (layer indices
stay global, as per-layer attention types need) and the modules dropped from this stage (final
norm before the last stage, embedding dropout after the first) are identities. The last stage runs
the whole model's forward, head and loss included, on ``input_ids`` (its embedding answering with
the received hidden states), so a head that reads the ids (a classifier pooling the last real
token of a padded batch) sees what the unsharded model sees. The head's modules beside the base
model (``lm_head``, ``score``, ``qa_outputs``, ...) are on the last stage.
"""

from __future__ import annotations

import torch.nn as nn

from shardformer.pipeline.spec import HEAD_INPUTS, PipelineSpec, stage_of
from shardformer.pipeline.stage_view import Returns, own_forward, stage_view, stand_in
from shardformer.tensor_parallel.detect import call_optional


def _prefix(model: nn.Module) -> str:
    base = getattr(model, "base_model", model)
    return "" if base is model else getattr(model, "base_model_prefix", "")


def spec_from_pp_plan(model: nn.Module) -> PipelineSpec | None:
    """A PipelineSpec from the model's ``base_model_pp_plan`` and head ``_pp_plan``, or None if it has none."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) if config is not None else None
    if not plan or "layers" not in plan or _prefix(model) is None:
        return None
    prefix = _prefix(model)
    names = list(plan)
    at = names.index("layers")
    path = lambda name: f"{prefix}.{name}" if prefix else name  # noqa: E731
    try:  # a plan may name children the model does not have (HRM's "layers"): then it says nothing
        model.get_submodule(path("layers"))
    except AttributeError:
        return None
    first = [path(n) for n in names[:at]]
    last = [path(n) for n in names[at + 1 :]] + list(getattr(type(model), "_pp_plan", None) or {})
    # the head's own modules beside the base model (a classifier's score, a QA head): on the last stage
    base = getattr(model, "base_model", model)
    last += [name for name, child in model.named_children() if child is not base and name not in last]
    shared = []
    embed, head = call_optional(model, "get_input_embeddings"), call_optional(model, "get_output_embeddings")
    if embed is not None and head is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0):
        tied = [p for p in first if model.get_submodule(p) is embed]
        shared = tied
        first = [p for p in first if p not in tied]
    return PipelineSpec(
        layers=path("layers"),
        stage_forward=plan_stage_forward,
        first=tuple(first),
        last=tuple(last),
        shared=tuple(shared),
    )


def _embedding_path(model: nn.Module) -> str | None:
    """The base model's child that turns ``input_ids`` into embeddings, per its pp plan."""
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    names = [n for n, (inputs, _) in plan.items() if "input_ids" in inputs]
    prefix = _prefix(model)
    return None if len(names) != 1 else (f"{prefix}.{names[0]}" if prefix else names[0])


def final_norm_from_pp_plan(model: nn.Module) -> str | None:
    """The child right after ``layers`` in the model's ``base_model_pp_plan``, if the plan says it reads
    and returns the hidden states (the final norm, which reads the last layer's output as it is)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) if config is not None else None
    if not plan or "layers" not in plan:
        return None
    names = list(plan)
    at = names.index("layers")
    if at + 1 == len(names):
        return None
    name = names[at + 1]
    if tuple(map(tuple, plan[name])) != (("hidden_states",), ("hidden_states",)):
        return None
    prefix = _prefix(model)
    path = lambda child: f"{prefix}.{child}" if prefix else child  # noqa: E731
    try:  # a plan may name children the model does not have (HRM's "layers"): then it says nothing
        model.get_submodule(path("layers")), model.get_submodule(path(name))
    except AttributeError:
        return None
    return path(name)


def plan_stage_forward(model: nn.Module, hidden, inputs: dict):
    """One stage of a plan-derived causal LM on a micro-batch (no KV cache)."""
    stage, num_stages = stage_of(model)
    extra = {k: inputs[k] for k in ("attention_mask", "position_ids") if inputs.get(k) is not None}
    feed = {"input_ids": inputs["input_ids"]} if stage == 0 else {"inputs_embeds": hidden}
    with stage_view(model):
        if stage < num_stages - 1:
            return model.base_model(**feed, **extra, use_cache=False).last_hidden_state
        embedding = _embedding_path(model)
        forward = own_forward(model)
        targets = {k: inputs[k] for k in HEAD_INPUTS if inputs.get(k) is not None}  # a QA head's span too
        if stage == 0 or embedding is None or inputs.get("input_ids") is None:
            return forward(**feed, **extra, **targets, use_cache=False)
        # the last stage runs on input_ids too (a classifier pools the last token that is not padding,
        # found from input_ids), its embedding answering with the received hidden states
        ids = inputs["input_ids"]
        if ids.shape != hidden.shape[:-1]:
            raise ValueError(
                f"input_ids {tuple(ids.shape)} do not match the hidden states received {tuple(hidden.shape)}"
            )
        with stand_in(model, {embedding: Returns(hidden)}):
            return forward(input_ids=ids, **extra, **targets, use_cache=False)
