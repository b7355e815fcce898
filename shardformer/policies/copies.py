"""Copies of a model with no transformers config to scale down (timm, plain modules): the model
itself with each repeated stack cut to two blocks (same widths, same code, dropout off).

Two blocks are the fewest that show a stack's per-block rule twice (what one block hands the next);
the widths stay the user's, so every count and width the code reads is the one it reads on the user's
model. The derived route traces this copy, and the proof runs it sharded against unsharded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging

import torch
import torch.nn as nn

from shardformer.core.inputs import make_inputs
from shardformer.core.instance import CannotReproduce, study_instance
from shardformer.core.tiny import tiny_copy_config
from shardformer.core.tiny_run import MAX_PARAMS, tiny_copy
from shardformer.core.versions import releases
from shardformer.policies.derived.blocks import repeated_blocks

KEEP = 2  # blocks kept of each repeated stack
logger = logging.getLogger("shardformer")


def copy_key(model: nn.Module, tp: int, heads: int | None = None) -> tuple:
    """The key of ``model``'s tiny copy at ``tp`` (and ``heads``, where a route was found on a wider copy),
    which every verdict on that copy holds (derivation, anatomy, tp / cp / pp / ep proofs): the class, the
    copy's config (a config-less model: its module tree and settings, `architecture`), what the
    instance adds to its class with the attention implementation and dtype (`shardformer.core.instance`),
    and the releases of the code it runs."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        shape = json.dumps(tiny_copy_config(config, tp).to_dict(), sort_keys=True, default=str)
    else:
        shape = architecture(model)
    return type(model), tp, heads, shape, study_instance(model).key, releases()


def instance_copy(model: nn.Module, tp: int, seed: int = 0, heads: int | None = None) -> nn.Module:
    """The small model every proof, derivation and anatomy reads, with everything the user's instance
    has: for a transformers model, a tiny copy of its class from its config with the instance's
    additions put on it (`shardformer.core.instance`); where an addition cannot be rebuilt small
    (a module whose constructor takes other than a config), the instance itself with each stack cut
    to two blocks, while that is small; else `shardformer.core.instance.CannotReproduce`
    naming the module. A model with no transformers config: the instance cut (`two_blocks`)."""
    if not hasattr(getattr(model, "config", None), "to_dict"):
        return two_blocks(model)
    instance = study_instance(model)
    try:
        tiny = tiny_copy(model, tp, seed=seed, heads=heads)
        if instance.extras:  # what was put on it must run on the small widths
            _runs(tiny, instance.describe())
        return tiny
    except CannotReproduce as e:
        with stacks_cut(model):
            count = sum(p.numel() for p in model.parameters())
        if count > MAX_PARAMS:
            raise CannotReproduce(
                f"{e}; and {type(model).__name__} cut to two blocks has {count / 1e6:.0f}M parameters, too many to "
                f"prove it on at its own widths. Give the module a constructor that takes the config "
                f"(MyModule(config)), or shard with ShardConfig(prove=False) and check it with `shardformer verify`"
            ) from e
        logger.info("%s: proven on the instance itself, cut to two blocks per stack (%s)", type(model).__name__, e)
        return two_blocks(model)


def _runs(tiny: nn.Module, what: str) -> None:
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            batch = make_inputs(tiny, 0)
            tiny(batch["x"]) if "x" in batch else tiny(**batch)
    except Exception as e:  # noqa: BLE001 - the additions do not fit the small widths
        raise CannotReproduce(f"a tiny copy given {what} does not run: {type(e).__name__}: {str(e)[:200]}") from e


def repeated_stacks(model: nn.Module) -> list[str]:
    """Paths of the stacks `shardformer.policies.derived.blocks.repeated_blocks` finds whose
    blocks are all of one class and one shape (a stack of mixed classes, or of stages that widen as
    ConvNeXt's do, is kept whole in a copy: the layers after it read the last item's width)."""

    stacks: list[str] = []
    for block in repeated_blocks(model):
        stack = block.rpartition(".")[0]
        if stack and stack not in stacks:
            stacks.append(stack)
    return [s for s in stacks if len({_shape(m) for m in model.get_submodule(s)}) == 1]


def _kept(model: nn.Module, path: str, stack: nn.Module) -> list[int]:
    extras = study_instance(model).extras
    kept, kinds = [], set()
    for index in range(len(stack)):
        prefix = f"{path}.{index}"
        kind = tuple(
            (p[len(prefix) :], e.key()) for p, e in extras.items() if p == prefix or p.startswith(prefix + ".")
        )
        if index < KEEP or kind not in kinds:
            kept.append(index)
        kinds.add(kind)
    return kept


def _shape(block: nn.Module) -> tuple:
    return type(block), tuple((name, tuple(p.shape)) for name, p in block.named_parameters())


@contextlib.contextmanager
def stacks_cut(model: nn.Module):
    """``model`` with each of its repeated stacks holding its first two blocks and the first block of each
    other kind the instance holds (a block with a hook or a patched method of its own), restored on exit."""
    saved = {path: model.get_submodule(path) for path in repeated_stacks(model)}
    kept_of = {path: _kept(model, path, stack) for path, stack in saved.items()}
    saved = {path: stack for path, stack in saved.items() if len(kept_of[path]) < len(stack)}
    for path, stack in saved.items():
        kept = [stack[i] for i in kept_of[path]]
        _set(model, path, type(stack)(*kept) if isinstance(stack, nn.Sequential) else nn.ModuleList(kept))
    try:
        yield model
    finally:
        for path, stack in saved.items():
            _set(model, path, stack)


def two_blocks(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose repeated stacks keep two blocks, with dropout off (both copies the
    proof compares compute one function); of a model on the meta device (``shardformer plan``), a
    real copy with random weights (`materialize`)."""
    with stacks_cut(model):
        tiny = copy.deepcopy(model)
    no_dropout(tiny)
    if any(t.device.type == "meta" for t in (*tiny.parameters(), *tiny.buffers())):
        materialize(tiny)
    return tiny


def materialize(model: nn.Module) -> None:
    """``model``, built on the meta device, on the cpu with random weights: what a derivation needs
    (the cut depends on the code and the sizes, not on the values). Each module's own
    ``reset_parameters`` sets what it has (norms at one), and timm's ``init_non_persistent_buffers``
    the tables it computes when built (relative position indices), which the meta device left empty."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
        for buffer in model.buffers():
            buffer.zero_()
    for module in model.modules():
        for name in ("reset_parameters", "init_non_persistent_buffers"):
            init = getattr(module, name, None)
            if callable(init):
                init()


def no_dropout(model: nn.Module) -> None:
    """Every dropout module of ``model`` at probability 0 (a head's ``classifier_dropout`` that the
    config does not name, and so the recipe cannot zero, included)."""
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):  # its attention dropout is a float, not a module
            module.dropout = 0.0
        if "Drop" in type(module).__name__:
            for name in ("p", "drop_prob"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.0)


def architecture(model: nn.Module) -> str:
    """A cache key for the two-block copy: every module's class and sizes in order, and the plain
    settings each module holds (a flag its forward reads, such as timm's ``fused_attn``), so that two
    models cut alike only when they compute alike at any depth."""
    key = repr(study_instance(model).key)  # hooks, patched methods, classes' code: read on the whole model
    with stacks_cut(model):
        settings = [
            (path, name, value)
            for path, module in model.named_modules()
            for name, value in sorted(vars(module).items())
            if not name.startswith("_") and name != "training" and isinstance(value, _SETTINGS)
        ]
        return repr(model) + repr(settings) + key


_SETTINGS = (bool, int, float, str, tuple, type(None))


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)
