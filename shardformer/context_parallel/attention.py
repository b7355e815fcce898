"""Context parallelism through transformers' attention interface: one attention implementation and
one mask implementation, registered under `IMPLEMENTATION`, reach every model that uses the
interface, with no per-family code.

A model under context parallelism has ``config._attn_implementation = IMPLEMENTATION`` and
remembers its original implementation (``"sdpa"``, ``"eager"``, ...):

- the mask function: in a split forward, transformers' ``create_*_mask`` hands it the model's own
  mask pattern (causal, sliding window, chunked, bidirectional, with overlays) and the 2D padding
  mask; it returns a `SplitMask` holding them, which the layers pass on to attention
  untouched. Masks are evaluated on GLOBAL positions with transformers' own ``sdpa_mask``, so
  they are the model's own masks, exactly (no "causal" assumed). Otherwise it is the original
  implementation's mask function.
- the attention function: given a `SplitMask`, ring or Ulysses attention over the whole
  sequence; given anything else in a forward that was not split (generate, decode), the
  original implementation; given anything else in a split forward (a model that builds its own
  4D mask, or none), a clear refusal - the same on every rank, before attention communicates.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from shardformer.context_parallel.blocks import tile_rows
from shardformer.context_parallel.layout import ZigzagLayout
from shardformer.context_parallel.ring import ring_attention
from shardformer.context_parallel.ulysses import ulysses_attention

IMPLEMENTATION = "shardformer_context_parallel"
# kwargs of the attention interface the ring cannot honour (they change the softmax itself)
_RING_UNSUPPORTED = ("softcap", "s_aux", "sinks")

# id(config) -> (config, ContextParallel): configs are not hashable, and an attribute on them
# would be written out by save_pretrained.
_STATES: dict[int, tuple[Any, Any]] = {}


def attach_state(configs, state) -> None:
    for config in configs:
        _STATES[id(config)] = (config, state)


def _state_for(config):
    found = _STATES.get(id(config)) if config is not None else None
    return found[1] if found is not None and found[0] is config else None


def original_attention(module, implementation: str):
    """The attention function ``module`` would use under ``implementation`` (eager's lives in the
    model's own modeling file)."""
    if implementation == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager
        implementation = "sdpa"
    return ALL_ATTENTION_FUNCTIONS[implementation]


class MaskReadAsTensor(AttributeError, ValueError):
    """A model's code read its attention mask as a tensor where context parallelism hands it an
    `OpaqueMask` (an AttributeError too, so ``hasattr`` and ``getattr(..., default)`` answer as
    for any object without that attribute). ``reason``: why, for a refusal naming the model."""

    def __init__(self, what: str) -> None:
        self.reason = (
            f"its code reads its attention mask as a tensor ({what}), but a split forward hands it the model's "
            f"mask pattern over the whole sequence, which only transformers' attention interface can use"
        )
        super().__init__(f"context parallelism: {self.reason}; shard it with context_parallel_size=1")


class OpaqueMask:
    """A mask only the attention interface reads. A model whose own code reads it as a tensor (Doge:
    ``attention_mask.dtype``, slices, torch ops) cannot be split: every such read raises
    `MaskReadAsTensor`, the same on every rank, before its attention communicates (and on the
    tiny copy that proves what mixes tokens, `.mixing`, when the model is sharded)."""

    def __getattr__(self, name):
        if name.startswith("_"):  # copy, pickle and dataclass machinery probe these
            raise AttributeError(name)
        raise MaskReadAsTensor(f".{name}")

    def __getitem__(self, index):
        raise MaskReadAsTensor("an index")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise MaskReadAsTensor(getattr(func, "__name__", str(func)))


@dataclass(eq=False)
class SplitMask(OpaqueMask):
    """The model's mask in a split forward: its pattern, the padding, and where the tokens are."""

    layout: ZigzagLayout
    group: Any
    mode: str
    mask_function: Any
    padding: torch.Tensor  # [batch, padded_len] bool, False past the true length
    mask_kwargs: dict  # what create_*_mask passed (use_vmap, dtype, config, local_size, ...)
    original: str
    forward: Any  # the split forward this mask belongs to (counts the attention calls)
    _cache: dict = field(default_factory=dict)  # the whole mask (Ulysses), during the forward only
    _tiles: dict = field(default_factory=dict)  # (source, rows) -> True: every pair attends, False: none
    _dead: Any = False  # the query rows that see no key ([b, 1, n, 1]; None: none), once found

    @property
    def uniform_dead_rows(self) -> bool:
        """Eager attention adds the dtype's minimum to masked scores, so a row that sees no key (left
        padding) spreads evenly over every key of the sequence; sdpa gives it zeros, as the ring does."""
        return self.original == "eager"

    def release(self) -> None:
        """End of the forward: keep no mask for backward (the whole mask is n^2 per batch row, alive
        as long as the autograd graph holds this object); the ring's tiles keep no mask at all."""
        self._cache.clear()

    def _block(self, q_start: int, kv_start: int, q_len: int, kv_len: int) -> torch.Tensor:
        return sdpa_mask(
            batch_size=self.padding.shape[0],
            q_length=q_len,
            kv_length=kv_len,
            q_offset=q_start,
            kv_offset=kv_start,
            mask_function=self.mask_function,
            attention_mask=self.padding,
            allow_is_causal_skip=False,
            use_vmap=self.mask_kwargs.get("use_vmap", False),
            device=self.padding.device,
        )

    def _pattern(self, source: int, rows: slice) -> torch.Tensor:
        """The model's mask of this rank's query ``rows`` against ``source``'s keys: ``[b, 1, rows, n]``."""
        c, layout = self.layout.chunk, self.layout
        pieces = []
        for i, q_start in enumerate(layout.starts(layout.rank)):  # the rows of each chunk this rank holds
            lo, hi = max(rows.start, i * c), min(rows.stop, (i + 1) * c)
            if lo < hi:
                keys = [self._block(q_start + lo - i * c, k, hi - lo, c) for k in layout.starts(source)]
                pieces.append(torch.cat(keys, dim=-1))
        return torch.cat(pieces, dim=-2)

    def _row_tiles(self, rows_per_tile: int) -> list[slice]:
        n = self.layout.local_len
        return [slice(r, min(r + rows_per_tile, n)) for r in range(0, n, rows_per_tile)]

    def dead_rows(self) -> torch.Tensor | None:
        """Under eager's convention, this rank's query rows that see no key of the sequence."""
        if self._dead is False:
            dead = None
            if self.uniform_dead_rows:
                rows_per_tile = tile_rows(self.padding.shape[0], self.layout.local_len)
                seen = torch.cat(
                    [
                        torch.stack([self._pattern(s, rows).any(-1) for s in range(self.layout.world)]).any(0)
                        for rows in self._row_tiles(rows_per_tile)
                    ],
                    dim=-1,
                )
                dead = None if bool(seen.all()) else ~seen.unsqueeze(-1)
            self._dead = dead  # tiny: kept for backward
        return self._dead

    def ring_tiles(self, source: int, rows_per_tile: int):
        """This rank's query rows against ``source``'s keys, tile by tile (see `RingAttention`): the
        tiles where some pair attends, with their mask (None: all attend). A dead row (`dead_rows`)
        sees every real key, with the constant score the ring gives it. Which tiles attend fully or
        not at all is remembered (the forward's layers and the backward share it); no mask is kept."""
        dead = self.dead_rows()
        for rows in self._row_tiles(rows_per_tile):
            known = self._tiles.get((source, rows.start, rows.stop))
            if known is not None:
                if known:
                    yield rows, None
                continue
            mask = self._pattern(source, rows)
            if dead is not None:
                real = self.layout.indices_of(source, mask.device) < self.layout.full_len
                mask = mask | (dead[:, :, rows] & real)
            some, every = bool(mask.any()), bool(mask.all())
            if every or not some:
                self._tiles[(source, rows.start, rows.stop)] = every
            if some:
                yield rows, None if every else mask

    def full(self):
        """The original implementation's mask over the whole sequence, in order (Ulysses): its true
        length, as the model sees it (the split's padding at the end is no key at all)."""
        if "full" not in self._cache:
            n = self.layout.full_len
            kwargs = {**self.mask_kwargs, "batch_size": self.padding.shape[0], "q_length": n, "kv_length": n}
            padding = self.padding[:, :n]
            kwargs.update(q_offset=0, kv_offset=0, mask_function=self.mask_function, attention_mask=padding)
            self._cache["full"] = ALL_MASK_ATTENTION_FUNCTIONS[self.original](**kwargs)
        return self._cache["full"]

    def attend(self, module, query, key, value, scaling, dropout, kwargs):
        self.forward.attention_calls += 1
        n = self.layout.local_len
        if query.shape[2] != n or key.shape[2] != n:
            raise ValueError(
                f"context parallelism: {type(module).__name__} attends {query.shape[2]} queries to {key.shape[2]} "
                f"keys, but this rank holds {n} tokens of the split sequence; attention over other inputs (cross "
                f"attention, shared or cached keys) cannot be split: shard with context_parallel_size=1"
            )
        if self.mode == "all_to_all":
            attend = original_attention(module, self.original)
            out = ulysses_attention(
                module, query, key, value, self.full(), attend, self.layout, self.group,
                scaling=scaling, dropout=dropout, **kwargs,
            )  # fmt: skip
            return out, None
        bad = [name for name in _RING_UNSUPPORTED if kwargs.get(name) is not None]
        if dropout:
            bad.append(f"dropout={dropout}")
        if bad:
            raise ValueError(
                f"context_parallel_mode='ring' cannot compute {type(module).__name__}'s attention with "
                f"{', '.join(bad)} exactly; use context_parallel_mode='all_to_all' (or no attention dropout)"
            )
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = ring_attention(query, key, value, self.ring_tiles, scale, self.group, self.dead_rows())
        return out.transpose(1, 2).contiguous(), None


def context_parallel_mask(*, config=None, mask_function=None, attention_mask=None, **kwargs):
    """The mask interface under `IMPLEMENTATION` (see the module's docstring)."""
    state = _state_for(config)
    if state is None:
        raise RuntimeError(
            f"attention implementation {IMPLEMENTATION!r} is set on a model that shardformer did not shard with "
            f"context parallelism; set the model's attn_implementation back (e.g. 'sdpa')"
        )
    current = state.current
    if current is None:
        return ALL_MASK_ATTENTION_FUNCTIONS[state.original](
            config=config, mask_function=mask_function, attention_mask=attention_mask, **kwargs
        )
    kwargs = {
        k: v for k, v in kwargs.items() if k not in ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset")
    }
    mask = SplitMask(
        current.layout, state.group, state.mode, mask_function, current.padding,
        {**kwargs, "config": config}, state.original, current,
    )  # fmt: skip
    current.masks.append(mask)
    return mask


def context_parallel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention interface under `IMPLEMENTATION` (see the module's docstring)."""
    if isinstance(attention_mask, SplitMask):
        return attention_mask.attend(module, query, key, value, scaling, dropout, kwargs)
    state = _state_for(getattr(module, "config", None))
    if state is not None and state.current is not None:
        what = "no mask" if attention_mask is None else f"a {type(attention_mask).__name__} mask it built itself"
        raise ValueError(
            f"context parallelism: {type(module).__name__} gets {what}, not one from transformers' create_*_mask "
            f"functions, so its mask over the split sequence is unknown; shard this model with context_parallel_size=1"
        )
    implementation = state.original if state is not None else "sdpa"
    return original_attention(module, implementation)(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


def register() -> None:
    """Register the implementation with transformers (idempotent)."""
    ALL_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, context_parallel_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, context_parallel_mask)
