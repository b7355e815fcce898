"""Parallel layers against the unsharded torch/transformers modules, at tp=2 and tp=4 (one spawn each).

Each check builds the full module from one seed on every rank, shards it, and compares forward
output, input gradient and gathered parameter gradients, and counts the collectives issued.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

from shardformer.tensor_parallel.layers import (
    CollectiveCounter,
    Linear1D_Col,
    Linear1D_Row,
    SharedInputCopy,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.tensor_parallel.slicer import make_spec, shard_spec, slice_tensor
from tests.helpers import assert_close, assert_grads_match, check_table, full_of, rank, world

HIDDEN, OUT = 8, 12


def _input(*shape, seed=1):
    torch.manual_seed(seed)
    return torch.randn(*shape, requires_grad=True)


def _compare(full, sharded, x, gathered_output=True, local_spec=None):
    """Run both, backprop the same upstream gradient; returns the collective counts (fwd, bwd)."""
    x_ref = x.detach().clone().requires_grad_()
    y_ref = full(x_ref)
    with CollectiveCounter() as fwd:
        y = sharded(x)
    if gathered_output:
        assert_close(y, y_ref, what="output")
        upstream = torch.randn_like(y_ref)
        y_ref.backward(upstream)
        grad_out = upstream
    else:
        # a column layer without gather: this rank's output is its slice of the full output
        assert_close(y, slice_tensor(y_ref.detach(), local_spec), what="local output")
        upstream = torch.randn_like(y_ref)
        y_ref.backward(upstream)
        grad_out = slice_tensor(upstream, local_spec)
    with CollectiveCounter() as bwd:
        y.backward(grad_out)
    assert_close(x.grad, x_ref.grad, what="input grad")
    assert_grads_match(sharded, full)
    return fwd.counts, bwd.counts


def _output_spec(layer, y_dim):
    spec = shard_spec(layer.weight)
    return type(spec)(y_dim - 1, spec.world_size, spec.rank, spec.full_size, spec.padded_size, spec.n_cast)


def check_column_linear():
    torch.manual_seed(0)
    full = nn.Linear(HIDDEN, OUT)
    layer = Linear1D_Col.from_native(full, None)
    assert layer.weight.shape == (OUT // world(), HIDDEN)
    fwd, bwd = _compare(full, layer, _input(3, 5, HIDDEN), gathered_output=False, local_spec=_output_spec(layer, 3))
    assert fwd == {} and bwd == {"all_reduce": 1}, (fwd, bwd)


def check_column_linear_gather_output():
    torch.manual_seed(0)
    full = nn.Linear(HIDDEN, OUT)
    fwd, bwd = _compare(full, Linear1D_Col.from_native(full, None, gather_output=True), _input(2, HIDDEN))
    assert fwd == {"all_gather": 1} and bwd == {"all_reduce": 1}, (fwd, bwd)


def check_fused_qkv_linear():
    torch.manual_seed(0)
    full = nn.Linear(HIDDEN, 3 * HIDDEN)
    layer = Linear1D_Col.from_native(full, None, n_cast=3)
    # each rank holds [Q_r | K_r | V_r], not a contiguous third of the fused weight
    q, k, v = full.weight.detach().chunk(3, dim=0)
    w = world()
    mine = [t.chunk(w, dim=0)[rank()] for t in (q, k, v)]
    assert_close(layer.weight.detach(), torch.cat(mine, dim=0), what="fused shard")
    _compare(full, layer, _input(2, 3, HIDDEN), gathered_output=False, local_spec=_output_spec(layer, 3))
    torch.manual_seed(0)
    full = nn.Linear(HIDDEN, 3 * HIDDEN)
    _compare(full, Linear1D_Col.from_native(full, None, n_cast=3, gather_output=True), _input(2, 3, HIDDEN))


def check_fused_qkv_conv1d():
    torch.manual_seed(0)
    full = Conv1D(3 * HIDDEN, HIDDEN)  # weight [in, out]
    nn.init.normal_(full.bias)
    layer = Linear1D_Col.from_native(full, None, n_cast=3)
    assert layer.reversed and layer.weight.shape == (HIDDEN, 3 * HIDDEN // world())
    q, k, v = full.weight.detach().chunk(3, dim=1)
    mine = [t.chunk(world(), dim=1)[rank()] for t in (q, k, v)]
    assert_close(layer.weight.detach(), torch.cat(mine, dim=1), what="fused conv1d shard")
    fwd, bwd = _compare(full, layer, _input(2, 3, HIDDEN), gathered_output=False, local_spec=_output_spec(layer, 3))
    assert fwd == {} and bwd == {"all_reduce": 1}, (fwd, bwd)


def check_row_linear():
    torch.manual_seed(0)
    full = nn.Linear(OUT, HIDDEN)
    layer = Linear1D_Row.from_native(full, None)
    x = _input(3, OUT)
    x_local = slice_tensor(x.detach(), _spec_cols(x)).requires_grad_()
    y_ref = full(x)
    with CollectiveCounter() as fwd:
        y = layer(x_local)
    assert_close(y, y_ref, what="row output")
    upstream = torch.randn_like(y)
    y_ref.backward(upstream)
    with CollectiveCounter() as bwd:
        y.backward(upstream)
    assert fwd.counts == {"all_reduce": 1} and bwd.counts == {}, (fwd.counts, bwd.counts)
    assert_close(x_local.grad, slice_tensor(x.grad, _spec_cols(x)), what="row input grad")
    assert_grads_match(layer, full)


def _spec_cols(x):
    return make_spec(x.shape, -1, rank(), world())


def check_row_linear_splits_input():
    torch.manual_seed(0)
    full = nn.Linear(OUT, HIDDEN)
    fwd, bwd = _compare(full, Linear1D_Row.from_native(full, None, input_is_parallel=False), _input(4, OUT))
    assert fwd == {"all_reduce": 1} and bwd == {"all_gather": 1}, (fwd, bwd)


def check_row_conv1d():
    torch.manual_seed(0)
    full = Conv1D(HIDDEN, OUT)  # in=OUT, out=HIDDEN
    layer = Linear1D_Row.from_native(full, None, input_is_parallel=False)
    assert layer.reversed and layer.weight.shape == (OUT // world(), HIDDEN)
    _compare(full, layer, _input(2, 3, OUT))


def check_vocab_parallel_embedding_odd_vocab():
    for vocab in (13, 16):
        torch.manual_seed(0)
        full = nn.Embedding(vocab, HIDDEN, padding_idx=vocab - 1)
        layer = VocabParallelEmbedding1D.from_native(full, None)
        assert layer.weight.shape[0] * world() >= vocab and layer.weight.shape[0] * world() < vocab + world()
        ids = torch.tensor([[0, 1, vocab - 1, vocab // 2], [vocab - 2, 3, 3, vocab - 1]])
        with CollectiveCounter() as fwd:
            y = layer(ids)
        y_ref = full(ids)
        assert_close(y, y_ref, what="embedding output")
        upstream = torch.randn_like(y)
        y.backward(upstream)
        y_ref.backward(upstream)
        assert fwd.counts == {"all_reduce": 1}, fwd.counts
        assert_close(full_of(layer.weight.grad, layer.weight), full.weight.grad, what="embedding grad")
        # padding rows (beyond the true vocabulary) receive nothing
        padded = layer.weight.shape[0] * world() - vocab
        if padded and rank() == world() - 1:
            assert torch.all(layer.weight.grad[-padded:] == 0) and torch.all(layer.weight.detach()[-padded:] == 0)


def check_vocab_parallel_embedding_refuses_ids_outside_the_vocabulary():
    """An id no rank holds (negative, in the padding rows, past them) raises on every rank, as the
    unsharded embedding does, before the layer's all-reduce; the ranks then go on together."""
    import pytest

    torch.manual_seed(0)
    full = nn.Embedding(13, HIDDEN)  # padded to 14 at tp=2, 16 at tp=4
    layer = VocabParallelEmbedding1D.from_native(full, None)
    for bad in (-1, 13, layer.weight.shape[0] * world() - 1, 1000):
        ids = torch.tensor([[0, 5, bad]])
        with pytest.raises(IndexError):
            full(ids)
        with (
            CollectiveCounter() as fwd,
            pytest.raises(
                IndexError,
                match=rf"input ids outside the vocabulary of 13 \(\[0, 13\)\): {bad} \(1 of 3\); .*tokenizer",
            ),
        ):
            layer(ids)
        assert fwd.counts == {}, fwd.counts  # refused before any collective
    ids = torch.tensor([[0, 12, 5]])
    assert_close(layer(ids), full(ids), what="in-range ids after the refusals")


