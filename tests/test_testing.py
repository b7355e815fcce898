"""The spawn helper itself: results come back, a failing rank fails the call, a hung rank is killed."""

import time

import pytest
import torch
import torch.distributed as dist

from shardformer.tools.testing import RankError, run_on_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the helper


def _rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(3600)


def test_results_come_back_by_rank():
    assert run_on_ranks(_sum_of_ranks, 3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_failing_rank_fails_with_its_traceback():
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_on_ranks(_rank1_raises, 2, timeout=60)


def test_hanging_rank_is_killed_by_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish"):
        run_on_ranks(_rank1_hangs, 2, timeout=10)  # room for rank 0 to start on a busy machine
    assert time.monotonic() - start < 30
