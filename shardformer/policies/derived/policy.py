"""``DerivedPolicy``: the policy of a model with neither a built-in policy nor a transformers plan.

Its cut comes from the model's own structure, read off a tiny copy (`.derive`); every block
of the user's model is cut by its class's rule. The input embedding and the LM head become
vocab-parallel as on the plan route. ``shard_model`` proves the policy on the tiny copy, sharded
against unsharded on the same ranks, before it cuts the user's model (`.proof`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch.nn as nn

from shardformer.core.refusal import DATA_PARALLEL, HEADS, POLICY, fix_of, has_convolutions
from shardformer.policies.derived.attributes import per_rank_attributes, rebuilt_counts
from shardformer.policies.derived.blocks import (
    blocks_to_cut,
    is_projection,
    out_width,
    own_weights,
    pooling_heads,
    repeated_blocks,
    value_at,
)
from shardformer.policies.derived.channels import channel_layers
from shardformer.policies.derived.column_cuts import cut_options, nearest_config
from shardformer.policies.derived.derive import BlockRule, NotDerivableError, TowerNotRun, derive, no_stack
from shardformer.policies.derived.heads import head_counts, head_inputs_layer
from shardformer.policies.derived.mixers import FUSED_PACKAGE, MIXER_COLUMN, fused_kernels, layouts_in, local_counts
from shardformer.policies.derived.numpy_draws import NoTrainingDraws, draws_from_numpy
from shardformer.policies.derived.rewrites import ModuleWidth, reads_width_from_input
from shardformer.policies.derived.tiny_inputs import has_config
from shardformer.policies.derived.towers import uncovered_blocks
from shardformer.policies.derived.widths import local_widths_layer
from shardformer.policies.tp_plan.heads import head_sizes
from shardformer.policies.tp_plan.lm import embedding_layer
from shardformer.policies.tp_plan.policy import TpPlanPolicy
from shardformer.policies.tp_plan.styles import GradAllReduce, PackedRow, grad_all_reduce_of, head_params_layer
from shardformer.policies.tp_plan.ties import cut_ties_alike
from shardformer.tensor_parallel.detect import find_ties, int_attributes
from shardformer.tensor_parallel.layers.linear import Linear1D_RowIntoParallel, is_conv1d
from shardformer.tensor_parallel.layers.multihead import ParallelMultiheadAttention
from shardformer.tensor_parallel.layers.norm import NormOverRanks, SplitLayerNorm, norm_over_ranks_layer
from shardformer.tensor_parallel.layers.per_head import HeadModules
from shardformer.tensor_parallel.layers.read_attention import ReadMultiheadAttention
from shardformer.tensor_parallel.lm_head import seq2seq_routable
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Layer, Policy, Row_Layer

logger = logging.getLogger("shardformer")


class DerivedPolicy(TpPlanPolicy):
    """Cuts any transformers model, timm model or plain module by the roles its projections play in a traced tiny copy."""

    tower_of: tuple[nn.Module, str] | None = None  # (the whole model, the path) when cutting a tower of it

    def argument_policy(self, config, shard_config):
        model, tp = self.model, shard_config.tensor_parallel_size
        if tp == 1:  # nothing to cut (cp-only, dp-only): derive nothing, the model stays as it is
            return {type(model): Argument({}, [list])}
        if not blocks_to_cut(model) and has_convolutions(model):  # a convnet: its convolutions cut over channels
            return self._channel_argument(model, tp)
        if getattr(model, "config", None) is None and not blocks_to_cut(model):
            raise no_stack(model)
        whole, tower = self.tower_of or (model, "")
        derivation = derive(whole, tp, tower)
        config = getattr(model, "config", None)  # None: a timm model or a plain module (counts read off modules)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        sizes = head_sizes(text)  # None for a per-layer config (Dots3 Note's): no global head count
        heads = sizes[0] if sizes else None
        if derivation.heads and isinstance(heads, int) and heads < derivation.heads:
            raise NotDerivableError(
                f"{type(model).__name__}'s cut at tensor_parallel_size={tp} was derived and proven on a copy with "
                f"{derivation.heads} heads (its layout groups heads in fixed blocks); this model has {heads}, too "
                f"few to cut that way",
                HEADS,
                POLICY,
            )
        if derivation.refused:
            raise NotDerivableError(
                f"no exact cut of {type(model).__name__} at tensor_parallel_size={tp} was found for:\n  "
                + "\n  ".join(dict.fromkeys(derivation.refused))
                + "\n(the rest of the model would shard, but shardformer does not leave projections whole "
                "without a word)",
                *(fix_of(r) for r in derivation.refused),
            )
        fused = fused_kernels(model) if any(rule.mixers for rule in derivation.rules.values()) else None
        if fused:
            raise NotDerivableError(
                f"{type(model).__name__}'s state-space mixers would not run as cut: {fused}, and those kernels read "
                f"out_proj's and x_proj's whole weights themselves, which no cut layer stands in for (the sharded "
                f"model would be silently wrong)",
                f"shard it where the {FUSED_PACKAGE} package is not installed and without use_kernels=True "
                f"(transformers then runs its PyTorch path, which the cut follows)",
                DATA_PARALLEL,
            )
        modules = dict(model.named_modules())
        layers: dict[str, Layer] = {}
        attrs: dict[str, object] = {}
        for block in blocks_to_cut(model):
            rule = derivation.rules.get(type(modules[block]))
            if rule is None:
                raise NotDerivableError(
                    f"{block} ({type(modules[block]).__name__}) did not appear in the tiny copy of "
                    f"{type(model).__name__}, so no cut of it was proven"
                )
            self._cut_block(block, modules, rule, tp, config, layers, attrs)
        self._cut_heads(pooling_heads(model), derivation, modules, tp, config, layers, attrs)
        for path in derivation.grad_sum:  # computed once, read by each rank's heads in every block
            _sum_grad(layers, modules, path)
        if not layers:
            if config is None:  # a timm model or a plain module: convolutions, or projections a Policy may name
                raise no_stack(model)
            blocks = blocks_to_cut(model)
            held = own_weights(modules[blocks[0]]) if blocks else {}
            named = "; ".join(f"{cls} ({', '.join(rels)})" for cls, rels in held.items())
            raise NotDerivableError(
                f"no projection of {type(model).__name__} reads and writes a block's stream"
                + (f": its blocks compute with {named}, modules multiplying by weights of their own, not "
                   f"nn.Linear projections, which the derived route does not cut" if named else ""),
                DATA_PARALLEL,
                POLICY,
            )  # fmt: skip
        idle = [b for b in repeated_blocks(model) if _all_idle(modules[b], derivation.rules.get(type(modules[b])))]
        whole = uncovered_blocks(model, layers, idle)
        if whole:
            raise NotDerivableError(
                f"no projection of {', '.join(whole[:4])}{' ...' if len(whole) > 4 else ''} reads and writes its "
                f"block's stream: the blocks would stay whole"
            )
        read = set(derivation.read_by_weight)  # the model's code reads these weights itself: they stay whole
        if not {self.head_path, self.embedding_path} & read:
            self._vocab(layers, modules)
        if self.head_path in layers and seq2seq_routable(model):
            layers[self.head_path].gather_output = False  # the loss is taken over, on the vocab slices
        cut_ties_alike(self.model, layers)
        self._token_embeddings(layers, modules, [p for p in derivation.embeddings if p not in read])
        found = list(layers.values())
        return {type(model): Argument(attrs, [lambda: found])}

    def _channel_argument(self, model: nn.Module, tp: int) -> dict:
        layers, whole = channel_layers(model, tp)
        if not layers:
            whys = "; ".join(f"{conv}: {why}" for conv, why in list(whole.items())[:3])
            raise NotDerivableError(
                f"{type(model).__name__} has no stack of blocks with projections, and the output channels of none "
                f"of its convolutions can be cut (a convolution's channels are cut where only per-channel work "
                f"and convolutions read them): {whys or 'it runs no convolution'}",
                DATA_PARALLEL,
            )
        return {type(model): Argument({}, [lambda: layers])}

    def proven_parts(self) -> list[str]:
        return [""]  # the whole model

    @classmethod
    def cut_tower(cls, model: nn.Module, tower: str, shard_config) -> tuple[list[Layer], dict[str, object]]:
        """The layers and per-rank attributes of the sub-model at ``tower`` (a stack another route
        leaves whole), as paths relative to ``model``."""
        sub = model.get_submodule(tower)
        policy = cls()
        policy.tower_of = (model, tower)
        policy.set_model(sub)
        try:
            argument = policy.argument_policy(sub.config, shard_config)[type(sub)]
        except TowerNotRun as e:  # whole on every rank computes what it computes unsharded: exact, not split
            logger.warning("%s: it stays whole on every rank (exact; its weights are not split)", e.reason)
            return [], {}
        layers = [
            dataclasses.replace(layer, suffix=f"{tower}.{layer.suffix}")
            for func in argument.param_funcs
            for layer in func()
        ]
        return layers, {f"{tower}.{k}": v for k, v in argument.attr_dict.items()}

    @classmethod
    def cut_heads(cls, model: nn.Module, shard_config, cut_paths=()) -> tuple[list[Layer], dict[str, object]]:
        """The layers and per-rank attributes cutting ``model``'s attention pooling heads (timm's
        ``AttentionPoolLatent``) with no path of ``cut_paths`` inside, for a policy of another route that
        cuts the blocks and leaves the heads whole; none where the model has none, or where no exact cut
        of one was derived (it stays whole)."""
        tp = shard_config.tensor_parallel_size
        heads = [h for h in pooling_heads(model) if not any(p.startswith(f"{h}.") for p in cut_paths)]
        if tp == 1 or not heads:
            return [], {}
        try:
            derivation = derive(model, tp)
        except NotDerivableError as e:
            logger.info("%s: its pooling heads stay whole on every rank: %s", type(model).__name__, e)
            return [], {}
        layers: dict[str, Layer] = {}
        attrs: dict[str, object] = {}
        cls._cut_heads(heads, derivation, dict(model.named_modules()), tp, None, layers, attrs)
        return list(layers.values()), attrs

    @classmethod
    def _cut_heads(cls, heads, derivation, modules, tp, config, layers, attrs) -> None:
        """Each pooling head of a class the derivation found a cut for, cut by that rule."""
        for head in heads:
            rule = derivation.rules.get(type(modules[head]))
            if rule is not None:
                cls._cut_block(head, modules, rule, tp, config, layers, attrs)

    def _token_embeddings(self, layers: dict[str, Layer], modules, paths: list[str]) -> None:
        """Embeddings that look up the caller's token ids and that no LM head shares (CLIP's text token
        embedding, a plain LM's) are vocab-parallel too: each rank holds 1/tp of the rows, and one
        all-reduce of the looked-up vectors gives every rank the whole lookup."""
        tied = {name.rpartition(".")[0] for names in find_ties(self.model) for name in names}
        for path in paths:
            module = modules.get(path)
            if path in layers or path in tied or module is None or module.max_norm is not None or module.sparse:
                continue
            embed_cls = embedding_layer(module)
            if embed_cls is not None:
                layers[path] = Col_Layer(path, bias=None, replace_layer=embed_cls)

    @staticmethod
    def _cut_block(block, modules, rule: BlockRule, tp, config, layers, attrs) -> None:
        inside = {
            rel: m
            for rel, m in modules[block].named_modules()
            if rel and is_projection(m) and not any(rel.startswith(f"{a}.") for a in rule.attention)
        }
        for rel in rule.attention:  # torch's nn.MultiheadAttention, replaced whole by the layer cutting its heads
            layers[f"{block}.{rel}"] = Layer(f"{block}.{rel}", replace_layer=ParallelMultiheadAttention)
        for rel in rule.read_attention:  # its code hands the cut projections' weights to torch's function
            path = f"{block}.{rel}".rstrip(".")
            layers[path] = Layer(path, replace_layer=ReadMultiheadAttention)
        unknown = sorted(
            set(inside) - set(rule.cols) - rule.rows - rule.whole - rule.idle - rule.inner_rows - set(rule.channels)
        )
        if unknown:
            raise NotDerivableError(
                f"{block} ({type(modules[block]).__name__}) has projections the tiny copy did not run: {unknown}"
            )
        layouts = layouts_in(modules[block], rule.mixers, tp)  # state-space mixers: widths at this model's sizes
        for rel, spec in rule.cols.items():  # widths are checked by the sharder's plan
            if rel in inside:
                module = inside[rel]
                if spec == MIXER_COLUMN:
                    blocks, units = layouts[next(m for m, p in rule.mixers.items() if p.col == rel)].cuts["written"]
                    options = {"n_cast": blocks, **({"head_width": units} if units else {})}
                else:
                    options = cut_options(spec, out_width(module), nearest_config(modules[""], f"{block}.{rel}"))
                layers[f"{block}.{rel}"] = Col_Layer(f"{block}.{rel}", reversed=is_conv1d(module), **options)
        for rel in rule.rows:
            if rel in inside and rel in rule.row_blocks:  # input features in blocks, each cut on its own
                layers[f"{block}.{rel}"] = Row_Layer(
                    f"{block}.{rel}", replace_layer=PackedRow, n_cast=rule.row_blocks[rel]
                )
            elif rel in inside:
                layers[f"{block}.{rel}"] = Row_Layer(f"{block}.{rel}", reversed=is_conv1d(inside[rel]))
        for rel, module in modules[block].named_modules():
            if reads_width_from_input(module) and f"{rel}.qkv".lstrip(".") in rule.cols:
                layers[f"{block}.{rel}".rstrip(".")] = Layer(f"{block}.{rel}".rstrip("."), replace_layer=ModuleWidth)
        for rel in rule.inner_rows & set(inside):  # a mixer's x_proj: its whole output feeds the rank's channels
            layers[f"{block}.{rel}"] = Row_Layer(f"{block}.{rel}", replace_layer=Linear1D_RowIntoParallel)
        for rel, tensors in rule.channels.items():  # a mixer's tensors its code reads itself, cut with its channels
            if f"{block}.{rel}" not in modules:  # a block of the class without this mixer (a hybrid's attention)
                continue
            owners = [m for m in layouts if rel == m or rel.startswith(f"{m}.") or not m]
            if not owners:  # no layout of its mixer in this block (Nemotron 3.5's hybrid): its columns stay whole
                continue
            layout = layouts[max(owners, key=len)]
            dims = {name: dim for name, (dim, _) in tensors.items()}
            blocks = {name: layout.cuts[role][0] for name, (_, role) in tensors.items()}
            units = {name: layout.cuts[role][1] for name, (_, role) in tensors.items()}
            layers[f"{block}.{rel}"] = Layer(f"{block}.{rel}", replace_layer=head_params_layer(dims, blocks, units))
        for mixer, layout in layouts.items():  # one group over the ranks: its gated norm's variance spans them
            for norm in rule.mixers[mixer].norms if layout.spans_ranks else ():
                _add_layer(layers, f"{block}.{norm}", norm_over_ranks_layer(layout.width("inner")))
        for rel in rule.split_norms:
            if f"{block}.{rel}" in modules:
                layers[f"{block}.{rel}"] = Layer(f"{block}.{rel}", replace_layer=SplitLayerNorm)
        for rel, dims in rule.head_params.items():
            if f"{block}.{rel}" in modules:
                layers[f"{block}.{rel}"] = Layer(f"{block}.{rel}", replace_layer=head_params_layer(dims))
        for rel, dims in rule.feature_norms.items():  # other norms over cut features: cut, their means over ranks
            if f"{block}.{rel}" in modules:  # with its per-head parameters (RecurrentGemma's RG-LRU gates)
                merged = {**rule.head_params.get(rel, {}), **dims}
                layers[f"{block}.{rel}"] = Layer(f"{block}.{rel}", replace_layer=head_params_layer(merged))
                _add_layer(layers, f"{block}.{rel}", NormOverRanks)
        for rel, module in modules[block].named_modules():  # per-head draws from numpy: refused in training
            if draws_from_numpy(type(module)) and any(c.startswith(f"{rel}.") for c in rule.cols if rel):
                _add_layer(layers, f"{block}.{rel}", NoTrainingDraws)
        for rel in rule.head_lists:
            if f"{block}.{rel}" in modules:
                layers[f"{block}.{rel}"] = Layer(f"{block}.{rel}", replace_layer=HeadModules)
        attrs.update({f"{block}.{rel}": value for rel, value in rule.settings.items()})
        for rel, cuts in rule.head_inputs.items():
            path = f"{block}.{rel}" if rel else block
            counts = {key: value_at(modules[block], cut.heads) for key, cut in cuts.items() if cut.heads}
            layers[path] = Layer(path, replace_layer=head_inputs_layer(cuts, counts))
        for rel, row in rule.local_widths.items():  # after the module's own cut (its biases) above
            path = f"{block}.{rel}" if rel else block
            heads = tuple(head_counts(modules[path], tp))  # the module's own, whole: its stage's (Swin's differ)
            _add_layer(layers, path, local_widths_layer(out_width(modules[f"{block}.{row}"]), heads))
        for rel in rule.grad_sum:  # beside what else replaces the module (its per-rank widths)
            _sum_grad(layers, modules, f"{block}.{rel}" if rel else block)
        # a class's blocks differ inside (T5's encoder and decoder blocks; RecurrentGemma's temporal block, an
        # attention in some layers and a recurrence in others): the attributes it has, for the groups it has
        divide = {d for d in rule.divide if _held(modules[block], d, rule)}
        divide |= rebuilt_counts(modules[block], divide)
        for mixer, layout in layouts.items():  # a mixer's counts: its widths' shares (B and C may be whole)
            counts = {d for d in divide if d.startswith(f"{mixer}.")}
            attrs.update({f"{block}.{k}": v for k, v in local_counts(modules[block], counts, layout).items()})
            divide -= counts
        attrs.update({f"{block}.{k}": v for k, v in per_rank_attributes(modules[block], divide, tp).items()})
        # the proven rule says which counts become per-rank; the others of the modules owning cut
        # columns keep their value, named so the sharder's check for forgotten counts passes them
        # (at the user's sizes one may equal a cut width by chance: T5's max distance 128, d_model 128)
        owners = {rel.rpartition(".")[0] for rel in rule.cols if rel in inside}
        for owner in owners:
            for name, value in int_attributes(modules[block].get_submodule(owner)).items():
                dotted = f"{owner}.{name}" if owner else name
                if dotted not in divide:
                    attrs.setdefault(f"{block}.{dotted}", value)


def _sum_grad(layers: dict[str, Layer], modules: dict, path: str) -> None:
    """The gradient of the module at ``path``, or of the parameter ``path`` names, summed over tp."""
    owner, _, name = path.rpartition(".")
    if path in modules:
        _add_layer(layers, path, GradAllReduce)
    elif owner in modules and name in dict(modules[owner].named_parameters(recurse=False)):
        _add_layer(layers, owner, grad_all_reduce_of((name,)))


def _add_layer(layers: dict[str, Layer], path: str, layer_cls: type) -> None:
    """A layer for the module at ``path``; after one already there (its parameters cut), both in turn."""
    before = layers.get(path)
    if before is not None and type(before) is Layer and before.replace_layer is not None:
        first, then = before.replace_layer, layer_cls

        def from_native(cls, module, process_group=None, **options):
            module = first.from_native(module, process_group, **options)
            return then.from_native(module, process_group, **options)

        layer_cls = type(then.__name__, (first, then), {"from_native": classmethod(from_native)})
    layers[path] = Layer(path, replace_layer=layer_cls)


def _all_idle(block: nn.Module, rule: BlockRule | None) -> bool:
    """Every projection of the block never ran in the traced forward (it computes nothing here)."""
    inside = {rel for rel, m in block.named_modules() if rel and is_projection(m)}
    return rule is not None and bool(inside) and inside <= rule.idle


def _held(block: nn.Module, dotted: str, rule: BlockRule) -> bool:
    """Whether ``block`` has the attribute at ``dotted`` and a column of a group the rule divides it for."""
    try:
        value_at(block, dotted)
    except AttributeError:
        return False
    columns, inside = rule.divided_with.get(dotted), dict(block.named_modules())
    return columns is None or any(c in inside for c in columns)


def derived_model(model: nn.Module) -> bool:
    """Whether ``model`` could take the derived route: it has repeated blocks (a transformers model's
    config is scaled down to a tiny copy; any other module is copied with two blocks per stack), it has
    convolutions (cut over channels, `.channels`), or it is no transformers model (the route then refuses
    it with the reason)."""
    return bool(blocks_to_cut(model)) or not has_config(model) or has_convolutions(model)


@functools.cache
def with_pooling_heads(policy_cls: type[Policy]) -> type[Policy]:
    """``policy_cls`` (a family's hand-written policy) that also cuts the attention pooling heads it
    leaves whole (timm's ViT with ``global_pool="map"``), as the derived route cuts them; the route's
    proof on a tiny copy covers both. Same name: the record and the logs name the family's policy."""

    def argument_policy(self, config, shard_config):
        arguments = policy_cls.argument_policy(self, config, shard_config)
        layers, attrs = DerivedPolicy.cut_heads(self.model, shard_config, _cut_paths(self.model, arguments))
        if layers:
            own = arguments.get(type(self.model), Argument())
            arguments[type(self.model)] = Argument({**own.attr_dict, **attrs}, [*own.param_funcs, lambda: layers])
        return arguments

    return type(policy_cls.__name__, (policy_cls,), {"argument_policy": argument_policy})


def _cut_paths(model: nn.Module, arguments: dict) -> list[str]:
    """The module paths the layers of ``arguments`` (``{module class: Argument}``) name in ``model``."""
    paths = []
    for path, module in model.named_modules():
        argument = arguments.get(type(module))
        for func in argument.param_funcs if argument is not None else ():
            paths += [f"{path}.{layer.suffix}" if path else layer.suffix for layer in func()]
    return paths
