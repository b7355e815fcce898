"""ShardedTrainer against transformers' plain Trainer on the unsharded model in one process.

Same weights, same data, same global batches (8 examples: 2 accumulated micro-batches of 4 per step),
clipping active (max_grad_norm below the gradient norm). Checked at tp=2 (2 ranks) and tp=2 x dp=2
(4 ranks): every logged loss and gradient norm, the weights after 4 steps, the folder save_model
writes (loaded by plain from_pretrained), a run resumed from the step-2 checkpoint, and evaluate /
predict after training (loss, logits over the whole vocabulary, each example once). At tp=2 also LoRA
adapters under ShardedTrainer: losses, the saved adapter loaded by plain PEFT, and resume;
load_best_model_at_end restoring the same (early) best checkpoint as the plain Trainer; and a tiny T5
(an encoder-decoder through Trainer's default column filter): its logged losses. At tp=2 x dp=2 also a
model on hybrid sharding's mesh (dp_replicate=2): ShardedTrainer has no ZeRO, so it trains as plain dp.
"""

import functools
import os
import shutil

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2LMHeadModel, Trainer

from shardformer import ProcessMesh, ShardConfig, shard_model
from shardformer.checkpoint import gather_full_state
from shardformer.engine import EngineConfig, ParallelEngine
from shardformer.integrations import ShardedTrainer
from shardformer.tools.testing import run_on_ranks
from tests.helpers import PEFT_READS_A_DEPRECATED_PROPERTY, assert_close
from tests.integrations import common
from tests.integrations.common import dataset, logged, seq2seq_dataset, shared_dir, tiny_gpt2, tiny_t5, training_args

GLOBAL_BATCH = 4


@functools.cache
def reference():
    out = shared_dir()
    trainer = Trainer(model=tiny_gpt2(), args=training_args(out, GLOBAL_BATCH, 1), train_dataset=dataset())
    trainer.train()
    result = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    result["state"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    result.update(_evaluated(trainer))
    shutil.rmtree(out, ignore_errors=True)
    result["lora"] = _lora_run(Trainer, tiny_gpt2, 1)
    result["best"] = _best_run(Trainer, tiny_gpt2(), 1)
    result["seq2seq"] = _seq2seq_run(Trainer)
    return result


def _best_run(trainer_class, model, dp) -> dict:
    """load_best_model_at_end: evaluated and saved every step, the best being the smallest eval loss (an
    early step, so the restored weights differ from the last ones); the weights once training ends."""
    out = shared_dir()
    args = training_args(
        out, GLOBAL_BATCH, dp, max_steps=3, save_steps=1, eval_strategy="steps", eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False,
    )  # fmt: skip
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), eval_dataset=common.eval_dataset()[:4])
    trainer.train()
    state = gather_full_state(model) if dist.is_initialized() else model.state_dict()
    result = {"checkpoint": os.path.basename(trainer.state.best_model_checkpoint), "metric": trainer.state.best_metric}
    result["eval_loss"] = logged(trainer, "eval_loss")
    if state is not None:  # numpy: tensors would travel as shared memory
        result["state"] = {k: v.detach().numpy().copy() for k, v in state.items()}
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    return result


def _seq2seq_run(trainer_class, tp=None) -> dict:
    """Two steps of an encoder-decoder under (Sharded)Trainer with its default column filter, which
    keeps only the batch keys the model's forward signature names (a sharded forward of
    ``(*args, labels=None, **kwargs)`` lost input_ids: "You must specify exactly one of input_ids...")."""
    model = tiny_t5() if tp is None else shard_model(tiny_t5(), ShardConfig(tensor_parallel_size=tp))
    out = shared_dir()
    args = training_args(out, GLOBAL_BATCH, 1, max_steps=2, save_strategy="no", remove_unused_columns=True)
    trainer = trainer_class(model=model, args=args, train_dataset=seq2seq_dataset())
    trainer.train()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    return {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}


def _evaluated(trainer) -> dict:
    trainer.compute_metrics = common.token_accuracy
    metrics = trainer.evaluate(common.eval_dataset())
    predicted = trainer.predict(common.eval_dataset()[:5])
    return {
        "eval": {k: metrics[f"eval_{k}"] for k in ("loss", "accuracy", "examples")},
        "predictions": predicted.predictions.copy(),
        "label_ids": predicted.label_ids.copy(),
    }


