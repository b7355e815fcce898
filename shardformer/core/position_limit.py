"""Positions past what a model's learned position table holds: refused naming the input, the limit and the fix.

A learned absolute position embedding (GPT-2's ``wpe``, BERT's ``position_embeddings``, CLIP's
``position_embedding``: an ``nn.Embedding`` read with position ids) has one row per position the model
takes. A longer input, or a ``generate()`` that runs past it, ends in torch's bare ``IndexError: index
out of range in self``. A sharded model checks the ids each such table reads before it reads them
(a forward pre-hook, `install`), as the vocab-parallel embedding checks token ids: tp ranks
hold the same batch, so every rank raises alike, and nothing waits on a rank that raised. Context
parallelism, whose ranks each read other positions, checks the whole sequence's positions on every
rank before it splits them (`check_positions`).

A table is one left whole by the cut, not the input embeddings, whose size is the config's
``max_position_embeddings`` (GPT-2: ``n_positions``) or whose name says positions. Subclasses with
their own forward (OPT's and BART's offset tables, Whisper's slices) read other arguments and are left
alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from shardformer.core.index_check import check_indices

_SETTING = "max_position_embeddings"


@dataclass(frozen=True)
class PositionTable:
    """One learned position table of a model: where it is, how many positions it holds, what sets that."""

    path: str
    size: int
    model: str  # the class of the model it belongs to, as the user knows it
    setting: str | None  # "config.n_positions" where the config's max_position_embeddings sets the size

    def check(self, positions: torch.Tensor) -> None:
        limit = f"{self.setting} = {self.size}" if self.setting else str(self.size)
        check_indices(
            positions, self.size, "position ids",
            f"{self.model} takes at most {limit} positions (past and new tokens together; the unsharded model fails "
            f"here too, with torch's 'index out of range'): shorten the input to {self.size} tokens (e.g. "
            f"tokenizer(..., truncation=True, max_length={self.size})), and with generate() keep the prompt plus "
            f"max_new_tokens within {self.size}",
            within=f"the {self.size} positions of {self.path}",
        )  # fmt: skip


def _setting(config) -> str | None:
    if config is None or getattr(config, _SETTING, None) is None:
        return None
    return "config." + getattr(config, "attribute_map", {}).get(_SETTING, _SETTING)


def _user_class(model: nn.Module) -> str:
    """The model's class as the user built it, not the subclass the cut swapped in (VocabParallel<Name>)."""
    return next(c for c in type(model).__mro__ if not c.__module__.startswith("shardformer.")).__name__


def position_tables(model: nn.Module) -> list[PositionTable]:
    """The learned position tables of ``model`` (see the module docstring)."""
    get_inputs = getattr(model, "get_input_embeddings", None)
    try:
        inputs = get_inputs() if callable(get_inputs) else None
    except NotImplementedError:  # a PreTrainedModel that does not say
        inputs = None
    found, configs = [], {"": getattr(model, "config", None)}
    for path, module in model.named_modules():
        if hasattr(module, "config"):
            configs[path] = module.config
        if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward or module is inputs:
            continue
        owner = max((p for p in configs if path.startswith(p)), key=len)  # the nearest config above it
        config = configs[owner]
        sized = config is not None and getattr(config, _SETTING, None) == module.num_embeddings
        name = path.rsplit(".", 1)[-1]
        if sized or "position" in name or name == "wpe":
            setting = _setting(config) if sized else None
            found.append(PositionTable(path, module.num_embeddings, _user_class(model), setting))
    return found


def check_positions(tables: list[PositionTable], positions: torch.Tensor) -> None:
    """Raise unless every table holds every one of ``positions`` (the ids the tables will be read with)."""
    for table in tables:
        table.check(positions)


def install(model: nn.Module) -> list[PositionTable]:
    """Check the ids each position table of ``model`` reads before it reads them; the tables found."""
    tables = position_tables(model)
    modules = dict(model.named_modules())
    for table in tables:
        modules[table.path].register_forward_pre_hook(_checker(table), with_kwargs=True)
    return tables


def _checker(table: PositionTable):
    def check(_module, args, kwargs):
        ids = args[0] if args else kwargs.get("input")
        if isinstance(ids, torch.Tensor):
            table.check(ids)
        return None

    return check
