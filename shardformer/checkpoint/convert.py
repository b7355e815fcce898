"""A training checkpoint turned into a HuggingFace folder offline: one process, CPU, no torch.distributed.

The checkpoint's model tensors (``model.<HF name>``, in the pieces every rank wrote) are consolidated
into the folder `save_pretrained` writes for the trained model (`shardformer.checkpoint.hf_export`):
the same file names, tensor names, ``config.json`` and generation config. The model class and config
come from the checkpoint's manifest; a model built from them on the meta device (no memory) says which
weights transformers ties and in what order the state dict lists them. ``shardformer convert
CHECKPOINT --to hf OUT`` runs it (`shardformer.cli.convert`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import transformers

from shardformer.checkpoint import commit, consolidate, hf_export
from shardformer.checkpoint.errors import CheckpointError
from shardformer.checkpoint.export_folder import abandon, finish
from shardformer.checkpoint.pieces import MODEL


def _skeleton(meta: dict, checkpoint: str) -> nn.Module | None:
    """The checkpoint's transformers model on the meta device; None for a timm model."""
    if "num_classes" in meta:
        return None
    cls = getattr(transformers, meta["model_class"], None)
    if meta.get("config") is None or cls is None or not hasattr(cls, "config_class"):
        raise CheckpointError(
            f"{checkpoint} holds a {meta['model_class']}, which is not a transformers model class this converter "
            "can build: load the checkpoint with load_checkpoint and export it with save_pretrained"
        )
    with torch.device("meta"):
        return cls(cls.config_class.from_dict(meta["config"]))


def _names(meta: dict, chunks: dict, skeleton: nn.Module | None) -> dict[str, str]:
    """``{output name: saved name}`` of the weights the export writes, in the order it writes them."""
    saved = {n[len(MODEL) :] for n in chunks if n.startswith(MODEL)}
    order = meta.get("names") or (list(skeleton.state_dict()) if skeleton is not None else [])
    names = [n for n in order if n in saved] + sorted(saved - set(order))
    dropped = {alias for group in meta.get("ties", []) for alias in group[1:]}
    if skeleton is not None:
        dropped |= {t for t, s in hf_export.tied_targets(skeleton).items() if s in saved}
    return {n: MODEL + n for n in names if n not in dropped}


def convert_to_hf(checkpoint: str, out: str, max_shard_size: int | str = "2GB") -> str:
    """Write the HuggingFace folder of the training checkpoint ``checkpoint`` at ``out``; returns its path.

    Any checkpoint `save_checkpoint` wrote, at any layout; checksums are verified first. ``out`` is
    replaced as `save_pretrained` replaces its folder (files it does not write, such as a tokenizer,
    are kept).
    """
    full = commit.checked_path(checkpoint, replacing=False)
    meta = commit.read_meta(full)
    commit.verify_files(full, meta, rank=0, world=1)
    skeleton = _skeleton(meta, full)
    chunks = consolidate.chunks_in(full)
    names = _names(meta, chunks, skeleton)
    with contextlib.ExitStack() as held:
        target, tmp = hf_export.prepare_export(out, held)
        try:
            hf_export.write_weights(tmp, chunks, names, max_shard_size, rank=0, world=1)
            if skeleton is None:
                hf_export.write_timm_config(tmp, meta["model_class"], meta["num_classes"])
            else:
                hf_export.write_description(tmp, skeleton, hf_export.stored_dtype(chunks, names))
            finish(tmp, target, hf_export.replaced_by_an_export)
        except BaseException:
            abandon(tmp, target)
            raise
    return target