def check_lm_head_gathered_logits_trim_padding():
    torch.manual_seed(0)
    full = nn.Linear(HIDDEN, 13, bias=False)
    layer = VocabParallelLMHead1D.from_native(full, None, gather_output=True)
    fwd, bwd = _compare(full, layer, _input(2, 3, HIDDEN))
    assert fwd == {"all_gather": 1} and bwd == {"all_reduce": 1}, (fwd, bwd)
    assert layer(torch.zeros(1, HIDDEN)).shape[-1] == 13


def check_column_layers_sharing_an_input_copy_reduce_once():
    """q/k/v reading one input: one backward all-reduce with a shared SharedInputCopy, one each
    without; the sharers stay sharers from step to step (none of them overlaps on its own)."""
    torch.manual_seed(0)
    fulls = [nn.Linear(HIDDEN, OUT) for _ in range(3)]
    for shared, expected in ((SharedInputCopy(), 1), (None, 3)):
        layers = [Linear1D_Col.from_native(f, None, input_copy=shared) for f in fulls]
        for step in range(2):
            x, x_ref = _input(2, HIDDEN), _input(2, HIDDEN)
            loss = sum(layer(x).square().sum() for layer in layers)
            with CollectiveCounter() as bwd:
                loss.backward()
            assert bwd.counts == {"all_reduce": expected}, (shared, step, bwd.counts)
            sum(f(x_ref).square().sum() for f in fulls).backward()
            assert_close(x.grad, x_ref.grad, what=f"input grad (shared={shared is not None}, step {step})")
        if shared is not None:
            assert not any(shared.reads_alone(layer) for layer in layers)


