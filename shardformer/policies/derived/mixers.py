"""State-space mixers (Mamba's and Mamba-2's selective scan), cut by channel as Megatron cuts them.

A mixer is a module holding a depthwise ``nn.Conv1d`` (one filter per channel) and the block's
projections around it. Its code reads most of its weights itself (``self.conv1d.weight``,
``self.dt_proj.weight @ dt``, ``A_log``, ``D``), where no stand-in layer sees them: the reads are
followed instead. Every tensor of the mixer with a dimension as long as the channels it holds gets
the cut of those channels. The channels, read off the widths of ``in_proj``, the convolution and
``out_proj`` (and ``n_groups``, where the mixer has one):

- Mamba: ``in_proj`` writes ``[x | gate]`` (two blocks of the inner width); the convolution,
  ``dt_proj``'s output, ``A_log`` and ``D`` are per channel; ``x_proj`` reads the channels and writes
  ``[dt | B | C]`` whole: a row whose all-reduced output feeds each rank's channels again
  (`Linear1D_RowIntoParallel`).
- Mamba-2: ``in_proj`` writes ``[z | x | B | C | dt]`` (B and C per group of heads, dt per head); the
  convolution runs over ``[x | B | C]``; ``A_log``, ``D``, ``dt_bias`` are per head; the gated norm
  normalises per group. Each rank holds whole groups, so ``n_groups`` must split over tp.

Each rank's share of the mixer is run in this process on the recorded input (an inner row given the
whole output its all-reduce gives) to choose which counts its code reads become per-rank, as
`.simulate` does for a plain group; the proof on ranks confirms the cut.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardformer.core.compare import ATOL, RTOL, max_error
from shardformer.core.refusal import HEADS, Reason
from shardformer.core.shard_spec import make_spec, slice_tensor
from shardformer.policies.derived.attributes import apply_attributes, attribute_candidates
from shardformer.policies.derived.blocks import in_width, is_projection, out_width
from shardformer.policies.derived.simulate import record_calls

CONV_COUNTS = ("in_channels", "out_channels", "groups")  # the depthwise convolution's own, always per-rank
# counts tried in every subset (the smallest first): a tiny mixer's state size, head width and chunk
# often equal its head count, so more candidates than a plain group's are in play
MAX_COUNTS = 10


def _depthwise(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv1d) and module.groups == module.in_channels == module.out_channels > 1


def mixers(block: nn.Module) -> dict[str, str]:
    """``{mixer: its depthwise convolution}`` (paths relative to ``block``) of the modules holding a
    depthwise ``nn.Conv1d`` and two projections or more."""
    found = {}
    for rel, module in block.named_modules():
        conv = next((name for name, child in module.named_children() if _depthwise(child)), None)
        if conv is not None and sum(map(is_projection, module.modules())) >= 2:
            found[rel] = f"{rel}.{conv}" if rel else conv
    return found


@dataclass
class MixerCut:
    """A mixer's cut, paths relative to the block: ``cols`` (``in_proj``: its blocks), the ``row``
    (``out_proj``), the inner ``rows`` (``x_proj``), the tensors cut with the channels
    (``{leaf: {name: (dim, blocks)}}``) and the ints made per-rank."""

    cols: dict[str, tuple[int, ...]]
    row: str
    rows: set[str] = field(default_factory=set)
    channels: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = field(default_factory=dict)
    divide: tuple[str, ...] = ()
    grad_sum: set[str] = field(default_factory=set)  # leaves on the inner rows' whole outputs (Jamba's dt/B/C norms)


def _blocks(mixer: nn.Module, conv: nn.Conv1d, col: nn.Module, row: nn.Module, tp: int):
    """``{width: blocks}`` of the mixer's channel widths (``in_proj``'s output, the convolution's
    channels, the inner width, the heads), None where the widths are no Mamba layout, or why not."""
    inner, channels, written = in_width(row), conv.out_channels, out_width(col)
    groups = getattr(mixer, "n_groups", None)
    if type(groups) is not int:  # Mamba: [x | gate], the convolution over x
        return {written: (inner, inner), inner: (inner,)} if channels == inner and written == 2 * inner else None
    state, heads = (channels - inner) // 2, written - inner - channels  # B and C: n_groups x state each
    if channels <= inner or (channels - inner) % 2 or heads <= 0:
        return None
    if groups % tp or heads % tp:
        return Reason(
            f"n_groups={groups} (num_heads={heads}) does not split over tensor_parallel_size={tp}: B, C and the "
            f"gated norm are per group, and each rank must hold whole groups",
            HEADS,
        )
    return {
        written: (inner, inner, state, state, heads),
        channels: (inner, state, state),
        inner: (inner,),
        heads: (heads,),
    }


def mixer_cut(model: nn.Module, block: str, mixer: str, conv: str, reads, leaf_reads, tp: int, inputs):
    """The cut of the mixer at ``mixer`` in ``block`` (``reads``/``leaf_reads``: the traced flows of the
    block's projections and other leaves): a `MixerCut`, None where it is no Mamba layout (the plain
    groups decide), or a `Reason` it cannot be cut."""
    module = model.get_submodule(f"{block}.{mixer}" if mixer else block)
    prefix = f"{mixer}." if mixer else ""
    inside = {rel: f for rel, f in reads.items() if rel.startswith(prefix)}
    cols = [rel for rel, f in inside.items() if f.stream]
    rows = [rel for rel, f in inside.items() if not f.stream and f.sources]
    if len(cols) != 1:
        return None
    col = model.get_submodule(f"{block}.{cols[0]}")
    out = [r for r in rows if out_width(model.get_submodule(f"{block}.{r}")) == in_width(col)]
    if len(out) != 1:
        return None
    blocks = _blocks(module, model.get_submodule(f"{block}.{conv}"), col, model.get_submodule(f"{block}.{out[0]}"), tp)
    if not isinstance(blocks, dict):
        return blocks
    inner = [r for r in rows if r != out[0]]
    cut = MixerCut({cols[0]: blocks[out_width(col)]}, out[0], set(inner))
    # leaves reading only the inner rows' outputs stay whole; each rank's gradient covers its own channels
    cut.grad_sum = {
        rel for rel, f in leaf_reads.items() if rel.startswith(prefix) and f.sources and f.sources <= cut.rows
    }
    for rel, leaf in module.named_modules():
        path = f"{prefix}{rel}".rstrip(".") or mixer
        if path in cut.cols or path == cut.row or path in cut.rows or path in cut.grad_sum:
            continue
        for name, t in [*leaf.named_parameters(recurse=False), *leaf.named_buffers(recurse=False)]:
            dim = next((d for d, n in enumerate(t.shape) if n in blocks), None)
            if dim is not None:
                cut.channels.setdefault(path, {})[name] = (dim, blocks[t.shape[dim]])
    widths = set(blocks) | {getattr(module, "n_groups", 0)}
    chosen = _choose_counts(model, block, mixer, conv[len(prefix) :], cut, widths, tp, inputs)
    if chosen is None:
        return Reason(f"{type(module).__name__} at {mixer}: no per-rank counts make its channels' cut exact")
    cut.divide = chosen
    return cut


class _Given(nn.Module):
    """Stands in for a projection in the simulation: an inner row's whole output (what its all-reduce
    gives), a column's rank share of its whole output."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *_args, **_kwargs) -> torch.Tensor:
        return self.output


