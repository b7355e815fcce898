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
  (`Linear1D_RowIntoParallel`). Zamba's multi-head Mamba writes ``x`` and ``gate`` interleaved (one
  channel's pair after another's: cut evenly) and keeps ``x_proj``, ``dt_proj``, ``A_log`` and ``D`` per
  head (``[heads, ...]`` parameters, cut with the heads: each head's scan reads its own channels alone).
- Mamba-2: ``in_proj`` writes ``[z | x | B | C | dt]`` (B and C per group of heads, dt per head); the
  convolution runs over ``[x | B | C]``; ``A_log``, ``D``, ``dt_bias`` are per head; the gated norm
  normalises per group. Each rank holds whole groups where ``n_groups`` splits over tp; with one group
  (Falcon-H1, Bamba, Granite-4, Zamba2) every rank holds B and C whole, their gradients summed over
  the ranks, and the gated norm's variance spans the ranks (`NormOverRanks`).

The widths are read again on the model being cut (`Layout`), so a rule found on the tiny copy cuts
the user's sizes. transformers' fused kernels (``mamba_ssm``'s, or the hub's with ``use_kernels``)
read ``out_proj``'s and ``x_proj``'s whole weights themselves: with them the cut is refused
(`fused_kernels`).

Each rank's share of the mixer is run in this process on the recorded input (an inner row given the
whole output its all-reduce gives) to choose which counts its code reads become per-rank, as
`.simulate` does for a plain group; the proof on ranks confirms the cut.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardformer.core.compare import ATOL, RTOL, max_error
from shardformer.core.refusal import HEADS, Reason
from shardformer.core.shard_spec import make_spec, slice_tensor
from shardformer.policies.derived.attributes import attribute_candidates, per_rank_attributes
from shardformer.policies.derived.blocks import in_width, is_projection, out_width
from shardformer.policies.derived.simulate import record_calls

CONV_COUNTS = ("in_channels", "out_channels", "groups")  # the depthwise convolution's own, always per-rank
MIXER_COLUMN = ("mixer",)  # a rule's column spec: the mixer's in_proj, in the blocks its `Layout` reads
FUSED_PACKAGE = "mamba_ssm"  # mamba_inner_fn, mamba_split_conv1d_scan_combined: they read out_proj's weight
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


@dataclass(frozen=True)
class Layout:
    """A mixer's channel widths by role (``written``: in_proj's output, ``channels``: the convolution's,
    ``inner``, ``heads``, ``groups``): ``{role: (blocks, units)}``, each block of whole units (heads,
    groups, one dt per head; None: cut evenly), a block of fewer units than ranks held by every rank.
    ``spans_ranks``: one group over several ranks, whose gated norm's variance spans them."""

    tp: int
    cuts: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]]
    spans_ranks: bool = False

    def role(self, width: int) -> str | None:
        return next((r for r, (blocks, _) in self.cuts.items() if sum(blocks) == width), None)

    def width(self, role: str) -> int:
        return sum(self.cuts[role][0])

    def spec(self, shape, dim: int, role: str, rank: int):
        blocks, units = self.cuts[role]
        return make_spec(shape, dim, rank, self.tp, blocks, head_width=units)

    def local(self, width: int) -> int | None:
        """This rank's share of a whole ``width`` of the mixer's (None: no width of the mixer)."""
        role = self.role(width)
        return None if role is None else self.spec((width,), 0, role, 0).local_size


@dataclass(frozen=True)
class MixerParts:
    """Where a mixer's parts are, relative to its block: the convolution, ``in_proj`` (``col``),
    ``out_proj`` (``row``) and the norms over its inner channels."""

    conv: str
    col: str
    row: str
    norms: tuple[str, ...] = ()
    interleaved: bool = False  # in_proj writes [x | gate] channel by channel (Zamba's), not as two blocks


@dataclass
class MixerCut:
    """A mixer's cut, paths relative to the block: its `MixerParts`, the inner ``rows`` (``x_proj``),
    the tensors cut with the channels (``{leaf: {name: (dim, role)}}``) and the ints made per-rank."""

    parts: MixerParts | None
    rows: set[str] = field(default_factory=set)
    channels: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)
    divide: tuple[str, ...] = ()
    grad_sum: set[str] = field(default_factory=set)  # leaves on the inner rows' whole outputs (Jamba's dt/B/C norms)


