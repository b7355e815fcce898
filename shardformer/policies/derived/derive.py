"""A model class's cut, derived once per (class, architecture, tp) from a tiny copy of it.

The tiny copy is the user's config scaled down (`shardformer.core.tiny.tiny_copy_config`:
the same layout choices, heads enough for tp). One traced forward says which projections read the
stream and which write back (`.trace`); the in-process simulation chooses each group's fused
blocks and per-rank attributes (`.simulate`). The result is a rule per block class: the
user's model, whatever its depth and width, is cut by its blocks' classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardformer.core import example_inputs
from shardformer.core.inputs import NoInputsError
from shardformer.core.refusal import DATA_PARALLEL, HEADS, POLICY, Reason, Refusal, has_convolutions
from shardformer.policies.copies import KEEP, copy_key, repeated_stacks
from shardformer.policies.derived.blocks import attends, is_projection, repeated_blocks
from shardformer.policies.derived.given_inputs import input_embeddings
from shardformer.policies.derived.mixers import MIXER_COLUMN, MixerCut, MixerParts, cut_mixers
from shardformer.policies.derived.partial_grads import partial_modules
from shardformer.policies.derived.settings import calling_settings
from shardformer.policies.derived.simulate import common_parent, find_cut
from shardformer.policies.derived.tiny_inputs import has_config, runs, tiny_with_inputs
from shardformer.policies.derived.trace import inside, mixed_rows, pair, trace
from shardformer.tensor_parallel.layers.multihead import refusal as multihead_refusal

logger = logging.getLogger("shardformer")


class NotDerivableError(Refusal):
    """The model's structure gives no exact cut (the fix first, then where and why)."""


class NotProvenError(NotDerivableError):
    """A route ran on a tiny copy and was not exact (or no route was)."""


class TowerNotRun(NotDerivableError):
    """A tower no forward of the tiny model reaches and that does not run alone: nothing to derive a cut from."""


@dataclass
class BlockRule:
    """How every block of one class is cut (suffixes relative to the block)."""

    cols: dict[str, int | tuple[str, ...]] = field(default_factory=dict)  # fused blocks per column
    rows: set[str] = field(default_factory=set)
    row_blocks: dict[str, int] = field(default_factory=dict)  # a row whose input is cut block by block
    whole: set[str] = field(default_factory=set)
    divide: set[str] = field(default_factory=set)  # int attributes (or config.X of a module) / tp
    divided_with: dict[str, set[str]] = field(default_factory=dict)  # attribute -> the columns of groups dividing it
    grad_sum: set[str] = field(default_factory=set)  # replicated leaves that run on this rank's heads only
    idle: set[str] = field(default_factory=set)  # projections the traced forward never ran: left whole
    head_params: dict[str, dict[str, int]] = field(default_factory=dict)  # leaf -> {param: heads' dim}
    head_inputs: dict[str, dict] = field(default_factory=dict)  # module -> {kwarg or position: HeadCut}
    head_lists: dict[str, int] = field(default_factory=dict)  # list of one module per head -> its length
    settings: dict[str, bool] = field(default_factory=dict)  # flags that make the code call a projection
    split_norms: set[str] = field(default_factory=set)  # LayerNorms over cut features: statistics over ranks
    feature_norms: dict[str, dict[str, int]] = field(default_factory=dict)  # other norms over them: leaf -> dims
    attention: set[str] = field(default_factory=set)  # torch's nn.MultiheadAttention modules, cut by heads
    read_attention: set[str] = field(default_factory=set)  # modules running F.multi_head_attention_forward
    local_widths: dict[str, str] = field(default_factory=dict)  # module -> the row writing the width it makes local
    inner_rows: set[str] = field(default_factory=set)  # rows whose all-reduced output feeds cut work (Mamba's x_proj)
    channels: dict[str, dict[str, tuple]] = field(default_factory=dict)  # leaf -> {tensor: (dim, role)} (mixers)
    mixers: dict[str, MixerParts] = field(default_factory=dict)  # state-space mixers, cut by their `Layout`


@dataclass
class Derivation:
    rules: dict[type, BlockRule]
    refused: list[str]  # groups no candidate cut computes exactly, with why
    heads: int | None = None  # the tiny copy's query heads, when not the recipe's default
    embeddings: list[str] = field(default_factory=list)  # embeddings that look up the caller's token ids
    whole_heads: dict[str, str] = field(default_factory=dict)  # pooling heads left whole, with why
    grad_sum: set[str] = field(default_factory=set)  # modules outside the blocks whose gradient is partial
    read_by_weight: list[str] = field(default_factory=list)  # outside the blocks, read by the code (`Trace`)