def _row_share(module: nn.Module, rank: int, tp: int) -> nn.Linear:
    """``module`` (an ``nn.Linear``) with this rank's input features, without its bias (added once, after
    the ranks' sum)."""
    weight = slice_tensor(module.weight.detach(), make_spec(module.weight.shape, 1, rank, tp))
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def _choose_counts(model, block: str, mixer: str, conv: str, cut: MixerCut, widths, tp: int, inputs):
    """The ints (relative to the block) to make per-rank: the smallest set of the candidates under which
    the simulated ranks' summed ``out_proj`` equals the whole mixer's (a chunk length that equals the
    head count by chance stays whole); None where no set does."""
    path, prefix = f"{block}.{mixer}" if mixer else block, f"{mixer}." if mixer else ""
    given_paths = [f"{block}.{r}" for r in [*cut.cols, *cut.rows]]
    calls = record_calls(model, [path, f"{block}.{cut.row}", *given_paths], inputs)
    if path not in calls or f"{block}.{cut.row}" not in calls:
        return None
    module = model.get_submodule(path)
    args, kwargs, _ = calls[path]
    expected = calls[f"{block}.{cut.row}"][2]
    local = MixerCut(
        {c[len(prefix) :]: b for c, b in cut.cols.items()},
        cut.row[len(prefix) :],
        {r[len(prefix) :] for r in cut.rows},
        {(p[len(prefix) :] if p != mixer else ""): t for p, t in cut.channels.items()},
    )
    # an inner row's all-reduce gives its whole output; a column's output is sliced from the whole one's
    given = {r[len(prefix) :]: calls[f"{block}.{r}"][2] for r in [*cut.cols, *cut.rows] if f"{block}.{r}" in calls}
    fixed = tuple(f"{conv}.{name}" for name in CONV_COUNTS)
    names = [n for n in attribute_candidates(module, widths, tp) if not n.startswith(f"{conv}.")][:MAX_COUNTS]
    for divide in (c for k in range(len(names) + 1) for c in itertools.combinations(names, k)):
        try:
            got = _run_ranks(module, local, (*fixed, *divide), tp, args, kwargs, given)
        except Exception:  # noqa: BLE001 - counts the code cannot run with: a rejected candidate
            continue
        if got.shape == expected.shape and max_error(got, expected, ATOL, RTOL)[1]:
            return tuple(prefix + n for n in (*fixed, *divide))
    return None


