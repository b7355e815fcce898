"""What each projection of a model does, read off one recorded forward of a tiny copy.

One forward runs under a ``TorchFunctionMode`` that follows, for every tensor inside a block to cut
(`.blocks.blocks_to_cut`), two facts: does it still carry the block's **stream** (a block input
as wide as a projection reads) without passing through a projection, and which projections' outputs it
was computed from (the nearest ones). Then, per projection (``nn.Linear`` or transformers' ``Conv1D``):

- it reads the stream: **column** candidate (attention's q / k / v, an MLP's first layer, keys and
  values of cross-attention read from the encoder's states);
- it reads only other projections' outputs: **row** candidate, paired with those projections
  (attention's output projection after q / k / v, an MLP's second layer);
- it reads neither (a projection of position or time embeddings): left whole.

The same forward follows, over the whole model, which parameters each tensor was computed from
(its **origins**, reset to a projection's own parameters at each projection inside a block): what
each projection of a block reads, and what the model's outputs are made of, say whose gradient a cut
leaves partial on each rank (`.partial_grads`).

Names never decide: a model whose projections are renamed is traced the same.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardformer.policies.derived.blocks import blocks_to_cut, in_width, is_projection, pooling_heads, run_hooked
from shardformer.tensor_parallel.layers.read_attention import weights_read


@dataclass
class Flow:
    """A tensor's facts: does it carry the block's stream, and from which projections it was computed."""

    stream: bool = False
    sources: frozenset[str] = frozenset()

    def __or__(self, other: Flow) -> Flow:
        return Flow(self.stream or other.stream, self.sources | other.sources)


_LOOKUPS = (F.embedding, torch.embedding)  # how nn.Embedding's own forward reads its weight


class FlowMode(TorchFunctionMode):
    """Propagates `Flow` (inside the block running) and origins (everywhere: the names of the
    parameters a tensor was computed from, ``names`` mapping their ids) through every torch function
    called while it is active."""

    def __init__(self, names: dict[int, str] | None = None) -> None:
        super().__init__()
        self.flows: dict[int, Flow] = {}
        self.names = names or {}
        self.origins: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.owners: dict[int, set[str]] = {}  # weights watched: id -> the paths of the modules holding them
        self.running: set[str] = set()  # the watched modules whose forward is running
        self.read_elsewhere: set[str] = set()  # watched modules whose weight a function read outside their forward
        # F.multi_head_attention_forward on projections' weights (`ReadAttention`)
        self.attention_reads: list[tuple] = []
        self.lookups: set[str] = set()  # the watched modules that are embeddings

    def get(self, t) -> Flow | None:
        return self.flows.get(id(t)) if torch.is_tensor(t) else None

    def set(self, t: torch.Tensor, flow: Flow) -> None:
        self.flows[id(t)] = flow
        self.alive.append(t)

    def origins_of(self, tensors) -> frozenset[str]:
        """The names of the parameters any of ``tensors`` (a pytree) was computed from, or is."""
        found: set[str] = set()
        for t in tree_leaves(tensors):
            if torch.is_tensor(t):
                found |= self.origins.get(id(t), frozenset())
                if id(t) in self.names:
                    found.add(self.names[id(t)])
        return frozenset(found)

    def _read_attention(self, read: dict, args, kwargs) -> None:
        names = {role: self.names.get(id(read[role]), "") for role in ("q", "k", "v", "out")}
        query = args[0] if args else kwargs.get("query")
        masks = [kwargs.get("attn_mask"), kwargs.get("key_padding_mask")]  # the per-head tensors handed in
        read_attention = ReadAttention(names, read["heads"], self.origins_of(query), self.origins_of(masks))
        self.attention_reads.append(read_attention)

    def set_origins(self, out, origins: frozenset[str]) -> None:
        for t in tree_leaves(out):
            if torch.is_tensor(t):
                self.origins[id(t)] = origins
                self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = weights_read(args, kwargs) if func is F.multi_head_attention_forward else None
        if read is not None:
            self._read_attention(read, args, kwargs)
        out = func(*args, **kwargs)
        params = [id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, nn.Parameter)]
        # a weight's values read, not its dtype, device or shape (`x.to(self.embed.weight.dtype)`)
        values_read = any(torch.is_tensor(t) for t in tree_leaves(out))
        for owners in (self.owners[i] for i in params if i in self.owners and values_read):
            running = owners & self.running  # a tied weight is read by the forward of either module holding it
            # an embedding's own forward that reads its weight other than by the lookup (Whisper's positions:
            # `self.weight[:n]`) is read by its code too: a vocab-parallel lookup cannot stand in for it
            if not running or (running <= self.lookups and func not in _LOOKUPS):
                self.read_elsewhere |= owners
        flows = [f for t in tree_leaves((args, kwargs)) if (f := self.get(t)) is not None]
        if flows:
            merged = Flow()
            for f in flows:
                merged = merged | f
            for t in tree_leaves(out):
                if torch.is_tensor(t):
                    self.set(t, merged)
        # what the output projection the function runs writes is made of its own parameters, as a called one's
        origins = self.origins_of([read["out"], read["out_bias"]] if read else (args, kwargs))
        if origins:
            self.set_origins(out, origins)
        return out


@dataclass(frozen=True)
class ReadAttention:
    """One call of ``F.multi_head_attention_forward`` on projections' weights (WavLM's attention):
    ``weights`` ``{"q", "k", "v", "out": parameter name}``, the ``heads`` it was handed, and the origins
    of its query and of the masks (per head, each rank reads its heads' share)."""

    weights: dict
    heads: int
    query: frozenset[str]
    masks: frozenset[str]


@dataclass
class Trace:
    """Per block path: each projection's input flow (relative suffix -> Flow), in call order."""

    blocks: list[str]
    heads: list[str] = field(default_factory=list)  # pooling heads beside the stacks (`pooling_heads`)
    reads: dict[str, dict[str, Flow]] = field(default_factory=dict)
    leaf_reads: dict[str, dict[str, Flow]] = field(default_factory=dict)  # other leaves with parameters
    # projections never called whose weight the block's code reads itself (``F.linear(x, self.qkv.weight,
    # bias)``: timm's EVA and BEiT attention with a q/v bias): a cut layer cannot stand in for them
    bypassed: dict[str, list[str]] = field(default_factory=dict)
    # per block: {owner: (q, k, v, out, heads)} of the modules whose code runs F.multi_head_attention_forward
    # on its projections' weights (`ReadAttention`), paths relative to the block: cut by `ReadMultiheadAttention`
    read_attention: dict[str, dict[str, tuple]] = field(default_factory=dict)
    # per block: the parameters (model-wide names) each projection's input was computed from; and those
    # the model's outputs were computed from without passing through a block's projection
    origins: dict[str, dict[str, frozenset[str]]] = field(default_factory=dict)
    output_origins: frozenset[str] = frozenset()
    # outside the blocks: modules whose weight the model's code reads itself (MobileBERT's LM head concatenates
    # its decoder's weight with another's; Perceiver's decoder multiplies by the input embedding's), and
    # embeddings whose own forward indexes their weight (Whisper's positions): no vocab-parallel layer
    # stands in for them there
    read_by_weight: list[str] = field(default_factory=list)


def _leaf_with_params(module: nn.Module) -> bool:
    return not list(module.children()) and any(True for _ in module.parameters(recurse=False))


def trace(model: nn.Module, inputs: dict) -> Trace:
    """One forward of ``model`` on ``inputs``, following the flows inside every repeated block."""
    blocks = blocks_to_cut(model)
    result = Trace(blocks, pooling_heads(model))
    mode = FlowMode({id(p): name for name, p in model.named_parameters()})
    handles = []
    current: list[str] = []

    def enter_block(path: str, block: nn.Module):
        widths = {in_width(m) for m in block.modules() if is_projection(m)}

        def hook(_m, args, kwargs):
            mode.flows.clear()
            current.append(path)
            result.reads.setdefault(path, {})
            result.leaf_reads.setdefault(path, {})
            result.origins.setdefault(path, {})
            floats = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.is_floating_point()]
            stream = [t for t in floats if t.dim() >= 2 and t.shape[-1] in widths]
            # none with the features last: channels first (a convolutional block's [batch, C, H, W] that
            # its code turns channels-last before its projections: ConvNeXt's); else a stage's input, of
            # a width no projection reads until the stage's patch embedding makes the stream (Segformer's)
            stream = stream or [t for t in floats if t.dim() >= 3 and t.shape[1] in widths]
            for t in stream or [t for t in floats if t.dim() >= 3]:
                mode.set(t, Flow(stream=True))

        return hook

    def leave_block(_m, _args, _out):
        current.pop()

    def leaf_hooks(block_path: str, rel: str, module: nn.Module):
        reads = result.reads if is_projection(module) else result.leaf_reads

        def before(_m, args):
            if current and current[-1] == block_path:
                x = next((t for t in tree_leaves(args) if torch.is_tensor(t)), None)
                flow = mode.get(x) or Flow()
                reads[block_path][rel] = reads[block_path].get(rel, Flow()) | flow
                if is_projection(module):
                    seen = result.origins[block_path].get(rel, frozenset())
                    result.origins[block_path][rel] = seen | mode.origins_of(x)

        def after(_m, _args, out):
            if current and current[-1] == block_path and is_projection(module):
                for t in tree_leaves(out):
                    if torch.is_tensor(t):
                        mode.set(t, Flow(sources=frozenset([rel])))
                # what the projection read is recorded above: its output is made of its own parameters
                mode.set_origins(out, mode.origins_of(list(module.parameters())))

        return before, after

    modules = dict(model.named_modules())
    # the weights of modules outside the blocks and of the blocks' projections: read only by their own forward
    # (or by that of a module holding the same weight: the blocks of a shared, tied layer each call their own)?
    for path, m in modules.items():
        if isinstance(getattr(m, "weight", None), nn.Parameter) and (not inside(path, blocks) or is_projection(m)):
            mode.owners.setdefault(id(m.weight), set()).add(path)
            if isinstance(m, nn.Embedding):
                mode.lookups.add(path)
            handles.append(m.register_forward_pre_hook(lambda _m, _a, p=path: mode.running.add(p)))
            handles.append(m.register_forward_hook(lambda _m, _a, _o, p=path: mode.running.discard(p)))
    for path in blocks + result.heads:
        block = modules[path]
        handles.append(block.register_forward_pre_hook(enter_block(path, block), with_kwargs=True))
        handles.append(block.register_forward_hook(leave_block))
        for rel, m in block.named_modules():
            if rel and (is_projection(m) or _leaf_with_params(m)):
                before, after = leaf_hooks(path, rel, m)
                handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    output = run_hooked(model, inputs, handles, mode)
    result.output_origins = mode.origins_of(list(output.values()) if isinstance(output, dict) else output)
    result.read_by_weight = sorted(p for p in mode.read_elsewhere if not inside(p, blocks))
    _place_read_attention(result, mode.attention_reads, modules)
    for path in blocks + result.heads:
        result.bypassed[path] = [
            rel
            for rel, m in modules[path].named_modules()
            if rel
            and is_projection(m)
            and rel not in result.reads.get(path, {})
            and f"{path}.{rel}" in mode.read_elsewhere
        ]
    return result