def check_input_copy_learns_layers_reading_alone():
    """Two column layers given one SharedInputCopy but reading different inputs (GPT-2's c_attn and
    c_fc): from the second step on each is known to read alone and overlaps its own all-reduce;
    the same two all-reduces and input gradients every step."""
    torch.manual_seed(0)
    fulls = [nn.Linear(HIDDEN, OUT) for _ in range(2)]
    shared = SharedInputCopy()
    layers = [Linear1D_Col.from_native(f, None, input_copy=shared) for f in fulls]
    for step in range(2):
        xs, xs_ref = [_input(2, HIDDEN, seed=s) for s in (1, 2)], [_input(2, HIDDEN, seed=s) for s in (1, 2)]
        loss = sum(layer(x).square().sum() for layer, x in zip(layers, xs))
        with CollectiveCounter() as bwd:
            loss.backward()
        assert bwd.counts == {"all_reduce": 2}, (step, bwd.counts)
        sum(f(x).square().sum() for f, x in zip(fulls, xs_ref)).backward()
        for x, x_ref in zip(xs, xs_ref):
            assert_close(x.grad, x_ref.grad, what=f"input grad (step {step})")
        assert [shared.reads_alone(layer) for layer in layers] == [True, True], step


def check_column_overlap_on_and_off_agree():
    """The overlapped backward (input-gradient all-reduce running while the weight gradient is
    computed) gives what the sequential one gives, with the same one all-reduce; a frozen bias too."""
    for make in (lambda: nn.Linear(HIDDEN, OUT), lambda: Conv1D(OUT, HIDDEN)):
        grads, counts = [], []
        for overlap in (True, False):
            torch.manual_seed(0)
            full = make()
            full.bias.requires_grad_(False)
            layer = Linear1D_Col.from_native(full, None)
            layer.overlap_communication = overlap
            x = _input(3, 5, HIDDEN)
            with CollectiveCounter() as bwd:
                layer(x).square().sum().backward()
            grads.append((x.grad, layer.weight.grad))
            counts.append(bwd.counts)
            assert layer.bias.grad is None
        assert counts[0] == counts[1] == {"all_reduce": 1}, counts
        for on, off in zip(grads[0], grads[1]):
            assert torch.equal(on, off), (on - off).abs().max()


