"""Expert parallelism and checkpoints on 4 ranks (two spawns): training checkpoints resharded across ep
(ep=2, its experts' ZeRO shards over 2 ranks -> ep=1, ep=2, ep=2 x (2 replicas x 2 shards), and ZeRO-3
at ep=2 -> ep=1; ep=4 -> tp=2 x ep=2 -> ep=1; DeepSeek-V3 at pp=2 x ep=2, a stage without experts -> ep=1), each loaded
run's next steps equal to the run that never stopped (losses and every weight, AdamW); shard-on-load
reading only this rank's experts (ep=2, tp=2 x ep=2, GPT-OSS at ep=4), equal to from_pretrained +
shard_model; the refusals (a ZeroOptimizer over the whole dp holding experts, a folder of per-expert
weights for shard-on-load). And ShardedTrainer at ep=2 x dp=4 against transformers' Trainer on the
unsharded model in one process: logged losses and gradient norms (clipping active), the weights after 4
steps, and a run resumed from its step-2 checkpoint.
"""

import os

import pytest
import torch
import transformers

from shardformer import EngineConfig, ParallelEngine, ShardConfig, shard_model
from shardformer.checkpoint import CheckpointError, gather_full_state, load_checkpoint, load_sharded, save_checkpoint
from shardformer.data_parallel import ZeroOptimizer
from shardformer.integrations import ShardedTrainer
from shardformer.tools.testing import run_on_ranks
from tests.checkpoint.common import remove_dir, shared_dir
from tests.expert_parallel.common import _config, batch, build, gathered_weights
from tests.helpers import assert_close, check_table
from tests.integrations.common import dataset, logged, training_args


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _engine(num_microbatches=1, family="mixtral", **sizes):
    torch.manual_seed(0)  # the same start on every rank (the loaded runs are overwritten by the checkpoint)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, output_router_logits=True))
    return ParallelEngine(model, _adamw, EngineConfig(num_microbatches=num_microbatches, **sizes))


# the step before the save and the two after it; one sample per forward in every layout (dp=4, or dp=2 with
# two micro-batches): the router's load-balancing loss is computed per forward
DATA = [batch(50 + s, size=4) for s in range(3)]


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
    engine = _engine(ep=2)  # dp=4: the experts' ZeRO shards over the 2 ranks holding the same experts
    engine.train_step(DATA[0])
    save_checkpoint(ckpt, engine.model, engine.optimizer, step=1)
    names = sorted(os.listdir(ckpt))
    assert {n.split("-")[1] for n in names if n.startswith("tensors-")} == {f"rank0000{r}" for r in range(4)}, names
    reference = [engine.train_step(DATA[1])]  # its loss checks the weights loaded, the weights after it the optimizer
    expected = gathered_weights(engine.model)
    # ep=1 (one ZeroOptimizer), the layout it was saved at, and hybrid sharding (2 replicas x 2 shards, the
    # experts' ZeRO over the one rank of a shard group holding them)
    for sizes in ({}, {"ep": 2}, {"ep": 2, "dp_replicate": 2}):
        other = _engine(**sizes)
        info = _resumed_equals(ckpt, other, reference, (1,), f"ep=2 -> {sizes or 'ep=1'}")
        assert info["layout"] == {"tp": 1, "pp": 1, "dp": 4, "world": 4, "ep": 2}, info
        assert info["rng_restored"] == bool(sizes), info  # the same ranks: hybrid sharding too
        _same_weights(other, expected, f"ep=2 -> {sizes or 'ep=1'}")
    # ZeRO-3 (each experts module an FSDP2 unit over the ranks holding its experts): loads, and saves a
    # checkpoint that ZeRO-1 at ep=1 resumes
    following = engine.train_step(DATA[2])
    zero3 = _engine(ep=2, zero_stage=3)
    _resumed_equals(ckpt, zero3, reference, (1,), "ep=2 -> ZeRO-3 ep=2")
    save_checkpoint(os.path.join(path, "zero3"), zero3.model, zero3.optimizer, step=2)
    _resumed_equals(os.path.join(path, "zero3"), _engine(), [following], (2,), "ZeRO-3 ep=2 -> ep=1")
    remove_dir(path)


def check_refusals_and_shard_on_load():
    # a ZeroOptimizer over the whole dp group cannot hold experts split over ep: refused, nothing written
    plain, model = build("mixtral")
    model = shard_model(model, ShardConfig(expert_parallel_size=2))
    opt = ZeroOptimizer(_adamw(list(model.parameters())), model.shardformer.mesh.dp_group)
    path = shared_dir("sf-ep-ckpt-")
    with pytest.raises(CheckpointError, match="whose ZeRO group must be the 2 ranks holding the same experts"):
        save_checkpoint(os.path.join(path, "ckpt"), model, opt)
    assert not os.path.exists(os.path.join(path, "ckpt"))
    # shard-on-load at ep=2 and tp=2 x ep=2 from shardformer's export (the model's own stacked experts)
    # equals from_pretrained + shard_model
    folder, legacy = os.path.join(path, "hf"), os.path.join(path, "legacy")
    model.save_pretrained(folder)
    torch.distributed.barrier()
    _check_shard_on_load(folder, ShardConfig(expert_parallel_size=2))
    _check_shard_on_load(folder, ShardConfig(tensor_parallel_size=2, expert_parallel_size=2))
    # transformers' own save_pretrained writes GPT-OSS's stacked experts (with their biases) as they are,
    # and Mixtral's one by one, which it converts on loading: refused
    gpt_oss, gpt_oss_folder = build("gpt_oss")[0], os.path.join(path, "gpt-oss")
    if torch.distributed.get_rank() == 0:
        gpt_oss.save_pretrained(gpt_oss_folder)
        plain.save_pretrained(legacy)
    torch.distributed.barrier()
    _check_shard_on_load(gpt_oss_folder, ShardConfig(expert_parallel_size=4), "GptOssForCausalLM")
    with pytest.raises(CheckpointError, match="a layout transformers converts when loading"):
        load_sharded("MixtralForCausalLM", legacy, ShardConfig(expert_parallel_size=2))
    remove_dir(path)


