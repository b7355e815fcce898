"""How a column/row group is cut, found by running each rank's share of it in this one process.

For a group (column projections feeding one row projection, inside one block) the module that holds
them all is copied once per rank; in each copy the columns keep this rank's output features, the
row this rank's input features, and the head counts and widths the module's code reads become
per-rank values. Run on the recorded inputs, the copies' row outputs, summed (what the row layer's
all-reduce does), must equal the row's output in the whole model. Candidate cuts are tried from the
simplest: every column split evenly, then fused blocks (``[Q | K | V]`` in 3, ``[gate | up]`` in 2,
``[Q | K | V]`` sized by the head counts); the attribute set with and without the widths equal to the
stream's. No collective runs: this only chooses; the proof on ranks (`.proof`) confirms.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardformer.core.compare import ATOL, RTOL, max_error
from shardformer.core.refusal import DATA_PARALLEL, HEADS, Reason
from shardformer.core.shard_spec import make_spec, slice_tensor
from shardformer.policies.derived import column_cuts as cuts
from shardformer.policies.derived.attributes import apply_attributes, attribute_candidates, splits_over
from shardformer.policies.derived.blocks import in_width, out_width, run_hooked, value_at
from shardformer.policies.derived.feature_norms import feature_norm_options, own_statistics, replay_means
from shardformer.policies.derived.given_inputs import inputs_from_outside
from shardformer.policies.derived.heads import (
    HeadCut,
    bias_options,
    channel_options,
    depthwise_counts,
    depthwise_options,
    distinct_heads,
    head_counts,
    head_lists,
    head_options,
    slice_heads,
)
from shardformer.policies.derived.missing_kernels import zeros_without_kernel
from shardformer.policies.derived.rewrites import use_module_width
from shardformer.policies.derived.trace import Group
from shardformer.policies.derived.widths import run_in_local_widths
from shardformer.policies.tp_plan.styles import forget_cached_tensors
from shardformer.tensor_parallel.detect import attributes_read, int_attributes, is_head_count
from shardformer.tensor_parallel.layers.linear import is_conv1d
from shardformer.tensor_parallel.layers.norm import normalize, splits_features

MAX_ATTRIBUTES = 6  # candidates tried in every subset: 64 sets at most


@dataclass
class Cut:
    """A group's cut: fused blocks per column (1: even), and the attributes to divide by tp, all
    relative to the block (``config.X`` for a count read through the module's config).
    ``head_params``: parameters beside the projections cut with the heads (T5's relative attention
    bias ``[buckets, heads]``): ``{leaf: {name: dim}}``. ``head_inputs``: per-head tensors the
    model computes outside the blocks and hands in whole (ALiBi): ``{module: {kwarg or position:
    HeadCut}}``, cut on the way in. ``head_lists``: lists of one module per head (StableLM's per-head
    norms), each rank shown its heads' modules: ``{list: length}``."""

    blocks: dict[str, int | tuple[str, ...]] = field(default_factory=dict)  # col -> n or ("heads",)
    divide: tuple[str, ...] = ()
    head_params: dict[str, dict[str, int]] = field(default_factory=dict)
    head_inputs: dict[str, dict[str | int, HeadCut]] = field(default_factory=dict)
    head_lists: dict[str, int] = field(default_factory=dict)
    row_blocks: int = 1  # the row's input features in this many blocks, each cut on its own
    local_widths: dict[str, str] = field(default_factory=dict)  # module -> the row whose output width it makes local
    split_norms: set[str] = field(default_factory=set)  # LayerNorms over the cut features (SplitLayerNorm)
    feature_norms: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # other norms over them: {leaf: {param: dim}}


def common_parent(paths: list[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]
    prefix = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        prefix.append(items[0])
    return ".".join(prefix)


def _rel(path: str, parent: str) -> str:
    return path[len(parent) + 1 :] if parent else path


def _weight_out_in(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = module.weight.detach()
    return (w.t() if is_conv1d(module) else w), (None if module.bias is None else module.bias.detach())


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def record_calls(model: nn.Module, paths: list[str], inputs: dict) -> dict[str, tuple]:
    """``{path: (args, kwargs, output)}`` of the first call of each module in one forward, copied as
    they were then (the model may change them in place afterwards: Falcon's ``mlp_output += ...``)."""
    inputs_seen: dict[str, tuple] = {}
    seen: dict[str, tuple] = {}
    handles = []
    for path in paths:
        module = model.get_submodule(path)

        def before(_m, args, kwargs, path=path):
            inputs_seen.setdefault(path, (copy.deepcopy(args), copy.deepcopy(kwargs)))

        def after(_m, _args, _kwargs, out, path=path):
            if path not in seen:
                seen[path] = (*inputs_seen[path], copy.deepcopy(out))

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    run_hooked(model, inputs, handles)
    return seen


def _split_norm_inputs(model, parent_path: str, parent: nn.Module, widths: set[int], inputs) -> dict[str, torch.Tensor]:
    """``{leaf relative to the parent: its recorded input}`` of the LayerNorms in the parent over one of ``widths``."""
    found = [
        rel
        for rel, m in parent.named_modules()
        if rel and splits_features(m) and m.normalized_shape[0] in widths and m.normalized_shape[0] > 1
    ]
    if not found:
        return {}
    paths = {rel: f"{parent_path}.{rel}" if parent_path else rel for rel in found}
    calls = record_calls(model, list(paths.values()), inputs)
    return {rel: calls[path][0][0] for rel, path in paths.items() if path in calls and calls[path][0]}


def _whole_stats_norm(norm: nn.LayerNorm, whole: torch.Tensor, rank: int, tp: int) -> nn.Module:
    """``norm`` on this rank's features, with the statistics of the whole recorded input (what the ranks'
    sums give SplitLayerNorm)."""
    x = whole.float()
    sums = iter([x.sum(-1, keepdim=True), (x - x.mean(-1, keepdim=True)).square().sum(-1, keepdim=True)])
    weight = slice_tensor(norm.weight.detach(), make_spec(norm.weight.shape, 0, rank, tp))
    bias = None if norm.bias is None else slice_tensor(norm.bias.detach(), make_spec(norm.bias.shape, 0, rank, tp))

    class WholeStats(nn.Module):
        def forward(self, t):
            return normalize(t, weight, bias, norm.eps, x.shape[-1], lambda _part: next(sums))

    return WholeStats()


def _run_ranks(
    parent,
    row_rel,
    col_rels,
    blocks,
    divide,
    tp,
    args,
    kwargs,
    config,
    heads=None,
    row_blocks=1,
    local_width=0,
    split_norms=None,
    feature_norms=None,
) -> torch.Tensor:
    """Sum of the row's outputs over ``tp`` simulated ranks (without the row's bias). ``heads``:
    ``(params {leaf: {name: dim}}, inputs {key: HeadCut}, lists {list: length})`` cut by heads, relative
    to the parent;
    ``row_blocks``: the row's input features cut block by block; ``local_width``: the parent runs
    under `.widths.LocalWidths` for that width; ``feature_norms``: ``{leaf: (dims, the whole leaf's means)}``
    (`.feature_norms`)."""
    head_params, head_inputs, head_lists = heads or ({}, {}, {})
    whole_heads = tuple(head_counts(parent, tp))  # read before any count is divided
    total = None
    for rank in range(tp):
        local = copy.deepcopy(parent)
        use_module_width(local)  # as the policy gives it on the ranks (an input's width is a whole width)
        norms = (feature_norms or {}).items()
        for rel, dims in [*head_params.items(), *((rel, dims) for rel, (dims, _) in norms)]:
            leaf = local.get_submodule(rel)
            forget_cached_tensors(leaf)
            for name, dim in dims.items():
                t = getattr(leaf, name)
                part = slice_tensor(t.detach(), make_spec(t.shape, dim, rank, tp))
                setattr(leaf, name, nn.Parameter(part) if isinstance(t, nn.Parameter) else part)
        for rel, (_, means) in norms:
            replay_means(local.get_submodule(rel), means)
        for rel, length in head_lists.items():  # this rank's heads' modules, as HeadModules shows them
            items = list(local.get_submodule(rel))
            local.set_submodule(rel, nn.ModuleList(items[rank * length // tp : (rank + 1) * length // tp]))
        call_args, call_kwargs = list(copy.deepcopy(args)), copy.deepcopy(kwargs)
        for key, cut in head_inputs.items():
            where = call_args if isinstance(key, int) else call_kwargs
            count = value_at(parent, cut.heads) if cut.heads else 0
            where[key] = slice_heads(where[key], cut, count, rank, tp)
        for rel in col_rels:
            module = local.get_submodule(rel)
            w, b = _weight_out_in(module)
            options = cuts.cut_options(blocks[rel], w.shape[0], config)
            spec = make_spec(w.shape, 0, rank, tp, options["n_cast"], head_width=options.get("head_width"))
            local.set_submodule(rel, _linear(slice_tensor(w, spec), None if b is None else slice_tensor(b, spec)))
        row = local.get_submodule(row_rel)
        w, _ = _weight_out_in(row)
        local_row = _linear(slice_tensor(w, make_spec(w.shape, 1, rank, tp, row_blocks)), None)
        captured: list[torch.Tensor] = []
        local_row.register_forward_hook(lambda _m, _a, out, into=captured: into.append(out))
        local.set_submodule(row_rel, local_row)
        for rel, whole in (split_norms or {}).items():
            local.set_submodule(rel, _whole_stats_norm(local.get_submodule(rel), whole, rank, tp))
        apply_attributes(local, divide, tp)
        if local_width:
            run_in_local_widths(local, local_width, tp, whole_heads)
        with torch.no_grad():
            local(*call_args, **call_kwargs)
        if len(captured) != 1:
            raise RuntimeError(f"the row projection ran {len(captured)} times")
        total = captured[0] if total is None else total + captured[0]
    return total


def find_cut(model: nn.Module, block: str, group: Group, tp: int, inputs: dict) -> tuple[Cut | None, str]:
    """The simplest cut under which ``tp`` simulated ranks compute the group exactly, or None and why."""
    cols = [f"{block}.{c}" for c in group.cols]
    row = f"{block}.{group.row}"
    parent_path = common_parent([*cols, row])
    parent = model.get_submodule(parent_path) if parent_path else model
    calls = record_calls(model, [parent_path, row], inputs)
    if parent_path not in calls or row not in calls:
        return None, "the group did not run in the recorded forward"
    args, kwargs, _ = calls[parent_path]
    expected = calls[row][2]
    without_kernel = zeros_without_kernel(parent, group.row, calls[row][0][0] if calls[row][0] else None)
    if without_kernel:
        return None, without_kernel
    lists = head_lists(parent, tp)
    if lists:  # per-head modules told apart: each rank must run its own heads'
        parent, expected = distinct_heads(parent, lists, _rel(row, parent_path), args, kwargs)
    row_module = model.get_submodule(row)
    row_bias = getattr(row_module, "bias", None)
    stream_width = out_width(row_module)  # the row writes back into the stream
    config = cuts.nearest_config(model, parent_path)  # None: a timm model or a plain module (counts read off modules)
    col_modules = {c: model.get_submodule(c) for c in cols}
    widths = {in_width(row_module)} | {out_width(m) for m in col_modules.values()}
    per_col = []
    for path, module in col_modules.items():
        options = cuts.column_candidates(out_width(module), config, tp)
        if not options:
            return None, f"{path}: output width {out_width(module)} does not split over tp={tp}"
        per_col.append(options)
        widths |= cuts.block_widths(out_width(module), options, config)
    if in_width(row_module) % tp:
        return None, f"{row}: input width {in_width(row_module)} does not split over tp={tp}"
    col_rels = [_rel(c, parent_path) for c in cols]
    names = attribute_candidates(parent, widths, tp)
    # every subset of the candidates, the largest first, those keeping the stream's width whole first
    subsets = [c for k in range(len(names), -1, -1) for c in itertools.combinations(names[:MAX_ATTRIBUTES], k)]
    attr_sets = sorted(subsets, key=lambda c: (-len(c), sum(value_at(parent, n) == stream_width for n in c)))
    prefix = _rel(parent_path, block) if parent_path != block else ""

    def in_block(rel: str) -> str:
        return f"{prefix}.{rel}" if prefix and rel else prefix or rel

    errors: list[str] = []
    # the plain cuts first; per-head parameters and inputs only when none of them is exact; last,
    # blocked cuts (CodeGen regroups its fused qkv into 4 blocks of [q | v | k]: each block cut on its
    # own, and the row's input in as many blocks)
    # and last, the module run under LocalWidths (reshapes to the stream's width read off the input)
    biases = bias_options(parent, col_rels, widths) | depthwise_options(parent, widths)
    # not of the stream's width: a per-channel leaf there (a layer scale) works on the stream, whole
    for rel, names in channel_options(parent, _rel(row, parent_path), widths - {stream_width}).items():
        biases.setdefault(rel, {}).update(names)
    heads_options = head_options(parent, args, kwargs, tp, inputs, stream_width, biases, lists, config)
    stages = [(None, 1, per_col, 0)] + [(h, 1, per_col, 0) for h in heads_options]
    for m in BLOCKED_ROWS:
        if in_width(row_module) % (m * tp) == 0:
            blocked = [[n for n in (m, 3 * m) if cuts.fits_blocks(out_width(c), n, tp)] for c in col_modules.values()]
            if all(blocked):
                stages.append((None, m, blocked, 0))
    if stream_width % tp == 0:
        stages += [(h, 1, per_col, stream_width) for h in [None, *heads_options]]
    # a LayerNorm over the columns' whole output width between them and the row (EVA-02's MLP): its
    # statistics summed over ranks (SplitLayerNorm); simulated with the whole input's statistics
    norms = _split_norm_inputs(model, parent_path, parent, {out_width(m) for m in col_modules.values()}, inputs)
    stages = [(*stage, {}, {}) for stage in stages]
    if norms:
        stages += [(h, 1, per_col, 0, norms, {}) for h in [None, *heads_options]]
    # other norms over the row's input features (BitNet's RMS norm, ConvNeXt-V2's GRN): means over ranks
    features = feature_norm_options(model, parent_path, parent, in_width(row_module), inputs, record_calls)
    if features:
        stages += [(h, 1, per_col, 0, {}, features) for h in [None, *heads_options]]
    trials, unsplit = 0, _unsplit_heads(parent, prefix, tp)
    for heads, row_blocks, options, local_width, split_norms, feature_norms in stages:
        for choice in sorted(itertools.product(*options), key=_cost):
            blocks = dict(zip(col_rels, choice))
            convs = depthwise_counts(parent, heads[0]) if heads else ()
            for divide in (d + convs for d in attr_sets):
                trials += 1
                if unsplit and errors:  # no even cut splits those heads: the first candidate's failure says how
                    return None, _why_none(unsplit, tp, errors[0])
                if trials > MAX_TRIALS:  # a count, not a clock: every rank stops at the same candidate
                    first = f"no exact cut among the first {MAX_TRIALS} candidates ({errors[0]})"
                    return None, _why_none(unsplit, tp, first)
                try:
                    got = _run_ranks(
                        parent, _rel(row, parent_path), col_rels, blocks, divide, tp, args, kwargs, config, heads,
                        row_blocks, local_width, split_norms, feature_norms,
                    )  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a cut the code cannot run is a rejected candidate
                    errors.append(f"{_describe(blocks, divide)}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                if row_bias is not None:
                    got = got + row_bias.detach()
                if got.shape == expected.shape and max_error(got, expected, ATOL, RTOL)[1]:
                    cut = Cut({_rel(c, block): n for c, n in zip(cols, choice)}, tuple(in_block(n) for n in divide))
                    cut.row_blocks = row_blocks
                    if local_width:  # the width is the row's output, read per block (Swin's stages differ)
                        cut.local_widths = {prefix: group.row}
                    cut.split_norms = {in_block(rel) for rel in split_norms}
                    cut.feature_norms = {in_block(rel): dims for rel, (dims, _) in feature_norms.items()}
                    if heads is not None:
                        params, head_inputs, per_head = heads
                        cut.head_params = {in_block(rel): dims for rel, dims in params.items()}
                        cut.head_lists = {in_block(rel): length for rel, length in per_head.items()}
                        outside = inputs_from_outside(model, parent_path, inputs)
                        passed_whole = {
                            key: HeadCut(c.dim, in_block(c.heads) if c.heads else "")
                            for key, c in head_inputs.items()
                            if key in outside
                        }
                        cut.head_inputs = {prefix: passed_whole} if passed_whole else {}
                    return cut, ""
                errors.append(f"{_describe(blocks, divide)}: the ranks' summed output differs from the group's")
    per_head = _count_of_width(parent, stream_width)
    if per_head:  # Doge's dt_proj: every key/value head's values in, one value per head out
        return None, Reason(
            f"{group.row} ({type(row_module).__name__}) reads every head's features ({in_width(row_module)} "
            f"inputs) and writes one value per head ({stream_width} = {per_head}), which the code after it reads "
            f"per head: cut by heads, each rank holds its heads' features but needs its heads' values computed "
            f"from all of them, which no cut of the projection gives exactly",
            DATA_PARALLEL,
        )
    statistic = own_statistics(parent, args, kwargs, widths - {stream_width})  # Gemma 3n's activation sparsity
    return None, statistic or _why_none(unsplit, tp, errors[0] if errors else "no candidate cut")


def _count_of_width(parent: nn.Module, width: int) -> str:
    """The head count (``config.num_key_value_heads``, an int of a module) equal to ``width``, or ""."""
    config = getattr(parent, "config", None)
    counts = {f"config.{k}": v for k, v in vars(config).items()} if config is not None else {}
    for rel, module in parent.named_modules():
        counts.update({f"{rel}.{k}".lstrip("."): v for k, v in int_attributes(module).items()})
    equal = [name for name, v in counts.items() if is_head_count(name.rpartition(".")[2]) and v == width]
    return min(equal, key=lambda name: ("key_value" not in name and "kv" not in name, name), default="")


def _unsplit_heads(parent: nn.Module, prefix: str, tp: int) -> list[str]:
    """The head counts ``tp`` cannot split (3 heads at tp=2; a query count below tp too: one head of
    Swin's, Segformer's or PVT's first stage, which only key/value heads may replicate), as
    ``name=value``: those its code reads, else those it keeps (Segformer reads head_dim)."""
    unsplit, unread = [], []
    for rel, module in parent.named_modules():
        read = attributes_read(type(module))
        for name, value in int_attributes(module).items():
            queries = "key_value" not in name and "kv" not in name.lower()
            if is_head_count(name) and (not splits_over(name, value, tp) or (queries and value % tp)):
                found = unsplit if read is None or name in read else unread
                found.append(".".join(p for p in (prefix, rel, name) if p) + f"={value}")
    return unsplit or unread


def _why_none(unsplit: list[str], tp: int, first_error: str) -> str:
    """Why no cut of a group is exact: the head counts ``tp`` cannot split, then the first candidate's failure."""
    if not unsplit:
        return first_error
    text = (
        f"{', '.join(unsplit)}: {'these heads do' if len(unsplit) > 1 else 'its heads do'} not split over "
        f"tensor_parallel_size={tp}; the first candidate: {first_error}"
    )
    return Reason(text, HEADS)


MAX_TRIALS = 200  # simulated candidates per group (many projections in one group multiply them)
BLOCKED_ROWS = (2, 4, 8)  # blocks of a row's input tried when nothing plainer is exact


def _describe(blocks: dict, divide) -> str:
    fused = {k: v for k, v in blocks.items() if v != 1}
    return f"cut {fused or 'evenly'}, dividing {list(divide) or 'no attributes'}"


def _cost(choice) -> tuple:
    return tuple(0 if n == 1 else 1 for n in choice), tuple(str(n) for n in choice)
