"""Megatron sequence parallelism on a tensor-parallel model, without rewriting the model's forward.

Between attention and MLP blocks (norms, dropout, residual adds) plain tensor parallelism keeps the
full ``[batch, seq, hidden]`` activations on every rank. With sequence parallelism each rank keeps
``seq / tp`` of them instead:

- the first layer of the stack (of a pipeline stage) splits its input along the sequence; the region
  ends after the model's final norm (where the family or transformers' pipeline plan names one and
  this stage holds it), which runs on the chunk and all-gathers its output, else after the last
  layer. Embeddings and heads see the full sequence, because transformers' forwards read positions
  and masks from the full length. The vocab-parallel LM head reading the final norm's gathered
  output keeps only this rank's chunk of it for the backward, re-gathers it there and
  reduce-scatters its input gradient into the chunk (with ``regather``, as Megatron-LM's
  sequence-parallel output layer); the hidden states the model returns are gathered;
- an *entry* (a block holding column-parallel layers: attention, MLP) all-gathers its input, and the
  gradient is reduce-scattered; the column layers skip their own all-reduce. With ``regather`` (the
  default) they keep only this rank's chunk of the gathered input for the backward and all-gather
  it again there, as Megatron-LM does (one more all-gather per entry and step, for 1/tp of the
  memory of the gathered inputs); without, they keep the gathered input;
- row-parallel layers reduce-scatter their output instead of all-reducing it;
- parameters in the split region (norms, row biases, layer scales) see a chunk of the sequence: a
  hook sums their gradients over the tp ranks;
- dropout in the split region draws the full-sequence mask (the one plain tp draws) and keeps its chunk.

A forward shorter than the tp size (a decode step) runs as plain tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardformer.core.comm import all_reduce, group_size
from shardformer.core.record import sharding_of
from shardformer.tensor_parallel.layers.dropout import DropoutForReplicatedInput
from shardformer.tensor_parallel.layers.linear import Linear1D_Col, Linear1D_Row, VocabParallelLMHead1D
from shardformer.tensor_parallel.sequence_regions import (
    SEQ_DIM,
    GatheredSequence,
    chunk_length,
    gather_sequence,
    gather_sequence_for_tp,
    own_chunk,
    reduce_scatter_sequence,
    split_sequence,
)


class SequenceParallel:
    """The state of one model's sequence parallelism, set by the first layer of every forward."""

    def __init__(self, group, plan: SequenceParallelPlan, regather: bool = True) -> None:
        self.group, self.world, self.plan, self.regather = group, group_size(group), plan, regather
        self.active = False  # this forward runs split (its sequence is at least tp long)
        self.grad_active = False  # the latest forward under autograd did
        self.full_len = 0
        self._gathered: GatheredSequence | None = None  # the latest entry input, while regathering
        self.final_norm_here = lambda: False  # this stage holds the final norm (set by apply_sequence_parallel)
        self._end_pending = False  # the last layer left its output split: the final norm ends the region
        self._end: GatheredSequence | None = None  # the final norm's gathered output, while regathering
        self._end_chunk: torch.Tensor | None = None  # its chunk, held until the head reads it (nothing else may)

    @property
    def local_len(self) -> int:
        return chunk_length(self.full_len, self.world)

    def begin(self, hidden: torch.Tensor) -> torch.Tensor:
        self.full_len = hidden.shape[SEQ_DIM]
        self.active = self.full_len >= self.world
        self._end_pending, self._end, self._end_chunk = False, None, None
        if torch.is_grad_enabled():
            self.grad_active = self.active
        return split_sequence(hidden, self.group) if self.active else hidden

    def end(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_sequence(hidden, self.group, self.full_len) if self.active else hidden

    def end_of_layers(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output: gathered here, or left split for the final norm to end the region."""
        if self.active and self.final_norm_here():
            self._end_pending = True
            return hidden
        return self.end(hidden)

    def check_norm_input(self, x: torch.Tensor, where: str) -> None:
        if self._end_pending and not self.is_split(x):
            raise RuntimeError(
                f"sequence parallelism: the final norm {where} expected this rank's {self.local_len} of "
                f"{self.full_len} tokens (the last layer's output) along dim {SEQ_DIM}, got {tuple(x.shape)}; "
                f"the model changes the hidden states between its last layer and {where}, shard it with "
                f"sequence_parallel=False"
            )

    def end_at_norm(self, out: torch.Tensor) -> torch.Tensor:
        """The final norm's output (a chunk, if the region is still open): all-gathered, and remembered
        for the LM head while re-gathering (the gathered tensor's backward keeps this rank's chunk of
        its gradient: its readers besides the head, such as returned hidden states, are replicated)."""
        if not self._end_pending:
            return out
        self._end_pending = False
        full = gather_sequence(out, self.group, self.full_len)
        if self.regather and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._end, self._end_chunk = GatheredSequence(full, out, self.group, self.full_len), out
        return full

    def check_closed(self, where: str) -> None:
        """After the model's forward: the region was closed, and the final norm's chunk is let go."""
        self._end, self._end_chunk = None, None
        if self._end_pending:
            self._end_pending = False
            raise RuntimeError(
                f"sequence parallelism: {where} ran its last layer but not its final norm, so its output would "
                f"hold this rank's chunk of the sequence; shard it with sequence_parallel=False"
            )

    def head_source(self, x: torch.Tensor) -> tuple[GatheredSequence | None, torch.Tensor | None]:
        """For the LM head reading ``x``: the final norm's gathered output and its chunk, if ``x`` is that
        output (unchanged) and regathering is on, else ``(None, None)`` (the head runs as plain tp)."""
        end = self._end
        if end is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None, None
        chunk = end.chunk_of(x)
        if chunk is None:
            return None, None
        self._end, self._end_chunk = None, None  # the head saves the chunk itself
        return end, chunk

    def full_hidden_states(self, output):
        """A model output whose ``hidden_states`` (recorded by transformers' hooks inside the split
        region: this rank's chunks) are gathered, as the unsharded model returns them."""
        if not self.active or torch.is_tensor(output):
            return output
        if isinstance(output, dict):  # transformers' ModelOutput
            states = output.get("hidden_states")
            if isinstance(states, tuple):
                output["hidden_states"] = self._gathered_states(states)
            return output
        if type(output) is tuple:  # return_dict=False: hidden states are a tuple inside the tuple
            return tuple(self._gathered_states(o) if type(o) is tuple else o for o in output)
        return output

    def _gathered_states(self, states: tuple) -> tuple:
        return tuple(self.end(h) if torch.is_tensor(h) and h.dim() == 3 and self.is_split(h) else h for h in states)

    def is_split(self, x: torch.Tensor) -> bool:
        return self.active and x.dim() > SEQ_DIM and x.shape[SEQ_DIM] == self.local_len

    def gather_for_tp(self, x: torch.Tensor, where: str) -> torch.Tensor:
        if not self.active:
            return x
        if not self.is_split(x):
            raise RuntimeError(
                f"sequence parallelism: {where} expected this rank's {self.local_len} of {self.full_len} tokens "
                f"along dim {SEQ_DIM}, got {tuple(x.shape)}; the model passes it something the policy did not "
                f"expect, shard it with sequence_parallel=False"
            )
        full = gather_sequence_for_tp(x, self.group, self.full_len)
        if self.regather and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._gathered = GatheredSequence(full, x, self.group, self.full_len)
        return full

    def regather_source(self, x: torch.Tensor) -> tuple[GatheredSequence | None, torch.Tensor | None]:
        """For a column layer reading ``x``: where to re-gather it from in backward and the chunk to keep,
        if ``x`` is the latest entry input, unchanged, and regathering is on (else ``(None, None)``:
        the layer keeps ``x``)."""
        gathered = self._gathered
        if gathered is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None, None
        chunk = gathered.chunk_of(x)
        return (gathered, chunk) if chunk is not None else (None, None)

    def reduce_scatter(self, y: torch.Tensor, where: str) -> torch.Tensor:
        if y.dim() <= SEQ_DIM or y.shape[SEQ_DIM] != self.full_len:
            raise RuntimeError(
                f"sequence parallelism: row-parallel {where} produced {tuple(y.shape)}, not the {self.full_len} "
                f"tokens of the sequence along dim {SEQ_DIM}; shard this model with sequence_parallel=False"
            )
        return reduce_scatter_sequence(y, self.group, self.full_len)

    def own_chunk(self, full: torch.Tensor) -> torch.Tensor:
        return own_chunk(full, self.group, self.full_len)

    def full_shape(self, x: torch.Tensor) -> torch.Size:
        shape = list(x.shape)
        shape[SEQ_DIM] = self.full_len
        return torch.Size(shape)

    def reduce_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Gradient hook of a split-region parameter: each rank saw a chunk of the sequence."""
        if not self.grad_active:
            return grad
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), self.group)

    def layer_options(self, path: str, cls: type) -> dict:
        """What the layer the sharder builds at ``path`` (of class ``cls``) is given: the parallel
        layers this state (and their name, for errors), dropout in the split region this state."""
        if path in self.plan.parallel:
            return {"sequence_parallel": self, "sequence_parallel_name": path}
        if path in self.plan.heads:
            return {"sequence_parallel_end": self}
        in_stack = path.startswith(self.plan.layers + ".")
        if in_stack and isinstance(cls, type) and issubclass(cls, DropoutForReplicatedInput):
            return {"sequence_parallel": self}  # in the split region: its chunk of the full mask
        return {}


@dataclass
class SequenceParallelPlan:
    """What sequence parallelism touches, by path (resolved before anything is cut)."""

    layers: str  # the ModuleList of transformer layers
    final_norm: str | None = None  # the norm right after the layers, which ends the region (None: the last layer)
    heads: list[str] = field(default_factory=list)  # vocab-parallel LM heads, which may read the final norm
    entries: list[str] = field(default_factory=list)  # blocks whose input is gathered
    parallel: list[str] = field(default_factory=list)  # column/row layers inside the layers
    split_params: list[str] = field(default_factory=list)  # parameters that see a chunk of the sequence


def _under(path: str, prefixes) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def plan_sequence_parallel(
    model: nn.Module, layers: str, replacements, entry_suffixes=None, final_norm: str | None = None
) -> SequenceParallelPlan:
    """Find entries, parallel layers and split-region parameters; refuse what cannot be exact.

    ``layers``: the path of the model's layer stack (from its family record); ``replacements``: the
    sharder's planned swaps; ``entry_suffixes``: the policy's entries relative to a layer (default:
    each child of a layer that holds a column-parallel layer); ``final_norm``: the path of the norm the
    model applies to the last layer's output, and nothing else before it (from its family record or
    transformers' pipeline plan; None: the region ends after the last layer). It is used only if it is
    a per-token norm (LayerNorm, RMSNorm) that nothing replaces.
    """
    plan = SequenceParallelPlan(layers, final_norm=_per_token_norm(model, final_norm, replacements))
    if plan.final_norm is not None:
        plan.split_params += [
            f"{plan.final_norm}.{n}" for n, _ in model.get_submodule(plan.final_norm).named_parameters()
        ]
        plan.heads = [r.path for r in replacements if _is(r, VocabParallelLMHead1D)]
    layer_list = model.get_submodule(layers)
    columns = [r.path for r in replacements if _is(r, Linear1D_Col) and not _is(r, VocabParallelLMHead1D)]
    rows = [r.path for r in replacements if _is(r, Linear1D_Row)]
    exact = set()  # parameters other replacements vouch for (per-head norms and sinks)
    for r in replacements:
        names = getattr(r.layer.replace_layer, "sequence_parallel_exact_params", None)
        exact.update(f"{r.path}.{n}" for n in (names(r.module) if names else ()))
    for r in replacements:
        if r.path.startswith(layers + ".") and not getattr(r.layer.replace_layer, "supports_sequence_parallel", False):
            raise ValueError(
                f"sequence parallelism: {r.path} becomes {getattr(r.layer.replace_layer, '__name__', r.layer.replace_layer)}, "
                f"which does not declare supports_sequence_parallel (it may mix tokens of different ranks' chunks, "
                f"like experts cut over tp); shard this model with sequence_parallel=False"
            )
    for index, layer in enumerate(layer_list):
        prefix = f"{layers}.{index}"
        mine = [c for c in columns if c.startswith(prefix + ".")]
        if entry_suffixes is None:
            children = {c[len(prefix) + 1 :].split(".")[0] for c in mine}
            entries = [f"{prefix}.{name}" for name, _ in layer.named_children() if name in children]
        else:
            entries = [f"{prefix}.{suffix}" for suffix in entry_suffixes]
            for path in entries:
                if model.get_submodule(path) is None:
                    raise ValueError(f"sequence parallel entry {path} is not in the model")
        stray = [c for c in mine if not _under(c, entries)]
        if stray:
            raise ValueError(
                f"sequence parallelism: column-parallel {stray[0]} is not inside an entry ({entries}); the policy's "
                f"sequence_parallel_entries() must name the block that holds it"
            )
        parallel = [p for p in columns + rows if p.startswith(prefix + ".")]
        for name, _ in layer.named_parameters():
            path = f"{prefix}.{name}"
            owner = path.rpartition(".")[0]
            in_entry, in_parallel = _under(path, entries), _under(owner, parallel)
            if in_entry and not in_parallel and path not in exact:
                raise ValueError(
                    f"sequence parallelism: {path} sits in {_entry_of(path, entries)} beside the column-parallel "
                    f"layers but is not one of them; it may read the gathered input (a router, a replicated "
                    f"projection), which sequence parallelism cannot keep exact. Shard this model with "
                    f"sequence_parallel=False"
                )
            row_bias = owner in rows and name.endswith("bias")  # added after the reduce-scatter: on a chunk
            if row_bias or not (in_entry or in_parallel):
                plan.split_params.append(path)
        plan.entries += entries
        plan.parallel += parallel
    return plan


def _per_token_norm(model: nn.Module, path: str | None, replacements) -> str | None:
    if path is None or any(_under(r.path, [path]) or _under(path, [r.path]) for r in replacements):
        return None
    try:
        norm = model.get_submodule(path)
    except AttributeError:
        return None
    per_token = isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) or type(norm).__name__.endswith(("RMSNorm", "LayerNorm"))
    return path if per_token else None


def _is(replacement, classes) -> bool:
    cls = replacement.layer.replace_layer
    return isinstance(cls, type) and issubclass(cls, classes)


def _entry_of(path: str, entries: list[str]) -> str:
    return next(e for e in entries if _under(path, [e]))


def _replace_hidden(args, kwargs, fn, where: str):
    """A forward pre-hook's ``(args, kwargs)`` with the hidden states (first argument) passed through ``fn``."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    for key in ("hidden_states", "x", "input"):
        if key in kwargs:
            return args, {**kwargs, key: fn(kwargs[key])}
    raise RuntimeError(f"sequence parallelism: cannot find the hidden states among the inputs of {where}")


def apply_sequence_parallel(model: nn.Module, sp: SequenceParallel) -> None:
    """Install the hooks of ``plan`` on the (already sharded) model: the stack's ends, the entries'
    gathers and the split-region gradient sums. (The parallel layers and the dropout of the split
    region were given ``sp`` when the sharder built them.)"""
    plan = sp.plan
    layer_list = model.get_submodule(plan.layers)

    def ends() -> tuple[int, int]:  # first and last layer of this pipeline stage (of all without pp)
        kept = sharding_of(model).layers
        return (0, len(layer_list) - 1) if kept is None else (kept[0], kept[-1])

    for index, layer in enumerate(layer_list):

        def begin(_module, args, kwargs, index=index):
            if ends()[0] != index:
                return None
            return _replace_hidden(args, kwargs, sp.begin, f"layer {index}")

        def end(_module, _args, _kwargs, output, index=index):
            if ends()[1] != index:
                return None
            if isinstance(output, torch.Tensor):
                return sp.end_of_layers(output)
            return (sp.end_of_layers(output[0]), *output[1:])

        layer.register_forward_pre_hook(begin, with_kwargs=True)
        layer.register_forward_hook(end, with_kwargs=True)
    for path in plan.entries:

        def gather(_module, args, kwargs, path=path):
            return _replace_hidden(args, kwargs, lambda x: sp.gather_for_tp(x, path), path)

        model.get_submodule(path).register_forward_pre_hook(gather, with_kwargs=True)
    for path in plan.split_params:
        model.get_parameter(path).register_hook(sp.reduce_grad)
    if plan.final_norm is not None:
        _end_at_final_norm(model, sp, plan.final_norm)
    ancestors = plan.layers.split(".")[:-1]
    for depth in range(len(ancestors) + 1):  # the modules whose outputs carry the hidden states recorded in the stack
        module = model.get_submodule(".".join(ancestors[:depth]))
        module.register_forward_hook(lambda _m, _args, output: sp.full_hidden_states(output))


def _end_at_final_norm(model: nn.Module, sp: SequenceParallel, path: str) -> None:
    """The final norm at ``path`` runs on the chunk and ends the region, where this stage holds it (a
    pipeline stage without it ends the region after its last layer)."""
    norm = model.get_submodule(path)

    def here() -> bool:
        found = model
        for name in path.split("."):
            found = found._modules.get(name) if isinstance(found, nn.Module) else None
        return found is norm

    def check(_module, args, kwargs):
        _replace_hidden(args, kwargs, lambda x: sp.check_norm_input(x, path), path)

    sp.final_norm_here = here
    norm.register_forward_pre_hook(check, with_kwargs=True)
    norm.register_forward_hook(lambda _m, _args, output: sp.end_at_norm(output))
    model.register_forward_hook(lambda _m, _args, _output: sp.check_closed(type(model).__name__))