def _lora(model):
    torch.manual_seed(5)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM",
        init_lora_weights="gaussian",
    )  # fmt: skip
    return get_peft_model(model, config)


def _lora_run(trainer_class, build, dp) -> dict:
    """LoRA adapters under (Sharded)Trainer: losses, the saved adapter (read back by plain PEFT on the
    unsharded model), and the losses of a run resumed from the step-2 checkpoint."""
    out, out2 = shared_dir(), shared_dir()
    trainer = trainer_class(model=_lora(build()), args=training_args(out, GLOBAL_BATCH, dp), train_dataset=dataset())
    trainer.train()
    trainer.save_model(os.path.join(out, "adapter"))
    result = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    if not dist.is_initialized() or dist.get_rank() == 0:
        loaded = PeftModel.from_pretrained(tiny_gpt2(), os.path.join(out, "adapter"))
        result["adapter"] = {k: v.detach().numpy().copy() for k, v in loaded.state_dict().items() if "lora_" in k}
    args = training_args(out2, GLOBAL_BATCH, dp)
    resumed = trainer_class(model=_lora(build()), args=args, train_dataset=dataset())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    result["resumed_loss"] = logged(resumed, "loss")
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True), shutil.rmtree(out2, ignore_errors=True)
    return result


def _sharded_run(tp):
    dp = dist.get_world_size() // tp
    out, out2 = shared_dir(), shared_dir()
    model = shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp))
    trainer = ShardedTrainer(model=model, args=training_args(out, GLOBAL_BATCH, dp), train_dataset=dataset())
    trainer.train()
    result = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    result["state"] = gather_full_state(model)
    result.update(_evaluated(trainer))
    trainer.save_model(os.path.join(out, "final"))

    again = shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp))
    resumed = ShardedTrainer(model=again, args=training_args(out2, GLOBAL_BATCH, dp), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    # the resumed log holds steps 1-2 from the checkpoint's trainer state, then its own steps 3-4
    result["resumed_loss"], result["resumed_state"] = logged(resumed, "loss"), gather_full_state(again)

    if dp == 2:  # on hybrid sharding's mesh (2 replicas x 1 shard): ShardedTrainer has no ZeRO, so plain dp
        mesh = ProcessMesh(tp_size=tp, dp_replicate_size=dp)
        hybrid = shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp, mesh=mesh))
        args = training_args(out2, GLOBAL_BATCH, dp, save_strategy="no")
        trainer = ShardedTrainer(model=hybrid, args=args, train_dataset=dataset())
        trainer.train()
        result["hybrid"] = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    if dp == 1:  # once: activation checkpointing, and what is refused
        model = shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp))
        args = training_args(out2, GLOBAL_BATCH, dp, save_strategy="no", **{common.CHECKPOINTING: True})
        checkpointed = ShardedTrainer(model=model, args=args, train_dataset=dataset())
        checkpointed.train()
        result["checkpointed_loss"] = logged(checkpointed, "loss")
        model = shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp, sequence_parallel=True))
        sequence_parallel = ShardedTrainer(model=model, args=args, train_dataset=dataset())
        sequence_parallel.train()
        result["sequence_parallel_loss"] = logged(sequence_parallel, "loss")
        fresh = shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp))
        result["plain_trainer"] = _refusal(lambda: Trainer(model=fresh, args=args, train_dataset=dataset()).train())
        staged = ParallelEngine(tiny_gpt2(), lambda p: torch.optim.SGD(p, lr=0.1), EngineConfig(tp=1, pp=2)).model
        result["pipeline"] = _refusal(lambda: ShardedTrainer(model=staged, args=args, train_dataset=dataset()))
        result["lora"] = _lora_run(
            ShardedTrainer, lambda: shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp)), dp
        )
        result["seq2seq"] = _seq2seq_run(ShardedTrainer, tp)
        result["best"] = _best_run(ShardedTrainer, shard_model(tiny_gpt2(), ShardConfig(tensor_parallel_size=tp)), dp)
    if dist.get_rank() == 0:
        result["saved"] = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final")).state_dict()
        result["checkpoint_files"] = sorted(os.listdir(os.path.join(out, "checkpoint-2")))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True), shutil.rmtree(out2, ignore_errors=True)
    for key in ("state", "resumed_state", "saved"):  # numpy: tensors would travel as shared memory
        if result.get(key) is not None:
            result[key] = {k: v.detach().numpy().copy() for k, v in result[key].items()}
    return result


