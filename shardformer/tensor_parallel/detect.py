"""What the model itself says, read from it rather than trusted from the policy.

Three checks the sharder runs for every policy, before any collective:

- **ties**: parameters that are one tensor under several names (``wte`` / ``lm_head``) stay one
  Parameter after sharding, whether or not the policy's ``binding_policy`` lists them;
- **sizes**: every cut width divides by the tensor-parallel size, and so does every head count a
  cut projection holds (a ``k_proj`` of 1 KV head cannot be split over 2 ranks even though its
  width can);
- **per-rank attributes**: an int attribute still holding the full head count or width of a module
  whose projections were cut, and read outside ``__init__``, is rewritten (a head count: the mapping
  is certain) or refused with its name and the ``attr_dict`` entry that fixes it (a width).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import textwrap
from dataclasses import dataclass

import torch.nn as nn

from shardformer.core.refusal import DATA_PARALLEL
from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.tensor_parallel.layers.linear import is_conv1d
from shardformer.tensor_parallel.policy import Col_Layer, Row_Layer
from shardformer.tensor_parallel.slicer import shard_spec

logger = logging.getLogger("shardformer")


MAX_SUGGESTED_TP = 64  # the tensor_parallel_sizes a refusal suggests: one node's accelerators, or a few nodes'


class PolicyMismatch(ValueError):
    """The policy disagrees with what the model says (raised before any collective)."""


# -- ties ---------------------------------------------------------------------------------------


def names_by_tensor(named_tensors) -> dict[int, list[str]]:
    """``{id(tensor): its names}`` over ``(name, tensor)`` pairs, names in order: the one place tensors
    are grouped by identity (ties, checkpoint names, aliases written once)."""
    names: dict[int, list[str]] = {}
    for name, tensor in named_tensors:
        names.setdefault(id(tensor), []).append(name)
    return names


def find_ties(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor in ``model`` (each group at least two names)."""
    groups = names_by_tensor(model.named_parameters(remove_duplicate=False)).values()
    return [names for names in groups if len(names) > 1]


def call_optional(model: nn.Module, method: str):
    """``model.method()`` (``get_input_embeddings``, ...), or None where the model has none."""
    try:
        return getattr(model, method)()
    except (AttributeError, NotImplementedError):
        return None


def is_cuttable(module: nn.Module) -> bool:
    """A module whose weight a policy can cut (a projection or an embedding)."""
    return isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module)


def cuts_weights(layer) -> bool:
    """Whether a layer descriptor's class holds per-rank parts of its module's weights: one that only
    hooks them (``keeps_weights``, set on that very class: a gradient summed over ranks) leaves a tie
    as it was."""
    cls = layer.replace_layer
    return not (isinstance(cls, type) and vars(cls).get("keeps_weights", False))


def check_ties_are_cut_alike(model: nn.Module, ties: list[list[str]], replaced: set[str]) -> None:
    """Refuse a tie whose names the policy treats differently: one layer cut, a tied layer left whole.

    A bare parameter alias (BERT's ``cls.predictions.bias``) is fine: it simply becomes the shard.
    """
    for names in ties:
        owners = {n: n.rpartition(".")[0] for n in names}
        cut = [n for n in names if owners[n] in replaced]
        whole = [n for n in names if owners[n] not in replaced and is_cuttable(model.get_submodule(owners[n]))]
        if cut and whole:
            raise PolicyMismatch(
                f"{cut[0]} and {whole[0]} are one tied tensor in the model, but the policy replaces "
                f"{owners[cut[0]]} and leaves {owners[whole[0]]} ({type(model.get_submodule(owners[whole[0]])).__name__}) "
                f"whole; cut both the same way (e.g. a VocabParallelLMHead1D for the head) or neither"
            )


def keep_ties(model: nn.Module, ties: list[list[str]]) -> None:
    """After sharding, make every name of each tie the same Parameter again (the sharded one)."""
    for names in ties:
        params = {n: model.get_parameter(n) for n in names}
        source = next((n for n in names if shard_spec(params[n]) is not None), names[0])
        src = params[source]
        for name in names:
            dst = params[name]
            if dst is src:
                continue
            if shard_spec(dst) is not None and (dst.shape != src.shape or shard_spec(dst) != shard_spec(src)):
                raise PolicyMismatch(
                    f"tied {source} {tuple(src.shape)} and {name} {tuple(dst.shape)} were sharded differently; "
                    f"the policy must cut both the same way (same dim and vocabulary padding)"
                )
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, src)


