"""The step agreement's pieces in one process: the batch fingerprint and the verdict on a table of ranks.
(The engine's use of them, on 4 ranks, is in tests/pipeline/test_engine.py.)"""

import pytest
import torch

from shardformer.core.step_agreement import batch_fingerprint, check_agreement


def test_the_fingerprint_sees_one_token_one_bit_and_the_order():
    ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "pixel_values": pixels, "note": "not a tensor"}
    same = batch_fingerprint({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})
    assert batch_fingerprint(batch) == same
    token, bit, swapped = ids.clone(), pixels.clone(), ids.clone()
    token[2, 5] += 1
    bit.view(-1)[7] = torch.nextafter(bit.view(-1)[7], torch.tensor(10.0))
    swapped[[0, 1]] = ids[[1, 0]]
    for changed in ({"input_ids": token}, {"pixel_values": bit}, {"input_ids": swapped}):
        assert batch_fingerprint({**batch, **changed}) != same, list(changed)
    assert 0 <= same < 2**31


def test_ranks_in_different_steps_are_named():
    table = torch.tensor([[7.0, 5, 1], [7.0, 5, 1], [7.0, 4, 1], [7.0, 5, 2]], dtype=torch.float64)
    pattern = r"rank 0 in train_step #5, .* rank 2 in train_step #4, rank 3 in eval_step #5\): a rank skipped"
    with pytest.raises(RuntimeError, match=pattern):
        check_agreement(table, [[0, 1, 2, 3]])
    table[2, 1], table[3, 2] = 5, 1
    check_agreement(table, [[0, 1, 2, 3]])
    table[3, 0] = 8.0  # another batch on rank 3: fine only where it is not rank 0's peer
    check_agreement(table, [[0, 2]])
    with pytest.raises(RuntimeError, match=r"ranks 1, 3 must get the same batch .*\(ranks 1; ranks 3 hold"):
        check_agreement(table, [[0, 2], [1, 3]])


def test_the_fingerprint_is_the_same_summed_in_chunks_and_stays_on_the_device(monkeypatch):
    import shardformer.core.step_agreement as agreement

    batch = {"pixels": torch.randn(3, 100, 7), "input_ids": torch.randint(0, 10**6, (5, 33))}
    whole = agreement.fingerprint_tensor(batch)
    assert torch.is_tensor(whole) and whole.dtype == torch.int64 and int(whole) == agreement.batch_fingerprint(batch)
    monkeypatch.setattr(agreement, "_CHUNK", 64)  # large tensors are summed in chunks: the same number
    assert agreement.batch_fingerprint(batch) == int(whole)