def _refusal(call):
    try:
        call()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def _compare(result, ref):
    assert_close(torch.tensor(result["loss"]), torch.tensor(ref["loss"]), what="logged losses")
    assert_close(torch.tensor(result["grad_norm"]), torch.tensor(ref["grad_norm"]), what="logged grad norms")
    assert ref["grad_norm"][0] > 0.3, "clipping must be active for the test to mean something"
    worst = 0.0
    for name, value in ref["state"].items():
        for key, what in (("state", "after 4 steps"), ("saved", "saved"), ("resumed_state", "resumed")):
            mine = torch.from_numpy(result[key][name])
            worst = max(worst, (mine - value).abs().max().item())
            assert_close(mine, value, what=f"{name} {what}")
    print(
        f"parity: losses {_worst(result['loss'], ref['loss']):.2e}, grad norms "
        f"{_worst(result['grad_norm'], ref['grad_norm']):.2e}, weights {worst:.2e}"
    )
    assert_close(torch.tensor(result["resumed_loss"]), torch.tensor(ref["loss"]), what="resumed losses")
    assert result["eval"]["examples"] == 13 == ref["eval"]["examples"], (result["eval"], ref["eval"])
    assert_close(torch.tensor(result["eval"]["loss"]), torch.tensor(ref["eval"]["loss"]), what="eval loss")
    assert result["eval"]["accuracy"] == ref["eval"]["accuracy"], (result["eval"], ref["eval"])
    assert result["predictions"].shape == ref["predictions"].shape, result["predictions"].shape
    assert_close(torch.from_numpy(result["predictions"]), torch.from_numpy(ref["predictions"]), what="predictions")
    assert (result["label_ids"] == ref["label_ids"]).all()
    assert "config.json" in result["checkpoint_files"], result["checkpoint_files"]


def _worst(a, b):
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


@PEFT_READS_A_DEPRECATED_PROPERTY
def test_trainer_at_tp2_matches_one_process():
    result = run_on_ranks(_sharded_run, 2, 2, timeout=240)[0]
    _compare(result, reference())
    assert_close(torch.tensor(result["checkpointed_loss"]), torch.tensor(reference()["loss"]), what="checkpointed")
    sequence_parallel = torch.tensor(result["sequence_parallel_loss"])
    assert_close(sequence_parallel, torch.tensor(reference()["loss"]), what="sequence parallel")
    assert "ShardedTrainer" in (result["plain_trainer"] or ""), result["plain_trainer"]
    assert "pipeline stages" in (result["pipeline"] or ""), result["pipeline"]
    lora, ref_lora = result["lora"], reference()["lora"]
    for key in ("loss", "grad_norm", "resumed_loss"):
        assert_close(torch.tensor(lora[key]), torch.tensor(ref_lora[key]), what=f"LoRA {key}")
    assert ref_lora["adapter"] and ref_lora["adapter"].keys() == lora["adapter"].keys()
    for name, value in ref_lora["adapter"].items():
        assert_close(torch.from_numpy(lora["adapter"][name]), torch.from_numpy(value), what=f"saved adapter {name}")
    for key in ("loss", "grad_norm"):  # T5 (derived route, vocab-parallel seq2seq loss)
        got, expected = torch.tensor(result["seq2seq"][key]), torch.tensor(reference()["seq2seq"][key])
        assert_close(got, expected, what=f"T5 {key}")
    best, ref_best = result["best"], reference()["best"]
    assert best["checkpoint"] == ref_best["checkpoint"] == "checkpoint-1", (best["checkpoint"], ref_best["checkpoint"])
    assert_close(torch.tensor(best["eval_loss"]), torch.tensor(ref_best["eval_loss"]), what="eval losses")
    for name, value in ref_best["state"].items():
        assert_close(torch.from_numpy(best["state"][name]), torch.from_numpy(value), what=f"best model's {name}")


def test_trainer_at_tp2_dp2_matches_one_process():
    result = run_on_ranks(_sharded_run, 4, 2, timeout=300)[0]
    _compare(result, reference())
    for key in ("loss", "grad_norm"):  # the mesh split into 2 replicas x 1 shard: the same run
        assert_close(torch.tensor(result["hybrid"][key]), torch.tensor(reference()[key]), what=f"dp_replicate=2 {key}")