# -- sizes --------------------------------------------------------------------------------------


def _config_ints(config) -> dict[str, int]:
    items = config.to_dict().items() if hasattr(config, "to_dict") else vars(config).items() if config else ()
    return {k: v for k, v in items if isinstance(v, int) and not isinstance(v, bool)}


def is_head_count(name: str) -> bool:
    """``num_heads``, ``num_key_value_heads``, ``n_head``: a count, not ``head_dim`` / ``attention_head_size``."""
    low = name.lower()
    return "head" in low and not any(w in low for w in ("dim", "size", "mask", "scale"))


def is_index(name: str) -> bool:
    """``layer_idx``, ``block_index``, ``layer_id``: a position in the model, never a width or a count,
    however its value happens to compare with one (layer 2 of a model whose gate has 2 outputs)."""
    low = name.lower()
    return "idx" in low or "index" in low or low.endswith("_id") or low in ("layer_number", "layer_num")


def _head_dim(config_ints: dict[str, int], module: nn.Module) -> int | None:
    hd = getattr(module, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    if config_ints.get("head_dim"):
        return config_ints["head_dim"]
    heads = config_ints.get("num_attention_heads") or config_ints.get("n_head")
    hidden = config_ints.get("hidden_size") or config_ints.get("n_embd")
    return hidden // heads if heads and hidden and hidden % heads == 0 else None


@dataclass
class Cut:
    """One planned cut: the module at ``path`` split over ``dim`` (``"out"`` / ``"in"``)."""

    path: str
    module: nn.Module
    side: str  # "out" (column) or "in" (row)
    n_cast: int = 1
    vocab: bool = False  # vocabulary splits are padded, so any size fits
    blocks: tuple[int, ...] | None = None  # fused blocks of different sizes (Phi-3's q | k | v)
    gathered: bool = False  # the output is gathered back: the module's owner sees full sizes
    whole_heads: bool = False  # cut by whole heads, fewer than ranks replicated (the spec checks it)

    @property
    def full_width(self) -> int | None:
        m = self.module
        if isinstance(m, nn.Linear):
            return m.out_features if self.side == "out" else m.in_features
        if is_conv1d(m):
            return m.weight.shape[1] if self.side == "out" else m.weight.shape[0]
        if isinstance(m, nn.Embedding):
            return m.num_embeddings if self.side == "out" else m.embedding_dim
        return None


def check_sizes(cuts: list[Cut], tp: int, config, parents: dict[str, nn.Module]) -> None:
    """Every cut width, and every head count a cut projection holds, divides by ``tp``."""
    if tp == 1:
        return
    ints = _config_ints(config)
    for cut in cuts:
        width = cut.full_width
        if width is None or cut.vocab:
            continue
        where = f"{cut.path} ({type(cut.module).__name__})"
        if cut.whole_heads:
            continue
        if cut.blocks:  # the policy sized the blocks from the head counts: each must divide
            if any(b % tp for b in cut.blocks):
                raise PolicyMismatch(
                    f"{where}: fused blocks {cut.blocks} do not each divide by tensor_parallel_size={tp}"
                )
            continue
        if width % (cut.n_cast * tp) != 0:
            raise PolicyMismatch(
                f"{where}: its {'output' if cut.side == 'out' else 'input'} width {width}"
                f"{f' ({cut.n_cast} fused blocks)' if cut.n_cast > 1 else ''} does not divide by "
                f"tensor_parallel_size={tp}; {_sizes_that_cut(width // cut.n_cast)}"
            )
        if cut.side != "out" or cut.gathered:
            continue
        parent = parents.get(cut.path.rpartition(".")[0])
        counts = {k: v for k, v in ints.items() if is_head_count(k) and v > 0}
        if parent is not None:
            counts.update({k: v for k, v in int_attributes(parent).items() if is_head_count(k) and v > 0})
        head_dim = _head_dim(ints, parent) if parent is not None else _head_dim(ints, cut.module)
        block = width // cut.n_cast
        if not head_dim or block % head_dim:
            continue
        for name, count in counts.items():  # this projection holds `count` heads of head_dim
            if count * head_dim == block and count % tp != 0:
                raise PolicyMismatch(
                    f"{where} holds {name}={count} heads of {head_dim}, and tensor_parallel_size={tp} does not "
                    f"divide {count}; use a tensor_parallel_size that divides {count}"
                )


def _sizes_that_cut(width: int) -> str:
    """What a user can do about a width ``tp`` does not divide: the sizes that do (a width of Fourier features,
    Perceiver's 3 + 258, may have no even divisor at all), and data parallelism, which cuts no width."""
    sizes = [str(size) for size in range(2, MAX_SUGGESTED_TP + 1) if width % size == 0]
    if not sizes:
        return f"no tensor_parallel_size up to {MAX_SUGGESTED_TP} divides it; or {DATA_PARALLEL}"
    named = f"{', '.join(sizes[:-1])} or {sizes[-1]}" if len(sizes) > 1 else sizes[0]
    return f"a tensor_parallel_size of {named} divides it; or {DATA_PARALLEL}"


# -- per-rank attributes ------------------------------------------------------------------------


def int_attributes(module: nn.Module) -> dict[str, int]:
    return {k: v for k, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool) and k[0] != "_"}


