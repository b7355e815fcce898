"""Training checkpoints as torch.distributed.checkpoint (DCP) folders, on 4 gloo ranks (one spawn).

tp=2 x pp=2 (ZeroOptimizer, AdamW) saved at step 2 and resumed at tp=2 x dp=2 ZeRO-3: the next steps'
losses and weights equal those of the unsharded run that never stopped; the same checkpoint read by
plain ``dcp.load`` (DCP's HuggingFaceStorageReader) into an unsharded model's ``state_dict()`` and a
plain AdamW's `get_optimizer_state_dict` holds that run's weights and moments. A checkpoint written by
plain FSDP2 (``fully_shard`` + ``dcp.save`` of `get_model_state_dict` and `get_optimizer_state_dict`) is
refused without ``allow_pickle`` and, with it, resumes at tp=2 x dp=2 step for step. So do the folders
that accelerate's FSDP2 ``save_state`` writes (its own `save_fsdp_model` / `save_fsdp_optimizer`; resumed at
pp=2 x dp=2 ZeRO-3, the learning rate recorded by name coming back) and transformers' distributed
checkpoint (its own writers; the model read without unpickling, resumed at tp=2 x dp=2 ZeRO-3); a folder
that does not fit the model, or an optimizer of another kind, is refused by name with nothing changed.
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2LMHeadModel

from shardformer import EngineConfig, ParallelEngine, ProcessMesh
from shardformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardformer.engine import split_batch
from tests.checkpoint.common import remove_dir, shared_dir
from tests.helpers import assert_close, check_table
from tests.pipeline import common
from tests.policies import zoo
from tests.zero.test_zero3 import CLIP, LR, Reference, _assert_weights, _engine, _mesh, _schedule, _train, adamw

GPT2 = "GPT2LMHeadModel"


def _plain_load(path, reference):
    """Plain DCP into an unsharded model and a plain AdamW: the reference run's weights and moments."""
    _, plain = common.models(GPT2)
    opt = adamw(plain.parameters())
    state = plain.state_dict()
    dcp.load({"model": state}, storage_reader=HuggingFaceStorageReader(path))
    for name, value in reference.model.state_dict().items():
        assert_close(state[name], value, what=f"plain dcp.load: {name}")
    moments = {
        name: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(0.0)}
        for name, p in plain.named_parameters()
    }
    dcp.load({"optim": {"state": moments}}, storage_reader=HuggingFaceStorageReader(path))
    expected = get_optimizer_state_dict(reference.model, reference.opt)["state"]
    for name in moments:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_close(moments[name][key], expected[name][key], atol=1e-7, what=f"plain dcp.load: {key} of {name}")
    assert opt is not None


def check_tp2_pp2_to_tp2_dp2_zero3_and_plain_dcp_load():
    reference_model, model = common.models(GPT2)
    reference = Reference(reference_model, 2)
    data = common.batches(GPT2, 4, seed=5)
    engine, sched = _engine(model, 2, 1, zero_stage=1, pp=2, num_microbatches=2)
    expected_first = [reference.step(b) for b in data[:2]]
    assert_close(torch.tensor(_train(engine, sched, data[:2])), torch.tensor(expected_first), what="tp2 x pp2")
    path = shared_dir("sf-dcp-")
    ckpt = os.path.join(path, "ckpt")
    save_checkpoint(ckpt, engine.model, engine.optimizer, sched, step=2)
    _plain_load(ckpt, reference)
    expected = [reference.step(b) for b in data[2:]]
    _, other = common.models(GPT2)
    torch.nn.init.normal_(other.transformer.h[0].mlp.c_fc.weight)
    zero3, sched3 = _engine(other, 2, 2)
    info = load_checkpoint(ckpt, zero3.model, zero3.optimizer, sched3)
    assert info["step"] == 2 and info["layout"] == {"tp": 2, "pp": 2, "dp": 1, "world": 4}, info
    assert_close(torch.tensor(_train(zero3, sched3, data[2:])), torch.tensor(expected), what="resumed at ZeRO-3")
    _assert_weights(zero3, reference.model, "tp2 x pp2 -> tp2 x dp2 ZeRO-3: weights")
    remove_dir(path)