def _run_ranks(mixer: nn.Module, cut: MixerCut, divide, tp: int, args, kwargs, given) -> torch.Tensor:
    """The sum over ``tp`` simulated ranks of the mixer's ``out_proj`` output (its bias added once)."""
    total = None
    for rank in range(tp):
        local = copy.deepcopy(mixer)
        for rel, tensors in cut.channels.items():
            leaf = local.get_submodule(rel) if rel else local
            for name, (dim, blocks) in tensors.items():
                t = getattr(leaf, name)
                part = slice_tensor(t.detach(), make_spec(t.shape, dim, rank, tp, blocks))
                setattr(leaf, name, nn.Parameter(part) if isinstance(t, nn.Parameter) else part)
        for rel, blocks in cut.cols.items():
            whole = given[rel]
            local.set_submodule(rel, _Given(slice_tensor(whole, make_spec(whole.shape, -1, rank, tp, blocks))))
        row = _row_share(local.get_submodule(cut.row), rank, tp)
        captured: list[torch.Tensor] = []
        row.register_forward_hook(lambda _m, _a, out, into=captured: into.append(out))
        local.set_submodule(cut.row, row)
        for rel in cut.rows:
            local.set_submodule(rel, _Given(given[rel]))
        apply_attributes(local, divide, tp)
        with torch.no_grad():
            local(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        if len(captured) != 1:
            raise RuntimeError(f"out_proj ran {len(captured)} times")
        total = captured[0] if total is None else total + captured[0]
    bias = mixer.get_submodule(cut.row).bias
    return total if bias is None else total + bias.detach()


def cut_mixers(model: nn.Module, block: str, reads, leaf_reads, tp: int, inputs, decided=()) -> dict:
    """``{mixer: its cut, or why it has none}`` of the block's state-space mixers (those of no Mamba
    layout are left out: their projections are grouped as any block's; those with a column in
    ``decided``, cut on an earlier block of the class, are left out too)."""
    found = {}
    for mixer, conv in mixers(model.get_submodule(block)).items():
        if any(col.startswith(f"{mixer}.") for col in decided):
            found[mixer] = MixerCut({}, "")  # nothing to add
            continue
        cut = mixer_cut(model, block, mixer, conv, reads, leaf_reads, tp, inputs)
        if cut is not None:
            found[mixer] = cut
    return found