def _check_shard_on_load(folder, config, cls="MixtralForCausalLM"):
    loaded = load_sharded(cls, folder, config)
    expected = shard_model(getattr(transformers, cls).from_pretrained(folder), config)
    got = dict(loaded.named_parameters())
    for name, p in expected.named_parameters():
        assert got[name].shape == p.shape and getattr(got[name], "expert_spec", None) == getattr(p, "expert_spec", None)
        assert torch.equal(got[name], p), name
    assert any(hasattr(p, "expert_spec") for p in got.values())
    ids = batch(60)["input_ids"]
    assert_close(loaded(input_ids=ids).logits, expected(input_ids=ids).logits, what="shard-on-load logits")


def check_reshard_ep4_to_tp2_ep2_to_ep1():
    path = shared_dir("sf-ep-ckpt-")
    first, second = os.path.join(path, "ep4"), os.path.join(path, "tp2-ep2")
    engine = _engine(ep=4)
    engine.train_step(DATA[0])
    save_checkpoint(first, engine.model, engine.optimizer, step=1)
    reference = [engine.train_step(DATA[s]) for s in (1, 2)]
    expected = gathered_weights(engine.model)
    middle = _engine(num_microbatches=2, tp=2, ep=2)  # experts cut over tp inside each ep rank
    _resumed_equals(first, middle, reference[:1], (1,), "ep=4 -> tp=2 x ep=2")
    save_checkpoint(second, middle.model, middle.optimizer, step=2)
    last = _engine()  # ep=1, dp=4
    _resumed_equals(second, last, reference[1:], (2,), "tp=2 x ep=2 -> ep=1")
    _same_weights(last, expected, "ep=4 -> tp=2 x ep=2 -> ep=1")
    remove_dir(path)


def check_reshard_pp2_ep2_to_ep1():  # DeepSeek-V3: its first stage holds a dense layer only, no experts
    path = shared_dir("sf-ep-ckpt-")
    engine = _engine(num_microbatches=2, family="deepseek_v3", pp=2, ep=2)
    engine.train_step(DATA[0])
    save_checkpoint(os.path.join(path, "ckpt"), engine.model, engine.optimizer, step=1)
    reference = [engine.train_step(DATA[s]) for s in (1, 2)]  # the second loss follows the optimizer's state
    _resumed_equals(os.path.join(path, "ckpt"), _engine(family="deepseek_v3"), reference, (1, 2), "pp=2 x ep=2 -> ep=1")
    remove_dir(path)


test_ep_checkpoints = check_table(
    [
        check_reshard_ep2_to_ep1_and_ep2, check_reshard_ep4_to_tp2_ep2_to_ep1, check_reshard_pp2_ep2_to_ep1,
        check_refusals_and_shard_on_load,
    ],
    4,
)  # fmt: skip


def _mixtral():
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(_config("mixtral"))


def _trainer_run(trainer_class, model, out, dp, resume=None):
    trainer = trainer_class(model=model, args=training_args(out, 4, dp), train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    return {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}


def _sharded_trainer():
    import shutil

    import torch.distributed as dist

    from tests.integrations.common import shared_dir as trainer_dir

    out, out2 = trainer_dir(), trainer_dir()
    model = shard_model(_mixtral(), ShardConfig(expert_parallel_size=2))  # dp=4: experts summed over 2 ranks
    result = _trainer_run(ShardedTrainer, model, out, 4)
    state = gather_full_state(model)
    again = shard_model(_mixtral(), ShardConfig(expert_parallel_size=2))
    result["resumed"] = _trainer_run(ShardedTrainer, again, out2, 4, os.path.join(out, "checkpoint-2"))["loss"]
    resumed_state = gather_full_state(again)
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    shutil.rmtree(out, ignore_errors=True), shutil.rmtree(out2, ignore_errors=True)
    result["state"] = {k: v.numpy().copy() for k, v in state.items()}
    result["resumed_state"] = {k: v.numpy().copy() for k, v in resumed_state.items()}
    return result


def test_sharded_trainer_at_ep2_dp4_matches_one_process(tmp_path):
    got = run_on_ranks(_sharded_trainer, 4, timeout=240)[0]
    model = _mixtral()
    ref = _trainer_run(transformers.Trainer, model, str(tmp_path), 1)
    assert ref["grad_norm"][0] > 0.3, "clipping must be active for the test to mean something"
    for key in ("loss", "grad_norm"):
        assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), what=f"logged {key}")
    assert_close(torch.tensor(got["resumed"]), torch.tensor(ref["loss"]), what="resumed losses")
    for name, value in model.state_dict().items():
        for key in ("state", "resumed_state"):
            assert_close(torch.from_numpy(got[key][name]), value, what=f"{name} ({key})")