def layout_of(mixer: nn.Module, conv: nn.Conv1d, col: nn.Module, row: nn.Module, tp: int, interleaved=False):
    """The `Layout` of the mixer's widths (``in_proj``'s output, the convolution's channels, the inner
    width, the heads), None where they are no Mamba layout, or a `Reason` it cannot be cut. ``interleaved``:
    Mamba's ``[x | gate]`` written channel by channel."""
    inner, channels, written = in_width(row), conv.out_channels, out_width(col)
    groups = getattr(mixer, "n_groups", None)
    if type(groups) is not int:  # Mamba: [x | gate], the convolution over x
        if channels != inner or written != 2 * inner:
            return None
        cuts = {"written": ((2 * inner,) if interleaved else (inner, inner), None), "inner": ((inner,), None)}
        heads = _scan_heads(mixer, inner)
        if heads is not None and heads % tp:
            text = (
                f"its {heads} scan heads (per-head parameters [heads, ...]) do not split over tensor_parallel_size={tp}"
            )
            return Reason(text, HEADS)
        return Layout(tp, cuts | ({"heads": ((heads,), None)} if heads else {}))
    state, heads = (channels - inner) // 2, written - inner - channels  # B and C: n_groups x state each
    if channels <= inner or (channels - inner) % 2 or heads <= 0:
        return None
    if heads % tp or inner % heads or (groups % tp and groups != 1):
        return Reason(
            f"n_groups={groups} (num_heads={heads}) does not split over tensor_parallel_size={tp}: B, C and the "
            f"gated norm are per group, and each rank holds whole groups (or, with one group, all of it)",
            HEADS,
        )
    cuts = {
        "written": (inner, inner, state, state, heads),
        "channels": (inner, state, state),
        "inner": (inner,),
        "heads": (heads,),
    }
    if groups % tp == 0:
        return Layout(tp, {role: (blocks, None) for role, blocks in cuts.items()} | {"groups": ((groups,), None)})
    head = inner // heads  # one group: B and C held whole by every rank, the heads cut
    units = {"written": (head, head, state, state, 1), "channels": (head, state, state), "inner": (head,)}
    return Layout(tp, {role: (blocks, units.get(role, (1,))) for role, blocks in cuts.items()}, spans_ranks=True)


def _scan_heads(mixer: nn.Module, inner: int) -> int | None:
    """The heads of a Mamba mixer that scans its channels head by head (Zamba's ``n_mamba_heads``): the
    first dimension of its own parameters laid out ``[heads, head width, ...]``; None for one scan."""
    for t in mixer.parameters(recurse=False):
        if t.dim() >= 2 and 1 < t.shape[0] < inner and t.shape[0] * t.shape[1] == inner:
            return t.shape[0]
    return None


def fused_kernels(model: nn.Module) -> str | None:
    """How transformers would run a mixer through a fused kernel that reads ``out_proj``'s (and
    ``x_proj``'s) whole weight itself, so no cut layer stands in for them; None where it cannot."""
    if importlib.util.find_spec(FUSED_PACKAGE) is not None:
        return f"the {FUSED_PACKAGE} package is installed (its fused mamba_inner_fn / mamba_split_conv1d_scan_combined)"
    if getattr(model, "use_kernels", False):
        return "the model was loaded with use_kernels=True (the hub's fused mamba kernels)"
    return None


def local_counts(root: nn.Module, names, layout: Layout) -> dict[str, object]:
    """``{dotted name below root: per-rank value}``: a count equal to one of the mixer's widths becomes
    this rank's share of that width (with one group, ``conv_dim`` keeps B and C whole), others ``/ tp``."""
    values, others = {}, []
    for dotted in names:
        owner, _, name = dotted.rpartition(".")
        whole = None if owner.endswith("config") else getattr(root.get_submodule(owner), name)
        local = layout.local(whole) if type(whole) is int else None
        if local is None:
            others.append(dotted)
        else:
            values[dotted] = local
    return values | per_rank_attributes(root, others, layout.tp)


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
    parts = module, model.get_submodule(f"{block}.{conv}"), col, model.get_submodule(f"{block}.{out[0]}"), tp
    first = layout_of(*parts)
    if not isinstance(first, Layout):
        return first
    found = _cut_with(model, block, mixer, conv, (cols[0], out[0], rows), leaf_reads, first, inputs)
    second = layout_of(*parts, interleaved=True)  # Mamba's [x | gate] written channel by channel (Zamba's)
    if isinstance(found, MixerCut) or second == first:
        return found
    found = _cut_with(model, block, mixer, conv, (cols[0], out[0], rows), leaf_reads, second, inputs)
    if isinstance(found, MixerCut):
        found.parts = dataclasses.replace(found.parts, interleaved=True)
    return found