def check_cp2_dp2_to_tp2_dp2():
    """Context-parallel ranks hold their cp peers' pieces: saved once, resumed at another layout."""
    reference_model, model = common.models(GPT2)
    reference = Reference(reference_model, 2)
    data = common.batches(GPT2, 4, seed=7)
    cfg = EngineConfig(cp=2, dp=2, zero_stage=1, max_grad_norm=CLIP)
    engine = ParallelEngine(model, adamw, cfg, mesh=ProcessMesh(1, 1, 2, 2))
    sched = _schedule(engine.optimizer)
    expected_first = [reference.step(b) for b in data[:2]]
    assert_close(torch.tensor(_train(engine, sched, data[:2])), torch.tensor(expected_first), what="cp2 x dp2")
    path = shared_dir("sf-dcp-cp-")
    ckpt = os.path.join(path, "ckpt")
    save_checkpoint(ckpt, engine.model, engine.optimizer, sched, step=2)
    expected = [reference.step(b) for b in data[2:]]
    _, other = common.models(GPT2)
    resumed, sched2 = _engine(other, 2, 2, zero_stage=1)
    info = load_checkpoint(ckpt, resumed.model, resumed.optimizer, sched2)
    assert info["step"] == 2 and info["layout"]["cp"] == 2, info
    assert_close(torch.tensor(_train(resumed, sched2, data[2:])), torch.tensor(expected), what="cp2 -> tp2 x dp2")
    _assert_weights(resumed, reference.model, "cp2 x dp2 -> tp2 x dp2: weights")
    remove_dir(path)


def _fsdp2_step(reference_model, model, batch):
    """One AdamW step of ``model`` under plain ``fully_shard`` on every rank, and the same step of the
    unsharded reference (whose later steps follow the engine: clipped, over ``reference.chunks``)."""
    reference = Reference(reference_model, dist.get_world_size(), clip=None)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters())
    model(**split_batch(batch, dist.get_world_size(), "chunks")[dist.get_rank()]).loss.backward()
    opt.step()
    reference.step(batch)
    reference.clip = CLIP
    return reference, opt


def check_a_plain_fsdp2_checkpoint_resumes():
    data = common.batches(GPT2, 2, seed=6)
    reference_model, model = common.models(GPT2)
    reference, opt = _fsdp2_step(reference_model, model, data[0])
    path = shared_dir("sf-dcp-fsdp2-")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)

    _, other = common.models(GPT2)
    engine = ParallelEngine(other, adamw, EngineConfig(tp=2, dp=2, zero_stage=1, max_grad_norm=CLIP), mesh=_mesh(2, 2))
    with pytest.raises(CheckpointError, match=r"\.metadata is a pickle .* allow_pickle=True"):
        load_checkpoint(path, engine.model, engine.optimizer)
    info = load_checkpoint(path, engine.model, engine.optimizer, allow_pickle=True)
    assert info == {"step": None, "extra": None, "layout": None, "rng_restored": False}, info
    _assert_weights(engine, reference.model, "FSDP2 checkpoint loaded: weights")
    reference.chunks = 2  # as the engine steps: over dp=2
    expected = reference.step(data[1])
    assert_close(torch.tensor(engine.train_step(data[1])), torch.tensor(expected), what="FSDP2 checkpoint resumed")
    remove_dir(path)


def _refused_unchanged(path, model, optimizer, pattern):
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(path, model, optimizer, allow_pickle=True)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a refused load changed the model"