NO_STACK = "has no stack of repeated blocks with projections to cut (tensor parallelism cuts linear projections)"
WIDER = 4  # a refused derivation is tried once more with this many times the heads (CodeGen's 4 fixed blocks)


_CACHE: dict[tuple, Derivation] = {}


def _key(model: nn.Module, tp: int, tower: str = "") -> tuple:
    return copy_key(model, tp), tower


def derive(model: nn.Module, tp: int, tower: str = "") -> Derivation:
    """The cut of ``model``'s class (of its sub-model at ``tower``) at ``tp`` (cached), read off a tiny copy."""
    key = _key(model, tp, tower)
    if key not in _CACHE:
        found = _derive(model, tp, tower)
        if found.refused and has_config(
            model
        ):  # layouts that fix the heads' grouping need more heads than tp alone asks
            wider = max(4, 2 * tp) * WIDER
            try:
                second = _derive(model, tp, tower, wider)
            except NotDerivableError:
                second = None
            if second is not None and not second.refused:
                found = second
        _CACHE[key] = found
    return _CACHE[key]


def _copy_does_not_run(model: nn.Module, inputs: dict, error: Exception) -> NotDerivableError:
    """Why a model with no config to scale down is refused when its two-block copy fails: the cut, where
    the whole model runs on the same inputs (stages that change width from one to the next), else the
    recipe's inputs (a size the model was not built for), named with their shapes."""

    name = type(model).__name__
    failed = f"{type(error).__name__}: {str(error)[:200]}"
    cut = any(len(model.get_submodule(p)) > KEEP for p in repeated_stacks(model))
    if not cut or not runs(model, inputs):
        shapes = ", ".join(f"{k}: {list(v.shape)}" for k, v in inputs.items() if torch.is_tensor(v))
        given = getattr(model, example_inputs.ATTRIBUTE, None) is not None
        return NotDerivableError(
            f"{name} does not run on {'the example_inputs given' if given else 'the inputs shardformer makes for it'} "
            f"({shapes}; {failed}), so no cut can be derived and proven on a copy of it",
            *(() if given else (example_inputs.pass_them(list(inputs) or ["x"]),)),
            POLICY,
            DATA_PARALLEL,
        )
    paths = dict.fromkeys(b.rpartition(".")[0] for b in repeated_blocks(model))  # every stack, also those kept whole
    stacks = ", ".join(
        f"{path} ({len(model.get_submodule(path))} x {type(model.get_submodule(path)[0]).__name__})"
        for path in paths
        if path
    )
    return NotDerivableError(
        f"{name} runs, but its copy with each repeated stack cut to two items ({stacks}) does not ({failed}): the "
        f"items of a stack change width or resolution from one to the next (stages), so no cut can be derived "
        f"and proven on a copy",
        DATA_PARALLEL,
    )


def no_stack(model: nn.Module) -> NotDerivableError:
    """A model with no stack of blocks to cut: a convolutional network (data parallelism), else a model
    whose projections a Policy may still name."""
    fixes = (DATA_PARALLEL,) if has_convolutions(model) else (POLICY, DATA_PARALLEL)
    return NotDerivableError(f"{type(model).__name__} {NO_STACK}", *fixes)


def _fix(block: nn.Module, group, why: str) -> str:
    """The fix for a group no candidate cut computes: the one its reason carries (a head count), else
    data parallelism where the group runs through a convolution (a mixer no channel cut follows: its conv and
    scan, which no cut of its projections computes), else a Policy."""
    if isinstance(why, Reason):
        return why.fix
    owner = common_parent([*group.cols, group.row])
    return DATA_PARALLEL if has_convolutions(block.get_submodule(owner) if owner else block) else POLICY


