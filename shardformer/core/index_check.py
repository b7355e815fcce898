"""Refuse indices outside a table before a layer uses them: the vocabulary, a model's positions.

The unsharded ``nn.Embedding`` and ``F.cross_entropy`` raise on such an index. A vocab-parallel
layer would not: every rank masks the ids it does not hold, so an id no rank holds becomes a zero
embedding or a wrong loss. A position table left whole raises, but with torch's bare "index out of
range in self" (`shardformer.core.position_limit`). The check reads only this rank's tensor (tp
ranks hold the same batch, so every rank raises alike) and runs before the layer's first collective:
no collective is added and none is left waiting. Compiled, the check is an asynchronous assert (no
graph break, no value in the message); eager, the error names the first bad value.
"""

from __future__ import annotations

import torch


def check_indices(
    values: torch.Tensor, size: int, what: str, fix: str, ignore_index: int | None = None, within: str | None = None
) -> None:
    """Raise ``IndexError`` unless every entry of ``values`` is in ``[0, size)`` (or is ``ignore_index``);
    ``within`` names the table (default: the vocabulary of ``size``)."""
    if values.is_meta:
        return  # no values to read: a job simulated on the meta device (shardformer.tools.simulate)
    valid = (values >= 0) & (values < size)
    if ignore_index is not None:
        valid |= values == ignore_index
    table = within or f"the vocabulary of {size}"
    allowed = f"{table} ([0, {size})" + ("" if ignore_index is None else f", or {ignore_index}") + ")"
    if torch.compiler.is_compiling():
        torch._assert_async(valid.all(), f"{what} outside {allowed}; {fix}")
        return
    if bool(valid.all()):
        return
    bad = values[~valid]
    shown = ", ".join(str(v) for v in bad.unique()[:5].tolist())
    raise IndexError(f"{what} outside {allowed}: {shown} ({bad.numel()} of {values.numel()}); {fix}")