def check_an_accelerate_fsdp2_state_resumes():
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    data = common.batches(GPT2, 2, seed=7)
    reference_model, model = common.models(GPT2)
    reference, opt = _fsdp2_step(reference_model, model, data[0])
    path = shared_dir("sf-dcp-accelerate-")
    PartialState(cpu=True)  # accelerate's logging asks for its state
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = SimpleNamespace(num_processes=dist.get_world_size(), process_index=dist.get_rank())
    save_fsdp_model(plugin, accelerator, model, path)  # what Accelerator.save_state calls
    save_fsdp_optimizer(plugin, accelerator, opt, model, path)
    inner = os.path.join(path, "pytorch_model_fsdp_0")

    plain = GPT2LMHeadModel(common.config(GPT2))  # the same names and shapes, another optimizer class
    _refused_unchanged(
        path, plain, torch.optim.SGD(plain.parameters(), lr=0.1), r"optimizer_0: .* resume with the optimizer class"
    )
    config = common.config(GPT2)
    config.n_positions += 8
    wider = GPT2LMHeadModel(config)
    _refused_unchanged(
        inner,
        wider,
        None,
        r"(?s)written by accelerate .* transformer\.wpe\.weight: shape \[32, 32\] in the checkpoint, \[40, 32\] here",
    )

    _, other = common.models(GPT2)
    engine, sched = _engine(other, 1, 2, zero_stage=3, pp=2, num_microbatches=2)
    with pytest.raises(CheckpointError, match=r"pytorch_model_fsdp_0/\.metadata is a pickle .* allow_pickle=True"):
        load_checkpoint(path, engine.model, engine.optimizer)
    load_checkpoint(inner, engine.model, allow_pickle=True)  # the model alone, from the folder inside
    _assert_weights(engine, reference.model, "accelerate's model folder loaded: weights")
    for group in engine.optimizer.param_groups:
        group["lr"] = 3 * LR
    info = load_checkpoint(path, engine.model, engine.optimizer, allow_pickle=True)
    assert info["step"] is None and not info["rng_restored"], info
    assert {g["lr"] for g in engine.optimizer.param_groups} == {LR}, "the learning rate recorded by name"
    expected = reference.step(data[1])  # 4 chunks: dp=2 x 2 micro-batches, as FSDP2's 4 ranks
    assert_close(torch.tensor(_train(engine, sched, data[1:])), torch.tensor([expected]), what="accelerate resumed")
    _assert_weights(engine, reference.model, "accelerate resumed at pp=2 x dp=2 ZeRO-3: weights")
    remove_dir(path)


def check_a_transformers_distributed_checkpoint_resumes():
    from transformers.distributed.checkpoint import _save_model_checkpoint_distributed, save_optimizer_distributed

    config = common.config(GPT2)
    config.tie_word_embeddings = False  # transformers' writer refuses a tied weight (two names of one storage)
    reference_model, model = zoo.load_twice(GPT2, "eager", config=config)
    data = common.batches(GPT2, 2, seed=8)
    reference, opt = _fsdp2_step(reference_model, model, data[0])
    path = shared_dir("sf-dcp-transformers-")
    _save_model_checkpoint_distributed(model, path)  # what save_pretrained(..., distributed_checkpoint=True) calls
    save_optimizer_distributed(model, opt, os.path.join(path, "optimizer"))

    _, other = zoo.load_twice(GPT2, "eager", config=config)
    engine, sched = _engine(other, 2, 2)
    load_checkpoint(path, engine.model)  # safetensors headers: no unpickling
    _assert_weights(engine, reference.model, "transformers' checkpoint loaded: weights")
    with pytest.raises(CheckpointError, match=r"holds no optimizer state .* optimizer_path="):
        load_checkpoint(path, engine.model, engine.optimizer, allow_pickle=True)
    for group in engine.optimizer.param_groups:
        group["lr"] = 3 * LR
    load_checkpoint(
        path, engine.model, engine.optimizer, allow_pickle=True, optimizer_path=os.path.join(path, "optimizer")
    )
    assert {g["lr"] for g in engine.optimizer.param_groups} == {LR}, "the learning rate recorded by name"
    reference.chunks = 2
    expected = reference.step(data[1])
    assert_close(torch.tensor(_train(engine, sched, data[1:])), torch.tensor([expected]), what="transformers resumed")
    remove_dir(path)


test_dcp_world4 = check_table(
    [
        check_tp2_pp2_to_tp2_dp2_zero3_and_plain_dcp_load,
        check_cp2_dp2_to_tp2_dp2,
        check_a_plain_fsdp2_checkpoint_resumes,
        check_an_accelerate_fsdp2_state_resumes,
        check_a_transformers_distributed_checkpoint_resumes,
    ],
    4,
)
