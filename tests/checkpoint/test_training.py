"""Training checkpoints and pipeline export on 4 gloo ranks (one spawn).

Resume: a run saved at step 5 and resumed in a fresh model and optimizer gives the losses of steps
6..10 of the run that never stopped (tp=2, dp=2, ZeroOptimizer, dropout on). Resharding: the same
kind of checkpoint loaded at (tp=1, dp=4) and (tp=4, dp=1) continues with the same losses. A save
that fails on one rank leaves the previous checkpoint loadable. ``shardformer convert`` of a
checkpoint writes the folder ``save_pretrained`` wrote of the same model (tp x dp, and tp x pp).
Pipeline parallelism is simulated per its contract (each stage keeps the original model with the other stages' modules set to None).
"""

import os

import torch
import torch.distributed as dist
import transformers as tf

import shardformer.checkpoint.rng_state as rng_state
from shardformer import ShardConfig, shard_model
from shardformer.api import shard_before_split
from shardformer.checkpoint import CheckpointError, layout_of, load_checkpoint, save_checkpoint, save_pretrained
from shardformer.cli.main import main as cli_main
from shardformer.core.record import with_stage
from shardformer.core.tiny import tiny_config
from shardformer.data_parallel import ZeroOptimizer
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from tests.checkpoint.common import full_logits, remove_dir, same_folder, sgd_steps, shared_dir
from tests.helpers import assert_close, check_table
from tests.policies import zoo

GLOBAL_BATCH = 4


def _gpt2(tp, pp=1, dropout=0.0, seed=0):
    config = zoo.gpt2_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(config)
    if pp == 1:
        return shard_model(model, ShardConfig(tensor_parallel_size=tp))
    # ParallelEngine's way: shard_model refuses pp > 1 (it does not split), the caller keeps a stage after
    return shard_before_split(
        model, ShardConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp), None, pipeline_spec_for(model)
    )


def _trainer(model, optim="sgd"):
    lay = layout_of(model)
    inner = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if optim == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    opt = ZeroOptimizer(inner, dp_group=lay.dp_group, tp_group=lay.tp_group, model=model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return opt, sched


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, zoo.VOCAB, (GLOBAL_BATCH, zoo.SEQ), generator=g)


def _train(model, opt, sched, steps):
    lay = layout_of(model)
    model.train()
    losses = []
    for step in steps:
        per = GLOBAL_BATCH // lay.dp
        ids = _batch(step)[lay.dp_rank * per : (lay.dp_rank + 1) * per]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=lay.dp_group)
        losses.append(value.item() / lay.dp)
    return losses


def _llama(attention_dropout, seed=0):
    """A model whose policy comes from transformers' tp plan (its attention dropout on a per-rank stream)."""
    torch.manual_seed(seed)
    config = tiny_config(tf.LlamaConfig, vocab_size=zoo.VOCAB, attention_dropout=attention_dropout)
    return shard_model(tf.LlamaForCausalLM(config), ShardConfig(tensor_parallel_size=2))


def check_resume_equals_uninterrupted():
    _resume_equals_uninterrupted(lambda seed: _gpt2(2, dropout=0.1, seed=seed), 5)


def check_resume_with_attention_dropout_of_a_plan_derived_model():
    _resume_equals_uninterrupted(lambda seed: _llama(0.3, seed=seed), 2)


def _resume_equals_uninterrupted(build, steps):
    path = shared_dir()
    model = build(0)
    opt, sched = _trainer(model, "adamw")
    first = _train(model, opt, sched, range(1, steps + 1))
    save_checkpoint(os.path.join(path, "ckpt"), model, opt, sched, step=steps, extra={"sample": 20})
    reference = _train(model, opt, sched, range(steps + 1, 2 * steps + 1))

    fresh = build(7)
    opt2, sched2 = _trainer(fresh, "adamw")
    torch.manual_seed(1234)  # disturb the global RNG: the checkpoint must restore it
    _train(fresh, opt2, sched2, range(90, 91))  # move every RNG (the checkpoint must restore them all)
    info = load_checkpoint(os.path.join(path, "ckpt"), fresh, opt2, sched2)
    assert info["step"] == steps and info["extra"] == {"sample": 20} and info["rng_restored"], info
    resumed = _train(fresh, opt2, sched2, range(steps + 1, 2 * steps + 1))
    assert len(first) == steps
    torch.testing.assert_close(resumed, reference, atol=1e-6, rtol=0)
    remove_dir(path)