CHECKS = [
    check_column_linear,
    check_column_overlap_on_and_off_agree,
    check_column_layers_sharing_an_input_copy_reduce_once,
    check_input_copy_learns_layers_reading_alone,
    check_column_linear_gather_output,
    check_fused_qkv_linear,
    check_fused_qkv_conv1d,
    check_row_linear,
    check_row_linear_splits_input,
    check_row_conv1d,
    check_vocab_parallel_embedding_odd_vocab,
    check_vocab_parallel_embedding_refuses_ids_outside_the_vocabulary,
    check_lm_head_gathered_logits_trim_padding,
]

test_tp2 = check_table(CHECKS, 2)
test_tp4 = check_table(CHECKS, 4)


def test_from_native_on_one_rank_reuses_storage_and_keeps_flags():
    full = nn.Linear(HIDDEN, OUT).to(torch.float64)
    full.bias.requires_grad_(False)
    layer = Linear1D_Col.from_native(full)  # no process group: one rank
    assert layer.weight.data_ptr() == full.weight.data_ptr()
    assert layer.weight.dtype == torch.float64 and not layer.bias.requires_grad and layer.weight.requires_grad
    x = torch.randn(2, HIDDEN, dtype=torch.float64)
    assert_close(layer(x), full(x))
    assert_close(F.linear(x, layer.weight, layer.bias), full(x))


def test_heads_fewer_than_ranks_are_replicated_in_the_spec():
    """[Q | K | V] of 8 query and 2 key/value heads of width 3 on 4 ranks: Q is cut in 4, each K/V
    head is held whole by 2 consecutive ranks; merging takes one copy of each and restores the tensor."""
    import pytest

    from shardformer.core.shard_spec import merge_shards, replica_weights

    full = torch.arange((8 + 2 + 2) * 3 * 5, dtype=torch.float32).view(-1, 5)
    specs = [make_spec(full.shape, 0, r, 4, (24, 6, 6), head_width=3) for r in range(4)]
    assert specs[0].splits == (4, 2, 2) and specs[3].local_size == 6 + 3 + 3
    shards = [slice_tensor(full, s) for s in specs]
    assert torch.equal(shards[0][6:9], full[24:27]) and torch.equal(shards[1][6:9], full[24:27])  # K head 0
    assert torch.equal(shards[2][6:9], full[27:30])  # K head 1
    assert torch.equal(merge_shards(shards, specs[0]), full)
    weights = replica_weights(specs[0], shards[0].shape)
    assert weights[:6].eq(1).all() and weights[6:].eq(0.5).all()  # each K/V row counted once over 4 ranks
    with pytest.raises(ValueError, match="neither splits over nor replicates"):
        make_spec((9 * 3, 5), 0, 0, 2, (9 * 3,), head_width=3)


def test_compiled_embedding_refuses_ids_outside_the_vocabulary():
    """Compiled, the check is an assert inside the graph (no graph break): it still raises."""
    import pytest

    layer = VocabParallelEmbedding1D.from_native(nn.Embedding(13, HIDDEN))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert compiled(torch.tensor([0, 12])).shape == (2, HIDDEN)
    with pytest.raises(RuntimeError, match=r"input ids outside the vocabulary of 13"):
        compiled(torch.tensor([0, 13]))
