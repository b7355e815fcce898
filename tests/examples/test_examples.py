"""The examples end to end: `shardformer run` on 2 CPU processes (tp=2), train then inference.

`make test` runs the fine-tuning example (ShardedSFTTrainer with LoRA); the others are marked `example`
and run with `make examples` (CI runs both: two launches each cost about 20 s, over the suite's budget).

Tiny settings (``--set``) keep each launch to seconds; outputs go to pytest's tmp_path. Each test
checks what a user would: exit status 0, no warning printed (but those tests/helpers.py's
EXPECTED_WARNINGS lists with a reason), the loss fell, a loss-curve PNG and a checkpoint were written,
and inference after training says something different from the untrained model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import PEFT_READS_A_DEPRECATED_PROPERTY, unexpected_warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
LIMIT_S = 240  # a hang fails the test, not the suite
ENV = {**os.environ, "SHARDFORMER_TIMEOUT_S": "60", "HF_HUB_OFFLINE": "1"}
ENV.pop("PYTHONWARNINGS", None)  # a warning an example prints is a failure (see check_clean)
# what a rank prints for a Python warning ("file.py:12: FutureWarning: ...") and for a transformers log record
PRINTED_WARNING = re.compile(r"^\S+:\d+: (\w*Warning: .*)$|^\[transformers\] (.*)$", re.M)


def check_clean(what: str, result: subprocess.CompletedProcess) -> None:
    printed = [a or b for a, b in PRINTED_WARNING.findall(result.stdout + result.stderr)]
    assert not unexpected_warnings(printed), f"{what} warned:\n" + "\n".join(sorted(set(unexpected_warnings(printed))))


def launch(example: str, mode: str, out, *settings: str) -> str:
    """Run one example on 2 processes; return its stdout (after asserting it succeeded)."""
    folder = os.path.join(EXAMPLES, example)
    sets = [arg for item in (f"output_dir={out}", *settings) for arg in ("--set", item)]
    argv = [sys.executable, "-m", "shardformer.cli.main", "run", "--nproc_per_node", "2"]
    argv += [os.path.join(folder, "main.py"), "--config", os.path.join(folder, "config.py"), "--mode", mode, *sets]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=LIMIT_S, env=ENV, cwd=ROOT)
    assert result.returncode == 0, f"{example} --mode {mode} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    check_clean(f"{example} --mode {mode}", result)
    return result.stdout


def check_training(out, stdout: str) -> dict:
    with open(os.path.join(out, "metrics.json")) as file:
        metrics = json.load(file)
    assert metrics["last_loss"] < metrics["first_loss"], metrics
    assert os.path.getsize(os.path.join(out, "loss_curve.png")) > 1000
    assert "loss " in stdout and "train" in stdout  # the summary line and the progress bar
    return metrics


def predictions(out) -> dict:
    with open(os.path.join(out, "inference.json")) as file:
        return json.load(file)


@pytest.mark.example
def test_gpt2_train_then_generate(tmp_path):
    tiny = ("steps=40", "log_every=10", "max_new_tokens=20")
    stdout = launch("gpt2", "train", tmp_path, *tiny)
    check_training(tmp_path, stdout)
    assert os.path.isfile(tmp_path / "checkpoint" / "config.json")
    stdout = launch("gpt2", "inference", tmp_path, *tiny)
    result = predictions(tmp_path)
    assert result["trained"].startswith("The keeper ") and len(result["trained"].split()) > 10
    assert result["trained"] != result["untrained"]
    assert f"trained model:   {result['trained']!r}" in stdout  # printed once, by rank 0
    assert stdout.count("trained model:   ") == 1


@pytest.mark.example
def test_gpt2_pipeline_stages_train_then_generate(tmp_path):
    """The same example on 2 pipeline stages instead of 2 tensor-parallel ranks (--set pp=2)."""
    tiny = ("tp=1", "pp=2", "micro_batch_size=4", "steps=20", "log_every=10", "max_new_tokens=8")
    check_training(tmp_path, launch("gpt2", "train", tmp_path, *tiny))
    launch("gpt2", "inference", tmp_path, *tiny)
    result = predictions(tmp_path)
    assert result["trained"].startswith("The keeper") and result["trained"] != result["untrained"]


@pytest.mark.example
def test_bert_train_then_classify(tmp_path):
    tiny = ("steps=8", "batch_size=8", "lr=3e-4", "log_every=2")
    check_training(tmp_path, launch("bert", "train", tmp_path, *tiny))
    stdout = launch("bert", "inference", tmp_path, *tiny)
    result = predictions(tmp_path)
    assert [p["text"] for p in result["trained"]] == [p["text"] for p in result["untrained"]]
    assert [p["p_positive"] for p in result["trained"]] != [p["p_positive"] for p in result["untrained"]]
    assert "trained head:" in stdout


@pytest.mark.example
def test_vit_hf_train_then_predict(tmp_path):
    tiny = ("steps=25", "batch_size=16", "log_every=5")
    check_training(tmp_path / "hf", launch("vit", "train", tmp_path, *tiny))
    launch("vit", "inference", tmp_path, *tiny)
    result = predictions(tmp_path / "hf")
    assert result["trained"]["images"] != result["untrained"]["images"]
    assert result["trained"]["accuracy"] >= result["untrained"]["accuracy"]


@pytest.mark.example
@pytest.mark.parametrize("backbone", ["timm"])
def test_vit_timm_short_train(tmp_path, backbone):
    """With sequence parallelism and activation checkpointing switched on from the command line."""
    settings = ("steps=10", "batch_size=16", "sequence_parallel=True", "activation_checkpointing=True")
    stdout = launch("vit", "train", tmp_path, f"backbone={backbone}", *settings)
    check_training(tmp_path / backbone, stdout)
    assert sorted(os.listdir(tmp_path / backbone / "checkpoint")) == ["meta.json", "model.safetensors"]


@PEFT_READS_A_DEPRECATED_PROPERTY
def test_finetune_lora_with_trl_sft(tmp_path):
    """examples/finetune with --sft --lora: TRL's SFTTrainer on the sharded model trains LoRA adapters;
    the saved adapter is a standard one that plain PEFT loads on the unsharded base model."""
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    argv = [sys.executable, "-m", "shardformer.cli.main", "run", "--nproc_per_node", "2"]
    argv += [os.path.join(EXAMPLES, "finetune", "main.py"), "--output_dir", str(tmp_path), "--sft", "--lora"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=LIMIT_S, env=ENV, cwd=ROOT)
    assert result.returncode == 0, f"finetune failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    check_clean("finetune --sft --lora", result)
    with open(tmp_path / "metrics.json") as file:
        losses = json.load(file)["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    model = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), tmp_path / "final")
    adapted = [name for name, _ in model.named_parameters() if "lora_B" in name]
    assert len(adapted) == 4, adapted  # c_attn and c_fc in both layers, full shapes (the load checks them)