def _cut_with(model, block: str, mixer: str, conv: str, projections, leaf_reads, layout: Layout, inputs):
    """The mixer's `MixerCut` under ``layout`` (``projections``: its column, its row and every row traced
    in it), or the `Reason` no per-rank counts make it exact."""
    col, row, rows = projections
    module = model.get_submodule(f"{block}.{mixer}" if mixer else block)
    prefix = f"{mixer}." if mixer else ""
    inner = {r for r in rows if r != row}
    skip = {col, row, conv, *inner}
    # leaves reading only the inner rows' outputs stay whole; each rank's gradient covers its own channels
    grad_sum = {rel for rel, f in leaf_reads.items() if rel.startswith(prefix) and f.sources and f.sources <= inner}
    norms = tuple(
        f"{prefix}{rel}"
        for rel, leaf in module.named_modules()
        if rel and f"{prefix}{rel}" not in skip | grad_sum and _weight_width(leaf) == layout.width("inner")
    )
    cut = MixerCut(MixerParts(conv, col, row, norms), inner, grad_sum=grad_sum)
    for rel, leaf in module.named_modules():
        path = f"{prefix}{rel}".rstrip(".") or mixer
        if path in skip - {conv} or path in grad_sum:
            continue
        for name, t in [*leaf.named_parameters(recurse=False), *leaf.named_buffers(recurse=False)]:
            dim = next((d for d, n in enumerate(t.shape) if layout.role(n)), None)
            if dim is not None:
                cut.channels.setdefault(path, {})[name] = (dim, layout.role(t.shape[dim]))
    widths = {sum(blocks) for blocks, _ in layout.cuts.values()}
    chosen = _choose_counts(model, block, mixer, cut, layout, widths, inputs)
    if chosen is None:
        return Reason(f"{type(module).__name__} at {mixer}: no per-rank counts make its channels' cut exact")
    cut.divide = chosen
    return cut