def _derive(model: nn.Module, tp: int, tower: str = "", heads: int | None = None) -> Derivation:
    name = type(model.get_submodule(tower)).__name__
    try:
        tiny, inputs = tiny_with_inputs(model, tp, tower, heads)
    except NoInputsError as e:
        raise NotDerivableError(e.reason, *e.fixes) from None  # its own words: printed once
    except Exception as e:  # noqa: BLE001 - a config the class refuses at small sizes, inputs the recipe lacks
        raise NotDerivableError(
            f"a tiny {name} cannot be built from a scaled-down config or given inputs: {type(e).__name__}: {e}"
        ) from None  # the error's text is in the message: not printed twice
    if inputs is None:
        raise TowerNotRun(
            f"{tower} ({name}) is not run by a forward of a tiny {type(model).__name__} on the inputs shardformer "
            f"makes for it, nor alone on inputs of its own"
        )
    if has_config(tiny):
        tiny.config.use_cache = False
    inputs.pop("labels", None)
    if "decoder_input_ids" not in inputs and getattr(getattr(tiny, "config", None), "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs.get("input_ids", torch.ones(2, 8, dtype=torch.long))
    try:
        flows = trace(tiny, inputs)
    except Exception as e:  # noqa: BLE001
        if not has_config(tiny):
            raise _copy_does_not_run(model, inputs, e) from None
        raise NotDerivableError(f"a tiny {name} does not run: {type(e).__name__}: {e}") from None
    if not flows.blocks:
        raise no_stack(tiny)
    units = flows.blocks + flows.heads
    packed = {  # torch's nn.MultiheadAttention: cut whole by its own layer; its out_proj is read by weight
        block: [rel for rel, m in tiny.get_submodule(block).named_modules() if isinstance(m, nn.MultiheadAttention)]
        for block in units
    }
    for block, owners in packed.items():
        followed = {r for read in flows.read_attention.get(block, {}).values() for r in read[:4]}
        flows.bypassed[block] = [
            r for r in flows.bypassed.get(block, []) if not inside(r, owners) and r not in followed
        ]
    bypassed = {b: rels for b, rels in flows.bypassed.items() if rels and b in flows.blocks}
    settings = calling_settings(tiny, inputs, bypassed)
    if settings:  # the projections their code read by weight are called now: traced again
        flows = trace(tiny, inputs)
    rules: dict[type, BlockRule] = {cls: BlockRule(settings=found) for cls, found in settings.items()}
    refused: list[str] = []
    for block in flows.blocks:
        rule = rules.setdefault(type(tiny.get_submodule(block)), BlockRule())
        refused += _block_rule(tiny, block, rule, flows, packed[block], tp, inputs)
    whole_heads: dict[str, str] = {}
    for head in flows.heads:  # a pooling head is cut where that is exact, else left whole as it was
        cls = type(tiny.get_submodule(head))
        if cls in rules:
            continue
        rule = BlockRule()
        why = _block_rule(tiny, head, rule, flows, packed[head], tp, inputs, head=True)
        if why:
            whole_heads[head] = "; ".join(why)
            logger.info("%s (%s) stays whole on every rank: %s", head, cls.__name__, whole_heads[head])
        elif rule.cols or rule.attention:
            rules[cls] = rule
    for rule in rules.values():
        rule.whole -= set(rule.cols) | rule.rows
        rule.idle -= set(rule.cols) | rule.rows | rule.whole
    partial, outside = partial_modules(tiny, flows, rules)
    for cls, rels in partial.items():
        rules[cls].grad_sum |= rels
    # token ids: transformers' input_ids, or a plain module's first argument (not token types or positions)
    ids = [inputs["input_ids"]] if has_config(tiny) and "input_ids" in inputs else list(inputs.values())[:1]
    embeddings = input_embeddings(tiny, inputs, ids)
    return Derivation(rules, refused, heads, embeddings, whole_heads, outside, flows.read_by_weight)


def _read_attention_rule(name: str, reads: dict[str, tuple], rule: BlockRule, tp: int) -> list[Reason]:
    """The cut of the modules whose code hands their projections' weights to F.multi_head_attention_forward:
    q, k, v by their outputs, the output projection by its inputs, the owner run on this rank's heads."""
    refused = []
    for owner, (q, k, v, out, heads) in reads.items():
        if heads % tp:
            text = f"{name}: {owner or 'the block'} runs F.multi_head_attention_forward on {heads} heads, which do not split over tensor_parallel_size={tp}"
            refused.append(Reason(text, HEADS))
            continue
        rule.cols.update(dict.fromkeys((q, k, v), 1))
        rule.rows.add(out)
        rule.read_attention.add(owner)
    return refused


def _block_rule(tiny, block: str, rule: BlockRule, flows, packed: list[str], tp: int, inputs, head=False) -> list[str]:
    """Fill ``rule`` with the cut of the block (or pooling head) at ``block`` of the traced ``tiny``; the
    reasons no exact cut of a part of it was found. A pooling head that does not attend is left empty."""
    module = tiny.get_submodule(block)
    name = type(module).__name__
    refused = []
    traced = flows.reads.get(block, {}), flows.leaf_reads.get(block, {})
    mixers = {} if head else cut_mixers(tiny, block, *traced, tp, inputs, decided=set(rule.cols))
    for mixer, cut in mixers.items():
        refused += _mixer_rule(name, mixer, cut, rule)
    owned = [*packed, *mixers]  # modules cut as one: their projections join no plain group
    reads = {rel: flow for rel, flow in flows.reads.get(block, {}).items() if not inside(rel, owned)}
    # a timm or plain module, or a pooling head: projections of replicated tensors join a group, and a projection
    # on the heads' outputs left whole is refused (transformers models' blocks keep their sweep's rules); those after
    # a row read the stream (whole after its all-reduce: a head's MLP, Zamba2's shared layer with no residual)
    plain = head or not has_config(tiny)
    groups, whole = pair(reads, replicated_columns=plain, after_rows=True)
    if not groups and not head:  # no projection reads the stream and feeds a row: bottlenecks left whole
        groups, whole = pair(reads, replicated_columns=plain, after_whole=True)
    if head and not attends(groups, set(packed)):
        return []
    for rel in packed:
        why = multihead_refusal(module.get_submodule(rel), tp)
        if why is None:
            rule.attention.add(rel)
        else:
            text = f"{name}: {rel} is torch's nn.MultiheadAttention, and {why}"
            refused.append(Reason(text, HEADS if "heads do not split" in why else DATA_PARALLEL))
    refused += _read_attention_rule(name, flows.read_attention.get(block, {}), rule, tp)
    for rel in [r for r in flows.bypassed.get(block, []) if not inside(r, owned)]:
        text = (
            f"{name}: {rel} is never called: the {'head' if head else 'block'}'s code reads its weight itself "
            f"(F.linear(x, {rel.rpartition('.')[2]}.weight, ...)), which no cut layer can stand in for"
        )
        refused.append(Reason(text, DATA_PARALLEL))
    if plain:
        for rel in mixed_rows(reads, groups):
            text = (
                f"{name}: {rel} reads {', '.join(sorted(reads[rel].sources))}, computed from the attention's column "
                f"projections but not cut with them (it mixes what the heads compute, as talking-heads attention "
                f"does): no cut over heads computes it"
            )
            refused.append(Reason(text, DATA_PARALLEL))
    rule.whole |= set(whole) - set(rule.cols) - rule.rows
    for group in groups:
        if group.row in rule.rows and all(c in rule.cols for c in group.cols):
            continue  # decided on an earlier block of this class
        cut, why = find_cut(tiny, block, group, tp, inputs)
        if cut is None:
            text = f"{name}: {', '.join(group.cols)} -> {group.row}: {why}{_computed_with(module, block, group, flows)}"
            refused.append(Reason(text, _fix(module, group, why)))
            rule.whole |= {*group.cols, group.row}
            continue
        rule.cols.update(cut.blocks)
        rule.rows.add(group.row)
        if cut.row_blocks > 1:
            rule.row_blocks[group.row] = cut.row_blocks
        rule.divide |= set(cut.divide)
        for dotted in cut.divide:  # a class's blocks may differ inside (RecurrentGemma's temporal blocks)
            rule.divided_with.setdefault(dotted, set()).update(cut.blocks)
        rule.head_params.update(cut.head_params)
        rule.head_lists.update(cut.head_lists)
        for owner, cuts in cut.head_inputs.items():
            rule.head_inputs.setdefault(owner, {}).update(cuts)
        rule.local_widths.update(cut.local_widths)
        rule.split_norms |= cut.split_norms
        rule.feature_norms.update(cut.feature_norms)
    # projections the forward never ran (a decoder's cross-attention used alone) compute nothing: whole
    rule.idle |= {rel for rel, m in module.named_modules() if rel and is_projection(m) and rel not in reads}
    rule.idle -= {rel for rel in rule.idle if inside(rel, owned)}
    return refused


def _computed_with(module: nn.Module, block: str, group, flows) -> str:
    """What else the group computes with between its columns and its row (the parameters the row's
    input was computed from, besides the columns'), named for a refusal: the first place to look."""
    own = {*group.cols, group.row}
    owners = sorted(
        {
            name[len(block) + 1 :].rpartition(".")[0]
            for name in flows.origins.get(block, {}).get(group.row, ())
            if name.startswith(f"{block}.") and name[len(block) + 1 :].rpartition(".")[0] not in own
        }
    )
    if not owners:
        return ""
    parts = [
        f"{rel} ({'a convolution, which tensor parallelism does not cut' if has_convolutions(module.get_submodule(rel)) else type(module.get_submodule(rel)).__name__})"
        for rel in owners
    ]
    return (
        f" (between them the block also computes with {', '.join(parts)}, whole on every rank and read across "
        f"the hidden features the cut splits)"
    )


def _mixer_rule(name: str, mixer: str, cut: MixerCut | Reason, rule: BlockRule) -> list[str]:
    """A state-space mixer's cut (`.mixers`) added to ``rule``; the reason it has none, as a refusal."""
    if not isinstance(cut, MixerCut):
        return [Reason(f"{name}: {mixer}: {cut}", cut.fix)]
    if cut.parts is not None:
        rule.mixers[mixer] = cut.parts
        rule.cols[cut.parts.col] = MIXER_COLUMN
        rule.rows.add(cut.parts.row)
    rule.inner_rows |= cut.rows
    rule.channels.update(cut.channels)
    rule.divide |= set(cut.divide)
    rule.grad_sum |= cut.grad_sum
    return []
