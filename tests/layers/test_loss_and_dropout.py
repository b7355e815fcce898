"""Vocab-parallel cross-entropy against F.cross_entropy, and tensor-parallel dropout masks."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardformer.tensor_parallel.layers import (
    CollectiveCounter,
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    VocabParallelLMHead1D,
    vocab_parallel_cross_entropy,
)
from tests.helpers import GRAD_ATOL, assert_close, check_table, full_of, rank, world

HIDDEN = 8


def _labels(shape, vocab, seed=2):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[0, :2] = -100  # ignored tokens
    labels[-1, -1] = vocab - 1  # the last real token sits next to the padding
    return labels


def check_cross_entropy_matches_torch_with_padding_and_ignore():
    for vocab in (13, 16, 17):
        torch.manual_seed(0)
        full = nn.Linear(HIDDEN, vocab, bias=False)
        head = VocabParallelLMHead1D.from_native(full, None)
        hidden = torch.randn(3, 5, HIDDEN, requires_grad=True)
        hidden_ref = hidden.detach().clone().requires_grad_()
        labels = _labels((3, 5), vocab)

        with CollectiveCounter() as fwd:
            loss = vocab_parallel_cross_entropy(head(hidden), labels, None, vocab_size=vocab)
        ref = F.cross_entropy(full(hidden_ref).view(-1, vocab), labels.view(-1))
        assert_close(loss, ref, what=f"loss (vocab {vocab})")
        assert fwd.counts == {"all_reduce": 3}, fwd.counts
        assert all(n == 15 for _, n, _ in fwd.calls), "each all-reduce carries one number per token"

        with CollectiveCounter() as bwd:
            loss.backward()
        ref.backward()
        assert bwd.counts == {"all_reduce": 1}, bwd.counts  # the head's input gradient only
        assert_close(hidden.grad, hidden_ref.grad, GRAD_ATOL, what="hidden grad")
        assert_close(full_of(head.weight.grad, head.weight), full.weight.grad, GRAD_ATOL, what="head weight grad")


def check_cross_entropy_sum_and_none_reductions():
    torch.manual_seed(0)
    vocab = 12  # divides tp=2 and tp=4
    logits = torch.randn(4, vocab)
    labels = torch.tensor([1, -100, 11, 0])
    local = logits.chunk(dist.get_world_size(), dim=-1)[rank()]
    for reduction in ("sum", "none"):
        got = vocab_parallel_cross_entropy(local, labels, None, vocab, reduction=reduction)
        assert_close(got, F.cross_entropy(logits, labels, reduction=reduction), what=reduction)


def check_cross_entropy_half_precision_math_is_fp32():
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        vocab = 16
        logits = (torch.randn(6, vocab) * 20).to(dtype)  # large logits: fp16 exp would overflow
        labels = torch.randint(0, vocab, (6,))
        local = logits.chunk(dist.get_world_size(), dim=-1)[rank()].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, None, vocab)
        full = logits.float().requires_grad_()
        ref = F.cross_entropy(full, labels)
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        assert_close(loss, ref, what=f"{dtype} loss")
        loss.backward()
        ref.backward()
        assert local.grad.dtype == dtype
        assert_close(local.grad.float(), full.grad.chunk(dist.get_world_size(), dim=-1)[rank()], 1e-2, 1e-2)


def check_cross_entropy_refuses_labels_outside_the_vocabulary():
    """A label no rank holds (other than the ignore index) raises on every rank, as F.cross_entropy
    does, before the first all-reduce; the ranks then go on together."""
    import pytest

    vocab = 13  # padded: columns 13.. are padding on the last rank
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    local = F.pad(logits, (0, -vocab % world())).chunk(world(), dim=-1)[rank()]
    for bad in (-1, -7, vocab, 1000):
        labels = torch.tensor([1, bad, -100])
        with pytest.raises(IndexError):
            F.cross_entropy(logits, labels)
        pattern = rf"labels outside the vocabulary of 13 \(\[0, 13\), or -100\): {bad} \(1 of 3\); .*-100"
        with CollectiveCounter() as fwd, pytest.raises(IndexError, match=pattern):
            vocab_parallel_cross_entropy(local, labels, None, vocab)
        assert fwd.counts == {}, fwd.counts  # refused before any collective
    labels = torch.tensor([1, 12, -100])
    assert_close(vocab_parallel_cross_entropy(local, labels, None, vocab), F.cross_entropy(logits, labels))


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def check_dropout_masks():
    x = torch.ones(64, 32)
    rng_before = torch.get_rng_state()
    replicated = DropoutForReplicatedInput(p=0.5, seed=7)
    parallel = DropoutForParallelInput(p=0.5, seed=7)
    rep, par = replicated(x), parallel(x)
    assert torch.equal(torch.get_rng_state(), rng_before), "dropout must not consume the global RNG"
    reps, pars = _gather(rep), _gather(par)
    assert all(torch.equal(reps[0], r) for r in reps), "replicated input: same mask on every tp rank"
    assert not any(torch.equal(pars[0], p) for p in pars[1:]), "parallel input: different masks per rank"
    assert set(rep.unique().tolist()) == {0.0, 2.0} and 0.35 < (rep == 0).float().mean() < 0.65
    # the same seed replays the same masks; the next call draws a new one
    again = DropoutForReplicatedInput(p=0.5, seed=7)
    assert torch.equal(again(x), rep) and not torch.equal(again(x), rep)
    replicated.eval()
    assert replicated(x) is x


def check_dropout_gradient_uses_the_mask():
    x = torch.randn(16, 8, requires_grad=True)
    drop = DropoutForParallelInput(p=0.25, seed=3)
    y = drop(x)
    y.sum().backward()
    kept = y.detach() != 0
    assert_close(x.grad, kept.float() / 0.75)


CHECKS = [
    check_cross_entropy_matches_torch_with_padding_and_ignore,
    check_cross_entropy_sum_and_none_reductions,
    check_cross_entropy_half_precision_math_is_fp32,
    check_cross_entropy_refuses_labels_outside_the_vocabulary,
    check_dropout_masks,
    check_dropout_gradient_uses_the_mask,
]

test_tp2 = check_table(CHECKS, 2)
test_tp4 = check_table(CHECKS, 4)


def test_dropout_rejects_bad_probability():
    import pytest

    with pytest.raises(ValueError, match=r"p=1.0 must be in \[0, 1\)"):
        DropoutForReplicatedInput(p=1.0)