def _reshard_to(tp):
    path = shared_dir()
    model = _gpt2(2)
    opt, sched = _trainer(model)
    _train(model, opt, sched, range(1, 6))
    save_checkpoint(os.path.join(path, "ckpt"), model, opt, sched, step=5)
    reference = _train(model, opt, sched, range(6, 9))

    other = _gpt2(tp, seed=3)
    opt2, sched2 = _trainer(other)
    info = load_checkpoint(os.path.join(path, "ckpt"), other, opt2, sched2)
    assert info["layout"] == {"tp": 2, "pp": 1, "dp": 2, "world": 4} and not info["rng_restored"]
    resumed = _train(other, opt2, sched2, range(6, 9))
    torch.testing.assert_close(resumed, reference, atol=1e-5, rtol=1e-5)
    remove_dir(path)


def check_reshard_tp2_dp2_to_tp1_dp4():
    _reshard_to(1)


def check_reshard_tp2_dp2_to_tp4_dp1():
    _reshard_to(4)


def _disk_full_on_rank_1(monkeypatch_target):
    """Rank 1's writes fail after the file is written (a wrapped function, not a hook in the library)."""
    real = monkeypatch_target.save_file

    def failing(tensors, file, *args, **kwargs):
        real(tensors, file, *args, **kwargs)
        if dist.get_rank() == 1:
            raise OSError("disk full (simulated)")

    monkeypatch_target.save_file = failing
    return real


def check_failed_save_keeps_previous_checkpoint():
    path = shared_dir()
    ckpt = os.path.join(path, "ckpt")
    model = _gpt2(2)
    opt, sched = _trainer(model)
    _train(model, opt, sched, range(1, 3))
    save_checkpoint(ckpt, model, opt, sched, step=2)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, opt, sched, range(3, 4))
    real = _disk_full_on_rank_1(rng_state)
    try:
        save_checkpoint(ckpt, model, opt, sched, step=3)
        raise AssertionError("the save should have failed")
    except CheckpointError as e:
        assert "rank 1" in str(e) and "disk full" in str(e), e
    finally:
        rng_state.save_file = real
    dist.barrier()
    assert sorted(os.listdir(path)) == ["ckpt"], os.listdir(path)  # the temporary folder is gone
    info = load_checkpoint(ckpt, model, opt, sched)
    assert info["step"] == 2
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[n]), n
    remove_dir(path)


def check_mismatch_is_reported():
    path = shared_dir()
    model = _gpt2(2)
    save_checkpoint(os.path.join(path, "ckpt"), model)
    config = zoo.gpt2_config()
    config.n_positions = 16
    other = shard_model(tf.GPT2LMHeadModel(config), ShardConfig(tensor_parallel_size=2))
    try:
        load_checkpoint(os.path.join(path, "ckpt"), other)
        raise AssertionError("loading a different model should fail")
    except ValueError as e:
        assert "transformer.wpe.weight: shape [32, 32] in the checkpoint, [16, 32] here" in str(e), e
    try:
        load_checkpoint(os.path.join(path, "ckpt"), model, torch.optim.SGD(model.parameters(), lr=0.1))
        raise AssertionError("there is no optimizer state to load")
    except ValueError as e:
        assert "without an optimizer" in str(e), e
    factored = torch.optim.Adafactor(model.parameters(), lr=1e-2)  # row/column moments: not per element
    model(input_ids=_batch(0)[:1], labels=_batch(0)[:1]).loss.backward()
    factored.step()
    try:
        save_checkpoint(os.path.join(path, "factored"), model, factored)
        raise AssertionError("a factored optimizer state of a cut parameter cannot be put together")
    except ValueError as e:
        assert "not kept per element" in str(e) and "row_var" in str(e), e
    assert not os.path.exists(os.path.join(path, "factored")), os.listdir(path)
    remove_dir(path)


def _converts_to_the_export(ckpt: str, export: str) -> None:
    """Rank 0: ``shardformer convert`` of the checkpoint writes the folder the export wrote."""
    if dist.get_rank() == 0:
        out = os.path.join(os.path.dirname(ckpt), "converted")
        assert cli_main(["convert", ckpt, "--to", "hf", out]) == 0
        same_folder(out, export)
        tf.GPT2LMHeadModel.from_pretrained(out)  # loads without a missing or unexpected weight
    dist.barrier()


