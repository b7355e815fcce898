"""Single-process pieces of ZeRO: shard layout, bucket packing, the loss scaler, early argument errors."""

import pytest
import torch

from shardformer.data_parallel import DynamicLossScaler, ZeroOptimizer
from shardformer.data_parallel.layout import build_buckets, build_slots, read_rows, shard_of, write_rows


@pytest.mark.parametrize("numel,dp", [(1, 4), (7, 2), (8, 4), (13, 4), (100, 3)])
def test_rows_round_trip_and_shards_cover_the_tensor(numel, dp):
    flat = torch.arange(1.0, numel + 1)
    k = -(-numel // dp)
    region = torch.full((dp, k + 3), -1.0)[:, 1 : 1 + k]  # a strided view, like a slice of a bucket
    write_rows(region, flat)
    assert torch.equal(read_rows(region, numel), flat)
    assert region.sum() == flat.sum(), "padding must be zeros"
    shards = [shard_of(flat, dp, r) for r in range(dp)]
    assert all(s.numel() == k for s in shards)
    assert torch.equal(torch.cat(shards)[:numel], flat) and torch.cat(shards)[numel:].eq(0).all()
    assert torch.equal(torch.stack(shards), region)


def test_buckets_follow_reverse_order_and_respect_the_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 30, 5, 50, 3)]
    params.append(torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)))
    slots = build_slots([params[:3], params[3:]], dp=2, rank=1)
    assert [s.index for s in slots] == list(range(6))
    assert slots[5].master.dtype == torch.float32, "half-precision params get fp32 masters"
    assert torch.equal(slots[0].master, torch.zeros(5))
    buckets = build_buckets(slots, bucket_size=60, dp=2)
    order = [[s.index for s in b.slots] for b in buckets]
    assert order == [[5], [4, 3, 2], [1, 0]], order  # (2+25+3)*2 = 60 fits, (15+5)*2 = 40 fits
    for b in buckets:
        assert b.row_numel == sum(s.shard_numel for s in b.slots)
        assert [s.offset for s in b.slots] == [sum(s.shard_numel for s in b.slots[:i]) for i in range(len(b.slots))]


def test_loss_scaler_backs_off_grows_and_stays_in_range():
    scaler = DynamicLossScaler(initial_scale=8.0, growth_interval=2, min_scale=2.0, max_scale=16.0)
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.scale == 8.0
    for _ in range(6):
        scaler.update(False)
    assert scaler.scale == 16.0
    for _ in range(6):
        scaler.update(True)
    assert scaler.scale == 2.0
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.scale == 2.0
    with pytest.raises(ValueError, match="growth_factor=0.5 must be > 1"):
        DynamicLossScaler(growth_factor=0.5)


def test_bad_arguments_fail_before_any_collective():
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"stage=0 is not supported; use stage=1"):
        ZeroOptimizer(sgd, stage=0)
    with pytest.raises(ValueError, match=r"bucket_size=0 must be a positive number"):
        ZeroOptimizer(sgd, bucket_size=0)
    with pytest.raises(TypeError, match=r"reduce_dtype=torch.int32 must be a floating torch.dtype"):
        ZeroOptimizer(sgd, reduce_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"loss_scaler='static' must be"):
        ZeroOptimizer(sgd, loss_scaler="static")
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialised; call shardformer.init_distributed"):
        ZeroOptimizer(sgd)
