"""Expert parallelism and checkpoints: training checkpoints resharded across ep (ep=2 -> ep=1 and ep=2 on
2 ranks; ep=4 -> tp=2 x ep=2 -> ep=1 on 4 ranks), each loaded run's next steps equal to the run that
never stopped (losses and every weight, AdamW); shard-on-load reading only this rank's experts, equal
to from_pretrained + shard_model; and the refusals (a ZeroOptimizer over the whole dp holding experts,
a folder of per-expert weights for shard-on-load, ShardedTrainer at ep > 1). Two spawns.
"""

import os

import pytest
import torch
import transformers

from shardformer import EngineConfig, ParallelEngine, ShardConfig, shard_model
from shardformer.checkpoint import CheckpointError, load_checkpoint, load_sharded, save_checkpoint
from shardformer.data_parallel import ZeroOptimizer
from shardformer.integrations import ShardedTrainer
from tests.checkpoint.common import remove_dir, shared_dir
from tests.expert_parallel.common import batch, build, gathered_weights
from tests.helpers import assert_close, check_table


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _engine(num_microbatches=2, **sizes):
    _, model = build("mixtral", output_router_logits=True)
    return ParallelEngine(model, _adamw, EngineConfig(num_microbatches=num_microbatches, **sizes))


DATA = [batch(50 + s, size=4) for s in range(3)]  # the step before the save, and the two after it


def _resumed_equals(path, engine, reference_losses, steps, what):
    info = load_checkpoint(path, engine.model, engine.optimizer)
    losses = [engine.train_step(DATA[s]) for s in steps]
    assert_close(torch.tensor(losses), torch.tensor(reference_losses), what=f"{what}: losses after loading")
    return info


def _same_weights(engine, expected, what):
    got = gathered_weights(engine.model)
    for name, value in expected.items():
        assert_close(got[name], value, what=f"{what}: {name}")


def check_reshard_ep2_to_ep1_and_ep2():
    path = shared_dir("sf-ep-ckpt-")
    ckpt = os.path.join(path, "ckpt")
    engine = _engine(ep=2)
    engine.train_step(DATA[0])
    save_checkpoint(ckpt, engine.model, engine.optimizer, step=1)
    names = sorted(os.listdir(ckpt))
    assert "model-pp0-tp0.safetensors" in names and "model-pp0-tp0-ep1.safetensors" in names, names
    reference = [engine.train_step(DATA[1])]  # its loss checks the weights loaded, the weights after it the optimizer
    expected = gathered_weights(engine.model)
    for sizes in ({}, {"ep": 2}):  # ep=1 (dp=2, one ZeroOptimizer), and the layout it was saved at
        other = _engine(**sizes)
        info = _resumed_equals(ckpt, other, reference, (1,), f"ep=2 -> {sizes or 'ep=1'}")
        assert info["layout"] == {"tp": 1, "pp": 1, "dp": 2, "world": 2, "ep": 2}, info
        assert info["rng_restored"] == bool(sizes), info
        _same_weights(other, expected, f"ep=2 -> {sizes or 'ep=1'}")
    remove_dir(path)


def check_refusals_and_shard_on_load():
    # a ZeroOptimizer over the whole dp group cannot hold experts split over ep: refused, nothing written
    _, model = build("mixtral")
    model = shard_model(model, ShardConfig(expert_parallel_size=2))
    opt = ZeroOptimizer(_adamw(list(model.parameters())), model.shardformer.mesh.dp_group)
    path = shared_dir("sf-ep-ckpt-")
    with pytest.raises(CheckpointError, match="whose ZeRO group must be the 1 ranks holding the same experts"):
        save_checkpoint(os.path.join(path, "ckpt"), model, opt)
    assert not os.path.exists(os.path.join(path, "ckpt"))
    with pytest.raises(ValueError, match=r"expert_parallel_size=2; ShardedTrainer .* train it with ParallelEngine"):
        ShardedTrainer(model)
    # shard-on-load at ep=2 (and tp=2 x ep=2 on 4 ranks below) from shardformer's export (the model's own
    # stacked experts) equals from_pretrained + shard_model
    folder, legacy = os.path.join(path, "hf"), os.path.join(path, "legacy")
    model.save_pretrained(folder)
    torch.distributed.barrier()
    _check_shard_on_load(folder, ShardConfig(expert_parallel_size=2))
    # transformers' own save_pretrained writes Mixtral's experts one by one, which it converts on loading
    plain, _ = build("mixtral")
    if torch.distributed.get_rank() == 0:
        plain.save_pretrained(legacy)
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match="a layout transformers converts when loading"):
        load_sharded("MixtralForCausalLM", legacy, ShardConfig(expert_parallel_size=2))
    remove_dir(path)


def _check_shard_on_load(folder, config):
    loaded = load_sharded("MixtralForCausalLM", folder, config)
    expected = shard_model(transformers.MixtralForCausalLM.from_pretrained(folder), config)
    got = dict(loaded.named_parameters())
    for name, p in expected.named_parameters():
        assert got[name].shape == p.shape and getattr(got[name], "expert_spec", None) == getattr(p, "expert_spec", None)
        assert torch.equal(got[name], p), name
    ids = batch(60)["input_ids"]
    assert_close(loaded(input_ids=ids).logits, expected(input_ids=ids).logits, what="shard-on-load logits")


def check_reshard_ep4_to_tp2_ep2_to_ep1():
    path = shared_dir("sf-ep-ckpt-")
    first, second = os.path.join(path, "ep4"), os.path.join(path, "tp2-ep2")
    engine = _engine(num_microbatches=1, ep=4)  # one sample per forward everywhere (the router's loss sees it)
    engine.train_step(DATA[0])
    save_checkpoint(first, engine.model, engine.optimizer, step=1)
    reference = [engine.train_step(DATA[s]) for s in (1, 2)]
    expected = gathered_weights(engine.model)
    middle = _engine(tp=2, ep=2)  # experts cut over tp inside each ep rank
    _resumed_equals(first, middle, reference[:1], (1,), "ep=4 -> tp=2 x ep=2")
    save_checkpoint(second, middle.model, middle.optimizer, step=2)
    last = _engine(num_microbatches=1)  # ep=1, dp=4
    _resumed_equals(second, last, reference[1:], (2,), "tp=2 x ep=2 -> ep=1")
    _same_weights(last, expected, "ep=4 -> tp=2 x ep=2 -> ep=1")
    remove_dir(path)


def check_shard_on_load_tp2_ep2():
    _, model = build("mixtral")
    model = shard_model(model, ShardConfig(expert_parallel_size=2))  # dp=4 split into 2 x ep=2
    path = shared_dir("sf-ep-ckpt-")
    model.save_pretrained(path)
    torch.distributed.barrier()
    _check_shard_on_load(path, ShardConfig(tensor_parallel_size=2, expert_parallel_size=2))
    remove_dir(path)


test_ep_checkpoints_2 = check_table([check_reshard_ep2_to_ep1_and_ep2, check_refusals_and_shard_on_load], 2)
test_ep_checkpoints_4 = check_table([check_reshard_ep4_to_tp2_ep2_to_ep1, check_shard_on_load_tp2_ep2], 4)