def _place_read_attention(result: Trace, reads: list[ReadAttention], modules: dict) -> None:
    """Each read inside a block, relative to it: its projections (cut as columns and a row) and their owner;
    its query's origins read by the columns, its masks' by the row (each rank reads its heads' share)."""
    for read in reads:
        rels = [name.rpartition(".")[0] for name in read.weights.values()]
        block = next((b for b in result.blocks + result.heads if all(r.startswith(f"{b}.") for r in rels)), None)
        if block is None or not all(is_projection(modules.get(r)) for r in rels):
            continue
        q, k, v, out = (r[len(block) + 1 :] for r in rels)
        owner = _common_owner([q, k, v, out])
        result.read_attention.setdefault(block, {})[owner] = (q, k, v, out, read.heads)
        origins = result.origins.setdefault(block, {})
        for rel in (q, k, v):
            origins[rel] = origins.get(rel, frozenset()) | read.query
        origins[out] = origins.get(out, frozenset()) | read.masks


def _common_owner(rels: list[str]) -> str:
    parts = [r.split(".")[:-1] for r in rels]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def inside(path: str, owners: list[str]) -> bool:
    return any(path.startswith(f"{owner}.") for owner in owners)


@dataclass
class Group:
    """Column projections that feed one row projection, relative to their block."""

    cols: tuple[str, ...]
    row: str


