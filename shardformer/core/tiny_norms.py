"""BatchNorm in a tiny random copy: running statistics as training leaves them, and maps wide enough to
normalise.

A random convnet's BatchNorms start with the fresh statistics (mean 0, variance 1) while each random layer
shrinks what it passes on (weights of std 0.02), and EfficientNet draws the norms' own scales around 0 (std
0.02, where torch starts them at 1): its tiny copy ends at 1e-45, all zero, in eval mode, so every cut would
"agree" (and AlignModel's image-text similarity divides by that zero norm into NaN). Where a copy's output
shrinks so, `settle_batch_norms` moves scales drawn around 0 to around 1 and sets the statistics from the
copy's own inputs, as a trained model's are set from its data.

In training mode (the proof's) a BatchNorm over two values per channel (a 1x1 map at the end of a deep-stride
convnet, MobileNetV2's at 32 px, times a batch of 2) turns them into -1 and +1 whatever they were: its input's
gradient is zero in exact arithmetic, and a proof would compare rounding. `fewest_normalised` measures the
fewest values any BatchNorm normalises per channel; the recipe doubles a copy's images while it is 2 or fewer
(`shardformer.core.tiny_run`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from shardformer.core.divergence import first_tensor

SMALL_SCALE = 0.5  # a norm scale drawn below it everywhere was drawn around 0 (torch's start is 1)
SHRUNK = 1e-6  # an eval-mode output below it everywhere: the random layers shrank it (EfficientNet's: 1e-45)
DEGENERATE = 2  # values per channel a BatchNorm in training mode maps to -1 and +1 whatever they are


def batch_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _run(model: nn.Module, inputs: dict, eval_mode: bool = False):
    modes = {m: m.training for m in model.modules()}
    try:
        if eval_mode:
            model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            return model(inputs["x"]) if "x" in inputs else model(**inputs)
    finally:
        for m, training in modes.items():
            m.training = training


def settle_batch_norms(model: nn.Module, inputs: dict) -> None:
    """``model``'s BatchNorms as training leaves them where its eval-mode output on ``inputs`` shrinks to
    nothing (`SHRUNK`) or is not finite: scales drawn around 0 moved to around 1 (each keeps its own draw),
    running statistics those of ``inputs``. Only there: a random copy settled so is often ill-conditioned
    in eval mode (LeViT's near-constant channels, normalised, amplify rounding 1e9-fold in float64), and
    one whose fresh norms pass its output on is checked as it is."""
    # a copy runs: a forward may leave state behind (LeViT caches its attention biases, cut off from their
    # gradient under no_grad)
    probe = copy.deepcopy(model)
    main = first_tensor(_run(probe, inputs, eval_mode=True))
    if main is None or not main.is_floating_point() or main.abs().max() > SHRUNK:  # NaN: not above
        return
    with torch.no_grad():
        for m in batch_norms(probe):
            if m.weight is not None and m.weight.is_floating_point() and not m.weight.abs().max() > SMALL_SCALE:
                m.weight.add_(1.0)
    _calibrate(probe, inputs)
    model.load_state_dict(probe.state_dict())


def _calibrate(model: nn.Module, inputs: dict) -> None:
    """The running statistics of ``model``'s BatchNorms set to those of ``inputs``: one forward with only
    the norms in training mode (no dropout, no stochastic depth), their momentum None averaging the one
    batch; every module's mode and momentum put back."""
    norms = [m for m in batch_norms(model) if m.track_running_stats and m.running_mean is not None]
    if not norms:
        return
    modes = {m: m.training for m in model.modules()}
    momenta = {m: m.momentum for m in norms}
    try:
        model.eval()
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
            m.train()
        _run(model, inputs)
    finally:
        for m, momentum in momenta.items():
            m.momentum = momentum
        for m, training in modes.items():
            m.training = training


def fewest_normalised(model: nn.Module, inputs: dict) -> int | None:
    """``model`` run forward on ``inputs`` (without gradients), and the fewest values per channel any of its
    BatchNorms normalised over (batch times positions), or None when it has none."""
    counts = []

    def count(module, args):
        counts.append(args[0].numel() // args[0].shape[1])

    hooks = [m.register_forward_pre_hook(count) for m in batch_norms(model)]
    try:
        _run(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return min(counts, default=None)