def check_convert_writes_what_the_export_writes():
    """tp=2 x dp=2, ZeRO-1 AdamW (optimizer state in the same files): convert == export, loaded by from_pretrained."""
    path = shared_dir()
    model = _gpt2(2)
    opt, sched = _trainer(model, "adamw")
    _train(model, opt, sched, range(1, 3))
    save_checkpoint(os.path.join(path, "ckpt"), model, opt, sched, step=2)
    save_pretrained(model, os.path.join(path, "hf"), max_shard_size="40KB")
    if dist.get_rank() == 0:
        out = os.path.join(path, "converted")
        assert cli_main(["convert", os.path.join(path, "ckpt"), "--to", "hf", out, "--max-shard-size", "40KB"]) == 0
        same_folder(out, os.path.join(path, "hf"))
        assert "model.safetensors.index.json" in os.listdir(out)
        plain = tf.GPT2LMHeadModel.from_pretrained(out).eval()
        ids = _batch(0)
        with torch.no_grad():
            expected = tf.GPT2LMHeadModel.from_pretrained(os.path.join(path, "hf")).eval()(input_ids=ids).logits
            assert torch.equal(plain(input_ids=ids).logits, expected)
    remove_dir(path)


def _cut_to_stage(model):
    """What the pipeline code leaves on a stage: the same model object, other stages' modules None."""
    stage = model.shardformer.mesh.pp_rank
    if stage == 0:
        model.transformer.h[1] = None
        model.transformer.ln_f = None
    else:
        model.transformer.h[0] = None
        model.transformer.wte = None
        model.transformer.wpe = None
    with_stage(model, stage, 2, layers=(stage,), pipeline=None)
    return model


def check_pipeline_export_and_checkpoint():
    """tp=2 x pp=2: export to HF and a training checkpoint that loads at tp=4, pp=1."""
    name = "GPT2LMHeadModel"
    inputs = zoo.inputs_for(name)
    model = _gpt2(2, pp=2)
    group = model.shardformer.tp_group
    sgd_steps(model, inputs, lambda m, x: m(**x).loss)
    model.eval()
    with torch.no_grad():
        logits = full_logits(model(input_ids=inputs["input_ids"]).logits, zoo.VOCAB, group)
    model = _cut_to_stage(model)
    path = shared_dir()
    save_pretrained(model, os.path.join(path, "hf"))
    save_checkpoint(os.path.join(path, "ckpt"), model, step=2)
    _converts_to_the_export(os.path.join(path, "ckpt"), os.path.join(path, "hf"))
    if dist.get_rank() == 0:
        plain = tf.GPT2LMHeadModel.from_pretrained(os.path.join(path, "hf")).eval()
        with torch.no_grad():
            assert_close(plain(input_ids=inputs["input_ids"]).logits, logits, what="pp export logits")
    other = _gpt2(4, seed=9)
    load_checkpoint(os.path.join(path, "ckpt"), other)
    other.eval()
    with torch.no_grad():
        got = full_logits(other(input_ids=inputs["input_ids"]).logits, zoo.VOCAB, other.shardformer.tp_group)
    assert_close(got, logits, what="pp checkpoint loaded at tp=4")
    remove_dir(path)


def check_real_pipeline_split_export():
    """The same with shardformer.pipeline's own stage split (the GPT-2 pipeline spec)."""
    torch.manual_seed(0)
    reference = tf.GPT2LMHeadModel(zoo.gpt2_config()).eval()
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(zoo.gpt2_config())
    spec = pipeline_spec_for(model)
    model = shard_before_split(model, ShardConfig(tensor_parallel_size=2, pipeline_parallel_size=2), None, spec)
    spec.keep_stage(model, model.shardformer.mesh.pp_rank, 2)
    path = shared_dir()
    save_pretrained(model, os.path.join(path, "hf"))
    save_checkpoint(os.path.join(path, "ckpt"), model)
    _converts_to_the_export(os.path.join(path, "ckpt"), os.path.join(path, "hf"))
    ids = torch.randint(3, zoo.VOCAB, (2, zoo.SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        if dist.get_rank() == 0:
            plain = tf.GPT2LMHeadModel.from_pretrained(os.path.join(path, "hf")).eval()
            assert_close(plain(input_ids=ids).logits, expected, what="pipeline-split export")
        other = _gpt2(4, seed=9).eval()
        load_checkpoint(os.path.join(path, "ckpt"), other)
        got = full_logits(other(input_ids=ids).logits, zoo.VOCAB, other.shardformer.tp_group)
    assert_close(got, expected, what="pipeline-split checkpoint loaded at tp=4")
    remove_dir(path)


CHECKS = [
    check_resume_equals_uninterrupted,
    check_resume_with_attention_dropout_of_a_plan_derived_model,
    check_reshard_tp2_dp2_to_tp1_dp4,
    check_reshard_tp2_dp2_to_tp4_dp1,
    check_failed_save_keeps_previous_checkpoint,
    check_mismatch_is_reported,
    check_convert_writes_what_the_export_writes,
    check_pipeline_export_and_checkpoint,
    check_real_pipeline_split_export,
]
test_training_world4 = check_table(CHECKS, 4)