def pair(
    reads: dict[str, Flow], replicated_columns: bool = False, after_rows: bool = False, after_whole: bool = False
) -> tuple[list[Group], list[str]]:
    """The column/row groups of one block's projections, and the projections left whole (with why).
    ``replicated_columns``: a row may also read a projection of a tensor every rank holds whole (timm's
    Swin-V2 relative position MLP, one value per head): that projection is one more column of the group,
    cut by its outputs. ``after_rows``: a projection reading only rows' outputs (whole on every rank
    after the row's all-reduce) reads the stream: a pooling head's MLP after its attention, with no
    residual around the attention to carry the stream on. ``after_whole``: so does one reading only rows'
    outputs and those of projections of the stream left whole (MobileBERT's bottlenecks, whose narrow
    output its attention and feed-forward layers read in place of the stream); where the final pairing
    does not bear that out, no group is found."""
    original = reads
    groups, whole = _pair(reads, replicated_columns)
    fed: set[str] = set()
    while after_rows or after_whole:
        replicated = {g.row for g in groups} | ({r for r in whole if reads[r].stream} if after_whole else set())
        more = {rel for rel, f in reads.items() if not f.stream and f.sources and f.sources <= replicated}
        if not more:
            break
        fed |= more
        reads = {**reads, **{rel: Flow(stream=True) for rel in more}}
        groups, whole = _pair(reads, replicated_columns)
    if after_whole:  # each read fed whole outputs in the pairing found (not a column's, cut since)
        replicated = {g.row for g in groups} | {r for r in whole if reads[r].stream}
        if any(not original[rel].sources <= replicated for rel in fed):
            return [], list(original)
    return groups, whole


