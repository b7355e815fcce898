"""A Policy derived from a transformers model's own tensor-parallel plan.

The plan (``config.base_model_tp_plan`` with its ``*`` layer wildcard, plus the head class's
``_tp_plan``; transformers merges both into ``model.tp_plan``) says which module is cut how. On
top of it: the input embedding and the LM head become vocab-parallel (with the vocab-parallel
cross-entropy in the model's own loss path), ties found in the model stay one Parameter, a fused
projection that transformers gathers (Phi-3's ``qkv_proj``, ``gate_up_proj``) is split block by
block instead, and the head counts a forward reads become per-rank values.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from shardformer.core.refusal import POLICY
from shardformer.policies.derived.blocks import is_projection, repeated_blocks
from shardformer.policies.tp_plan import experts, heads, styles
from shardformer.policies.tp_plan.lm import embedding_layer
from shardformer.policies.tp_plan.ties import cut_ties_alike
from shardformer.tensor_parallel.detect import call_optional
from shardformer.tensor_parallel.layers import VocabParallelLMHead1D
from shardformer.tensor_parallel.lm_head import routes_loss
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Layer, Policy, Row_Layer
from shardformer.tensor_parallel.slicer import make_spec


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's full plan, keys relative to the model (transformers' merge, or ours of the same parts)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    merged = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(model, "base_model", model)
    prefix = getattr(model, "base_model_prefix", "") if base is not model else ""
    for key, style in (getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}).items():
        merged[f"{prefix}.{key}" if prefix else key] = style
    return merged


def has_tp_plan(model: nn.Module) -> bool:
    """A plan that cuts the layers (entries with the ``*`` layer wildcard), not only the LM head:
    a head-only plan (GPT-OSS's, DiffLlama's in transformers 5.23) would leave every layer whole."""
    return any("*" in key for key in model_tp_plan(model))


def plan_leaves_whole(model: nn.Module) -> list[str]:
    """Projections at least half the hidden width on both sides, inside blocks the plan cuts, that no
    plan entry names (a plan for the attention only leaves the MLP whole on every rank). A router or a
    latent projection is narrower and is not listed. Empty for a plan that cuts stacked experts: the
    derived route would leave those whole, so such a plan stays first."""

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(hidden, int):
        return []
    resolved, params = resolve(model, model_tp_plan(model))
    if params or "moe_tp_experts" in resolved.values():
        return []  # stacked experts, which only the plan cuts (the derived route sees projections only)
    named = [p for p, style in resolved.items() if style != "replicate"]
    whole = []
    for block in repeated_blocks(model):
        if not any(p.startswith(block + ".") for p in named):
            continue  # a stack the plan leaves whole entirely: a tower (derived) or refused
        for rel, module in model.get_submodule(block).named_modules():
            path = f"{block}.{rel}"
            if not rel or not is_projection(module) or any(path == p or path.startswith(p + ".") for p in resolved):
                continue
            if min(module.weight.shape) * 2 >= hidden:
                whole.append(path)
    return whole


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def resolve(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``{module path: style}`` for every module a plan entry names (entries naming nothing are
    skipped, as transformers does: optional layers), and ``{module path: {parameter: style}}`` for
    entries naming parameters (stacked experts, attention sinks)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    resolved: dict[str, str] = {}
    param_styles: dict[str, dict[str, str]] = {}
    for key, style in plan.items():
        pattern = _pattern(key)
        for name in params:
            if pattern.match(name) and style != "replicate":
                owner, _, leaf = name.rpartition(".")
                param_styles.setdefault(owner, {})[leaf] = style
        resolved.update({name: style for name in modules if name and pattern.match(name)})
    return resolved, param_styles


def _path_of(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)


def _inner_head(model: nn.Module) -> nn.Module | None:
    """The LM head of the one model a wrapper holds, where the wrapper's own ``get_output_embeddings``
    finds none (ShieldGemma 2 asks its inner model's text decoder, which holds no head): cut by
    vocabulary, padded, like any LM head, not as a plain projection whose width must divide."""
    heads = [head for child in model.children() if (head := call_optional(child, "get_output_embeddings")) is not None]
    return heads[0] if len(heads) == 1 else None


class TpPlanPolicy(Policy):
    """Shards any transformers model that ships a tensor-parallel plan, exactly. ``tower_policy``:
    the policy class (``cut_tower``) that cuts stacks the plan leaves whole, such as a VLM's vision
    tower (``get_autopolicy`` gives ``DerivedPolicy``); None refuses such stacks."""

    def __init__(self, tower_policy=None) -> None:
        super().__init__()
        self.tower_policy = tower_policy
        self.towers: list[str] = []  # sub-models the plan leaves whole, cut by tower_policy

    def set_model(self, model: nn.Module) -> None:
        super().set_model(model)
        self.embedding_path = _path_of(model, call_optional(model, "get_input_embeddings"))
        self.head_path = _path_of(model, call_optional(model, "get_output_embeddings") or _inner_head(model))

    def argument_policy(self, config, shard_config):
        model, tp = self.model, shard_config.tensor_parallel_size
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        plan = model_tp_plan(model)
        resolved, param_styles = resolve(model, plan)
        _check_layers_matched(model, plan, resolved, param_styles)
        modules = dict(model.named_modules())
        ours = (self.embedding_path, self.head_path)  # cut our way below, whatever the plan says
        layers = {}
        for path, style in resolved.items():
            if path in ours:
                continue
            if style == "moe_tp_experts":
                experts.check_experts(path, modules[path], param_styles.get(path, {}), tp)
                layers[path] = Layer(path, replace_layer=experts.experts_layer(param_styles[path]))
            elif style == "mla_kv_a_proj":
                rope = styles.mla_layer(getattr(text_config, "qk_rope_head_dim", 0))
                layers[path] = Layer(path, replace_layer=rope)
            else:
                layers[path] = styles.descriptor(style, path, modules[path])
        for owner, named in param_styles.items():
            if resolved.get(owner) == "all_reduce" and experts.stacked(modules[owner], named):
                # shared experts as stacked weights whose partial sums the plan all-reduces (Inkling's): cut as experts
                experts.check_experts(owner, modules[owner], named, tp)
                layers[owner] = Layer(owner, replace_layer=experts.experts_layer(named))
            elif resolved.get(owner) != "moe_tp_experts":  # e.g. attention sinks, one per head
                layers[owner] = Layer(owner, replace_layer=styles.params_layer(owner, modules[owner], named))
        self.cut_params = {f"{owner}.{name}" for owner, named in param_styles.items() for name in named}
        self._fuse(layers, modules, text_config)
        if any(isinstance(layer, Col_Layer) and not layer.gather_output for layer in layers.values()):
            heads.check_heads(text_config, tp)
        _check_sizes(layers, modules, tp)
        self._vocab(layers, modules)
        attrs = self._per_rank(layers, modules, tp, text_config)
        if tp > 1:  # stacks the plan leaves whole (a VLM's vision tower): derived, or refused
            from shardformer.policies.derived.towers import towers

            self.towers = towers(model, layers)
            if self.towers and self.tower_policy is None:
                raise styles.UnsupportedStyleError(
                    f"the tp plan of {type(model).__name__} leaves {', '.join(self.towers)} whole, and a "
                    f"TpPlanPolicy() made by hand has no policy for them",
                    "pass no policy (shard_model derives and proves a cut of the towers)",
                    POLICY,
                )
            for tower in self.towers:
                more, more_attrs = self.tower_policy.cut_tower(model, tower, shard_config)
                layers.update({layer.suffix: layer for layer in more})
                attrs.update(more_attrs)
        cut_ties_alike(model, layers)
        found = list(layers.values())
        return {type(model): Argument(attrs, [lambda: found])}

    def proven_parts(self) -> list[str]:
        """Paths of the sub-models whose cut was derived and must be proven before use."""
        return list(self.towers)

    def _fuse(self, layers: dict[str, Layer], modules, config) -> None:
        """Cut fused projections block by block: a plain ``colwise`` one, and the gathered pair
        (``colwise_gather_output`` + ``rowwise_split_input`` in one module) transformers uses for
        them, which then runs on this rank's blocks with no gather and no split."""
        for path, layer in list(layers.items()):
            if not isinstance(layer, Col_Layer) or layer.n_cast != 1 or not isinstance(modules[path], nn.Linear):
                continue
            blocks = heads.fused_blocks(path.rpartition(".")[2], modules[path], config)
            if blocks is None:
                continue
            if not layer.gather_output:
                layer.n_cast = blocks
                continue
            parent = path.rpartition(".")[0]
            siblings = {p: s for p, s in layers.items() if p.rpartition(".")[0] == parent and p != path}
            rows = [p for p, s in siblings.items() if s.replace_layer is styles.SplitInputRow]
            if len(siblings) == 1 and len(rows) == 1:
                layers[path] = Col_Layer(path, n_cast=blocks)
                layers[rows[0]] = Row_Layer(rows[0])

    def _vocab(self, layers: dict[str, Layer], modules) -> None:
        """Vocab-parallel input embedding and LM head (tied ones only together). The head's
        logits stay vocab-parallel where the model's loss can take them (``routes_loss``), else it gathers."""
        embed_cls = embedding_layer(modules[self.embedding_path]) if self.embedding_path else None
        head = modules.get(self.head_path) if self.head_path else None
        weight = getattr(head, "weight", None)  # MusicGen's head and embedding: a list of them, one per codebook
        tied = weight is not None and self.embedding_path is not None
        tied = tied and weight is getattr(modules[self.embedding_path], "weight", None)
        if embed_cls is not None and (tied or head is None or isinstance(head, nn.Linear)):
            layers[self.embedding_path] = Col_Layer(self.embedding_path, bias=None, replace_layer=embed_cls)
        elif self.embedding_path in layers and tied:
            del layers[self.embedding_path]  # a tied pair is cut together or not at all
        if not isinstance(head, nn.Linear) or (tied and self.embedding_path not in layers):
            if self.head_path in layers:
                del layers[self.head_path]
            return
        layers[self.head_path] = Col_Layer(
            self.head_path, replace_layer=VocabParallelLMHead1D, gather_output=not routes_loss(self.model)
        )

    def _per_rank(self, layers: dict[str, Layer], modules, tp: int, config) -> dict[str, object]:
        """Head counts read by the modules whose outputs are now split by head, as per-rank values;
        per-head norms next to them (replicated weights on this rank's heads) get their gradients
        summed, and parameters with a row per head are cut with the heads; any other unplanned
        parameters beside split heads are refused."""
        attrs: dict[str, object] = {}
        split_parents = {
            path.rpartition(".")[0]
            for path, layer in layers.items()
            if isinstance(layer, Col_Layer)
            and not layer.gather_output
            and path not in (self.head_path, self.embedding_path)
        }
        sizes = heads.head_sizes(config) or (0, 0, None)
        config_head_dim = sizes[2]
        groups = sizes[0] // tp if heads.replicated_kv(config, tp) else None
        if groups is not None and sizes[2]:  # fewer key/value heads than ranks: replicated, whole heads
            kv_width = sizes[1] * sizes[2]
            for path, layer in layers.items():
                if path.rpartition(".")[0] not in split_parents or not isinstance(layer, Col_Layer):
                    continue
                fused_qkv = isinstance(layer.n_cast, tuple) and len(layer.n_cast) == 3  # [Q | K | V]
                if fused_qkv or getattr(modules[path], "out_features", None) == kv_width:  # k_proj, v_proj
                    layer.head_width = sizes[2]
        split_widths = {sizes[0], sizes[1]} | ({sizes[0] * sizes[2], sizes[1] * sizes[2]} if sizes[2] else set())
        for parent in sorted(split_parents):
            module = modules[parent]
            head_dim = getattr(module, "head_dim", config_head_dim)  # the module's own, where layers differ
            # [heads, head_dim] of the query or key/value heads: contiguous per rank, as the columns cut them
            # (none where neither the module nor the config gives one: an MLP beside per-layer head widths)
            per_head = {torch.Size((n, head_dim)) for n in sizes[:2] if n and head_dim and n % tp == 0}
            attrs.update(heads.per_rank_attributes(parent, module, tp, groups))
            if isinstance(getattr(module, "attention_dropout", None), float) and parent not in layers:
                layers[parent] = Layer(parent, replace_layer=styles.AttentionDropoutRng)
            uncut = [n for n, _ in module.named_parameters(recurse=False) if f"{parent}.{n}" not in self.cut_params]
            if uncut:
                raise styles.UnsupportedStyleError(
                    f"{parent} ({type(module).__name__}) holds parameters of its own beside heads split over tp "
                    f"({uncut}); the tp plan does not say how to cut them"
                )
            for name, child in module.named_children():
                path = f"{parent}.{name}" if parent else name
                own = list(child.parameters(recurse=False))
                if path in layers or not own or list(child.children()):
                    continue
                if all(p.numel() == 1 or p.dim() == 1 and p.shape[0] == head_dim for p in own):
                    # shared by every head or feature (a per-head norm, a learned activation's scalars):
                    # each rank's gradient covers its own part only
                    layers[path] = Layer(path, replace_layer=styles.GradAllReduce)
                elif all(p.shape in per_head for p in own):  # a row per head (Cohere's q/k norm): cut with them
                    names = {n: 0 for n, _ in child.named_parameters(recurse=False)}
                    layers[path] = Layer(path, replace_layer=styles.head_params_layer(names))
                elif not any(size in split_widths for p in own for size in p.shape):
                    continue  # sized like no split activation: on replicated features (MLA's latent norms)
                else:
                    raise styles.UnsupportedStyleError(
                        f"{path} ({type(child).__name__}) has parameters, sits beside heads split over tp and is "
                        f"not in the tp plan; shardformer cannot tell how to cut it"
                    )
        return attrs


def _check_layers_matched(model: nn.Module, plan: dict[str, str], resolved, param_styles) -> None:
    """A plan whose per-layer entries name no module at all does not describe this model (a wrapped
    one, e.g. by PEFT): refuse, instead of leaving every layer whole without a word."""
    layer_keys = [k for k, style in plan.items() if "*" in k and style != "replicate"]
    if not layer_keys:
        return
    patterns = [_pattern(k) for k in layer_keys]
    hit = [*resolved, *(f"{owner}.{n}" for owner, named in param_styles.items() for n in named)]
    if not any(p.match(name) for p in patterns for name in hit):
        raise styles.UnsupportedStyleError(
            f"none of the tp plan's per-layer entries ({', '.join(layer_keys[:3])}, ...) names a module of "
            f"{type(model).__name__}: the model is not what its plan describes (is it wrapped, e.g. by PEFT?), "
            f"and sharding it would leave every layer whole",
            "shard the model before wrapping it",
            POLICY,
        )


def _check_sizes(layers: dict[str, Layer], modules, tp: int) -> None:
    """Every linear the plan cuts divides over tp (block by block), checked before any process group."""
    for path, layer in layers.items():
        module = modules[path]
        if not isinstance(module, nn.Linear) or not isinstance(layer, (Col_Layer, Row_Layer)):
            continue
        dim = 0 if isinstance(layer, Col_Layer) else 1
        try:
            make_spec(module.weight.shape, dim, 0, tp, layer.n_cast)
        except ValueError as e:
            raise ValueError(f"{path} ({'output' if dim == 0 else 'input'} features): {e}") from None