def _weight_width(leaf: nn.Module) -> int | None:
    """The width of a leaf's one-dimensional ``weight`` (a norm's), else None."""
    weight = getattr(leaf, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None


class _Given(nn.Module):
    """Stands in for a module in the simulation: an inner row's whole output (what its all-reduce
    gives), a column's or a norm's rank share of its whole output."""

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


def _strip(path: str, prefix: str) -> str:
    return path[len(prefix) :] if path.startswith(prefix) else ""


def _choose_counts(model, block: str, mixer: str, cut: MixerCut, layout: Layout, widths, inputs):
    """The ints (relative to the block) to make per-rank: the smallest set of the candidates under which
    the simulated ranks' summed ``out_proj`` equals the whole mixer's (a chunk length that equals the
    head count by chance stays whole); None where no set does. A norm whose group spans the ranks is
    given its rank's share of the whole norm's output (its collective runs on ranks, in the proof)."""
    path, prefix, parts = f"{block}.{mixer}" if mixer else block, f"{mixer}." if mixer else "", cut.parts
    given_paths = [f"{block}.{r}" for r in [parts.col, *cut.rows, *(parts.norms if layout.spans_ranks else ())]]
    calls = record_calls(model, [path, f"{block}.{parts.row}", *given_paths], inputs)
    if path not in calls or f"{block}.{parts.row}" not in calls:
        return None
    module = model.get_submodule(path)
    args, kwargs, _ = calls[path]
    expected = calls[f"{block}.{parts.row}"][2]
    # an inner row's all-reduce gives its whole output; a column's (a spanning norm's) is cut from the whole
    given = {_strip(p, f"{block}.{prefix}"): calls[p][2] for p in given_paths if p in calls}
    local = MixerCut(
        MixerParts(
            *(_strip(p, prefix) for p in (parts.conv, parts.col, parts.row)),
            tuple(_strip(n, prefix) for n in parts.norms),
        ),
        {_strip(r, prefix) for r in cut.rows},
        {_strip(p, prefix): t for p, t in cut.channels.items()},
    )
    conv = _strip(parts.conv, prefix)
    fixed = tuple(f"{conv}.{name}" for name in CONV_COUNTS)
    names = [n for n in attribute_candidates(module, widths, layout.tp) if not n.startswith(f"{conv}.")][:MAX_COUNTS]
    for divide in (c for k in range(len(names) + 1) for c in itertools.combinations(names, k)):
        try:
            got = _run_ranks(module, local, (*fixed, *divide), layout, args, kwargs, given)
        except Exception:  # noqa: BLE001 - counts the code cannot run with: a rejected candidate
            continue
        if got.shape == expected.shape and max_error(got, expected, ATOL, RTOL)[1]:
            return tuple(prefix + n for n in (*fixed, *divide))
    return None


def _run_ranks(mixer: nn.Module, cut: MixerCut, divide, layout: Layout, args, kwargs, given) -> torch.Tensor:
    """The sum over the ranks of the mixer's ``out_proj`` output (its bias added once)."""
    total, parts = None, cut.parts
    for rank in range(layout.tp):
        local = copy.deepcopy(mixer)
        for rel, tensors in cut.channels.items():
            leaf = local.get_submodule(rel) if rel else local
            for name, (dim, role) in tensors.items():
                t = getattr(leaf, name)
                part = slice_tensor(t.detach(), layout.spec(t.shape, dim, role, rank))
                setattr(leaf, name, nn.Parameter(part) if isinstance(t, nn.Parameter) else part)
        whole = given[parts.col]
        local.set_submodule(parts.col, _Given(slice_tensor(whole, layout.spec(whole.shape, -1, "written", rank))))
        for norm in parts.norms if layout.spans_ranks else ():
            whole = given[norm]
            local.set_submodule(norm, _Given(slice_tensor(whole, layout.spec(whole.shape, -1, "inner", rank))))
        row = _row_share(local.get_submodule(parts.row), rank, layout.tp)
        captured: list[torch.Tensor] = []
        row.register_forward_hook(lambda _m, _a, out, into=captured: into.append(out))
        local.set_submodule(parts.row, row)
        for rel in cut.rows:
            local.set_submodule(rel, _Given(given[rel]))
        for dotted, value in local_counts(local, divide, layout).items():
            owner, _, name = dotted.rpartition(".")
            setattr(local.get_submodule(owner), name, value)
        with torch.no_grad():
            local(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        if len(captured) != 1:
            raise RuntimeError(f"out_proj ran {len(captured)} times")
        total = captured[0] if total is None else total + captured[0]
    bias = mixer.get_submodule(parts.row).bias
    return total if bias is None else total + bias.detach()


def cut_mixers(model: nn.Module, block: str, reads, leaf_reads, tp: int, inputs, decided=()) -> dict:
    """``{mixer: its cut, or why it has none}`` of the block's state-space mixers (those of no Mamba
    layout are left out: their projections are grouped as any block's; those with a column in
    ``decided``, cut on an earlier block of the class, are left out too)."""
    found = {}
    for mixer, conv in mixers(model.get_submodule(block)).items():
        if any(col.startswith(f"{mixer}.") for col in decided):
            found[mixer] = MixerCut(None)  # nothing to add
            continue
        cut = mixer_cut(model, block, mixer, conv, reads, leaf_reads, tp, inputs)
        if cut is not None:
            found[mixer] = cut
    return found


def layouts_in(block: nn.Module, mixers_: dict[str, MixerParts], tp: int) -> dict[str, Layout]:
    """``{mixer: its Layout}`` read off the mixers of the rule that ``block`` holds (at its own sizes)."""
    found = {}
    for mixer, parts in mixers_.items():
        modules = dict(block.named_modules())
        if all(p in modules for p in (mixer, parts.conv, parts.col, parts.row)):
            widths = (modules[p] for p in (parts.conv, parts.col, parts.row))
            layout = layout_of(modules[mixer], *widths, tp, interleaved=parts.interleaved)
            if not isinstance(layout, Layout):
                raise ValueError(f"{type(modules[mixer]).__name__} at {mixer}: {layout or 'no Mamba layout'}")
            found[mixer] = layout
    return found