def _pair(reads: dict[str, Flow], replicated_columns: bool) -> tuple[list[Group], list[str]]:
    cols = {rel for rel, f in reads.items() if f.stream}
    rows = {rel: f.sources for rel, f in reads.items() if not f.stream and f.sources}
    for up, down in _low_rank(reads, cols, rows).items():  # the down projection is cut with the column beside it
        cols = (cols - {down}) | {up}
        rows.pop(up)
    replicated = {
        rel for rel, f in reads.items() if replicated_columns and not f.stream and not _from_columns(rel, reads, cols)
    }
    groups = [Group(tuple(sorted(src)), row) for row, src in rows.items() if src & cols and src <= cols | replicated]
    used: dict[str, int] = defaultdict(int)
    for g in groups:
        for c in g.cols:
            used[c] += 1
    # a column feeding two rows, or a row fed by a non-column, is not a plain pair: left whole
    groups = [g for g in groups if all(used[c] == 1 for c in g.cols)]
    paired = {c for g in groups for c in g.cols} | {g.row for g in groups}
    return groups, [rel for rel in reads if rel not in paired]


def _low_rank(reads: dict[str, Flow], cols: set[str], rows: dict[str, frozenset[str]]) -> dict[str, str]:
    """``{up: down}`` of the low-rank side paths beside a column (Zamba2's adapters, as LoRA's: ``proj(x) +
    up(down(x))``): ``up`` reads only ``down``, a column no other projection reads, and a row reads ``up``
    together with a column. Cut as the column beside it (``down`` whole: ``up`` reads its whole output on every
    rank), so the row's group holds both; only where that makes every input of the row a column."""
    readers: dict[str, int] = defaultdict(int)
    for sources in rows.values():
        for source in sources:
            readers[source] += 1
    found: dict[str, str] = {}
    for sources in rows.values():
        ups = {up: next(iter(rows[up])) for up in sources - cols if len(rows.get(up, ())) == 1}
        if not sources & cols or len(ups) != len(sources - cols):
            continue
        if all(down in cols and readers[down] == 1 and readers[up] == 1 for up, down in ups.items()):
            found.update(ups)
    return found


def _from_columns(rel: str, reads: dict[str, Flow], cols: set[str], seen: frozenset[str] = frozenset()) -> bool:
    """Whether the input of projection ``rel`` was computed, through any projections (not through those in
    ``seen``: rows whose all-reduce makes their output whole), from a column's output."""
    sources = reads[rel].sources - seen
    return bool(sources & cols) or any(
        _from_columns(s, reads, cols, seen | {rel}) for s in sources if s in reads and s not in cols
    )


def mixed_rows(reads: dict[str, Flow], groups: list[Group]) -> list[str]:
    """Projections computed from columns' outputs that no group holds (CaiT's talking heads: a
    projection across the heads between q/k and the output projection): no cut over heads computes them."""
    cols = {rel for rel, f in reads.items() if f.stream}
    rows = frozenset(g.row for g in groups)
    grouped = rows | {c for g in groups for c in g.cols}
    return [
        rel for rel, f in reads.items() if not f.stream and rel not in grouped and _from_columns(rel, reads, cols, rows)
    ]