def _attribute_loads(tree: ast.AST, owner: str) -> set[str]:
    """``owner.x`` read in ``tree``, and ``owner.config.x`` as ``config.x``."""
    names = set()
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)):
            continue
        inner = n.value
        if isinstance(inner, ast.Name) and inner.id == owner:
            names.add(n.attr)
        elif isinstance(inner, ast.Attribute) and inner.attr == "config" and getattr(inner.value, "id", None) == owner:
            names.add(f"config.{n.attr}")
    return names


@functools.cache
def attributes_read(cls: type) -> frozenset[str] | None:
    """The one reader of what a module's code reads: attributes ``self.x`` that ``cls`` reads outside
    ``__init__`` (its own methods and its bases'), plus ``module.x`` read by functions of its source
    file (``eager_attention_forward(module, ...)``); ``self.config.x`` is listed as ``config.x``.
    None when the source cannot be read: then every attribute counts as read."""
    names: set[str] = set()
    try:
        for klass in cls.__mro__:
            if klass.__module__.startswith(("torch.", "builtins")):
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != "__init__":
                    names |= _attribute_loads(fn, "self")
        source_file = sys.modules[cls.__module__]
        for fn in ast.parse(inspect.getsource(source_file)).body:
            if isinstance(fn, ast.FunctionDef) and fn.args.args and fn.args.args[0].arg == "module":
                names |= _attribute_loads(fn, "module")
    except (OSError, TypeError, SyntaxError, KeyError):
        return None
    return frozenset(names)


@dataclass
class StaleAttribute:
    path: str  # module path
    name: str
    value: int
    local: int
    kind: str  # "head count" or "width"

    @property
    def dotted(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name


def stale_attributes(cuts: list[Cut], tp: int, parents: dict[str, nn.Module], rewritten: set[tuple[int, str]]):
    """Int attributes of the modules that own column-cut projections, still holding a full head count
    or width, read outside ``__init__`` and not rewritten by the policy's attr_dict."""
    if tp == 1:
        return []
    found: dict[tuple[str, str], StaleAttribute] = {}
    for cut in cuts:
        if cut.side != "out" or cut.vocab or cut.full_width is None or cut.blocks or cut.gathered or cut.whole_heads:
            continue
        parent_path = cut.path.rpartition(".")[0]
        parent = parents.get(parent_path)
        if parent is None:
            continue
        read = attributes_read(type(parent))
        block = cut.full_width // cut.n_cast
        for name, value in int_attributes(parent).items():
            if (id(parent), name) in rewritten or (read is not None and name not in read) or value <= 1:
                continue
            if is_head_count(name) and block % value == 0 and block // value > 1:
                kind = "head count"
            elif (
                value == block and not is_index(name) and not any(w in name.lower() for w in ("head_dim", "head_size"))
            ):
                kind = "width"
            else:
                continue
            found.setdefault((parent_path, name), StaleAttribute(parent_path, name, value, value // tp, kind))
    return list(found.values())


def resolve_rewrites(targets, model: nn.Module) -> set[tuple[int, str]]:
    """``(id(module), attribute)`` of every attribute the policy's attr_dicts rewrite."""
    out = set()
    for _, module, argument in targets:
        for dotted in argument.attr_dict:
            owner, _, attr = dotted.rpartition(".")
            try:
                obj = module.get_submodule(owner) if owner else module
            except AttributeError:
                continue
            out.add((id(obj), attr))
    return out


def cut_of(path: str, layer, module: nn.Module) -> Cut | None:
    """The cut a layer descriptor makes, or None for layers that cut nothing (dropout)."""
    cls = layer.replace_layer
    vocab = isinstance(cls, type) and issubclass(cls, (VocabParallelEmbedding1D, VocabParallelLMHead1D))
    if isinstance(layer, Col_Layer):
        blocks = None if isinstance(layer.n_cast, int) else tuple(layer.n_cast)
        n_cast = layer.n_cast if blocks is None else len(blocks)
        return Cut(
            path, module, "out", n_cast, vocab, blocks,
            gathered=layer.gather_output and not vocab, whole_heads=layer.head_width is not None,
        )  # fmt: skip
    if isinstance(layer, Row_Layer):
        return Cut(path, module, "in", 1, vocab)
    return None


@dataclass
class Detected:
    """What `detect_from_model` found: ties to keep and head counts to make per-rank."""

    ties: list[list[str]]
    rewrites: list[StaleAttribute]

    def rewrite_attributes(self, model: nn.Module) -> None:
        for stale in self.rewrites:
            setattr(model.get_submodule(stale.path), stale.name, stale.local)
        if self.rewrites:
            first = self.rewrites[0]
            logger.info(
                "set %d per-rank head counts the policy left full (e.g. %s: %d -> %d)",
                len(self.rewrites), first.dotted, first.value, first.local,
            )  # fmt: skip


def _relative(path: str, targets) -> tuple[str, str]:
    """(policy module class, attr_dict key) for an attribute at module ``path``."""
    best = max((t for t in targets if path == t[0] or path.startswith(t[0] + ".") or not t[0]), key=lambda t: len(t[0]))
    rel = path[len(best[0]) + 1 :] if best[0] else path
    return type(best[1]).__name__, rel


def detect_from_model(model: nn.Module, config, shard_config, targets, replacements) -> Detected:
    """Run every check above on a planned shard; raise `PolicyMismatch` naming what is wrong."""
    tp = shard_config.tensor_parallel_size
    parents = dict(model.named_modules())
    cuts = [c for r in replacements if (c := cut_of(r.path, r.layer, r.module)) is not None]
    check_sizes(cuts, tp, config, parents)
    ties = find_ties(model)
    check_ties_are_cut_alike(model, ties, {r.path for r in replacements if cuts_weights(r.layer)})
    stale = stale_attributes(cuts, tp, parents, resolve_rewrites(targets, model))
    refused = [s for s in stale if s.kind == "width" or s.value % tp != 0]
    if refused:
        grouped: dict[tuple, list[StaleAttribute]] = {}
        for s in refused:  # one line per attr_dict entry, not per layer
            owner, rel = _relative(s.path, targets)
            grouped.setdefault((owner, f"{rel}.{s.name}" if rel else s.name, s.kind, s.value, s.local), []).append(s)
        lines = []
        for (owner, key, kind, value, local), items in grouped.items():
            more = f" (and {len(items) - 1} more like it)" if len(items) > 1 else ""
            fix = (
                f'add "{key}": {local} to the attr_dict of {owner}'
                if value % tp == 0
                else (f"tensor_parallel_size={tp} does not divide it")
            )
            lines.append(f"  {items[0].dotted} = {value}{more}: a {kind} read in forward; {fix}")
        raise PolicyMismatch(
            f"the policy cuts the projections of {type(model).__name__} at tensor_parallel_size={tp}, but "
            f"attributes their forward reads still hold the full size:\n" + "\n".join(lines)
        )
    return Detected(ties, [s for s in stale if s.kind == "head count"])
